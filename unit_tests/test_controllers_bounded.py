"""BoundedStaleness: the consumption gate and admission rule (spec 7.1 a, e, h, i at the gate level)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.configurable import ConfigError
from asyncrl.controllers import AdmissionRequest, BoundedStaleness, SampleInfo, build

SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def batches(draw, max_n: int = 16):
    n = draw(st.integers(1, max_n))
    version = draw(st.integers(0, 30))
    vf = np.array(draw(st.lists(st.integers(0, version), min_size=n, max_size=n)), dtype=np.int64)
    groups = np.array(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), dtype=np.int64)
    return SampleInfo(np.arange(n), groups, vf, vf), version


@SETTINGS
@given(batches(), st.integers(0, 6))
def test_gate_is_strict_and_group_atomic(batch, s):  # 7.1 a, e
    info, v = batch
    ctrl = BoundedStaleness(max_lag=s)
    keep = ctrl.keep(info, v)
    lag = v - info.version_first
    assert (lag[keep] <= s).all()
    for g in np.unique(info.group_id):
        members = info.group_id == g
        assert keep[members].all() or not keep[members].any()
        assert keep[members].all() == (lag[members].max() <= s)
    m = ctrl.metrics()
    assert m["staleness/dropped"] == (~keep).sum() == m["staleness/dropped_total"]
    assert m.get("staleness/dropped/lag", 0) == (lag > s).sum()
    assert m.get("staleness/dropped/group", 0) == ((lag <= s) & ~keep).sum()
    if keep.any():
        assert m["staleness/lag_max"] == lag[keep].max()
        assert m["staleness/lag_mean"] == pytest.approx(lag[keep].mean())


@SETTINGS
@given(st.lists(batches(), min_size=1, max_size=6), st.integers(0, 5), st.integers(1, 4))
def test_raising_s_never_grows_the_drop_set(timeline, s, extra):  # 7.1 i (fixed learner-version timeline)
    small, large = BoundedStaleness(max_lag=s), BoundedStaleness(max_lag=s + extra)
    for info, v in timeline:
        assert not (small.keep(info, v) & ~large.keep(info, v)).any()


def test_queue_aging_drops_at_re_check():  # 7.1 h
    ctrl = BoundedStaleness(max_lag=2)
    info = SampleInfo(np.array([0, 1]), np.array([7, 7]), np.array([3, 4]), np.array([3, 4]))
    assert ctrl.keep(info, 5).all()  # fresh enough on arrival (lags 2 and 1)
    assert not ctrl.keep(info, 6).any()  # one step later in the queue: lag 3 > 2, the whole group goes
    assert ctrl.metrics()["staleness/dropped/lag"] == 1 and ctrl.metrics()["staleness/dropped/group"] == 1


def test_accept_and_log_counts_violations_exactly():  # 7.1 a (accept_and_log)
    ctrl = BoundedStaleness(max_lag=1, straggler="accept_and_log")
    info = SampleInfo(np.arange(5), np.arange(5), np.array([0, 1, 2, 3, 4]), np.array([0, 1, 2, 3, 4]))
    assert ctrl.keep(info, 4).all()
    assert ctrl.metrics()["staleness/violations"] == 3  # lags 4, 3, 2 exceed 1
    assert ctrl.metrics()["staleness/dropped"] == 0


def _req(version: int, expected: int, block: int = 0) -> AdmissionRequest:
    return AdmissionRequest(
        n=8, learner_version=version, in_flight=0, batch_size=8, block_index=block, expected_version=expected
    )


def test_admission_bounds_the_expected_lag():
    ctrl = BoundedStaleness(max_lag=2)
    assert ctrl.admit(_req(0, 2)) and not ctrl.admit(_req(0, 3)) and ctrl.admit(_req(5, 7))
    lock = BoundedStaleness(max_lag=0)
    assert lock.admit(_req(3, 3)) and not lock.admit(_req(3, 4))
    assert ctrl.behavior_version(_req(0, 2)) is None  # bound mode: the latest weights


def test_fixed_mode_pins_the_behavior_version_s_back():
    fixed = BoundedStaleness(max_lag=2, mode="fixed")
    assert fixed.behavior_version(_req(4, 6)) == 4
    assert fixed.behavior_version(_req(0, 1)) == 0  # the first S batches: version 0
    assert not fixed.admit(_req(3, 6))  # v4 is not published yet: wait


def test_metric_window_resets_after_step_and_totals_persist():
    ctrl = BoundedStaleness(max_lag=0)
    info = SampleInfo(np.arange(3), np.arange(3), np.array([0, 1, 1]), np.array([0, 1, 1]))
    ctrl.keep(info, 1)
    ctrl.after_step(None)
    assert ctrl.metrics()["staleness/dropped"] == 1  # still the finished step's numbers
    ctrl.keep(info, 2)
    m = ctrl.metrics()
    assert m["staleness/dropped"] == 3 and m["staleness/dropped_total"] == 4
    restored = BoundedStaleness(max_lag=0)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.metrics()["staleness/dropped_total"] == 4


def test_window_also_resets_after_metrics_when_no_step_happened():
    """A batch that was dropped whole (no optimizer step, no after_step) is reported once."""
    ctrl = BoundedStaleness(max_lag=0)
    stale = SampleInfo(np.arange(2), np.arange(2), np.array([0, 0]), np.array([0, 0]))
    ctrl.keep(stale, 1)
    assert ctrl.metrics()["staleness/dropped"] == 2
    assert ctrl.metrics()["staleness/dropped"] == 2  # reading twice changes nothing
    ctrl.keep(SampleInfo(np.arange(1), np.arange(1), np.array([1]), np.array([1])), 1)
    m = ctrl.metrics()
    assert m["staleness/dropped"] == 0 and m["staleness/dropped_total"] == 2


def test_negative_max_lag_fails_at_build_with_field_and_fix():
    with pytest.raises(ConfigError) as err:
        build("bounded_staleness", {"max_lag": -1})
    assert "options.max_lag" in str(err.value) and "0 (synchronous)" in str(err.value)
    with pytest.raises(ConfigError, match="straggler"):
        build("bounded_staleness", {"straggler": "requeue"})
    with pytest.raises(ValueError, match="learner's counter"):
        BoundedStaleness(1).keep(SampleInfo(np.arange(1), np.arange(1), np.array([5]), np.array([5])), 3)
