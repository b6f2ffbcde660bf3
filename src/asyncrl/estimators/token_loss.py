"""TokenLossEstimator, the base of the built-in estimators, and the masked reduction it applies.

Why one place: every estimator must mask padding the same way, multiply the controllers'
detached token weights the same way and normalise by the same count, or two estimators with
"the same" loss would train at different effective learning rates. ``TokenLossEstimator`` is
the built-in estimators' shared call around that reduction (check, per-position loss, reduce).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, Literal

import torch

from asyncrl import records as R
from asyncrl.configurable import check, field
from asyncrl.estimators.base import EstimatorOutput, bind_config
from asyncrl.estimators.columns import check_inputs, check_token_logprobs
from asyncrl.estimators.functional import gather_logprobs, gather_logprobs_and_log_tail

Aggregation = Literal["token_mean", "seq_mean"]


@dataclass(frozen=True)
class EstimatorOptions:
    """Options every built-in estimator shares (each estimator's ``Config`` extends this)."""

    aggregation: Literal["token_mean", "seq_mean"] = field(
        "token_mean", help="token_mean: every valid token counts the same; seq_mean: every sample does"
    )
    chunk_size: int = field(
        0, help="sequence positions per log-softmax chunk (bounds the [B, chunk, V] temporary); 0 = all"
    )

    def __post_init__(self) -> None:
        check(
            self.chunk_size >= 0, "chunk_size", self.chunk_size, "use 0 (no chunking) or a positive integer"
        )


def check_token_weights(token_weights: torch.Tensor | None, mask: torch.Tensor) -> None:
    """``token_weights`` must be a finite ``[B, T]`` tensor matching ``completion_mask``."""
    if token_weights is None:
        return
    if token_weights.shape != mask.shape:
        raise ValueError(
            f"token_weights must have the shape of completion_mask {tuple(mask.shape)}, "
            f"got {tuple(token_weights.shape)}"
        )
    if not torch.isfinite(token_weights[mask]).all():
        raise ValueError("token_weights has non-finite values at valid positions")


def reduce_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    aggregation: Aggregation = "token_mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` loss -> (scalar loss, detached per-sample loss ``[B]``).

    Padded positions are removed with ``torch.where`` (so garbage there cannot reach the value);
    ``token_weights`` are detached and multiplied in; the normaliser is the number of valid
    tokens, not the weight sum (a weight of 0 removes a token's contribution without
    re-inflating the others).

    - ``token_mean``: ``Σ_{b,t} w l / Σ_{b,t} mask`` (DAPO; every token counts the same).
    - ``seq_mean``: ``mean_b (Σ_t w l / Σ_t mask)`` over samples with at least one valid token
      (original GRPO: every sample counts the same).

    The per-sample value is the unweighted masked mean ``Σ_t l / Σ_t mask`` (0 for empty samples),
    for telemetry.
    """
    _check_aggregation(aggregation)
    mask = mask.bool()
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    loss = torch.where(mask, per_token, zero)
    lengths = mask.sum(-1).to(per_token.dtype)  # [B]
    per_sample = (loss.detach().sum(-1) / lengths.clamp(min=1)).detach()
    if token_weights is not None:
        loss = loss * torch.where(mask, token_weights.detach().to(per_token.dtype), zero)
    if aggregation == "token_mean":
        return loss.sum() / lengths.sum().clamp(min=1), per_sample
    seq = loss.sum(-1) / lengths.clamp(min=1)
    has = lengths > 0
    return torch.where(has, seq, zero).sum() / has.sum().clamp(min=1), per_sample


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in ("token_mean", "seq_mean"):
        raise ValueError(f"aggregation must be 'token_mean' or 'seq_mean', got {aggregation!r}")


def reduction_count(mask: torch.Tensor, aggregation: Aggregation = "token_mean") -> int:
    """How many terms ``reduce_loss`` averages: valid tokens (``token_mean``) or samples with at
    least one valid token (``seq_mean``). 0 when nothing is valid (the loss is then 0; the
    division itself uses at least 1), so a rank whose samples were all dropped adds nothing to
    the global normaliser ``asyncrl.step.loss_step`` sums over ranks."""
    _check_aggregation(aggregation)
    mask = mask.bool()
    return int(mask.sum()) if aggregation == "token_mean" else int(mask.any(-1).sum())


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Detached max of ``x`` over valid positions; 0 if none."""
    m = mask.bool()
    while m.dim() < x.dim():
        m = m.unsqueeze(-1)
    vals = x.detach()[m.expand_as(x)]
    return float(vals.max()) if vals.numel() else 0.0


@dataclass(frozen=True)
class EstimatorInputs:
    """One estimator call's checked inputs: ``student_logits`` [B, T, V] aligned to completion
    tokens, the record ``batch``, ``mask`` [B, T] (bool completion mask) and the caller's
    precomputed ``token_logprobs`` [B, T] (or None); ``chunk_size`` from the estimator's options."""

    student_logits: torch.Tensor
    batch: Mapping[str, torch.Tensor]
    mask: torch.Tensor
    token_logprobs: torch.Tensor | None
    chunk_size: int

    def logprobs_at(self, ids: torch.Tensor) -> torch.Tensor:
        """``log π_θ`` at ``ids`` [B, T, K] -> [B, T, K] (differentiable, chunked log-softmax)."""
        return gather_logprobs(self.student_logits, ids.long(), chunk_size=self.chunk_size)

    def logprobs_and_log_tail_at(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``log π_θ`` at a support ``ids`` [B, T, k] and ``log(1 − M_θ(ids))`` [B, T], exact (masked
        logsumexp of the logits, not ``1 − Σ π``), both differentiable."""
        return gather_logprobs_and_log_tail(self.student_logits, ids.long(), chunk_size=self.chunk_size)

    def generated_logprobs(self) -> torch.Tensor:
        """``log π_θ(y_t)`` [B, T] at ``completion_ids``: the caller's ``token_logprobs`` when given
        (the learner gathers it once per step for its controllers too), else gathered here."""
        if self.token_logprobs is not None:
            return self.token_logprobs
        return self.logprobs_at(self.batch[R.COMPLETION_IDS])


@dataclass
class TokenLoss:
    """What an estimator body returns before the shared reduction: the per-position loss
    ``per_token`` [B, T], detached ``metrics`` and extra detached per-sample [B] tensors."""

    per_token: torch.Tensor
    metrics: dict[str, float] = dc_field(default_factory=dict)
    per_sample: dict[str, torch.Tensor] = dc_field(default_factory=dict)


class TokenLossEstimator:
    """Shared body of the built-in estimators (``Estimator`` protocol): bind the ``Config``, check
    the columns, token weights and ``token_logprobs``, compute the per-position loss
    (``token_loss``), reduce it with ``reduce_loss`` and return ``EstimatorOutput`` with the
    per-sample ``"loss"``. A subclass states only its columns and its ``token_loss``.
    """

    name: str  # and ``cache_kind`` (a class attribute or a property of the config)
    Config: type[EstimatorOptions] = EstimatorOptions

    def __init__(self, config: EstimatorOptions | None = None, **options: Any) -> None:
        self.config: Any = bind_config(self.Config, config, options)

    def required_columns(self) -> frozenset[str]:
        raise NotImplementedError

    def __call__(
        self,
        student_logits: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        *,
        token_weights: torch.Tensor | None = None,
        token_logprobs: torch.Tensor | None = None,
    ) -> EstimatorOutput:
        """See ``Estimator.__call__``."""
        check_inputs(self.name, student_logits, batch, sorted(self.required_columns()))
        mask = batch[R.COMPLETION_MASK].bool()
        check_token_weights(token_weights, mask)
        check_token_logprobs(self.name, token_logprobs, student_logits, mask)
        x = EstimatorInputs(student_logits, batch, mask, token_logprobs, self.config.chunk_size)
        out = self.token_loss(x)
        loss, per_sample = reduce_loss(
            out.per_token, mask, token_weights=token_weights, aggregation=self.config.aggregation
        )
        return EstimatorOutput(
            loss=loss,
            metrics=out.metrics,
            per_sample={"loss": per_sample, **out.per_sample},
            normalizer=reduction_count(mask, self.config.aggregation),
        )

    def token_loss(self, x: EstimatorInputs) -> TokenLoss:
        """The per-position loss [B, T] and metrics from checked inputs."""
        raise NotImplementedError
