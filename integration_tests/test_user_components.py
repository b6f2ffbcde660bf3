"""Users' own components through the real pipeline, named by dotted path: a rollout engine
defined in this module (``pipeline.engine=test_user_components:CappedEngine``) and the
admission-hook controller of ``examples/admission_throttle.py``.

Both are imported by name inside Ray processes (generator actors, the PolicyStore, Train
workers), so this module's Ray instance puts their directories on the workers' PYTHONPATH.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
from conftest import CACHE, REPO, check_contract, init_local_ray, tiny_config

from asyncrl.engines import HFEngine
from asyncrl.pipeline import run
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray

HERE = Path(__file__).resolve().parent
EXAMPLES = REPO / "examples"
STEPS = 6


class CappedEngine:
    """A user engine: ``HFEngine`` sampling at most ``cap`` tokens per completion (stopping early
    changes no log-probability of the tokens it did sample, so the staleness math is intact)."""

    name = "capped"
    supports_mc = True

    def __init__(self, inner: HFEngine, cap: int) -> None:
        self.inner, self.cap = inner, cap
        self.pad_id = inner.pad_id

    @classmethod
    def from_pretrained(cls, path, *, version: int = 0, cap: int = 2, **hf_options) -> CappedEngine:
        return cls(HFEngine.from_pretrained(path, version=version, **hf_options), cap)

    @classmethod
    def check_supported(cls, path, params, *, cap: int = 2, **hf_options) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1 token, got {cap}")
        HFEngine.check_supported(path, params, **hf_options)

    @property
    def version(self) -> int:
        return self.inner.version

    def load_weights(self, state_dict, version: int) -> None:
        self.inner.load_weights(state_dict, version)

    def generate(self, prompt_ids, prompt_mask, params, *, seed: int):
        capped = dataclasses.replace(params, max_new_tokens=min(self.cap, params.max_new_tokens))
        return self.inner.generate(prompt_ids, prompt_mask, capped, seed=seed)


@pytest.fixture(scope="module")
def ray_with_user_modules():
    import ray

    paths = [str(HERE), str(EXAMPLES), os.environ.get("PYTHONPATH", "")]
    sys.path.insert(0, str(EXAMPLES))  # the driver resolves the same names
    init_local_ray(PYTHONPATH=os.pathsep.join(p for p in paths if p))  # conftest's + the example modules
    yield ray
    ray.shutdown()
    sys.path.remove(str(EXAMPLES))


def test_engine_by_dotted_path_runs_in_the_generators(ray_with_user_modules, tiny_pair, tmp_path):
    cfg = tiny_config(
        tmp_path / "capped",
        f"pipeline.engine={Path(__file__).stem}:CappedEngine",
        "pipeline.engine_options={cap: 2}",
        "pipeline.generators=2",
        "pipeline.max_lag=0",
        f"train.steps={STEPS}",
        "train.eval_every=0",
    )
    result = run(cfg)
    check_contract(result, steps=STEPS)  # at max_lag 0: behavior log-probs are the learner's
    s = read_samples(result.run_dir)
    assert s["completion_len"].max() == 2 < cfg.sampling.max_new_tokens  # the user's engine generated


def test_admission_hook_controller_throttles_a_real_run(ray_with_user_modules, tiny_pair, tmp_path):
    """The token bucket (rate 1, burst 2) holds 3 generators one rollout batch ahead of the learner
    although max_lag=3 lets the bound admit blocks 3 versions ahead."""
    import admission_throttle

    overrides = [f"run_dir={tmp_path / 'throttled'}", f"workload.cache_dir={CACHE}", f"train.steps={STEPS}"]
    cfg = admission_throttle.build_config([*overrides, "telemetry.tensorboard=false"])
    assert cfg.pipeline.max_lag == 3 and cfg.pipeline.generators == 3
    result = run(cfg)
    check_contract(result, steps=STEPS)
    s = read_samples(result.run_dir)
    ahead = s["expected_version"] - s["admit_version"]
    assert ahead.max() == 1, ahead.value_counts()  # the bucket held every block back to 1 version ahead
    assert s["lag"].max() <= 1
