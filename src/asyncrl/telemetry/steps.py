"""What the learner writes per optimizer step (metrics.jsonl) and per consumed sample (samples.parquet).

One owner of the learner's metric keys (``names``) and of how each is reduced over ranks:
``asyncrl.step.loss_step`` returns the raw quantities already reduced over all data-parallel
ranks (counts, the global loss and token KL, the kept samples' lags and sequence log-ratios of
every rank), and the functions here only name and summarise them. The estimator's and the
controllers' own metrics keep their keys; a learner key wins on a clash (the learner's figure
is the global one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.controllers.functional import ess_fraction
from asyncrl.telemetry import names as N
from asyncrl.telemetry.staleness import per_bucket

#: bookkeeping and timing columns copied from the batch into samples.parquet when present: the
#: block's position in the stream, the learner version at its admission and the version the
#: admission expected to train it (``AdmissionBudget``), placement and timings
BATCH_EXTRAS = (
    R.BLOCK_INDEX,
    "admit_version",
    "expected_version",
    "gen_node",
    "score_node",
    "gen_time_s",
    "gen_wait_s",
    "gen_done_at",
    "score_time_s",
    "score_done_at",
    "consumed_at",
)


def step_metrics(result: Any) -> dict[str, float]:
    """The learner's per-step figures (global over ranks) from a ``StepResult``."""
    out = dict(result.metrics)
    lags = result.lags_global.double()
    out[N.DROPPED] = float(result.n_dropped)
    # a skipped non-finite step trained nothing (its samples' drop_reason says so), and its
    # figures are NaN: only numerics/skipped is reported for it
    out[N.SAMPLES_KEPT] = 0.0 if result.nonfinite else float(result.n_kept)
    if result.n_kept and not result.nonfinite:
        out.update(
            {
                N.LOSS: result.loss,
                N.LAG_MEAN: float(lags.mean()),
                N.LAG_MAX: float(lags.max()),
                N.ESS_RHO: float(ess_fraction(result.seq_log_ratio_global.double())),
                N.LR_SCHEDULED: result.lr_scheduled,
                N.LR_APPLIED: result.lr_applied,
                N.KL_BEHAVIOR_CURRENT: result.kl_behavior_current,
                N.GRAD_NORM: result.grad_norm,
                N.TOKENS: float(result.tokens),
            }
        )
    if result.nonfinite:
        out[N.NUMERICS_SKIPPED] = 1.0
    return out


def sample_rows(batch: Mapping[str, Any], result: Any, version: int, step: int) -> dict[str, np.ndarray]:
    """This rank's per-sample columns: bookkeeping from the batch, values from the step.

    ``version``: the learner version the samples were consumed at; ``step``: the 1-based
    optimizer step that consumed them (= metrics.jsonl ``step``).
    """
    n = len(batch[R.SAMPLE_ID])
    mask = np.asarray(batch[R.COMPLETION_MASK]).astype(bool)
    rows: dict[str, np.ndarray] = {
        "sample_id": np.asarray(batch[R.SAMPLE_ID]),
        "prompt_id": np.asarray(batch[R.PROMPT_ID]),
        "group_id": np.asarray(batch[R.GROUP_ID]),
        "version_first": np.asarray(batch[R.VERSION_FIRST]),
        "version_last": np.asarray(batch[R.VERSION_LAST]),
        "learner_version": np.full(n, version),
        "reward": np.asarray(batch.get(R.REWARD, np.full(n, np.nan)), dtype=np.float64),
        "completion_len": mask.sum(1),
        "step": np.full(n, step),
        **result.samples,
    }
    rows.update({k: np.asarray(batch[k]) for k in BATCH_EXTRAS if k in batch})
    # the ledger per sample: a non-finite step trained nothing, so its samples count as dropped
    passed = np.asarray(result.samples["kept"]).astype(bool)
    rows["kept"] = passed & (not result.nonfinite)
    rows[N.DROP_REASON] = np.where(
        passed, N.DROPPED_NONFINITE if result.nonfinite else "", N.DROPPED_CONTROLLERS
    ).astype(object)
    if R.TEACHER_TOPK_LOGPROBS in batch:
        rows[N.SAMPLE_TEACHER_MASS] = teacher_mass(batch[R.TEACHER_TOPK_LOGPROBS], mask)
    return rows


def teacher_mass(topk_logprobs: Any, mask: np.ndarray) -> np.ndarray:
    """Per sample: the mean over its valid tokens of the teacher mass the top-k cache kept,
    ``M_p(S) = Σ_k p``; NaN for a sample with no valid token."""
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    mass = np.exp(lp).sum(-1)  # [B, T]
    n = mask.sum(1)
    total = np.where(mask, mass, 0.0).sum(1)
    return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def bucket_metrics(rows: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``bucket/<lag>/<metric>`` over the kept samples (every rank's rows): loss, KL(behavior ||
    current), reward, the top-k cache's teacher mass (when the rows have it), the count ``n`` and
    ``ess``, the ESS fraction of the bucket's sequence weights ``exp(seq_log_ratio)`` (how far
    importance weighting would thin that bucket out)."""
    kept = np.asarray(rows["kept"]).astype(bool)
    out: dict[str, float] = {}
    if not kept.any():
        return out
    lags = rows["lag"][kept]
    for name in ("loss", "kl_behavior_current", "reward", N.SAMPLE_TEACHER_MASS):
        if name in rows:
            out.update(per_bucket(rows[name][kept], lags, name=name))
    out.update(per_bucket(np.ones(int(kept.sum())), lags, name="n", reduce="sum"))
    out.update(per_bucket(rows["seq_log_ratio"][kept], lags, reduce=_ess, name="ess"))
    return out


def _ess(log_weights: np.ndarray) -> float:
    return float(ess_fraction(torch.as_tensor(log_weights, dtype=torch.float64)))
