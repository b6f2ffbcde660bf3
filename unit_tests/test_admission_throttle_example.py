"""examples/admission_throttle.py: the admission-hook controller, Ray-free (its bookkeeping, and
its effect on the modelled pipeline); the real-pipeline run is in integration_tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from asyncrl.configurable import ConfigError
from asyncrl.controllers import AdmissionRequest, BoundedStaleness, build, chain
from asyncrl.lab.simulator import KEPT, simulate
from asyncrl.plan import check_components, controller_specs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLES))  # as for `python examples/admission_throttle.py`
    try:
        import admission_throttle

        yield admission_throttle
    finally:
        sys.path.remove(str(EXAMPLES))


def req(block: int, version: int, n: int = 4, B: int = 4) -> AdmissionRequest:
    return AdmissionRequest(
        n=n, learner_version=version, in_flight=0, batch_size=B, block_index=block, expected_version=block
    )


def test_bucket_infers_grants_from_block_order(example):
    bucket = example.AdmissionTokenBucket(rate=1, burst=2)
    assert bucket.admit(req(0, 0)) and bucket.admit(req(1, 0))  # a burst of two batches
    assert not bucket.admit(req(2, 0))  # block 1 was granted (block 2 is asked): the bucket is empty
    assert not bucket.admit(req(2, 0)) and bucket.metrics()["token_bucket/waited"] == 1
    assert bucket.admit(req(2, 1))  # one version later: one batch more
    assert bucket.metrics()["token_bucket/granted"] == 2
    state = bucket.state_dict()
    again = example.AdmissionTokenBucket(rate=1, burst=2)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_bucket_is_built_from_config_by_dotted_path(example):
    assert isinstance(build(example.NAME, {"rate": 2}), example.AdmissionTokenBucket)
    with pytest.raises(ConfigError, match=r"options\.rate"):
        build(example.NAME, {"rate": 0.5})
    cfg = example.build_config([])
    assert [name for name, _ in controller_specs(cfg)] == ["bounded_staleness", example.NAME]
    check_components(cfg, None)


def test_bucket_holds_generation_one_batch_ahead_in_the_modelled_pipeline(example):
    """3 generators at max_lag 3: alone, the bound lets blocks start 3 versions ahead; with the
    bucket (rate 1, burst 2) no block starts more than 1 version ahead, and nothing is dropped."""
    kw = dict(max_lag=3, batch_size=4, generators=3, steps=12, gen_times=(0.5,), step_times=(1.0,))
    free = simulate(**kw)
    throttled = simulate(**kw, controller=chain(BoundedStaleness(3), example.AdmissionTokenBucket(1, 2)))
    for r in (free, throttled):
        assert not r.deadlocked and r.counters["dropped"] == 0
    ahead = {
        name: (r.trace["expected_version"] - r.trace["admit_version"]).max()
        for name, r in (("free", free), ("throttled", throttled))
    }
    assert ahead == {"free": 3, "throttled": 1}
    assert throttled.trace["lag"][throttled.trace["dropped_at"] == KEPT].max() == 1
