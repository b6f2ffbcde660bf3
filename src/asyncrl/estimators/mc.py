"""Monte Carlo KL estimators: sampled reverse KL (behavior draws), sampled forward KL (teacher
draws), and the stratified top-k head plus importance-sampled tail.

They trade cache bytes for variance: every draw comes with the density of the distribution it
was drawn from, so expectations under the *current* student can be re-estimated by importance
weighting (ρ = π_θ/π_b) and recompute, however stale the draws are ("MC-correctable").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from asyncrl import records as R
from asyncrl.configurable import check, field
from asyncrl.estimators.base import ESTIMATORS
from asyncrl.estimators.columns import fill_padding
from asyncrl.estimators.functional import (
    forward_kl_mc_from_logprobs,
    reverse_kl_mc_from_logprobs,
    reverse_kl_stratified_from_logprobs,
)
from asyncrl.estimators.grpo import check_proximal_unclipped
from asyncrl.estimators.token_loss import (
    EstimatorInputs,
    EstimatorOptions,
    TokenLoss,
    TokenLossEstimator,
    masked_max,
)
from asyncrl.logratio import importance_log_ratio, masked_mean


def _ratio_metrics(
    log_rho: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor | None = None
) -> dict[str, float]:
    """IS diagnostics over ``[B, T, m]`` draws: mean/max ρ and the per-position ESS fraction
    ``(Σ_j ρ_j)² / (m Σ_j ρ_j²)`` in ``[1/m, 1]`` (computed in log space), averaged over positions."""
    log_rho = log_rho.detach()
    m = log_rho.shape[-1]
    draw_mask = mask.unsqueeze(-1).expand_as(log_rho)
    if valid is not None:
        draw_mask = draw_mask & valid
    rho = log_rho.exp()
    ess = torch.exp(2 * torch.logsumexp(log_rho, -1) - torch.logsumexp(2 * log_rho, -1) - math.log(m))
    return {
        "est/is_ratio_mean": float(masked_mean(rho, draw_mask)),
        "est/is_ratio_max": masked_max(rho, draw_mask),
        "est/ess_mc": float(masked_mean(ess, mask)),
    }


@dataclass(frozen=True)
class ReverseKLMCOptions(EstimatorOptions):
    form: Literal["pg", "value"] = field(
        "pg", help="pg: surrogate with expected gradient ∇KL(π_θ‖p); value: differentiable KL estimate"
    )
    advantage: Literal["online", "stale"] = field(
        "online",
        help="online: A = log p − log π_θ recomputed now (unbiased); stale: A = log p − log π_b (biased)",
    )
    clip_eps: float | None = field(None, help="PPO clip ε on ρ (pg form); None = unclipped (unbiased)")
    loo_baseline: bool = field(False, help="subtract the leave-one-out mean advantage (pg form, m >= 2)")
    source: Literal["mc", "token"] = field(
        "mc",
        help="mc: m behavior draws (cache behavior_mc); token: the generated token only (cache token, m = 1)",
    )
    anchor: Literal["behavior", "proximal"] = field(
        "behavior",
        help="ratio denominator: behavior (ρ = π_θ/π_b) or proximal (ρ = π_θ/π_prox, decoupled PPO with "
        "truncated_is weighting π_prox/π_b; source=token, clip_eps null)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.form == "value":
            check(
                self.advantage == "online",
                "advantage",
                self.advantage,
                "form='value' needs advantage='online'",
            )
            check(
                self.clip_eps is None,
                "clip_eps",
                self.clip_eps,
                "form='value' is unclipped; set clip_eps=None",
            )
            check(not self.loo_baseline, "loo_baseline", self.loo_baseline, "form='value' takes no baseline")
        check(
            self.clip_eps is None or self.clip_eps > 0, "clip_eps", self.clip_eps, "use a positive ε or None"
        )
        check(
            not (self.loo_baseline and self.source == "token"),
            "loo_baseline",
            self.loo_baseline,
            "a leave-one-out baseline needs source='mc' with m >= 2",
        )
        check(
            self.anchor == "behavior" or self.source == "token",
            "anchor",
            self.anchor,
            "source='mc' importance-weights its m draws by π_θ/π_b itself; anchor='proximal' (for "
            "truncated_is weights on the generated token) needs source='token'",
        )
        check_proximal_unclipped(self.anchor, self.clip_eps)


@ESTIMATORS.register("reverse_kl_mc")
class ReverseKLMC(TokenLossEstimator):
    """E5/E6 (default): ``KL(π_θ‖p)`` from m draws of the behavior policy, importance-weighted.

    - Estimand: ``∇RKL(s)`` (pg form) or ``RKL(s)`` and its gradient (value form) at the current
      student, from draws ``y_j ~ π_b(·|s)`` made at generation time (column 0 = generated token).
    - Cache: ``behavior_mc``: ``teacher_mc_logprobs`` = ``log p(y_j)`` at the rollout's ``mc_ids``,
      with ``mc_behavior_logprobs`` = ``log π_b(y_j)`` from the engine. ``source="token"`` uses only
      the generated token (cache ``token``: ``teacher_token_logprobs``, ``behavior_logprobs``).
    - Bias/variance: unbiased with ``advantage="online"`` and ``clip_eps=None``; variance
      ``Var_1/m`` and growing like ``E_{π_b}[ρ² l²]`` with staleness. ``advantage="stale"`` adds
      ``−∇KL(π_θ‖π_b)`` to the expected gradient; clipping bounds variance at the price of bias.
    - Staleness: enters only through ρ (corrects the token choice) and the advantage (online
      recomputes it); watch ``est/ess_mc``. With ``source='token'`` and ``anchor='proximal'``
      the ratio is π_θ/π_prox and ``truncated_is`` supplies π_prox/π_b (decoupled PPO, see
      ``asyncrl.estimators.grpo``).
    - Metrics: ``est/is_ratio_mean|max``, ``est/ess_mc`` (ESS/m per position, mean),
      ``est/clip_frac`` (when clipped), ``est/kl_value`` (value-form estimate of RKL).
    """

    name = "reverse_kl_mc"
    Config = ReverseKLMCOptions

    @property
    def cache_kind(self) -> str | None:
        return "behavior_mc" if self.config.source == "mc" else "token"

    @property
    def behavior_ratio(self) -> str:
        """Where its loss carries π_θ/π_b (``asyncrl.step.check_composition``): at the generated
        token (``source='token'``) or at m draws that include it (``source='mc'``)."""
        return "token" if self.config.source == "token" else "draws"

    @property
    def anchor(self) -> str:
        return self.config.anchor

    def required_columns(self) -> frozenset[str]:
        if self.config.source == "mc":
            return frozenset({R.COMPLETION_MASK, R.MC_IDS, R.MC_BEHAVIOR_LOGPROBS, R.TEACHER_MC_LOGPROBS})
        return frozenset({R.COMPLETION_MASK, R.COMPLETION_IDS, R.BEHAVIOR_LOGPROBS, R.TEACHER_TOKEN_LOGPROBS})

    def token_loss(self, x: EstimatorInputs) -> TokenLoss:
        cfg, batch, mask = self.config, x.batch, x.mask
        if cfg.source == "mc":
            ids, lb, lp = batch[R.MC_IDS], batch[R.MC_BEHAVIOR_LOGPROBS], batch[R.TEACHER_MC_LOGPROBS]
            if cfg.loo_baseline and ids.shape[-1] < 2:
                raise ValueError(f"{self.name}: loo_baseline needs m >= 2 columns in {R.MC_IDS!r}")
            lq = x.logprobs_at(ids)  # [B, T, m]
        else:  # m = 1: the generated token, whose log π_θ the caller may have gathered already
            lq = x.generated_logprobs().unsqueeze(-1)
            lb = batch[R.BEHAVIOR_LOGPROBS].unsqueeze(-1)
            lp = batch[R.TEACHER_TOKEN_LOGPROBS].unsqueeze(-1)
        lb = fill_padding(lb.to(lq.dtype), mask, 0.0)
        lp = fill_padding(lp.to(lq.dtype), mask, 0.0)
        per_token = reverse_kl_mc_from_logprobs(
            lq,
            lb,
            lp,
            form=cfg.form,
            advantage=cfg.advantage,
            clip_eps=cfg.clip_eps,
            loo_baseline=cfg.loo_baseline,
            anchor_logprobs=lq.detach() if cfg.anchor == "proximal" else None,  # π_prox = sg(π_θ)
        )
        with torch.no_grad():
            lqd = lq.detach()
            log_rho = importance_log_ratio(lqd, lb)
            metrics = _ratio_metrics(log_rho, mask)
            metrics["est/kl_value"] = float(masked_mean((log_rho.exp() * (lqd - lp)).mean(-1), mask))
            if cfg.form == "pg" and cfg.clip_eps is not None:
                adv = lp - (lqd if cfg.advantage == "online" else lb)
                rho = log_rho.exp()
                clipped = ((adv > 0) & (rho > 1 + cfg.clip_eps)) | ((adv < 0) & (rho < 1 - cfg.clip_eps))
                metrics["est/clip_frac"] = float(masked_mean(clipped.to(lqd.dtype), mask))
        return TokenLoss(per_token, metrics)


@dataclass(frozen=True)
class ForwardKLMCOptions(EstimatorOptions):
    pass


@ESTIMATORS.register("forward_kl_mc")
class ForwardKLMC(TokenLossEstimator):
    """E8: ``KL(p‖π_θ)`` from m draws of the teacher made at scoring time.

    - Estimand: ``FKL(s)`` and its gradient ``π_θ − p``.
    - Cache: ``teacher_mc``: ``teacher_mc_ids`` (``y_j ~ p``, i.i.d. with replacement) and
      ``teacher_mc_logprobs`` = ``log p(y_j)``.
    - Bias/variance: unbiased in value and gradient; variance ``∝ 1/m``.
    - Staleness: none per token (the proposal is the teacher); only ``d^{π_b}`` of the states.
    - Metrics: ``est/kl_value`` (the MC value), ``est/student_logprob`` (mean ``log π_θ(y_j)``).
    """

    name = "forward_kl_mc"
    Config = ForwardKLMCOptions
    cache_kind: str | None = "teacher_mc"

    def required_columns(self) -> frozenset[str]:
        return frozenset({R.COMPLETION_MASK, R.TEACHER_MC_IDS, R.TEACHER_MC_LOGPROBS})

    def token_loss(self, x: EstimatorInputs) -> TokenLoss:
        mask = x.mask
        lq = x.logprobs_at(x.batch[R.TEACHER_MC_IDS])  # [B, T, m]
        lp = fill_padding(x.batch[R.TEACHER_MC_LOGPROBS].to(lq.dtype), mask, 0.0)
        per_token = forward_kl_mc_from_logprobs(lq, lp)
        metrics = {
            "est/kl_value": float(masked_mean(per_token.detach(), mask)),
            "est/student_logprob": float(masked_mean(lq.detach().mean(-1), mask)),
        }
        return TokenLoss(per_token, metrics)


@dataclass(frozen=True)
class ReverseKLStratifiedOptions(EstimatorOptions):
    pass


@ESTIMATORS.register("reverse_kl_stratified")
class ReverseKLStratified(TokenLossEstimator):
    """E7: ``KL(π_θ‖p)`` as an exact sum on the teacher's top-k plus an importance-sampled tail.

    - Estimand: ``RKL(s)`` and its gradient, ``L = Σ_{y∈S} π_θ l_θ + (1/m) Σ_j 1[y_j ∉ S] ρ_j l_θ(y_j)``.
    - Cache: ``topk_behavior_mc``: the ``topk`` columns (S, fixed before sampling and independent
      of the draws) plus ``teacher_mc_logprobs`` at the rollout's ``mc_ids``.
    - Bias/variance: unbiased; variance only from the tail, small when ``M_θ(S)`` is near 1, so it
      beats plain MC at equal m on peaked students. Reduces to top-k ``drop`` at m = 0.
    - Staleness: the head is recomputed exactly; the tail is corrected by ρ = π_θ/π_b.
    - Metrics: ``est/teacher_mass``, ``est/student_mass``, ``est/tail_sample_frac`` (draws outside
      S), ``est/is_ratio_mean|max``, ``est/ess_mc``, ``est/kl_value``.
    """

    name = "reverse_kl_stratified"
    Config = ReverseKLStratifiedOptions
    cache_kind: str | None = "topk_behavior_mc"
    #: its tail importance-weights m behavior draws that include the generated token
    behavior_ratio = "draws"

    def required_columns(self) -> frozenset[str]:
        return frozenset(
            {
                R.COMPLETION_MASK,
                R.TEACHER_TOPK_IDS,
                R.TEACHER_TOPK_LOGPROBS,
                R.MC_IDS,
                R.MC_BEHAVIOR_LOGPROBS,
                R.TEACHER_MC_LOGPROBS,
            }
        )

    def token_loss(self, x: EstimatorInputs) -> TokenLoss:
        batch, mask = x.batch, x.mask
        support = batch[R.TEACHER_TOPK_IDS].long()
        samples = batch[R.MC_IDS].long()
        k = support.shape[-1]
        lq = x.logprobs_at(torch.cat([support, samples], -1))  # [B, T, k + m]
        lq_s, lq_y = lq[..., :k], lq[..., k:]
        lp_s = fill_padding(batch[R.TEACHER_TOPK_LOGPROBS].to(lq.dtype), mask, -math.log(k + 1))
        lb_y = fill_padding(batch[R.MC_BEHAVIOR_LOGPROBS].to(lq.dtype), mask, 0.0)
        lp_y = fill_padding(batch[R.TEACHER_MC_LOGPROBS].to(lq.dtype), mask, 0.0)
        in_support = (samples.unsqueeze(-1) == support.unsqueeze(-2)).any(-1)  # [B, T, m]
        per_token = reverse_kl_stratified_from_logprobs(lq_s, lp_s, lq_y, lb_y, lp_y, in_support)
        with torch.no_grad():
            metrics = _ratio_metrics(importance_log_ratio(lq_y.detach(), lb_y), mask, valid=~in_support)
            metrics["est/teacher_mass"] = float(masked_mean(torch.logsumexp(lp_s, -1).exp(), mask))
            metrics["est/student_mass"] = float(masked_mean(torch.logsumexp(lq_s.detach(), -1).exp(), mask))
            metrics["est/tail_sample_frac"] = float(masked_mean((~in_support).to(lq.dtype), mask))
            metrics["est/kl_value"] = float(masked_mean(per_token, mask))
        return TokenLoss(per_token, metrics)
