"""The Estimator protocol: one object per objective, owning its options, reduction and metrics.

``asyncrl.estimators.functional`` holds the pure math (per-position losses [B, T]);
an Estimator binds options, declares the record columns and the teacher-cache kind it
needs, applies the completion mask and optional per-token weights from controllers,
reduces, and reports detached metrics.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from asyncrl.configurable import from_dict
from asyncrl.registry import Registry


@dataclass
class EstimatorOutput:
    """``loss``: scalar to backpropagate. ``metrics``: detached floats, slash-namespaced
    (e.g. ``"est/teacher_mass"``). ``per_sample``: detached [B] tensors for samples.parquet
    (e.g. ``"loss"``). ``normalizer``: how many terms ``loss`` averages (valid tokens for
    ``token_mean``, samples with a valid token for ``seq_mean``; 0 when none is valid); with
    several data-parallel ranks ``asyncrl.step.loss_step`` uses it to weight every token
    (sample) the same over all ranks. None: the loss is taken as a per-rank mean (ranks
    weighted equally, so a rank with nothing valid still dilutes the others)."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)
    normalizer: float | None = None


@runtime_checkable
class Estimator(Protocol):
    """Structural type of an estimator.

    Optional attributes read when it is composed with controllers
    (``asyncrl.step.check_composition``), because an importance-weight controller must not
    count ``π_θ/π_b`` a second time:

    - ``behavior_ratio``: where the loss carries ``π_θ/π_b``: ``None`` (nowhere: the loss at
      position t is a function of the state, e.g. the KL estimators on teacher scores),
      ``"token"`` (at the generated token, e.g. ``grpo``), ``"draws"`` (at behavior draws that
      include the generated token, e.g. ``reverse_kl_mc`` with m draws). An estimator that
      reads behavior log-probs without declaring it cannot be paired with ``truncated_is``.
    - ``anchor``: for ``"token"``, ``"behavior"`` (ρ = π_θ/π_b) or ``"proximal"`` (ρ = π_θ/π_prox
      with π_prox the weights before the step, detached: decoupled PPO).
    """

    name: str
    #: the teacher-cache kind it needs ("topk", "behavior_mc", "token", "teacher_mc", "dense"),
    #: or None for RL estimators that need no teacher (they need a "reward" column instead)
    cache_kind: str | None

    def required_columns(self) -> frozenset[str]:
        """Record columns the estimator reads (checked when the pipeline is built)."""
        ...

    def __call__(
        self,
        student_logits: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        *,
        token_weights: torch.Tensor | None = None,
        token_logprobs: torch.Tensor | None = None,
    ) -> EstimatorOutput:
        """``student_logits`` [B, T, V] aligned to completion tokens (records.completion_logits).
        ``token_weights`` [B, T] detached, from controllers; multiplied into the per-token loss
        before the masked reduction.

        ``token_logprobs`` (optional, additive): ``log π_θ(y_t)`` [B, T] at ``completion_ids``,
        computed from ``student_logits`` WITH grad (``gather_logprobs(student_logits,
        completion_ids)``). Why: the learner needs that gather for its controllers anyway, so an
        estimator that reads log π_θ at the generated token uses it instead of a second
        log-softmax pass over ``[B, T, V]``; it gathers itself when None, so plain loops keep
        working. An estimator may leave the keyword out of its signature: callers pass it only
        where ``accepts_token_logprobs`` says so."""
        ...


# --- registry and option binding (additive) --------------------------------------------------
#: name -> Estimator class; each built-in class carries a frozen ``Config`` dataclass of its options
ESTIMATORS: Registry[type] = Registry("estimator")

C = TypeVar("C")


def accepts_token_logprobs(estimator: Any) -> bool:
    """True if ``estimator(...)`` takes the optional ``token_logprobs`` keyword (or ``**kwargs``);
    estimators written before the keyword existed do not, and must not be passed it."""
    try:
        params = inspect.signature(estimator).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: do not guess
        return False
    return any(p.name == "token_logprobs" or p.kind is p.VAR_KEYWORD for p in params)


def bind_config(config_cls: type[C], config: C | None, options: Mapping[str, Any]) -> C:
    """An estimator's config: the given ``config`` object, or one built from keyword ``options``.

    ``options`` go through ``configurable.from_dict``, so an unknown key fails with the nearest
    valid key and a bad value with the field name and the fix.
    """
    if config is not None:
        if options:
            raise TypeError(f"pass either a {config_cls.__name__} or keyword options, not both")
        if not isinstance(config, config_cls):
            raise TypeError(f"config must be a {config_cls.__name__}, got {type(config).__name__}")
        return config
    return from_dict(config_cls, options)
