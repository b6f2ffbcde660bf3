"""Lag buckets, per-bucket aggregation, KL(behavior||current) and ESS variants."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.controllers.functional import ess_fraction
from asyncrl.telemetry.staleness import (
    BUCKET_LOWER,
    LAG_BUCKETS,
    bucket_metrics,
    ess_variants,
    lag_bucket,
    lag_histogram,
    per_bucket,
    per_sample_kl,
    sample_lags,
    staleness_step_metrics,
)

torch.set_num_threads(1)


def test_bucket_boundaries():
    got = {lag: lag_bucket(lag) for lag in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 10_000)}
    assert got == {
        0: "0",
        1: "1",
        2: "2",
        3: "3-4",
        4: "3-4",
        5: "5-8",
        8: "5-8",
        9: "9-16",
        16: "9-16",
        17: "17+",
        10_000: "17+",
    }
    assert LAG_BUCKETS == ("0", "1", "2", "3-4", "5-8", "9-16", "17+")
    with pytest.raises(ValueError, match=">= 0"):
        lag_bucket(-1)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 100))
def test_label_contains_the_lag(lag):
    label = lag_bucket(lag)
    lo = BUCKET_LOWER[LAG_BUCKETS.index(label)]
    hi = math.inf if label.endswith("+") else int(label.split("-")[-1])
    assert lo <= lag <= hi


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.floats(-5, 5)), min_size=1, max_size=30))
def test_per_bucket_matches_a_manual_groupby(rows):
    lags = np.array([r[0] for r in rows])
    vals = np.array([r[1] for r in rows])
    got = per_bucket(vals, torch.as_tensor(lags), "mean")
    labels = [lag_bucket(x) for x in lags]
    for label in set(labels):
        sel = np.array([lb == label for lb in labels])
        assert got[label] == pytest.approx(vals[sel].mean())
    assert set(got) == set(labels)
    assert sum(lag_histogram(lags).values()) == len(rows)
    assert sum(per_bucket(vals, lags, "count").values()) == len(rows)


def test_named_keys_and_bucket_metrics():
    lags = np.array([0, 0, 3, 20])
    out = per_bucket(np.array([1.0, 3.0, 5.0, 7.0]), lags, "sum", name="loss")
    assert out == {"bucket/0/loss": 4.0, "bucket/3-4/loss": 5.0, "bucket/17+/loss": 7.0}
    m = bucket_metrics({"kl_k3": torch.tensor([0.0, 2.0, 1.0, 4.0])}, lags)
    assert m["bucket/0/n"] == 2 and m["bucket/0/kl_k3"] == 1.0 and m["bucket/17+/kl_k3"] == 4.0
    with pytest.raises(ValueError, match="one lag per sample"):
        per_bucket(np.ones(3), lags)


def test_lag_decomposition():
    lags = sample_lags(np.array([2, 5, 7]), np.array([4, 5, 7]), learner_version=8)
    assert lags["lag_head"].tolist() == [6, 3, 1]
    assert (lags["lag_head"] == lags["lag_in_flight"] + lags["lag_in_queue"]).all()
    assert lags["lag_tail"].tolist() == [4, 3, 1]


def test_kl_and_ess_variants():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[0, 3:] = False
    k1, k3 = per_sample_kl(logp, logp, mask)
    assert torch.equal(k1, torch.zeros(5, dtype=torch.float64)) and torch.equal(
        k3, torch.zeros(5, dtype=torch.float64)
    )
    assert ess_variants(logp, logp, mask) == {"ess_seq": 1.0, "ess_seq_clipped": 1.0, "ess_tok": 1.0}
    behavior = logp + 0.5 * torch.randn(5, 6, generator=g, dtype=torch.float64)
    k1, k3 = per_sample_kl(logp, behavior, mask)
    assert (k3 >= 0).all() and k3.shape == (5,)
    assert float(k1[0]) == pytest.approx(float((behavior - logp)[0, :3].mean()))
    ev = ess_variants(logp, behavior, mask, clip=1.5)
    seq = torch.where(mask, logp - behavior, 0.0).sum(1)
    assert ev["ess_seq"] == pytest.approx(float(ess_fraction(seq)))
    assert ev["ess_seq_clipped"] == pytest.approx(float(ess_fraction(seq.clamp(max=math.log(1.5)))))
    assert ev["ess_tok"] == pytest.approx(float(ess_fraction((logp - behavior)[mask])))


def test_step_metrics_cover_lags_kl_ess_and_buckets():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 3, generator=g)
    behavior = logp + 0.2 * torch.randn(4, 3, generator=g)
    m = staleness_step_metrics(logp, behavior, torch.ones(4, 3, dtype=torch.bool), np.array([0, 0, 2, 9]))
    assert m["staleness/lag_max"] == 9 and m["staleness/lag_mean"] == 2.75
    assert m["staleness/lag_hist/0"] == 2 and m["staleness/lag_hist/9-16"] == 1
    for key in (
        "kl/behavior_current",
        "kl/k1",
        "ess/ess_seq",
        "ess/ess_tok",
        "bucket/0/kl_k3",
        "bucket/2/ess_seq",
        "bucket/9-16/n",
    ):
        assert key in m, key
    assert m["bucket/9-16/ess_seq"] == 1.0  # one sample: ESS fraction 1


def test_learner_bucket_metrics_report_ess_per_lag_bucket():
    """The learner's per-bucket telemetry includes ``ess``: the ESS fraction of each bucket's
    sequence weights. Equal weights give 1; one dominant weight gives ~1/n; dropped samples are
    left out."""
    from asyncrl.telemetry.steps import bucket_metrics

    rows = {
        "kept": np.array([True, True, True, True, True, False]),
        "lag": np.array([0, 0, 2, 2, 2, 2]),
        "loss": np.ones(6),
        "kl_behavior_current": np.zeros(6),
        "reward": np.zeros(6),
        "seq_log_ratio": np.array([0.3, 0.3, 40.0, 0.0, 0.0, np.nan]),
    }
    m = bucket_metrics(rows)
    assert m["bucket/0/ess"] == pytest.approx(1.0)
    assert m["bucket/2/ess"] == pytest.approx(1 / 3, rel=1e-6) and m["bucket/2/n"] == 3
