"""TruncatedIS: detached importance weights ``pi_theta / pi_b`` on the loss (spec 4.2).

Stale or mismatched rollouts were sampled from ``pi_b``, not ``pi_theta``; multiplying each
token's loss by ``w = pi_theta / pi_b`` corrects the expectation. Raw weights are heavy-tailed,
so they are truncated (TIS: ``min(w, upper)``, the verl/slime/SkyRL default with cap 2) or
masked (IcePop-style: ``w = 0`` outside ``[lower, upper]``). Weights are stop-gradient: the
gradient is ``sum w A grad log pi_theta``, never through ``w``.

``level``: ``token`` (w_t), ``sequence`` (exp(L_i), VCPO's seq-TIS, cap ~8) or ``geometric``
(exp(L_i / T_i), length-invariant; best for filtering).

Composition (``asyncrl.step.check_composition``, docs/controllers.md "What the composed gradient is"): the
weights are formed at the learner's forward, before the step, so they are ``pi_prox / pi_b``
with ``pi_prox`` the pre-step weights. An estimator that carries ``pi_theta / pi_b`` at the
generated token itself (``grpo``, ``reverse_kl_mc`` with ``source='token'``) must anchor its
ratio on ``pi_prox`` (``anchor: proximal``; decoupled PPO), giving the truncated-IS policy
gradient ``E_b[min(pi_theta/pi_b, C) A grad log pi_theta]``; estimators that weight behavior
draws themselves are refused, and state-wise losses (the KL estimators on teacher scores)
accept only ``level='sequence'``, the one level that reweights the visited prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.configurable import check, field
from asyncrl.controllers.base import StepContext
from asyncrl.controllers.factory import CONTROLLERS
from asyncrl.controllers.functional import Action, Level, ess_fraction, truncated_is_weights
from asyncrl.logratio import kl_qp_k1, kl_qp_k3, masked_mean


@dataclass(frozen=True)
class TruncatedISConfig:
    level: Level = field("token", help="weight per token, per sequence (exp L_i) or geometric (exp L_i/T_i)")
    action: Action = field("truncate", help="truncate weights to [lower, upper] or mask (w=0) outside it")
    upper: float = field(2.0, help="upper bound C on the weight (inf = no truncation)")
    lower: float = field(0.0, help="lower bound on the weight (0 = none)")

    def __post_init__(self) -> None:
        check(self.upper > 0, "upper", self.upper, "use a positive cap, e.g. 2.0 (token) or 8.0 (sequence)")
        check(
            0 <= self.lower < self.upper, "lower", self.lower, f"use 0 <= lower < upper (upper={self.upper})"
        )


@CONTROLLERS.register("truncated_is")
class TruncatedIS:
    """Per-token loss weights from ``ctx.logprobs - ctx.behavior_logprobs`` (log space, clamped to +-20).

    Metrics over valid tokens of this rank: ``is/w_mean``, ``is/w_max`` (applied weights),
    ``is/frac_truncated``, ``is/frac_masked``, ``is/ess_tok_frac`` (ESS fraction of the raw
    token weights), ``is/kl_k1``, ``is/kl_k3`` (KL(pi_b || pi_theta) per token).
    """

    name = "truncated_is"
    Config = TruncatedISConfig

    def __init__(
        self, level: Level = "token", action: Action = "truncate", upper: float = 2.0, lower: float = 0.0
    ):
        self.config = TruncatedISConfig(level=level, action=action, upper=upper, lower=lower)
        self._metrics: dict[str, float] = {}

    @property
    def importance_level(self) -> str:
        """Its token weights are importance weights π/π_b at this level (``controllers.base``)."""
        return self.config.level

    def token_weights(self, ctx: StepContext) -> torch.Tensor:
        """[B, T] detached weights; 1 at padding."""
        cfg = self.config
        log_ratio = ctx.log_ratio.detach()
        out = truncated_is_weights(
            log_ratio, ctx.mask, level=cfg.level, action=cfg.action, upper=cfg.upper, lower=cfg.lower
        )
        m = ctx.mask.bool()
        n = int(m.sum())
        behavior, current = ctx.behavior_logprobs.detach(), ctx.logprobs.detach()  # KL(pi_b || pi_theta)
        if n:
            w = out.weights[m].double()
            lr = log_ratio[m]
            self._metrics = {
                "is/w_mean": float(w.mean()),
                "is/w_max": float(w.max()),
                "is/frac_truncated": float(out.truncated.sum()) / n,
                "is/frac_masked": float(out.masked.sum()) / n,
                "is/ess_tok_frac": float(ess_fraction(lr)),
                "is/kl_k1": float(masked_mean(kl_qp_k1(behavior, current), m)),
                "is/kl_k3": float(masked_mean(kl_qp_k3(behavior, current), m)),
            }
        else:
            self._metrics = {}
        return out.weights

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def active_fraction(self) -> float | None:
        """Fraction of the last step's valid tokens whose weight it truncated or masked."""
        if "is/frac_truncated" not in self._metrics:
            return None
        return self._metrics["is/frac_truncated"] + self._metrics["is/frac_masked"]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
