"""Deterministic KL estimators on an enumerated support: forward and reverse KL, top-k or dense.

Both are exact sums over the tokens the cache holds, recomputed under the current student at
learner time, so they have no sampling variance; their bias comes from the tokens the cache
does *not* hold (the tail rule decides how that mass is treated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from asyncrl import records as R
from asyncrl.configurable import field
from asyncrl.estimators.base import ESTIMATORS
from asyncrl.estimators.columns import fill_padding
from asyncrl.estimators.functional import (
    forward_kl_dense,
    forward_kl_topk_from_logprobs,
    reverse_kl_dense,
    reverse_kl_topk_from_logprobs,
)
from asyncrl.estimators.token_loss import (
    EstimatorInputs,
    EstimatorOptions,
    TokenLoss,
    TokenLossEstimator,
)
from asyncrl.logratio import masked_mean


@dataclass(frozen=True)
class SupportKLOptions(EstimatorOptions):
    tail: Literal["drop", "bucket", "renorm"] = field(
        "bucket",
        help="mass outside the top-k: drop (ignore), bucket (one extra bin, bounded by the full KL) "
        "or renorm (KL of the conditionals on the support)",
    )
    dense: bool = field(False, help="use the full teacher logits (cache 'dense'; small vocabularies only)")


class _SupportKL(TokenLossEstimator):
    """Shared body of ForwardKL / ReverseKL: gather on the support, apply the tail rule."""

    Config = SupportKLOptions
    _dense_fn: Any
    _topk_fn: Any

    @property
    def cache_kind(self) -> str | None:
        return "dense" if self.config.dense else "topk"

    def required_columns(self) -> frozenset[str]:
        if self.config.dense:
            return frozenset({R.COMPLETION_MASK, R.TEACHER_LOGITS})
        cols = {R.COMPLETION_MASK, R.TEACHER_TOPK_IDS, R.TEACHER_TOPK_LOGPROBS}
        if self.config.tail == "bucket":
            cols.add(R.TEACHER_TOPK_LOG_TAIL)
        return frozenset(cols)

    def token_loss(self, x: EstimatorInputs) -> TokenLoss:
        cfg, batch, mask = self.config, x.batch, x.mask
        metrics: dict[str, float] = {}
        if cfg.dense:
            teacher = fill_padding(batch[R.TEACHER_LOGITS], mask, 0.0)
            per_token = self._dense_fn(x.student_logits, teacher)
        else:
            ids = batch[R.TEACHER_TOPK_IDS]
            k = ids.shape[-1]
            tails: dict[str, torch.Tensor] = {}
            if cfg.tail == "bucket":  # both tails exact: the student's from its logits, the teacher's stored
                lq, tails["student_log_tail"] = x.logprobs_and_log_tail_at(ids)
                lt_p = batch[R.TEACHER_TOPK_LOG_TAIL].to(lq.dtype)
                tails["teacher_log_tail"] = fill_padding(lt_p, mask, -math.log(k + 1))
            else:
                lq = x.logprobs_at(ids)  # [B, T, k]
            # padding: head mass k/(k+1), tail 1/(k+1) (finite, harmless)
            lp = fill_padding(batch[R.TEACHER_TOPK_LOGPROBS].to(lq.dtype), mask, -math.log(k + 1))
            per_token = self._topk_fn(lq, lp, tail=cfg.tail, **tails)
            with torch.no_grad():
                metrics["est/teacher_mass"] = float(masked_mean(torch.logsumexp(lp, -1).exp(), mask))
                metrics["est/student_mass"] = float(masked_mean(torch.logsumexp(lq, -1).exp(), mask))
        metrics["est/kl_value"] = float(masked_mean(per_token.detach(), mask))
        return TokenLoss(per_token, metrics)


@ESTIMATORS.register("forward_kl")
class ForwardKL(_SupportKL):
    """E1/E3: ``KL(p‖π_θ)`` on the teacher's top-k support (default) or the full vocabulary.

    - Estimand: ``FKL(s) = Σ_y p (log p − log π_θ)`` per completion position.
    - Cache: ``topk`` (``teacher_topk_ids``/``teacher_topk_logprobs``, log-probs normalised over
      the full vocabulary, and ``teacher_topk_log_tail`` for the ``bucket`` tail) or ``dense``
      (``teacher_logits``) with ``dense=True``. Both tails of the bucket are exact log masses
      (the student's a masked logsumexp of its logits), so a tiny tail keeps its meaning in fp32.
    - Bias/variance: zero variance. Exact when dense or k = |V|; otherwise biased by the tail:
      ``bucket`` gives ``0 ≤ L ≤ FKL`` (gap ``(1−M_p) KL(p|T ‖ π_θ|T)``), ``drop`` drives the
      student tail to 0, ``renorm`` ignores the student's mass on S.
    - Staleness: none per token. The loss is teacher-weighted and the support teacher-chosen, so
      it does not read ``behavior_logprobs``; staleness only enters through which states were
      visited (``d^{π_b}``). That is why FKL tolerates a larger ``max_lag`` than RKL.
    - Metrics: ``est/teacher_mass`` = ``M_p(S)``, ``est/student_mass`` = ``M_θ(S)``, ``est/kl_value``.
    """

    name = "forward_kl"
    _dense_fn = staticmethod(forward_kl_dense)
    _topk_fn = staticmethod(forward_kl_topk_from_logprobs)


@ESTIMATORS.register("reverse_kl")
class ReverseKL(_SupportKL):
    """E2/E4: ``KL(π_θ‖p)`` recomputed under the current student on the teacher's top-k, or dense.

    - Estimand: ``RKL(s) = Σ_y π_θ (log π_θ − log p)``.
    - Cache: ``topk`` (support S = teacher top-k) or ``dense`` with ``dense=True``.
    - Bias/variance: zero variance; π_θ is recomputed on S, so no importance ratio is needed.
      ``bucket`` (default) gives ``0 ≤ L ≤ RKL`` and is stationary at ``π_θ = p``; ``drop`` is not
      stationary there and pushes mass out of S (the loss can go negative). The tail bias cannot
      be reweighted away: the cache has no proposal density for the tail ("not MC-correctable").
    - Staleness: the teacher's top-k does not depend on π_b, but it covers p's modes, not π_θ's,
      so the bias grows as the student drifts from the teacher.
    - Metrics: ``est/teacher_mass``, ``est/student_mass`` (coverage ``M_θ(S)``), ``est/kl_value``.
    """

    name = "reverse_kl"
    _dense_fn = staticmethod(reverse_kl_dense)
    _topk_fn = staticmethod(reverse_kl_topk_from_logprobs)
