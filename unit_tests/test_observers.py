"""The learner's one observer interface (``asyncrl.observers``): ``Observers`` calls its members in
order and skips hooks a member lacks, merges their metrics, nests their ``attempt`` contexts; the
built-ins forward to the step log, the gradient diagnostics and the fault plan as the learner did."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl.faults import NO_FAULTS, FaultConfig, Faults
from asyncrl.observers import FaultHooks, Observers, StepTelemetry


class Recorder:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def on_start(self, version, started_at):
        self.calls.append((self.name, "on_start", version, started_at))

    def before_step(self, batch, keep, version, *, first):
        self.calls.append((self.name, "before_step", version, first))
        return {f"{self.name}/before": 1.0, "shared": self.name}

    @contextlib.contextmanager
    def attempt(self, step):
        self.calls.append((self.name, "enter", step))
        yield
        self.calls.append((self.name, "exit", step))

    def on_step(self, batch, result, version, **kw):
        self.calls.append((self.name, "on_step", version, sorted(kw)))


class OnlyFinish:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def on_finish(self):
        self.calls.append(("finish",))


def test_members_are_called_in_order_missing_hooks_skipped_metrics_merged():
    calls: list = []
    obs = Observers(Recorder("a", calls), OnlyFinish(calls), Recorder("b", calls))
    obs.on_start(3, 1.5)
    merged = obs.before_step({}, np.ones(2, bool), 3, first=True)
    with obs.attempt(4):
        calls.append(("step",))
    assert obs.after_step(SimpleNamespace()) == {}  # nobody implements it
    obs.on_step({}, SimpleNamespace(), 3, t_got=0.0, t_computed=1.0, extra={})
    obs.on_batch()
    obs.on_checkpoint()
    obs.on_finish()
    assert merged == {"a/before": 1.0, "b/before": 1.0, "shared": "b"}  # a later member's key wins
    assert calls == [
        ("a", "on_start", 3, 1.5),
        ("b", "on_start", 3, 1.5),
        ("a", "before_step", 3, True),
        ("b", "before_step", 3, True),
        ("a", "enter", 4),
        ("b", "enter", 4),
        ("step",),
        ("b", "exit", 4),
        ("a", "exit", 4),
        ("a", "on_step", 3, ["extra", "t_computed", "t_got"]),
        ("b", "on_step", 3, ["extra", "t_computed", "t_got"]),
        ("finish",),
    ]


def test_step_telemetry_forwards_to_the_step_log_and_gradients_as_the_learner_did():
    log: list = []
    steps = SimpleNamespace(
        start=lambda v: log.append(("start", v)),
        ready=lambda t: log.append(("ready", t)),
        first_batch=lambda: log.append(("first_batch",)),
        log=lambda b, r, v, **kw: log.append(("log", v, kw["extra"])),
        flush=lambda: log.append(("flush",)),
        close=lambda: log.append(("close",)),
    )
    gradients = SimpleNamespace(
        before=lambda b, k, v: {"grad/probe": float(v)}, after=lambda r, backend: {"grad/cos_prev": backend}
    )
    tel = StepTelemetry(steps, gradients, backend=0.5)
    tel.on_start(0, 9.0)
    tel.on_batch()
    assert tel.before_step({}, np.ones(1, bool), 2, first=True) == {"grad/probe": 2.0}
    assert tel.before_step({}, np.ones(1, bool), 2, first=False) == {}  # the first mini-batch only
    assert tel.after_step(SimpleNamespace()) == {"grad/cos_prev": 0.5}
    tel.on_step({}, None, 2, t_got=0.0, t_computed=0.0, extra={"x": 1.0})
    tel.on_checkpoint()
    tel.on_finish()
    assert log == [
        ("start", 0),
        ("ready", 9.0),
        ("first_batch",),
        ("log", 2, {"x": 1.0}),
        ("flush",),
        ("close",),
    ]


def test_fault_hooks_exit_rank0_after_the_step_reaching_k_once(tmp_path, monkeypatch):
    exits: list = []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    faults = Faults(FaultConfig(learner_exit=2), str(tmp_path))
    other = FaultHooks(faults, model=None, rank0=False)
    hooks = FaultHooks(faults, model=None, rank0=True)
    other.on_step({}, SimpleNamespace(stepped=True, version=2), 1)
    hooks.on_step({}, SimpleNamespace(stepped=False, version=2), 1)  # no step taken: no exit
    assert exits == []
    hooks.on_step({}, SimpleNamespace(stepped=True, version=1), 0)
    hooks.on_step({}, SimpleNamespace(stepped=True, version=2), 1)
    hooks.on_step({}, SimpleNamespace(stepped=True, version=2), 1)  # once per run directory
    assert exits == [1]


def test_no_faults_attempt_is_a_plain_context():
    hooks = FaultHooks(NO_FAULTS, model=None, rank0=True)
    with hooks.attempt(1):
        pass
    with pytest.raises(KeyError), hooks.attempt(1):
        raise KeyError("passes through")
