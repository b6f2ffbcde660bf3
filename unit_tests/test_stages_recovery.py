"""The generation stage's answer to a dead engine (``EngineDeadError``): exit the actor process so
Ray Data restarts it and re-runs the block, until the run's deaths exceed
``pipeline.max_engine_restarts``; then fail the run with that setting named. No Ray needed: the
stage is built without its constructor, with a stand-in store and engine."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl import records as R
from asyncrl import stages
from asyncrl.engines import EngineDeadError, SamplingParams


class Store:
    def __init__(self) -> None:
        self.deaths = 0
        self.keys: list[int] = []

    def acquire(self, n, block_index, timeout_s, stream=None, have=None):
        self.keys.append(block_index)
        admitted = {"ticket": block_index, "version": 0, "expected_version": 0, "behavior_version": None}
        return {**admitted, "weights": None}  # the generator holds the latest weights

    def engine_died(self) -> int:
        self.deaths += 1
        return self.deaths


class DeadEngine:
    version = 0
    pad_id = 0

    def generate(self, *args, **kwargs):
        raise EngineDeadError("engine core died")


def stage(store: Store, max_engine_restarts: int) -> stages.Generate:
    g = stages.Generate.__new__(stages.Generate)
    g.engine, g.store, g.seed, g.admit_timeout_s = DeadEngine(), store, 0, 1.0
    g.params = SamplingParams(max_new_tokens=4)
    g.have_version, g.admissions, g.max_engine_restarts = -1, 0, max_engine_restarts
    g.stream, g.faults = None, stages.NO_FAULTS
    return g


def block() -> dict[str, np.ndarray]:
    return {
        R.SAMPLE_ID: np.arange(8, 12),
        R.BLOCK_INDEX: np.full(4, 2),
        R.PROMPT_IDS: np.ones((4, 3), dtype=np.int64),
        R.PROMPT_MASK: np.ones((4, 3), dtype=bool),
    }


def test_dead_engine_restarts_the_actor_then_fails_the_run(monkeypatch):
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(stages, "_exit_process", fake_exit)
    store = Store()
    g = stage(store, max_engine_restarts=2)
    for _ in range(2):  # each death within the budget exits the process (Ray restarts it)
        with pytest.raises(SystemExit):
            g(block())
    assert exits == [1, 1] and store.keys == [2, 2]  # the retried block asks for its own index again
    with pytest.raises(RuntimeError, match=r"died 3 times.*pipeline\.max_engine_restarts=2"):
        g(block())
    assert exits == [1, 1]


def test_no_restarts_allowed_fails_at_the_first_death(monkeypatch):
    monkeypatch.setattr(stages, "_exit_process", lambda code: pytest.fail("must not exit"))
    with pytest.raises(RuntimeError, match="max_engine_restarts=0"):
        stage(Store(), max_engine_restarts=0)(block())
