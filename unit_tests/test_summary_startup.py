"""``telemetry.summary.startup``: where a run's start-up went, from the driver's marks and the
learner's marks logged with its first step in this process."""

from __future__ import annotations

import pytest

from asyncrl.telemetry import names as N
from asyncrl.telemetry.summary import startup

MARKS = {
    "process_started_at": 100.0,
    "run_started_at": 102.0,
    "ray_started_at": 103.0,
    "ray_ready_at": 106.0,
    "fit_at": 107.0,
}
LEARNER = {
    N.LEARNER_START_AT: 114.0,
    N.LEARNER_READY_AT: 119.0,
    N.FIRST_BATCH_AT: 122.0,
    N.FIRST_STEP_AT: 122.5,
}


def test_the_parts_add_up_to_the_start_up():
    out = startup([{"step": 1, **LEARNER}, {"step": 2}], MARKS)
    assert out["first_step_s"] == pytest.approx(22.5)
    assert out["startup_s"] == pytest.approx(20.5)
    assert out["startup_ray_init_s"] == pytest.approx(3.0)
    parts = [out[p] for p in N.STARTUP_PARTS if p != "startup_ray_init_s"]
    assert parts == pytest.approx([5.0, 7.0, 5.0, 3.0, 0.5])
    assert sum(parts) == pytest.approx(out["startup_s"])


def test_an_earlier_process_first_step_is_not_this_runs_start_up():
    # resumed from the final checkpoint: the metrics hold only the earlier process's first step
    earlier = {k: v - 90.0 for k, v in LEARNER.items()}
    out = startup([{"step": 1, **earlier}], MARKS)
    assert out["startup_s"] is None and out["first_step_s"] is None
    assert all(out[p] is None for p in N.STARTUP_PARTS)
    # a resume that trains: this process's row is used, not the earlier one
    out = startup([{"step": 1, **earlier}, {"step": 5, **LEARNER}], MARKS)
    assert out["startup_s"] == pytest.approx(20.5)


def test_no_driver_marks_give_no_start_up():
    assert startup([{"step": 1, **LEARNER}], {})["startup_s"] is None
