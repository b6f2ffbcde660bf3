"""Gradient telemetry through the Ray pipeline: the scoring stage ships the teacher's full logits for
the probe's blocks only, the learner compares the estimator's gradient with the exact dense-KL
gradient before those steps, and logs the consecutive-gradient cosine every step."""

from __future__ import annotations

import numpy as np
from conftest import tiny_config

from asyncrl import run
from asyncrl.telemetry import names as N
from asyncrl.telemetry.sinks import read_metrics
from asyncrl.telemetry.summary import read_samples


def test_dense_reference_every_k_steps_with_bucket_figures(ray_local, tiny_pair, tmp_path):
    cfg = tiny_config(
        tmp_path / "grad",
        "estimator.name=forward_kl",
        "estimator.options={tail: bucket}",
        "cache.k=16",
        "pipeline.max_lag=1",
        "pipeline.lag_mode=fixed",
        "train.steps=7",
        "train.eval_every=0",
        "telemetry.grad_reference=dense",
        "telemetry.grad_every=3",
        "telemetry.grad_cos_prev=true",
    )
    result = run(cfg)
    rows = {m[N.STEP]: m for m in read_metrics(result.run_dir) if N.LOSS in m}
    assert sorted(rows) == list(range(1, 8))
    probed = [s for s, m in rows.items() if N.GRADREF_COS in m]
    assert probed == [1, 4, 7]  # versions 0, 3, 6: the probe runs before the step
    for s in probed:
        m = rows[s]
        # top-16 of the 100-token vocabulary holds nearly all of the teacher's mass
        assert 0.9 < m[N.GRADREF_COS] <= 1 + 1e-9, m
        # one probe's unbiased estimates may be < 0
        assert np.isfinite(m[N.GRADREF_BIAS_SQ_REL]) and np.isfinite(m[N.GRADREF_NOISE_REL])
        assert m[N.GRADREF_GROUPS] >= 2 and m[N.GRADREF_REF_SQ] > 0
        assert m[N.GRADREF_BIAS_SQ] + m[N.GRADREF_NOISE_SQ] >= 0  # = |d|^2 on every probe
        lag = 0 if s == 1 else 1  # fixed lag 1 after the first step
        assert m[N.bucket_key(str(lag), "grad_norm")] > 0
        assert m["time/grad_probe_s"] > 0
    for s, m in rows.items():
        assert 0 < m[N.bucket_key("0" if s == 1 else "1", "teacher_mass")] <= 1 + 1e-6
        assert (N.GRAD_COS_PREV in m) == (s > 1)
        assert -1 - 1e-6 <= m.get(N.GRAD_COS_PREV, 0.0) <= 1 + 1e-6
    samples = read_samples(result.run_dir)
    assert (samples["lag"][samples["step"] > 1] == 1).all()
    assert samples[N.SAMPLE_TEACHER_MASS].between(0, 1 + 1e-6).all()
