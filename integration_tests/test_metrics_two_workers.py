"""Two learner workers through Ray Train: every step's logged figures equal what samples.parquet says
(issue 12 item 5; the in-process emulation with uneven drops is unit_tests/test_metrics_ranks.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ess_np, tiny_config

from asyncrl.pipeline import run
from asyncrl.telemetry import names as N
from asyncrl.telemetry.sinks import read_metrics
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray


def test_two_workers_log_global_figures(ray_local, tiny_pair, tmp_path):
    cfg = tiny_config(
        tmp_path / "two",
        "pipeline.learner_workers=2",
        "pipeline.generators=2",
        "pipeline.max_lag=1",
        "train.steps=5",
        "train.eval_every=0",
        "controllers=[{name: ess_lr, options: {source: seq_clipped, clip: 1.5}}]",
    )
    result = run(cfg)
    samples = read_samples(result.run_dir)
    steps = [m for m in read_metrics(result.run_dir) if N.LOSS in m]
    assert [m[N.STEP] for m in steps] == list(range(1, 6))
    for m in steps:
        rows = samples[samples["step"] == m[N.STEP]]
        kept = rows[rows["kept"]]
        n_tok = kept["completion_len"].to_numpy()
        assert m[N.SAMPLES_KEPT] == len(kept) == cfg.train.batch_size
        assert m[N.TOKENS] == n_tok.sum()
        assert m[N.LAG_MEAN] == pytest.approx(kept["lag"].mean(), rel=1e-9)
        assert m[N.LAG_MAX] == kept["lag"].max()
        assert m[N.ESS_RHO] == pytest.approx(ess_np(kept["seq_log_ratio"].to_numpy()), rel=1e-6)
        lw = np.minimum(kept["seq_log_ratio"].to_numpy(), np.log(1.5))  # what ess_lr acted on
        assert m[N.ESS_LR_RHO] == pytest.approx(ess_np(lw), rel=1e-6)
        assert m[N.LOSS] == pytest.approx((kept["loss"] * n_tok).sum() / n_tok.sum(), rel=1e-5)
        kl = (kept["kl_behavior_current"] * n_tok).sum() / n_tok.sum()
        assert m[N.KL_BEHAVIOR_CURRENT] == pytest.approx(kl, rel=1e-5, abs=1e-9)
