"""Discrete-event simulator of asynchronous generation + learning under a staleness budget.

Used by the property tests of spec section 7.1 and by throughput-vs-S studies. It models:

- ``generators`` workers, each generating one group (``group_size`` samples) at a time. A
  worker asks ``AdmissionBudget.try_acquire`` before it starts (reloading the latest weights,
  so ``version_first`` = the learner version at dispatch); a refused worker waits until the
  budget changes. A group's generation time is the max over its members, drawn from a
  lognormal or Pareto distribution, an adversarial pattern (later requests finish first,
  every 5th request straggles), or an explicit cycle of durations (``gen_times``).
- one learner that assembles batches of ``batch_size`` samples in arrival order and trains
  each for a random or explicit step time; after each step it calls ``set_version`` then
  ``on_consumed`` (the order that makes S = 0 lock-step).
- the controller chain's ``keep`` gate on arrival and again at batch assembly (a sample can
  age in the queue); drops release budget immediately.
- optionally a crash right after a checkpoint: everything in flight is lost and the budget
  and controller are restored from their ``state_dict``.

Deterministic given ``seed``. The trace has one row per dispatched sample.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from asyncrl.controllers.admission import AdmissionBudget
from asyncrl.controllers.base import SampleInfo
from asyncrl.controllers.bounded import BoundedStaleness
from asyncrl.controllers.chain import as_controller, chain

GenDist = Literal["lognormal", "pareto", "adversarial", "fixed"]

# dropped_at codes in the trace
KEPT, PENDING, DROPPED_ON_ARRIVAL, DROPPED_AT_ASSEMBLY, LOST = 0, -1, 1, 2, 3


@dataclass(frozen=True)
class SimConfig:
    """Simulation settings (times in units of the mean learner step)."""

    max_lag: int = 2
    batch_size: int = 8
    group_size: int = 1
    generators: int = 4
    steps: int = 10
    gen_dist: GenDist = "lognormal"
    gen_mean: float = 1.0
    gen_sigma: float = 1.0
    pareto_alpha: float = 1.5
    gen_times: tuple[float, ...] = ()
    step_time: float = 1.0
    step_sigma: float = 0.0
    step_times: tuple[float, ...] = ()
    gate: bool = True
    inflight_updates: bool = False
    crash_after_step: int | None = None
    max_events: int = 1_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of group_size={self.group_size}"
            )
        if self.max_lag < 0 or self.generators < 1 or self.steps < 1:
            raise ValueError("need max_lag >= 0, generators >= 1, steps >= 1")


@dataclass
class SimResult:
    """``trace``: per-sample arrays (see ``TRACE_COLUMNS``); ``batches[v]``: sample ids trained at
    version v; ``keep_calls``: every gate call (for replay); ``in_flight``: after every event."""

    config: SimConfig
    trace: dict[str, np.ndarray]
    counters: dict[str, int]
    steps_done: int
    deadlocked: bool
    batches: list[np.ndarray]
    keep_calls: list[dict[str, Any]]
    in_flight: np.ndarray
    capacity_after_restore: int | None
    end_time: float

    @property
    def trained(self) -> np.ndarray:
        return self.trace["dropped_at"] == KEPT

    @property
    def throughput(self) -> float:
        """Trained samples per unit time."""
        return float(self.trained.sum()) / self.end_time if self.end_time > 0 else 0.0


TRACE_COLUMNS = (
    "sample_id",
    "group_id",
    "ticket",
    "dispatch_version",
    "version_first",
    "version_last",
    "t_dispatch",
    "t_done",
    "consume_version",
    "lag",
    "dropped_at",
)


class _Sim:
    def __init__(self, cfg: SimConfig, controller: Any | None) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.ctrl = (
            as_controller(controller) if controller is not None else chain(BoundedStaleness(cfg.max_lag))
        )
        self.budget = AdmissionBudget(cfg.max_lag, cfg.batch_size, controller=self.ctrl)
        self.version = 0
        self.t = 0.0
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.rows: dict[str, list[Any]] = {c: [] for c in TRACE_COLUMNS}
        self.idle: set[int] = set(range(cfg.generators))
        self.running: dict[int, tuple[int, list[int]]] = {}  # gen -> (epoch, sample rows)
        self.epoch = 0
        self.buffer: deque[list[int]] = deque()
        self.staging: list[list[int]] = []
        self.learner_busy = False
        self.batches: list[np.ndarray] = []
        self.keep_calls: list[dict[str, Any]] = []
        self.in_flight: list[int] = []
        self.n_requests = 0
        self.n_steps = 0
        self.crashed = False
        self.capacity_after_restore: int | None = None

    # -- random times ------------------------------------------------------------------
    def _gen_time(self) -> float:
        cfg, k = self.cfg, self.n_requests
        if cfg.gen_times:
            return float(cfg.gen_times[k % len(cfg.gen_times)])
        if cfg.gen_dist == "fixed":
            return cfg.gen_mean
        if cfg.gen_dist == "adversarial":  # later requests finish first; every 5th straggles
            if k % 5 == 4:
                return cfg.gen_mean * 4 * (cfg.max_lag + 2)
            return cfg.gen_mean * (1 + (-k) % cfg.generators) / cfg.generators
        n = cfg.group_size
        if cfg.gen_dist == "lognormal":
            mu = math.log(cfg.gen_mean) - cfg.gen_sigma**2 / 2
            return float(self.rng.lognormal(mu, cfg.gen_sigma, n).max())
        # Pareto (Lomax + 1) scaled to the requested mean: heavy tail for alpha <= 2
        a = cfg.pareto_alpha
        scale = cfg.gen_mean * (a - 1) / a if a > 1 else cfg.gen_mean
        return float(((self.rng.pareto(a, n) + 1) * scale).max())

    def _step_time(self) -> float:
        cfg = self.cfg
        if cfg.step_times:
            return float(cfg.step_times[self.n_steps % len(cfg.step_times)])
        if cfg.step_sigma > 0:
            return float(self.rng.lognormal(math.log(cfg.step_time) - cfg.step_sigma**2 / 2, cfg.step_sigma))
        return cfg.step_time

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    # -- generators ----------------------------------------------------------------------
    def _dispatch_idle(self) -> None:
        G = self.cfg.group_size
        for gen in sorted(self.idle):
            ticket = self.budget.try_acquire(G, self.version)
            if ticket is None:
                break  # the budget is shared: later generators would be refused too
            self.idle.discard(gen)
            rows = []
            for _ in range(G):
                i = len(self.rows["sample_id"])
                rows.append(i)
                for col, val in (
                    ("sample_id", i),
                    ("group_id", ticket),
                    ("ticket", ticket),
                    ("dispatch_version", self.version),
                    ("version_first", self.version),
                    ("version_last", self.version),
                    ("t_dispatch", self.t),
                    ("t_done", math.nan),
                    ("consume_version", -1),
                    ("lag", -1),
                    ("dropped_at", PENDING),
                ):
                    self.rows[col].append(val)
            self.running[gen] = (self.epoch, rows)
            self._push(self.t + self._gen_time(), "gen_done", (gen, self.epoch))
            self.n_requests += 1

    # -- gate ----------------------------------------------------------------------------
    def _gate(self, groups: list[list[int]], where: int) -> list[list[int]]:
        """Apply keep to whole groups at the current version; drop (and release) the rest."""
        if not self.cfg.gate or not groups:
            return groups
        idx = np.array([i for g in groups for i in g], dtype=np.int64)
        col = {
            c: np.asarray(self.rows[c])[idx]
            for c in ("sample_id", "group_id", "version_first", "version_last")
        }
        info = SampleInfo(col["sample_id"], col["group_id"], col["version_first"], col["version_last"])
        keep = np.asarray(self.ctrl.keep(info, self.version), dtype=bool)
        self.keep_calls.append({**col, "learner_version": self.version, "keep": keep.copy()})
        verdict = dict(zip(idx.tolist(), keep.tolist()))
        kept, n_drop = [], 0
        for g in groups:
            if all(verdict[i] for i in g):
                kept.append(g)
                continue
            for i in g:
                self.rows["dropped_at"][i] = where
                self.rows["lag"][i] = self.version - self.rows["version_first"][i]
            n_drop += len(g)
        if n_drop:
            self.budget.on_consumed(0, n_drop)
        return kept

    # -- learner -------------------------------------------------------------------------
    def _try_start_step(self) -> None:
        B = self.cfg.batch_size
        while not self.learner_busy and self.n_steps < self.cfg.steps:
            have = sum(len(g) for g in self.staging)
            if have >= B:
                batch = [i for g in self.staging for i in g]
                self.staging = []
                for i in batch:
                    self.rows["consume_version"][i] = self.version
                    self.rows["lag"][i] = self.version - self.rows["version_first"][i]
                    self.rows["dropped_at"][i] = KEPT
                self.batches.append(np.asarray(batch, dtype=np.int64))
                self.learner_busy = True
                self._push(self.t + self._step_time(), "step_done", self.epoch)
                return
            need = B - have
            take: list[list[int]] = []
            while self.buffer and need > 0:
                g = self.buffer.popleft()
                take.append(g)
                need -= len(g)
            if not take:
                return
            self.staging.extend(self._gate(take, DROPPED_AT_ASSEMBLY))

    def _step_done(self) -> None:
        self.learner_busy = False
        self.n_steps += 1
        self.version += 1
        self.budget.set_version(self.version)
        self.budget.on_consumed(self.cfg.batch_size, 0)
        if (
            self.cfg.crash_after_step is not None
            and self.n_steps == self.cfg.crash_after_step
            and not self.crashed
        ):
            self._crash()

    def _crash(self) -> None:
        """Checkpoint, then lose everything in flight, then restore from the checkpoint."""
        self.crashed = True
        budget_state, ctrl_state = self.budget.state_dict(), self.ctrl.state_dict()
        lost = [i for _, rows in self.running.values() for i in rows]
        lost += [i for g in list(self.buffer) + self.staging for i in g]
        for i in lost:
            self.rows["dropped_at"][i] = LOST
        self.running.clear()
        self.buffer.clear()
        self.staging = []
        self.idle = set(range(self.cfg.generators))
        self.epoch += 1  # pending gen_done events of the old epoch are void
        self.budget = AdmissionBudget(self.cfg.max_lag, self.cfg.batch_size, controller=self.ctrl)
        self.budget.load_state_dict(budget_state)
        self.ctrl.load_state_dict(ctrl_state)
        self.capacity_after_restore = self.budget.available

    def _gen_done(self, gen: int, epoch: int) -> None:
        if epoch != self.epoch or gen not in self.running:
            return
        _, rows = self.running.pop(gen)
        for i in rows:
            self.rows["t_done"][i] = self.t
            if self.cfg.inflight_updates:
                self.rows["version_last"][i] = self.version
        self.buffer.extend(self._gate([rows], DROPPED_ON_ARRIVAL))
        self.idle.add(gen)

    def run(self) -> SimResult:
        self._dispatch_idle()
        n_events = 0
        while self.events and self.n_steps < self.cfg.steps and n_events < self.cfg.max_events:
            self.t, _, kind, payload = heapq.heappop(self.events)
            n_events += 1
            if kind == "gen_done":
                self._gen_done(*payload)
            elif kind == "step_done":
                self._step_done()
            self._try_start_step()
            self._dispatch_idle()
            self.in_flight.append(self.budget.in_flight)
        trace = {c: np.asarray(v) for c, v in self.rows.items()}
        return SimResult(
            config=self.cfg,
            trace=trace,
            counters=self.budget.counters(),
            steps_done=self.n_steps,
            deadlocked=self.n_steps < self.cfg.steps and not self.events,
            batches=self.batches,
            keep_calls=self.keep_calls,
            in_flight=np.asarray(self.in_flight, dtype=np.int64),
            capacity_after_restore=self.capacity_after_restore,
            end_time=self.t,
        )


def simulate(config: SimConfig | None = None, controller: Any | None = None, **overrides: Any) -> SimResult:
    """Run one simulation. ``controller`` defaults to ``chain(BoundedStaleness(config.max_lag))``;
    its ``admit`` is consulted by the budget and its ``keep`` gates every arriving group."""
    cfg = config or SimConfig()
    if overrides:
        cfg = SimConfig(**{**cfg.__dict__, **overrides})
    return _Sim(cfg, controller).run()


__all__ = [
    "DROPPED_AT_ASSEMBLY",
    "DROPPED_ON_ARRIVAL",
    "KEPT",
    "LOST",
    "PENDING",
    "TRACE_COLUMNS",
    "SimConfig",
    "SimResult",
    "simulate",
]
