"""Staleness telemetry: lag buckets, per-bucket aggregation, KL(behavior||current) and ESS variants.

Every per-sample quantity is also reported per lag bucket (spec section 5) so that drift from
staleness can be told apart from train/inference mismatch: bucket ``0`` holds only the
mismatch floor. Buckets are ``0, 1, 2, 3-4, 5-8, 9-16, 17+``; the key of metric ``q`` in
bucket ``b`` is ``bucket/<b>/<q>`` (``asyncrl.telemetry.names.bucket_key``).

Lags (spec section 1): ``lag_head = v_L - v_first`` (what max_lag bounds), ``lag_tail =
v_L - v_last``, ``lag_in_flight = v_last - v_first``, ``lag_in_queue = v_L - v_last``.

KL(pi_b || pi_theta) per sample, over its sampled tokens: ``k1 = mean(log pi_b - log pi_theta)``
(unbiased, can be negative) and ``k3 = mean(r - log r - 1)``, ``r = pi_theta / pi_b`` (>= 0).

ESS fractions ``rho = (sum w)^2 / (N sum w^2)`` under distinct names, never mixed: ``ess_seq``
(w = exp(L_i), VCPO), ``ess_seq_clipped`` (w = min(exp(L_i), C)), ``ess_tok`` (w = exp(l_t)
over all valid tokens, what verl reports).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from asyncrl.controllers.functional import ess_fraction
from asyncrl.logratio import kl_qp_k1, kl_qp_k3, masked_mean, masked_token_log_ratio, sequence_log_ratio
from asyncrl.telemetry.names import TOKEN_LAG_HIST, bucket_key

LAG_BUCKETS: tuple[str, ...] = ("0", "1", "2", "3-4", "5-8", "9-16", "17+")
#: smallest lag of each bucket in LAG_BUCKETS
BUCKET_LOWER: tuple[int, ...] = (0, 1, 2, 3, 5, 9, 17)

Reduce = str | Callable[[np.ndarray], float]


def _np(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return x.numpy() if x.dtype != torch.bfloat16 else x.float().numpy()
    return np.asarray(x)


def lag_bucket_index(lags: Any) -> np.ndarray:
    """[N] integer lags -> [N] index into ``LAG_BUCKETS``."""
    lags = _np(lags)
    if lags.size and (lags < 0).any():
        raise ValueError(f"lags must be >= 0 (learner version - version_first), got min {lags.min()}")
    return np.searchsorted(np.asarray(BUCKET_LOWER), lags, side="right") - 1


def lag_bucket(lag: int) -> str:
    """Label of the bucket of one lag: 0 -> '0', 4 -> '3-4', 20 -> '17+'."""
    return LAG_BUCKETS[int(lag_bucket_index(np.asarray([lag]))[0])]


def _reduce(values: np.ndarray, reduce: Reduce) -> float:
    if callable(reduce):
        return float(reduce(values))
    if reduce == "mean":
        return float(values.mean())
    if reduce == "sum":
        return float(values.sum())
    if reduce == "max":
        return float(values.max())
    if reduce == "min":
        return float(values.min())
    if reduce == "count":
        return float(values.size)
    raise ValueError(f"reduce must be 'mean', 'sum', 'max', 'min', 'count' or a callable, got {reduce!r}")


def per_bucket(
    values: Any, lags: Any, reduce: Reduce = "mean", *, name: str | None = None
) -> dict[str, float]:
    """``reduce`` of ``values`` over the samples of each non-empty lag bucket.

    Keys are the bucket labels, or the metric keys ``bucket/<label>/<name>`` when ``name`` is
    given. ``values`` and ``lags`` are [N] (numpy or torch); ``reduce`` is ``mean``, ``sum``,
    ``max``, ``min``, ``count`` or a function of the bucket's values (e.g.
    ``lambda lw: float(ess_fraction(torch.as_tensor(lw)))``).
    """
    v, idx = _np(values), lag_bucket_index(lags)
    if v.shape[:1] != idx.shape:
        raise ValueError(f"values has {v.shape[:1]} samples but lags has {idx.shape}: one lag per sample")
    out = {LAG_BUCKETS[b]: _reduce(v[idx == b], reduce) for b in np.unique(idx).tolist()}
    return out if name is None else {bucket_key(label, name): value for label, value in out.items()}


def bucket_metrics(per_sample: Mapping[str, Any], lags: Any, reduce: Reduce = "mean") -> dict[str, float]:
    """``bucket/<label>/<metric>`` for every per-sample metric, plus ``bucket/<label>/n``."""
    out = per_bucket(_np(lags), lags, "count", name="n")
    for metric, values in per_sample.items():
        out.update(per_bucket(values, lags, reduce, name=metric))
    return out


def lag_histogram(lags: Any, prefix: str = "staleness/lag_hist") -> dict[str, float]:
    """Sample count of every bucket (zeros included): ``<prefix>/<label>``."""
    counts = np.bincount(lag_bucket_index(lags), minlength=len(LAG_BUCKETS))
    return {f"{prefix}/{label}": float(c) for label, c in zip(LAG_BUCKETS, counts)}


def sample_lags(version_first: Any, version_last: Any, learner_version: int) -> dict[str, np.ndarray]:
    """Head/tail/in-flight/in-queue lags per sample (spec section 1)."""
    vf, vl = _np(version_first).astype(np.int64), _np(version_last).astype(np.int64)
    if (vl < vf).any():
        raise ValueError("version_last < version_first for some samples: versions must be non-decreasing")
    return {
        "lag_head": learner_version - vf,
        "lag_tail": learner_version - vl,
        "lag_in_flight": vl - vf,
        "lag_in_queue": learner_version - vl,
    }


#: samples.parquet columns of the token-level lag distribution (``token_lag_columns``)
TOKEN_LAG_MIN, TOKEN_LAG_MAX, TOKEN_LAG_MEAN = "token_lag_min", "token_lag_max", "token_lag_mean"
TOKEN_LAG_COUNTS = "token_lag_counts"


def token_lag_columns(token_versions: Any, mask: Any, learner_version: int) -> dict[str, np.ndarray]:
    """Per sample, the lags ``learner_version - token_version`` of its valid tokens (in-flight
    updates make them differ along a row): ``token_lag_min`` / ``token_lag_max`` (int, -1 for a
    sample with no valid token), ``token_lag_mean`` (float, NaN then) and ``token_lag_counts``, an
    object array of per-sample int64 [len(LAG_BUCKETS)] token counts per lag bucket (a list column
    in samples.parquet; ``token_lag_histogram`` sums them). ``token_lag_max`` is the head lag."""
    tv, m = _np(token_versions).astype(np.int64), _np(mask).astype(bool)
    lag = learner_version - tv  # [B, T]
    if (lag[m] < 0).any():
        raise ValueError(
            f"token versions above the learner version {learner_version}: versions must come from the "
            f"learner's counter"
        )
    n = m.sum(1)
    some = n > 0
    big = np.iinfo(np.int64).max
    lo = np.where(some, np.where(m, lag, big).min(1), -1)
    hi = np.where(some, np.where(m, lag, -1).max(1), -1)
    mean = np.where(some, np.where(m, lag, 0).sum(1) / np.maximum(n, 1), np.nan)
    idx = np.searchsorted(np.asarray(BUCKET_LOWER), np.maximum(lag, 0), side="right") - 1  # [B, T]
    counts = np.empty(len(tv), dtype=object)
    for i in range(len(tv)):
        counts[i] = np.bincount(idx[i][m[i]], minlength=len(LAG_BUCKETS)).astype(np.int64)
    return {TOKEN_LAG_MIN: lo, TOKEN_LAG_MAX: hi, TOKEN_LAG_MEAN: mean, TOKEN_LAG_COUNTS: counts}


def token_lag_histogram(counts: Any, prefix: str = TOKEN_LAG_HIST) -> dict[str, float]:
    """Token count of every lag bucket (zeros included) summed over samples' ``token_lag_counts``:
    ``<prefix>/<label>``."""
    rows = [np.asarray(c, dtype=np.int64) for c in counts]
    total = np.sum(rows, axis=0) if rows else np.zeros(len(LAG_BUCKETS), dtype=np.int64)
    return {f"{prefix}/{label}": float(c) for label, c in zip(LAG_BUCKETS, total)}


def per_sample_kl(
    logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k1, k3)``: per-sample [B] token means of KL(pi_b || pi_theta) estimators over valid tokens."""
    m = mask.bool()
    lp, lb = logprobs.detach(), behavior_logprobs.detach()
    return masked_mean(kl_qp_k1(lb, lp), m, dim=-1), masked_mean(kl_qp_k3(lb, lp), m, dim=-1)


def ess_variants(
    logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor, *, clip: float = 8.0
) -> dict[str, float]:
    """``{"ess_seq", "ess_seq_clipped", "ess_tok"}``: ESS fractions in ``[1/N, 1]`` of this batch."""
    m = mask.bool()
    lr = masked_token_log_ratio(logprobs, behavior_logprobs, m)
    seq = sequence_log_ratio(lr, m).double()
    return {
        "ess_seq": float(ess_fraction(seq)),
        "ess_seq_clipped": float(ess_fraction(seq.clamp(max=math.log(clip)))),
        "ess_tok": float(ess_fraction(lr[m])) if m.any() else 1.0,
    }


def staleness_step_metrics(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    lags: Any,
    *,
    clip: float = 8.0,
) -> dict[str, float]:
    """One learner step's staleness telemetry: lag stats and histogram, batch KL (``kl/k1``,
    ``kl/behavior_current`` = k3) and ESS variants, each also per lag bucket."""
    m = mask.bool()
    lp, lb = logprobs.detach(), behavior_logprobs.detach()
    k1, k3 = masked_mean(kl_qp_k1(lb, lp), m, dim=-1), masked_mean(kl_qp_k3(lb, lp), m, dim=-1)
    lags_np = _np(lags).astype(np.int64)
    out: dict[str, float] = {
        "staleness/lag_mean": float(lags_np.mean()) if lags_np.size else 0.0,
        "staleness/lag_max": float(lags_np.max()) if lags_np.size else 0.0,
        "kl/k1": float(masked_mean(kl_qp_k1(lb, lp), m)),
        "kl/behavior_current": float(masked_mean(kl_qp_k3(lb, lp), m)),
        **lag_histogram(lags_np),
        **{f"ess/{k}": v for k, v in ess_variants(logprobs, behavior_logprobs, mask, clip=clip).items()},
    }
    out.update(bucket_metrics({"kl_k1": k1, "kl_k3": k3}, lags_np))
    idx = lag_bucket_index(lags_np)
    for b in np.unique(idx).tolist():
        sel = torch.as_tensor(idx == b)
        ess = ess_variants(logprobs[sel], behavior_logprobs[sel], mask[sel], clip=clip)
        out.update({bucket_key(LAG_BUCKETS[b], k): v for k, v in ess.items()})
    return out
