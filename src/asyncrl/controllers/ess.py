"""ESSLR: scale the LR by the effective sample size of the importance weights (VCPO, spec 4.3).

When a few stale trajectories carry most of the importance weight, the batch is effectively
much smaller than N. Adam normalises the gradient scale, so down-weighting samples does not
shrink the step; the LR must shrink instead. With sequence weights ``w_i = exp(L_i)``:

    rho = (sum w)^2 / (N sum w^2)          (ESS fraction, in [1/N, 1])
    lr  = lr_sched * sqrt(min(1, rho / rho_base))     (rule="sqrt"; "linear" drops the sqrt)

``rho`` is computed in log space from ``ctx.seq_log_ratio``, which the learner gathers over
all DP ranks, so every rank applies the same LR. The scale is applied for one step through
``base.scaled_lr`` and the scheduled LR is restored afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from asyncrl.configurable import check, field
from asyncrl.controllers.base import StepContext
from asyncrl.controllers.factory import CONTROLLERS
from asyncrl.controllers.functional import (
    Rule,
    ess_fraction,
    ess_fraction_from_partials,
    ess_lr_scale,
    ess_partials,
    rescale_partials,
)

Source = Literal["seq", "seq_clipped", "tok"]


@dataclass(frozen=True)
class ESSLRConfig:
    rho_base: float = field(1.0, help="ESS fraction at or above which the LR is not reduced; in (0, 1]")
    rule: Rule = field(
        "sqrt", help="scale = sqrt(min(1, rho/rho_base)) (VCPO) or linear min(1, rho/rho_base)"
    )
    min_scale: float = field(0.0, help="floor on the LR scale")
    source: Source = field(
        "seq",
        help="weights: seq = exp(L_i) unclipped (VCPO), seq_clipped = min(exp(L_i), clip), tok = exp(l_t)",
    )
    clip: float = field(8.0, help="cap C for source=seq_clipped")

    def __post_init__(self) -> None:
        check(
            0 < self.rho_base <= 1,
            "rho_base",
            self.rho_base,
            "use a value in (0, 1]: 1.0 for single-turn, ~0.55 for multi-turn (VCPO)",
        )
        check(0 <= self.min_scale <= 1, "min_scale", self.min_scale, "use a value in [0, 1]")
        check(self.clip > 0, "clip", self.clip, "use a positive cap, e.g. 8.0")


def _all_ranks_token_rho(log_ratio: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """ESS fraction of the token weights over all DP ranks (one MAX and one SUM all-reduce)."""
    local = ess_partials(log_ratio)
    if ctx.world_size == 1:
        return ess_fraction_from_partials([local])
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ESSLR(source='tok') with world_size > 1 needs torch.distributed initialised "
            "(token log-ratios live on each rank); use source='seq', which the learner gathers"
        )
    m = local[0:1].clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    part = rescale_partials(local, m[0])
    sums = part[1:].clone()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return ess_fraction_from_partials([torch.cat([m, sums])])


@CONTROLLERS.register("ess_lr")
class ESSLR:
    """LR scale from the ESS fraction of the batch's importance weights. Metrics: ``ess/rho`` (the
    fraction this controller acted on, for its ``source``), ``ess/lr_scale``, ``ess/ess_abs``; the
    learner logs its own unclipped sequence ESS separately as ``ess/rho_seq``."""

    name = "ess_lr"
    Config = ESSLRConfig

    def __init__(
        self,
        rho_base: float = 1.0,
        rule: Rule = "sqrt",
        min_scale: float = 0.0,
        source: Source = "seq",
        clip: float = 8.0,
    ) -> None:
        self.config = ESSLRConfig(rho_base=rho_base, rule=rule, min_scale=min_scale, source=source, clip=clip)
        self._metrics: dict[str, float] = {}

    def rho(self, ctx: StepContext) -> float:
        """The batch ESS fraction for the configured ``source``."""
        src = self.config.source
        if src == "tok":
            m = ctx.mask.bool()
            return float(_all_ranks_token_rho(ctx.log_ratio.detach()[m], ctx))
        lw = ctx.seq_log_ratio.detach().double()
        if src == "seq_clipped":
            lw = lw.clamp(max=math.log(self.config.clip))
        return float(ess_fraction(lw))

    def lr_scale(self, ctx: StepContext) -> float:
        cfg = self.config
        rho = self.rho(ctx)
        scale = ess_lr_scale(rho, rho_base=cfg.rho_base, rule=cfg.rule, min_scale=cfg.min_scale)
        n = ctx.seq_log_ratio.numel()
        self._metrics = {"ess/rho": rho, "ess/lr_scale": scale}
        if cfg.source != "tok":
            self._metrics["ess/ess_abs"] = rho * n
        return scale

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def active_fraction(self) -> float | None:
        """1 if it scaled the last step's LR below 1 (by more than 1e-6: rounding is not acting), else 0."""
        scale = self._metrics.get("ess/lr_scale")
        return None if scale is None else float(scale < 1.0 - 1e-6)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
