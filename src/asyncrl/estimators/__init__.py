"""Estimators: one object per objective, owning its options, masking, reduction and metrics.

The math lives in ``asyncrl.estimators.functional`` (pure tensor functions, per-position
losses); the classes here bind options from a frozen config, check the record columns, mask
padding, multiply the controllers' token weights, reduce and report slash-namespaced metrics.

Built-ins (``asyncrl ls estimators``) and the teacher cache each needs:

- ``reverse_kl_mc`` (default): KL(π_θ‖p) from m importance-weighted behavior draws;
  cache ``behavior_mc`` (or ``token`` with ``source="token"``).
- ``reverse_kl``: KL(π_θ‖p) recomputed on the teacher's top-k; cache ``topk`` (or ``dense``).
- ``reverse_kl_stratified``: KL(π_θ‖p), exact top-k head + MC tail; cache ``topk_behavior_mc``.
- ``forward_kl``: KL(p‖π_θ) on the teacher's top-k; cache ``topk`` (or ``dense``).
- ``forward_kl_mc``: KL(p‖π_θ) from m teacher draws; cache ``teacher_mc``.
- ``grpo``: clipped policy gradient with group-relative advantages; no cache (rewards).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncrl.estimators.base import (
    ESTIMATORS,
    Estimator,
    EstimatorOutput,
    accepts_token_logprobs,
    bind_config,
)
from asyncrl.estimators.grpo import GRPO
from asyncrl.estimators.kl import ForwardKL, ReverseKL
from asyncrl.estimators.mc import ForwardKLMC, ReverseKLMC, ReverseKLStratified

__all__ = [
    "ESTIMATORS",
    "GRPO",
    "Estimator",
    "EstimatorOutput",
    "ForwardKL",
    "ForwardKLMC",
    "ReverseKL",
    "ReverseKLMC",
    "ReverseKLStratified",
    "accepts_token_logprobs",
    "bind_config",
    "build",
]


def build(name: str, options: Mapping[str, Any] | None = None) -> Estimator:
    """Build a registered estimator (or a dotted path ``'pkg.mod:Class'``) from plain options.

    ``ESTIMATORS.build`` (``asyncrl.registry.Registry.build``, shared with the controllers): a
    class with a frozen ``Config`` is validated through it (unknown keys fail with the nearest
    valid key) and called with the validated fields as keywords; a class without one is called
    with ``**options``. Errors are ``ConfigError`` with field ``name`` for an unknown estimator
    and ``options.<key>`` for a bad option; the result must satisfy the ``Estimator`` protocol.
    """
    est = ESTIMATORS.build(name, options)
    if not isinstance(est, Estimator):
        raise TypeError(
            f"estimator {name!r} does not satisfy the Estimator protocol (name, cache_kind, "
            f"required_columns(), __call__(student_logits, batch, *, token_weights))"
        )
    return est
