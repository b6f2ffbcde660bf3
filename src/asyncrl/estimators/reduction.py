"""Masked reduction of a per-position loss [B, T] to the scalar an Estimator returns.

Why one place: every estimator must mask padding the same way, multiply the controllers'
detached token weights the same way and normalise by the same count, or two estimators with
"the same" loss would train at different effective learning rates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from asyncrl.configurable import check, field

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
    if aggregation not in ("token_mean", "seq_mean"):
        raise ValueError(f"aggregation must be 'token_mean' or 'seq_mean', got {aggregation!r}")
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


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Detached mean of ``x`` over valid positions (``mask`` broadcast over trailing axes); 0 if none."""
    m = mask.bool()
    while m.dim() < x.dim():
        m = m.unsqueeze(-1)
    m = m.expand_as(x)
    n = int(m.sum())
    return float(x.detach()[m].sum() / n) if n else 0.0


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Detached max of ``x`` over valid positions; 0 if none."""
    m = mask.bool()
    while m.dim() < x.dim():
        m = m.unsqueeze(-1)
    vals = x.detach()[m.expand_as(x)]
    return float(vals.max()) if vals.numel() else 0.0
