"""StalenessLRLaw: keep ``S * eta`` bounded (Staleness-LR scaling law, arXiv 2607.01083; spec 4.5).

Stale rollouts bias the surrogate gradient by O(S eta): pi_b is at most S steps old and each
step moves the policy by about eta G. Two modes:

- ``inverse_lag`` (default): ``eta = eta_sched * min(1, s_ref / S_eff)^gamma`` with ``S_eff`` the
  batch max head lag (the paper's S is the *maximum* lag) or a fixed ``s_bound``. gamma = 1
  keeps ``S_eff * eta`` constant beyond ``s_ref``; S_eff = 0 gives scale 1.
- ``two_constraint`` (our operationalisation; the paper's constants are not public):
  ``eta = min(eta_sched, c R_batch / (S_eff G), c (R_crit - D) / ((T - t) G))``.

  What it measures (in ``after_step``): the per-step policy drift
  ``d = mean over stale tokens of |log pi_theta(y_t) - log pi_b(y_t)| / (v_L - v_tok)``, i.e.
  the mean absolute change of a sampled token's log-prob per optimizer step, over each
  token's own age. ``G = EMA(d / eta_bar)`` with ``eta_bar`` the mean LR actually applied over
  those steps (``ctx.lr_applied``: the scheduled LR times every controller's scale, so a chain
  with ``ess_lr`` is measured per unit of the LR it really used), and ``D = sum d`` the drift
  spent so far. The caps bound the applied LR: the chain multiplies this controller's scale
  with the others', which can only lower it further.
  Lag-0 tokens carry no information (only train/inference mismatch) and are skipped, so a
  synchronous run never estimates G and both caps stay off. A learner that measures drift
  exactly (one extra forward after the step) can call ``observe_drift`` instead.
  ``R_batch`` is in log-ratio units (0.2 = the PPO clip radius); ``R_crit = inf`` turns the
  horizon cap off until it is calibrated.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.configurable import check, field
from asyncrl.controllers.base import StepContext
from asyncrl.controllers.factory import CONTROLLERS
from asyncrl.controllers.functional import inverse_lag_scale, two_constraint_lr

LawMode = Literal["inverse_lag", "two_constraint"]
_HISTORY = 64


@dataclass(frozen=True)
class StalenessLRLawConfig:
    mode: LawMode = field(
        "inverse_lag", help="inverse_lag: (s_ref/S)^gamma; two_constraint: measured-drift caps"
    )
    s_ref: float = field(1.0, help="lag up to which the LR is not reduced (inverse_lag)")
    gamma: float = field(1.0, help="exponent of the inverse-lag law; 1 keeps S*eta constant")
    s_bound: int | None = field(None, help="use this fixed S instead of the measured batch max lag")
    r_batch: float = field(0.2, help="R_batch: tolerated drift within one stale cycle (log-ratio units)")
    r_crit: float = field(math.inf, help="R_crit: total drift budget over the run; inf = no horizon cap")
    c_safety: float = field(0.5, help="safety factor c on both caps")
    total_steps: int | None = field(
        None, help="T: run length in optimizer steps (needed when r_crit is finite)"
    )
    ema: float = field(0.9, help="EMA factor of the drift-per-unit-LR estimate G")

    def __post_init__(self) -> None:
        check(self.s_ref > 0, "s_ref", self.s_ref, "use a positive lag, e.g. 1")
        check(self.gamma >= 0, "gamma", self.gamma, "use gamma >= 0 (1 keeps S*eta constant)")
        check(
            self.s_bound is None or self.s_bound >= 0, "s_bound", self.s_bound, "use null or an integer >= 0"
        )
        check(self.r_batch > 0, "r_batch", self.r_batch, "use a positive radius, e.g. 0.2")
        check(self.r_crit > 0, "r_crit", self.r_crit, "use a positive budget or .inf")
        check(0 < self.c_safety <= 1, "c_safety", self.c_safety, "use a value in (0, 1]")
        check(0 <= self.ema < 1, "ema", self.ema, "use a value in [0, 1)")
        check(
            math.isinf(self.r_crit) or (self.total_steps is not None and self.total_steps >= 1),
            "total_steps",
            self.total_steps,
            "set total_steps (T) when r_crit is finite",
        )


@CONTROLLERS.register("staleness_lr_law")
class StalenessLRLaw:
    """LR scale from the staleness-LR law. Metrics: ``law/S_eff``, ``law/scale``, ``law/S_eta``,
    and in two_constraint mode ``law/drift_step``, ``law/G_hat``, ``law/eta_batch_cap``,
    ``law/eta_horizon_cap`` (when finite), ``law/binding_batch``, ``law/binding_horizon``."""

    name = "staleness_lr_law"
    Config = StalenessLRLawConfig

    def __init__(
        self,
        mode: LawMode = "inverse_lag",
        s_ref: float = 1.0,
        gamma: float = 1.0,
        s_bound: int | None = None,
        r_batch: float = 0.2,
        r_crit: float = math.inf,
        c_safety: float = 0.5,
        total_steps: int | None = None,
        ema: float = 0.9,
    ) -> None:
        self.config = StalenessLRLawConfig(
            mode=mode,
            s_ref=s_ref,
            gamma=gamma,
            s_bound=s_bound,
            r_batch=r_batch,
            r_crit=r_crit,
            c_safety=c_safety,
            total_steps=total_steps,
            ema=ema,
        )
        self.g_hat: float | None = None
        self.drift_used = 0.0
        self.lr_history: deque[float] = deque(maxlen=_HISTORY)
        self._metrics: dict[str, float] = {}

    def s_eff(self, ctx: StepContext) -> float:
        """The staleness S the law uses: ``s_bound`` if set, else the step's largest sample lag."""
        if self.config.s_bound is not None:
            return float(self.config.s_bound)
        return float(ctx.lags_global.max()) if ctx.lags_global.numel() else 0.0

    def lr_scale(self, ctx: StepContext) -> float:
        cfg = self.config
        s = self.s_eff(ctx)
        eta_sched = ctx.base_lr
        if cfg.mode == "inverse_lag":
            scale = inverse_lag_scale(s, s_ref=cfg.s_ref, gamma=cfg.gamma)
            self._metrics = {}
        else:
            steps_left = math.inf if cfg.total_steps is None else float(cfg.total_steps - ctx.step)
            law = two_constraint_lr(
                eta_sched,
                s_eff=s,
                g_hat=self.g_hat or 0.0,
                r_batch=cfg.r_batch,
                r_crit=cfg.r_crit,
                drift_used=self.drift_used,
                steps_left=steps_left,
                c_safety=cfg.c_safety,
            )
            scale = law.eta / eta_sched if eta_sched > 0 else 1.0
            self._metrics = {
                "law/binding_batch": float(law.binding == "batch"),
                "law/binding_horizon": float(law.binding == "horizon"),
                "law/drift_used": self.drift_used,
            }
            if self.g_hat is not None:
                self._metrics["law/G_hat"] = self.g_hat
            if math.isfinite(law.eta_batch):
                self._metrics["law/eta_batch_cap"] = law.eta_batch
            if math.isfinite(law.eta_horizon):
                self._metrics["law/eta_horizon_cap"] = law.eta_horizon
        self._metrics.update({"law/S_eff": s, "law/scale": scale, "law/S_eta": s * eta_sched * scale})
        return scale

    def observe_drift(self, drift: float, lr: float) -> None:
        """Record a measured per-step policy drift ``d`` produced at learning rate ``lr``."""
        if not (math.isfinite(drift) and drift >= 0 and lr > 0):
            return
        g = drift / lr
        beta = self.config.ema
        self.g_hat = g if self.g_hat is None else beta * self.g_hat + (1 - beta) * g
        self.drift_used += drift
        self._metrics["law/drift_step"] = drift

    def after_step(self, ctx: StepContext) -> None:
        """Measure the drift of the steps before this one, then record the LR this step applied."""
        if self.config.mode != "two_constraint":
            return
        if ctx.lr_applied is None:
            raise ValueError(
                "staleness_lr_law(mode='two_constraint') needs ctx.lr_applied (the LR the step used, after "
                "every controller's scale); asyncrl.step.loss_step sets it, a custom loop must too"
            )
        tok_lag = (ctx.step - ctx.token_versions).double()
        stale = ctx.mask.bool() & (tok_lag >= 1)
        if stale.any():
            rate = ctx.log_ratio.detach().double().abs()[stale] / tok_lag[stale]
            window = max(1, round(float(tok_lag[stale].mean())))
            past = list(self.lr_history)[-window:]  # the steps that produced the drift
            if past:
                self.observe_drift(float(rate.mean()), sum(past) / len(past))
        self.lr_history.append(float(ctx.lr_applied))

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def active_fraction(self) -> float | None:
        """1 if it scaled the last step's LR below 1 (by more than 1e-6: rounding is not acting), else 0."""
        scale = self._metrics.get("law/scale")
        return None if scale is None else float(scale < 1.0 - 1e-6)

    def state_dict(self) -> dict[str, Any]:
        return {"g_hat": self.g_hat, "drift_used": self.drift_used, "lr_history": list(self.lr_history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g_hat = state.get("g_hat")
        self.drift_used = float(state.get("drift_used", 0.0))
        self.lr_history = deque((float(x) for x in state.get("lr_history", [])), maxlen=_HISTORY)
