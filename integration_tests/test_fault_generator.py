"""A generator process dies mid-run (OOM kill, engine crash): Ray Data restarts the actor and
re-runs the block; the run must finish with every sample trained exactly once and the staleness
bound intact, instead of leaking the dead attempt's admission (at ``max_lag=0`` that leak
deadlocks the lock-step pipeline).

The crash is injected with ``ASYNCRL_INJECT_GENERATOR_CRASH=<marker>:<k>``: the generator exits
right after its k-th admission, once. The variable must reach Ray's worker processes, so this
module starts its own Ray instance with it in the runtime env.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_config

from asyncrl.pipeline import run
from asyncrl.raysetup import RAY_ENV, runtime_env
from asyncrl.stages import CRASH_ENV
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray


@pytest.fixture
def ray_with_crash(tmp_path):
    import ray

    marker = tmp_path / "crashed"
    env = {**RAY_ENV, CRASH_ENV: f"{marker}:3"}
    ray.init(num_cpus=4, include_dashboard=False, runtime_env=runtime_env(env))
    yield marker
    ray.shutdown()


def test_generator_crash_is_retried_without_leaking_admission(tmp_path, tiny_pair, ray_with_crash):
    steps = 6
    cfg = tiny_config(
        tmp_path / "run",
        "pipeline.max_lag=0",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "pipeline.no_progress_timeout_s=45",  # a leaked admission would stall until this fires
    )
    result = run(cfg)
    assert ray_with_crash.exists(), "the injected crash did not happen"
    s = read_samples(result.run_dir)
    assert result.summary["steps"] == steps and result.summary["generation_retries"] == 1
    assert len(s) == steps * cfg.train.batch_size and s["kept"].all()
    assert np.unique(s["sample_id"]).size == len(s)  # the re-run block was trained once
    assert (s["lag"] == 0).all()  # still strictly on-policy after the restart
