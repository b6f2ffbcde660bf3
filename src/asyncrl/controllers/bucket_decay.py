"""LagBucketDecay: shrink the LR (or per-sample weights) by a non-increasing factor of lag (spec 4.6).

``f(lag)`` is a table of ``(min_lag, factor)`` rows (default ``{0-1: 1, 2-3: 0.75, 4-7: 0.5,
8-15: 0.35, >=16: 0.25}`` ~ lag^(-1/2)) or the parametric ``min(1, (lag0 / lag)^gamma)``
(gamma 0.5 ~ VCPO's sqrt rule, 1 ~ the S*eta law).

- ``batch_lr`` (default): ``lr_scale = f(stat(lags))`` with ``stat`` the batch mean or max lag.
- ``sample_weight``: per-token weights ``f(lag_i)`` for each sample. With Adam a uniform
  factor is undone by the normalisation, so only *relative* down-weighting inside a
  mixed-lag batch survives; that is why ``batch_lr`` is the default.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

import torch

from asyncrl.configurable import check, field
from asyncrl.controllers.base import StepContext
from asyncrl.controllers.factory import CONTROLLERS
from asyncrl.controllers.functional import decay_factor

DecayMode = Literal["batch_lr", "sample_weight"]
Stat = Literal["mean", "max"]
DEFAULT_TABLE: tuple[tuple[float, float], ...] = ((0, 1.0), (2, 0.75), (4, 0.5), (8, 0.35), (16, 0.25))


@dataclass(frozen=True)
class LagBucketDecayConfig:
    mode: DecayMode = field(
        "batch_lr", help="batch_lr: scale the LR by f(stat(lags)); sample_weight: weight f(lag_i)"
    )
    table: tuple[tuple[float, float], ...] = field(
        DEFAULT_TABLE,
        help="rows [min_lag, factor], min_lag ascending from 0, factors in (0, 1] non-increasing",
    )
    gamma: float | None = field(
        None, help="if set, use f(lag) = min(1, (lag0/lag)^gamma) instead of the table"
    )
    lag0: float = field(1.0, help="lag up to which the parametric f is 1")
    stat: Stat = field("mean", help="batch lag statistic for batch_lr")

    def __post_init__(self) -> None:
        rows = self.table
        check(len(rows) >= 1 and rows[0][0] == 0, "table", rows, "start the table with a row [0, 1.0]")
        check(
            all(a[0] < b[0] for a, b in itertools.pairwise(rows)),
            "table",
            rows,
            "sort rows by strictly increasing min_lag",
        )
        check(all(0 < f <= 1 for _, f in rows), "table", rows, "use factors in (0, 1]")
        check(
            all(a[1] >= b[1] for a, b in itertools.pairwise(rows)),
            "table",
            rows,
            "make the factors non-increasing in lag (staler samples never count more)",
        )
        check(self.gamma is None or self.gamma >= 0, "gamma", self.gamma, "use null or gamma >= 0")
        check(self.lag0 >= 0, "lag0", self.lag0, "use lag0 >= 0")


@CONTROLLERS.register("lag_bucket_decay")
class LagBucketDecay:
    """Lag-dependent decay of the LR or of per-sample weights. Metrics: ``bucket/lr_scale``,
    ``bucket/weight_mean`` (sample_weight mode)."""

    name = "lag_bucket_decay"
    Config = LagBucketDecayConfig

    def __init__(
        self,
        mode: DecayMode = "batch_lr",
        table: tuple[tuple[float, float], ...] = DEFAULT_TABLE,
        gamma: float | None = None,
        lag0: float = 1.0,
        stat: Stat = "mean",
    ) -> None:
        table = tuple((float(lo), float(f)) for lo, f in table)
        self.config = LagBucketDecayConfig(mode=mode, table=table, gamma=gamma, lag0=lag0, stat=stat)
        self._metrics: dict[str, float] = {}
        self._active: float | None = None

    def factor(self, lag: float) -> float:
        """``f(lag)``: 1 for fresh samples, non-increasing in lag."""
        cfg = self.config
        return decay_factor(lag, table=cfg.table, gamma=cfg.gamma, lag0=cfg.lag0)

    def lr_scale(self, ctx: StepContext) -> float:
        if self.config.mode != "batch_lr" or ctx.lags_global.numel() == 0:
            return 1.0
        lags = ctx.lags_global.double()
        stat = float(lags.mean() if self.config.stat == "mean" else lags.max())
        scale = self.factor(stat)
        self._metrics = {"bucket/lr_scale": scale}
        self._active = float(scale < 1.0 - 1e-6)
        return scale

    def token_weights(self, ctx: StepContext) -> torch.Tensor | None:
        if self.config.mode != "sample_weight":
            return None
        per_sample = torch.tensor(
            [self.factor(float(x)) for x in ctx.lags.tolist()], dtype=ctx.logprobs.dtype
        )
        self._metrics = {"bucket/weight_mean": float(per_sample.mean()) if per_sample.numel() else 1.0}
        self._active = float((per_sample < 1.0 - 1e-6).double().mean()) if per_sample.numel() else 0.0
        return per_sample[:, None].expand_as(ctx.logprobs).to(ctx.logprobs.device)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def active_fraction(self) -> float | None:
        """batch_lr: 1 if it scaled the last step's LR below 1; sample_weight: the fraction of the last
        step's samples it down-weighted."""
        return self._active

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
