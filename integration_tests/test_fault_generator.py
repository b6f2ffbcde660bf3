"""A generator process dies mid-run (OOM kill, engine crash): Ray Data restarts the actor and
re-runs the block; the run must finish with every sample trained exactly once and the staleness
bound intact, instead of leaking the dead attempt's admission (at ``max_lag=0`` that leak
deadlocks the lock-step pipeline).

The crash is injected with ``faults.generator_exit=3``: the generator exits right after its third
admission, once per run directory.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_config

from asyncrl.pipeline import run
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray


def test_generator_crash_is_retried_without_leaking_admission(tmp_path, tiny_pair, ray_local):
    steps = 6
    cfg = tiny_config(
        tmp_path / "run",
        "pipeline.max_lag=0",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "pipeline.no_progress_timeout_s=45",  # a leaked admission would stall until this fires
        "faults.generator_exit=3",
    )
    result = run(cfg)
    assert (tmp_path / "run" / "faults" / "generator_exit").exists(), "the injected crash did not happen"
    s = read_samples(result.run_dir)
    assert result.summary["steps"] == steps and result.summary["generation_retries"] == 1
    assert len(s) == steps * cfg.train.batch_size and s["kept"].all()
    assert np.unique(s["sample_id"]).size == len(s)  # the re-run block was trained once
    assert (s["lag"] == 0).all()  # still strictly on-policy after the restart
    # the re-run block is a second draw of its samples, counted as regenerated; the books balance
    assert result.summary["samples_regenerated"] == cfg.train.batch_size and result.summary["ledger_balanced"]
