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

from asyncrl.configurable import ConfigError
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
from asyncrl.registry import RegistryError

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

    Built-in classes validate ``options`` through their frozen ``Config`` (unknown keys fail with
    the nearest valid key); a user class without ``Config`` is called with ``**options``.
    Errors are ``ConfigError`` with field ``name`` for an unknown estimator (nearest registered
    names listed) and ``options.<key>`` for a bad option, like ``asyncrl.controllers.build``.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError("name", name, f"give a registered estimator name: {ESTIMATORS.names()}")
    try:
        cls: Any = ESTIMATORS.get(name)
    except RegistryError as err:
        raise ConfigError("name", name, str(err)) from None
    opts = dict(options or {})
    config_cls = getattr(cls, "Config", None)
    try:
        est = cls(bind_config(config_cls, None, opts)) if config_cls is not None else cls(**opts)
    except ConfigError as err:
        raise err.prefixed("options") from None
    if not isinstance(est, Estimator):
        raise TypeError(
            f"estimator {name!r} does not satisfy the Estimator protocol (name, cache_kind, "
            f"required_columns(), __call__(student_logits, batch, *, token_weights))"
        )
    return est
