"""GRPO: group-relative advantages and the clipped policy-gradient loss (the RL baseline).

It shares the policy-gradient core (``functional.policy_gradient_loss``) with the sampled
reverse-KL estimators; only the advantage differs: a sequence-level group-normalised reward
instead of the dense per-token ``log p − log π_θ``.

The ratio's anchor (``anchor``): ``behavior`` is the usual ``ρ = π_θ/π_b``; ``proximal`` is
decoupled PPO (AReaL): ``ρ = π_θ/π_prox`` with ``π_prox`` the weights before this optimizer
step, detached, i.e. ``sg(π_θ)`` in a loss computed before the step, so ``ρ = 1`` in value and
``∇ρ = ∇log π_θ``. An importance-weight controller (``truncated_is``) then supplies
``w = π_prox/π_b``, and the composed gradient is ``E_b[w·A·∇log π_θ]`` (truncated IS policy
gradient) instead of counting ``π_θ/π_b`` twice. ``asyncrl.step.check_composition`` refuses
``truncated_is`` with ``anchor='behavior'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from asyncrl import records as R
from asyncrl.configurable import check, field
from asyncrl.estimators.base import ESTIMATORS
from asyncrl.estimators.columns import check_logprob_column, fill_padding
from asyncrl.estimators.functional import grpo_advantages, policy_gradient_loss
from asyncrl.estimators.token_loss import (
    EstimatorInputs,
    EstimatorOptions,
    TokenLoss,
    TokenLossEstimator,
    masked_max,
)
from asyncrl.logratio import importance_log_ratio, kl_qp_k3, masked_mean

#: log π_ref of each generated token under a frozen reference model; read only when ``kl_coef > 0``.
#: Not a records contract column: whoever sets ``kl_coef`` must add it to the batch.
REF_LOGPROBS = "ref_logprobs"


@dataclass(frozen=True)
class GRPOOptions(EstimatorOptions):
    clip_eps: float | None = field(0.2, help="PPO clip ε on ρ = π_θ/π_b; None = unclipped")
    clip_eps_high: float | None = field(
        None, help="upper clip ε_high (DAPO clip-higher, e.g. 0.28); None = clip_eps"
    )
    dual_clip: float | None = field(None, help="dual-clip c > 1: caps the loss at −c·A for A < 0; None = off")
    scale: Literal["std", "none"] = field("std", help="std: (R − mean)/std (GRPO); none: R − mean (Dr.GRPO)")
    kl_coef: float = field(
        0.0,
        help="β of a KL(π_θ‖π_ref) penalty to a reference policy; > 0 needs a 'ref_logprobs' [B, T] column",
    )
    anchor: Literal["behavior", "proximal"] = field(
        "behavior",
        help="ratio denominator: behavior (ρ = π_θ/π_b) or proximal (ρ = π_θ/π_prox, decoupled PPO "
        "with truncated_is weighting π_prox/π_b; needs clip_eps and dual_clip null)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            self.clip_eps is None or self.clip_eps > 0, "clip_eps", self.clip_eps, "use a positive ε or None"
        )
        check(
            self.clip_eps_high is None or (self.clip_eps is not None and self.clip_eps_high > 0),
            "clip_eps_high",
            self.clip_eps_high,
            "use a positive ε_high together with clip_eps, or None",
        )
        check(self.dual_clip is None or self.dual_clip > 1, "dual_clip", self.dual_clip, "use c > 1 or None")
        check(self.kl_coef >= 0, "kl_coef", self.kl_coef, "use 0 (off) or a positive coefficient")
        check_proximal_unclipped(self.anchor, self.clip_eps, self.dual_clip)


def check_proximal_unclipped(anchor: str, clip_eps: float | None, dual_clip: float | None = None) -> None:
    """``anchor='proximal'`` puts ``ρ = π_θ/π_prox = 1`` in the step's forward pass, so a PPO clip
    could never bind: refuse a configured clip rather than let it look active."""
    for name, value in (("clip_eps", clip_eps), ("dual_clip", dual_clip)):
        check(
            anchor != "proximal" or value is None,
            name,
            value,
            "anchor='proximal' makes ρ = π_θ/π_prox = 1 at the step's forward pass, so a clip never binds; "
            f"set {name}: null (truncated_is's upper bounds the importance weights)",
        )


@ESTIMATORS.register("grpo")
class GRPO(TokenLossEstimator):
    """GRPO / Dr.GRPO / DAPO-style clipped policy gradient on scalar rewards.

    - Estimand: the policy gradient of the expected reward, with ``A_i = (R_i − mean_g R)/std_g R``
      broadcast to every token of sample i and ``loss_it = max(−A ρ, −A clip(ρ, 1−ε, 1+ε_high))``.
    - Cache: none (``cache_kind = None``); reads ``reward``, ``group_id``, ``completion_ids``,
      ``behavior_logprobs``. Advantages are computed over the members of each group present in
      the batch, so the pipeline must deliver (and drop) groups whole.
    - Bias/variance: unclipped it is the importance-weighted (unbiased) REINFORCE gradient with a
      group baseline (the std scaling and the in-group mean make it slightly biased, as in GRPO);
      clipping trades variance for bias per token.
    - Staleness: enters through ρ = π_θ/π_b only (``anchor='behavior'``); with
      ``anchor='proximal'`` the ratio is π_θ/π_prox and ``truncated_is`` supplies π_prox/π_b
      (decoupled PPO, see the module docstring).
    - ``kl_coef``: a penalty ``β·KL(π_θ‖π_ref)`` against a frozen *reference* policy (column
      ``ref_logprobs``, not the behavior policy), written as a policy-gradient term with the
      per-token reward ``−(log π_θ − log π_ref)`` and the same ratio ρ: per token
      ``β·ρ·sg(log π_θ − log π_ref)``, whose expected value under the sampler is
      ``β·KL(π_θ‖π_ref)`` and expected gradient ``β·∇KL(π_θ‖π_ref)`` per state. (A k3 term
      ``e^u − u − 1``, ``u = log π_ref − log π_θ``, has the right value but its pathwise gradient
      is ``∇KL(π_ref‖π_θ)``, the other direction.) ``est/kl_ref`` reports the k3 value.
    - Metrics: ``est/clip_frac``, ``est/is_ratio_mean|max``, ``est/reward_mean``,
      ``est/adv_abs_mean``, ``est/zero_adv_frac`` (samples in zero-variance groups), ``est/kl_ref``.
    """

    name = "grpo"
    Config = GRPOOptions
    cache_kind: str | None = None
    #: its loss carries π_θ/π_b at the generated token (``asyncrl.step.check_composition``)
    behavior_ratio = "token"

    @property
    def anchor(self) -> str:
        return self.config.anchor

    def required_columns(self) -> frozenset[str]:
        cols = {R.COMPLETION_MASK, R.COMPLETION_IDS, R.BEHAVIOR_LOGPROBS, R.REWARD, R.GROUP_ID}
        if self.config.kl_coef > 0:
            cols.add(REF_LOGPROBS)
        return frozenset(cols)

    def token_loss(self, x: EstimatorInputs) -> TokenLoss:
        cfg, batch, mask = self.config, x.batch, x.mask
        lq = x.generated_logprobs()  # [B, T]
        lb = fill_padding(batch[R.BEHAVIOR_LOGPROBS].to(lq.dtype), mask, 0.0)
        anchor = lq.detach() if cfg.anchor == "proximal" else lb  # π_prox = sg(π_θ) before the step
        adv = grpo_advantages(batch[R.REWARD], batch[R.GROUP_ID], scale=cfg.scale).to(lq.dtype)  # [B]
        per_token = policy_gradient_loss(
            lq, anchor, adv, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip
        )
        metrics: dict[str, float] = {}
        if cfg.kl_coef > 0:
            check_logprob_column(self.name, REF_LOGPROBS, batch[REF_LOGPROBS], mask)
            ref = fill_padding(batch[REF_LOGPROBS].to(lq.dtype), mask, 0.0)
            # reward −(log π_θ − log π_ref), unclipped: E[∇] = ∇KL(π_θ‖π_ref) (class docstring)
            penalty = policy_gradient_loss(lq, anchor, -(lq - ref), clip_eps=None)
            per_token = per_token + cfg.kl_coef * penalty
            metrics["est/kl_ref"] = float(masked_mean(kl_qp_k3(lq.detach(), ref), mask))
        with torch.no_grad():
            rho = importance_log_ratio(lq.detach(), lb).exp()
            metrics["est/is_ratio_mean"] = float(masked_mean(rho, mask))
            metrics["est/is_ratio_max"] = masked_max(rho, mask)
            if cfg.clip_eps is not None:
                high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
                a = adv.unsqueeze(-1)
                clipped = ((a > 0) & (rho > 1 + high)) | ((a < 0) & (rho < 1 - cfg.clip_eps))
                metrics["est/clip_frac"] = float(masked_mean(clipped.to(lq.dtype), mask))
            metrics["est/reward_mean"] = float(batch[R.REWARD].double().mean()) if adv.numel() else 0.0
            metrics["est/adv_abs_mean"] = float(adv.abs().mean()) if adv.numel() else 0.0
            metrics["est/zero_adv_frac"] = float((adv == 0).double().mean()) if adv.numel() else 0.0
        return TokenLoss(per_token, metrics, per_sample={"advantage": adv.detach()})
