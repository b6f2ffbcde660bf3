"""Discrete-event simulator of the pipeline's scheduling: generators, in-order delivery, learner.

It models what the Ray pipeline does (``asyncrl.pipeline``), with exogenous times instead of
compute, so the ordering rule and the staleness bound can be checked over any interleaving
(spec section 7.1) and throughput can be studied against ``S``, the number of actors and the
generation-time distribution:

- **Input**: blocks of ``B / W`` samples in stream order (block ``i`` of rollout batch
  ``i // W``), dispatched FIFO to ``generators`` workers, one block in flight each (Ray Data's
  actor pool with ``max_tasks_in_flight_per_actor=1``).
- **Admission**: a worker's ``acquire(n, block_index)`` reaches the store after a request delay
  (adversarial delays make requests for later blocks arrive first) and polls
  ``AdmissionBudget.try_acquire`` until admitted (the store's poll loop; the order in which
  waiting requests are polled is ``poll_order``). The controller chain decides (``admit``) and
  may pin the behavior version (``behavior_version``, fixed-lag mode).
- **Generation** starts at admission with the pinned weights or the latest published ones, so
  ``version_first`` is that version, and takes a drawn time: the max over the block's samples
  (batched generation runs until its longest completion) from a lognormal, Pareto, fixed or
  adversarial law, optionally with a heavy tail (``tail_prob`` of the samples take
  ``tail_factor`` times longer), or an explicit cycle of block durations (``gen_times``).
  A worker may die mid-generation (``gen_crashes``); it restarts after ``restart_time`` and
  requests the same block again (a retry: same admission, no new budget).
- **Delivery in block order** (``preserve_order``): a block leaves generation, and then the
  ``scorers`` stage (FIFO, ``score_time``), only after every earlier block did, so a straggler
  holds back its successors' delivery (head-of-line blocking) but not their generation.
- **Learner**: rollout batch ``r`` = blocks ``rW .. rW+W-1``, taken when all W arrived; the
  chain's ``keep`` gate once per batch at the version of its first step; then ``N`` mini-batch
  steps (``minibatches``), each a drawn step time, each followed by ``set_version``, the last
  also by ``on_consumed`` (the PolicyStore's ``publish``). A mini-batch with nothing kept takes
  no step (as ``loss_step``).
- **Crash / restore** (``crash_after_step``): after the rollout batch that reaches that step the
  learner checkpoints, everything in flight is lost, and the budget and controller are restored
  from their ``state_dict``; the stream restarts at block 0.
- **Drain** (``drain``): when the learner has taken ``steps`` steps the input ends; the learner
  keeps consuming until every dispatched block is trained or dropped (the last rollout batch may
  be partial), so a leak in the books shows as ``in_flight > 0`` at the end.

Deterministic given ``seed``. The trace has one row per admitted sample.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from asyncrl.controllers.admission import Admission, AdmissionBudget
from asyncrl.controllers.base import SampleInfo
from asyncrl.controllers.bounded import BoundedStaleness
from asyncrl.controllers.chain import as_controller, chain

GenDist = Literal["lognormal", "pareto", "adversarial", "fixed"]
PollOrder = Literal["fifo", "lifo", "random"]

# ``dropped_at`` codes in the trace
KEPT, PENDING, DROPPED, LOST = 0, -1, 1, 3


class SimulationError(RuntimeError):
    """The modelled pipeline did something the real one would refuse (e.g. a pinned version the
    PolicyStore no longer keeps)."""


@dataclass(frozen=True)
class SimConfig:
    """Simulation settings (times in units of the mean learner step)."""

    max_lag: int = 2
    lag_mode: Literal["bound", "fixed"] = "bound"
    batch_size: int = 8  # B: samples per rollout batch, over all learner workers
    group_size: int = 1
    learner_workers: int = 1  # W: blocks per rollout batch
    minibatches: int = 1  # N: optimizer steps per rollout batch
    generators: int = 4
    scorers: int = 1
    steps: int = 10  # optimizer steps before the input ends (a multiple of N)
    gen_dist: GenDist = "lognormal"
    gen_mean: float = 1.0
    gen_sigma: float = 1.0
    pareto_alpha: float = 1.5
    tail_prob: float = 0.0  # chance that a sample takes tail_factor x longer (heavy-tailed lengths)
    tail_factor: float = 10.0
    gen_times: tuple[float, ...] = ()  # explicit block durations, cycled (overrides gen_dist)
    score_time: float = 0.0
    step_time: float = 1.0
    step_sigma: float = 0.0
    step_times: tuple[float, ...] = ()  # explicit optimizer-step durations, cycled
    request_delays: tuple[float, ...] = ()  # acquire-request delays, cycled per request
    poll_order: PollOrder = "fifo"
    gen_crashes: tuple[int, ...] = ()  # the k-th fresh admissions (1-based) whose worker dies mid-block
    restart_time: float = 1.0
    gate: bool = True
    inflight_updates: bool = False  # version_last = learner version at completion (in-flight reloads)
    crash_after_step: int | None = None
    drain: bool = True
    max_events: int = 1_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size % self.learner_workers:
            raise ValueError(
                f"batch_size={self.batch_size} must divide over learner_workers={self.learner_workers}"
            )
        local = self.batch_size // self.learner_workers
        if local % (self.group_size * self.minibatches):
            raise ValueError(
                f"each block ({local} samples) must split into minibatches={self.minibatches} "
                f"mini-batches of whole groups (group_size={self.group_size})"
            )
        if self.max_lag < 0 or self.generators < 1 or self.scorers < 1 or self.steps < 1:
            raise ValueError("need max_lag >= 0, generators >= 1, scorers >= 1, steps >= 1")
        if self.steps % self.minibatches:
            raise ValueError(f"steps={self.steps} must be a multiple of minibatches={self.minibatches}")
        if self.lag_mode not in ("bound", "fixed"):
            raise ValueError(f"lag_mode must be 'bound' or 'fixed', got {self.lag_mode!r}")

    @property
    def block_size(self) -> int:
        return self.batch_size // self.learner_workers

    @property
    def bound(self) -> BoundedStaleness:
        """A fresh ``BoundedStaleness`` from ``max_lag``, ``lag_mode`` and ``minibatches`` (what the
        run's ``BoundedStaleness.from_config`` builds from the same three keys)."""
        return BoundedStaleness(self.max_lag, mode=self.lag_mode, minibatches=self.minibatches)


@dataclass
class SimResult:
    """``trace``: per-sample arrays (``TRACE_COLUMNS``); ``steps[v]``: rows trained by the step
    that produced version v+1; ``rollouts[r]``: rows of rollout batch r (all streams);
    ``keep_calls``: every gate call (for replay); ``in_flight``: the budget's after every event."""

    config: SimConfig
    trace: dict[str, np.ndarray]
    counters: dict[str, int]
    steps_done: int  # learner version when the input ended (>= config.steps unless deadlocked)
    version_final: int  # learner version after the drain
    deadlocked: bool
    steps: list[np.ndarray]
    rollouts: list[np.ndarray]
    keep_calls: list[dict[str, Any]]
    in_flight: np.ndarray
    after_restore: dict[str, int] | None  # the budget's counters right after a restore
    end_time: float  # when the learner reached config.steps
    learner_busy_time: float  # optimizer-step time spent up to end_time

    @property
    def trained(self) -> np.ndarray:
        return self.trace["dropped_at"] == KEPT

    @property
    def throughput(self) -> float:
        """Samples trained per unit time until the learner reached ``config.steps``."""
        done = self.trained & (self.trace["t_consumed"] <= self.end_time)
        return float(done.sum()) / self.end_time if self.end_time > 0 else 0.0

    @property
    def learner_utilisation(self) -> float:
        """Fraction of the time the learner spent stepping (1 = generation never held it back)."""
        return self.learner_busy_time / self.end_time if self.end_time > 0 else 0.0


TRACE_COLUMNS = (
    "sample_id",
    "group_id",
    "stream",  # restarts after a crash/restore
    "block_index",
    "rollout",  # block_index // W
    "admit_version",  # learner version at admission
    "expected_version",  # the version the budget predicted would train it
    "version_first",  # weights version used (pinned or latest at generation start)
    "version_last",
    "load_version",  # learner version when those weights were fetched
    "t_admit",
    "t_done",  # generation finished (last attempt)
    "t_delivered",  # reached the learner (after every earlier block)
    "t_consumed",
    "consume_version",  # version at the rollout batch's first step (where keep is evaluated)
    "train_version",  # version of its own mini-batch step (consume_version + k for the k-th)
    "lag",  # consume_version - version_first
    "dropped_at",
)


def ideal_throughput(cfg: SimConfig) -> float:
    """``min(generators * gen_rate, learner_rate)`` in samples per unit time, from the mean block
    time (fixed or explicit ``gen_times``; the other laws use ``gen_mean``) and the mean step time."""
    gen = float(np.mean(cfg.gen_times)) if cfg.gen_times else cfg.gen_mean
    step = float(np.mean(cfg.step_times)) if cfg.step_times else cfg.step_time
    gen_rate = cfg.generators * cfg.block_size / gen
    learner_rate = cfg.batch_size / (cfg.minibatches * step)
    return min(gen_rate, learner_rate)


_INFO_COLUMNS = ("sample_id", "group_id", "version_first", "version_last")


@dataclass
class _Rollout:
    """The rollout batch the learner is consuming: its rows, the kept rows of each mini-batch,
    the next mini-batch ``k`` and the samples trained so far."""

    rows: np.ndarray
    minibatches: list[list[int]]
    k: int = 0
    trained: int = 0


class _Worker:
    """One generator actor: its block and what it is doing."""

    def __init__(self) -> None:
        self.block: int | None = None
        self.state = "idle"  # idle | requesting | waiting | generating | restarting
        self.attempt = 0


class _Sim:
    def __init__(self, cfg: SimConfig, controller: Any | None) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.bound = cfg.bound
        self.ctrl = as_controller(controller) if controller is not None else chain(self.bound)
        self.budget = self._new_budget()
        # the PolicyStore keeps S + N past versions in fixed mode (BoundedStaleness.kept_versions)
        self.keep_versions = self.bound.kept_versions
        self.version = 0
        self.t = 0.0
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.rows: dict[str, list[Any]] = {c: [] for c in TRACE_COLUMNS}
        self.workers = [_Worker() for _ in range(cfg.generators)]
        self.stream = 0
        self.input_open = True
        self.n_dispatched_blocks = 0  # blocks handed to workers in this stream
        self.block_rows: dict[int, list[int]] = {}  # block -> trace rows (this stream)
        self.pending: list[int] = []  # workers whose request reached the store, in arrival order
        self.generated: dict[int, list[int]] = {}  # held until every earlier block is generated
        self.next_gen_release = 0
        self.score_queue: deque[int] = deque()
        self.scorers_busy = 0
        self.scored: dict[int, list[int]] = {}
        self.next_score_release = 0
        self.ready: dict[int, list[int]] = {}  # delivered to the learner, by block
        self.next_rollout = 0
        self.learner_busy = False
        self.current: _Rollout | None = None  # the rollout batch the learner is stepping through
        self.steps: list[np.ndarray] = []
        self.rollouts: list[np.ndarray] = []
        self.keep_calls: list[dict[str, Any]] = []
        self.in_flight: list[int] = []
        self.n_requests = 0
        self.n_blocks_timed = 0
        self.n_step_draws = 0
        self.n_fresh_admissions = 0
        self.crashed = False
        self.after_restore: dict[str, int] | None = None
        self.end_time: float | None = None
        self.steps_done: int | None = None
        self.busy_time = 0.0

    def _new_budget(self) -> AdmissionBudget:
        cfg = self.cfg
        return AdmissionBudget(
            self.ctrl,
            cfg.batch_size,
            blocks_per_rollout=cfg.learner_workers,
            versions_per_rollout=cfg.minibatches,
        )

    # -- drawn times ---------------------------------------------------------------------------
    def _gen_time(self) -> float:
        """One block's generation time: the max over its samples (see the module docstring)."""
        cfg, k = self.cfg, self.n_blocks_timed
        self.n_blocks_timed += 1
        n = cfg.block_size
        if cfg.gen_times:
            base = np.full(n, float(cfg.gen_times[k % len(cfg.gen_times)]))
        elif cfg.gen_dist == "fixed":
            base = np.full(n, cfg.gen_mean)
        elif cfg.gen_dist == "adversarial":  # later blocks finish first; every 5th straggles
            if k % 5 == 4:  # past every batch the bound lets run ahead: 4 (S + 2) mean times
                t = cfg.gen_mean * 4 * (self.bound.batches_ahead + 1)
            else:
                t = cfg.gen_mean * (1 + (-k) % cfg.generators) / cfg.generators
            base = np.full(n, t)
        elif cfg.gen_dist == "lognormal":
            mu = math.log(cfg.gen_mean) - cfg.gen_sigma**2 / 2
            base = self.rng.lognormal(mu, cfg.gen_sigma, n)
        else:  # Pareto (Lomax + 1) scaled to the requested mean: heavy tail for alpha <= 2
            a = cfg.pareto_alpha
            scale = cfg.gen_mean * (a - 1) / a if a > 1 else cfg.gen_mean
            base = (self.rng.pareto(a, n) + 1) * scale
        if cfg.tail_prob > 0:
            base = np.where(self.rng.random(n) < cfg.tail_prob, base * cfg.tail_factor, base)
        return float(base.max())

    def _step_time(self) -> float:
        cfg, k = self.cfg, self.n_step_draws
        self.n_step_draws += 1
        if cfg.step_times:
            return float(cfg.step_times[k % len(cfg.step_times)])
        if cfg.step_sigma > 0:
            return float(self.rng.lognormal(math.log(cfg.step_time) - cfg.step_sigma**2 / 2, cfg.step_sigma))
        return cfg.step_time

    def _request_delay(self) -> float:
        d = self.cfg.request_delays
        k = self.n_requests
        self.n_requests += 1
        return float(d[k % len(d)]) if d else 0.0

    def _push(self, t: float, kind: str, *payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, (self.stream, *payload)))

    # -- generators ------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Hand the next blocks of the input, in order, to idle workers (FIFO)."""
        for w, worker in enumerate(self.workers):
            if not self.input_open:
                return
            if worker.state != "idle":
                continue
            worker.block = self.n_dispatched_blocks
            self.n_dispatched_blocks += 1
            self._request(w)

    def _request(self, w: int) -> None:
        worker = self.workers[w]
        worker.state = "requesting"
        worker.attempt += 1
        self._push(self.t + self._request_delay(), "request", w, worker.attempt)

    def _poll(self) -> None:
        """The store's poll loop: every waiting request tries again until none is admitted."""
        progressed = True
        while progressed and self.pending:
            progressed = False
            order = list(self.pending)
            if self.cfg.poll_order == "lifo":
                order.reverse()
            elif self.cfg.poll_order == "random":
                order = [order[i] for i in self.rng.permutation(len(order))]
            for w in order:
                worker = self.workers[w]
                assert worker.block is not None
                admission = self.budget.try_acquire(self.cfg.block_size, worker.block)
                if admission is None:
                    continue
                self.pending.remove(w)
                self._start_generation(w, admission)
                progressed = True

    def _start_generation(self, w: int, admission: Admission) -> None:
        cfg, worker = self.cfg, self.workers[w]
        block = worker.block
        assert block is not None
        retry = block in self.block_rows
        worker.state = "generating"
        behavior = admission.behavior_version
        if behavior is not None and self.version - behavior > self.keep_versions:
            raise SimulationError(
                f"block {block} is pinned to version {behavior} but the store keeps only "
                f"{self.keep_versions} versions before {self.version}"
            )
        weights = self.version if behavior is None else behavior
        if not retry:
            rows = []
            for _ in range(cfg.block_size):
                i = len(self.rows["sample_id"])
                rows.append(i)
                values = {
                    "sample_id": i,
                    "group_id": i // cfg.group_size,  # blocks hold whole groups
                    "stream": self.stream,
                    "block_index": block,
                    "rollout": block // cfg.learner_workers,
                    "admit_version": admission.version,
                    "expected_version": admission.expected_version,
                    "t_admit": self.t,
                    "t_done": math.nan,
                    "t_delivered": math.nan,
                    "t_consumed": math.nan,
                    "consume_version": -1,
                    "train_version": -1,
                    "lag": -1,
                    "dropped_at": PENDING,
                }
                for col in TRACE_COLUMNS:
                    self.rows[col].append(values.get(col, -1))
            self.block_rows[block] = rows
            self.n_fresh_admissions += 1
        for i in self.block_rows[block]:
            self.rows["version_first"][i] = weights
            self.rows["version_last"][i] = weights
            self.rows["load_version"][i] = self.version
        duration = self._gen_time()
        if not retry and self.n_fresh_admissions in cfg.gen_crashes:
            self._push(self.t + duration / 2, "gen_crash", w, worker.attempt)
        else:
            self._push(self.t + duration, "gen_done", w, worker.attempt)

    def _gen_done(self, w: int) -> None:
        worker = self.workers[w]
        block = worker.block
        assert block is not None
        for i in self.block_rows[block]:
            self.rows["t_done"][i] = self.t
            if self.cfg.inflight_updates:
                self.rows["version_last"][i] = self.version
        worker.state, worker.block = "idle", None
        self.generated[block] = self.block_rows[block]
        while self.next_gen_release in self.generated:  # preserve_order
            b = self.next_gen_release
            self.score_queue.append(b)
            self.generated.pop(b)
            self.next_gen_release += 1
        self._score()

    # -- scoring ---------------------------------------------------------------------------------
    def _score(self) -> None:
        while self.score_queue and self.scorers_busy < self.cfg.scorers:
            b = self.score_queue.popleft()
            if self.cfg.score_time <= 0:
                self._scored(b)
                continue
            self.scorers_busy += 1
            self._push(self.t + self.cfg.score_time, "score_done", b)

    def _scored(self, block: int) -> None:
        self.scored[block] = self.block_rows[block]
        while self.next_score_release in self.scored:  # preserve_order
            b = self.next_score_release
            for i in self.scored.pop(b):
                self.rows["t_delivered"][i] = self.t
            self.ready[b] = self.block_rows[b]
            self.next_score_release += 1

    # -- learner ---------------------------------------------------------------------------------
    def _rollout_blocks(self) -> list[int] | None:
        """Blocks of the next rollout batch if they all arrived; a partial last one when draining."""
        W = self.cfg.learner_workers
        first = self.next_rollout * W
        wanted = [b for b in range(first, first + W) if b < self.n_dispatched_blocks or self.input_open]
        if not wanted:
            return None
        if all(b in self.ready for b in wanted):
            return wanted
        return None

    def _try_consume(self) -> None:
        while not self.learner_busy and self.current is None:
            if self.steps_done is not None and not self.cfg.drain:
                return
            blocks = self._rollout_blocks()
            if blocks is None:
                return
            self.next_rollout += 1
            per_block = [self.ready.pop(b) for b in blocks]
            rows = np.asarray([i for r in per_block for i in r], dtype=np.int64)
            keep = self._gate(rows)
            verdict = dict(zip(rows.tolist(), keep.tolist()))
            N = self.cfg.minibatches
            # mini-batch k = the k-th slice of every rank's block (split_minibatches per rank)
            minibatches = []
            for k in range(N):
                mb = []
                for r in per_block:
                    m = len(r) // N
                    mb.extend(r[k * m : (k + 1) * m])
                minibatches.append(mb)
            for i in rows.tolist():
                self.rows["consume_version"][i] = self.version
                self.rows["lag"][i] = self.version - self.rows["version_first"][i]
                self.rows["t_consumed"][i] = self.t
                self.rows["dropped_at"][i] = KEPT if verdict[i] else DROPPED
            self.rollouts.append(rows)
            self.current = _Rollout(rows, [[i for i in mb if verdict[i]] for mb in minibatches])
            self._next_minibatch()

    def _gate(self, rows: np.ndarray) -> np.ndarray:
        if not self.cfg.gate:
            return np.ones(len(rows), dtype=bool)
        col = {c: np.asarray(self.rows[c])[rows] for c in _INFO_COLUMNS}
        info = SampleInfo(col["sample_id"], col["group_id"], col["version_first"], col["version_last"])
        keep = np.asarray(self.ctrl.keep(info, self.version), dtype=bool)
        self.keep_calls.append({**col, "learner_version": self.version, "keep": keep.copy()})
        return keep

    def _next_minibatch(self) -> None:
        """Run mini-batch steps until one takes time (an empty one takes no step, like loss_step)."""
        while self.current is not None:
            kept = self.current.minibatches[self.current.k]
            for i in kept:
                self.rows["train_version"][i] = self.version
            if kept:
                self.learner_busy = True
                dt = self._step_time()
                if self.steps_done is None:
                    self.busy_time += dt
                self._push(self.t + dt, "step_done")
                return
            self._publish(stepped=False)

    def _publish(self, *, stepped: bool) -> None:
        """After a mini-batch: the new version, and after the last one the release (one call)."""
        cur = self.current
        assert cur is not None
        kept = cur.minibatches[cur.k]
        if stepped:
            self.version += 1
            self.steps.append(np.asarray(kept, dtype=np.int64))
        self.budget.set_version(self.version)
        cur.trained += len(kept)
        cur.k += 1
        if cur.k < len(cur.minibatches):
            return
        self.budget.on_consumed(cur.trained, len(cur.rows) - cur.trained)
        self.current = None
        self._after_rollout()

    def _after_rollout(self) -> None:
        cfg = self.cfg
        if cfg.crash_after_step is not None and not self.crashed and self.version >= cfg.crash_after_step:
            self._crash()
        if self.steps_done is None and self.version >= cfg.steps:
            self.steps_done = self.version
            self.end_time = self.t
            self.input_open = False

    def _crash(self) -> None:
        """Checkpoint, lose everything in flight, restore the budget and controller, restart the stream."""
        self.crashed = True
        budget_state, ctrl_state = self.budget.state_dict(), self.ctrl.state_dict()
        for rows in self.block_rows.values():
            for i in rows:
                if self.rows["dropped_at"][i] == PENDING:
                    self.rows["dropped_at"][i] = LOST
        self.stream += 1  # events of the old stream are void
        self.workers = [_Worker() for _ in range(self.cfg.generators)]
        self.pending = []
        self.block_rows, self.generated, self.scored, self.ready = {}, {}, {}, {}
        self.score_queue.clear()
        self.scorers_busy = 0
        self.n_dispatched_blocks = self.next_gen_release = self.next_score_release = self.next_rollout = 0
        self.budget = self._new_budget()
        self.budget.load_state_dict(budget_state)  # in-flight -> lost; the stream restarts at block 0
        self.ctrl.load_state_dict(ctrl_state)
        self.after_restore = self.budget.counters()

    # -- main loop -------------------------------------------------------------------------------
    def _handle(self, kind: str, payload: tuple[Any, ...]) -> None:
        stream, *args = payload
        if stream != self.stream:
            return  # lost in a crash
        if kind == "request":
            w, attempt = args
            if self.workers[w].attempt == attempt:
                self.workers[w].state = "waiting"
                self.pending.append(w)
        elif kind == "gen_done":
            self._gen_done(args[0])
        elif kind == "gen_crash":  # the actor dies; Ray restarts it and re-runs the same block
            w = args[0]
            self.workers[w].state = "restarting"
            self._push(self.t + self.cfg.restart_time, "restart", w)
        elif kind == "restart":
            self._request(args[0])
        elif kind == "score_done":
            self.scorers_busy -= 1
            self._scored(args[0])
            self._score()
        elif kind == "step_done":
            self.learner_busy = False
            self._publish(stepped=True)
            self._next_minibatch()

    def _drained(self) -> bool:
        return (
            not self.input_open
            and self.current is None
            and not self.learner_busy
            and self.next_rollout * self.cfg.learner_workers >= self.n_dispatched_blocks
        )

    def run(self) -> SimResult:
        cfg = self.cfg
        self._dispatch()
        n_events = 0
        while self.events and n_events < cfg.max_events:
            if self.steps_done is not None and (not cfg.drain or self._drained()):
                break
            self.t, _, kind, payload = heapq.heappop(self.events)
            n_events += 1
            self._handle(kind, payload)
            self._poll()
            self._try_consume()
            self._dispatch()
            self.in_flight.append(self.budget.in_flight)
        deadlocked = self.steps_done is None or (cfg.drain and not self._drained())
        trace = {c: np.asarray(v) for c, v in self.rows.items()}
        return SimResult(
            config=cfg,
            trace=trace,
            counters=self.budget.counters(),
            steps_done=self.steps_done if self.steps_done is not None else self.version,
            version_final=self.version,
            deadlocked=deadlocked,
            steps=self.steps,
            rollouts=self.rollouts,
            keep_calls=self.keep_calls,
            in_flight=np.asarray(self.in_flight, dtype=np.int64),
            after_restore=self.after_restore,
            end_time=self.end_time if self.end_time is not None else self.t,
            learner_busy_time=self.busy_time,
        )


def simulate(config: SimConfig | None = None, controller: Any | None = None, **overrides: Any) -> SimResult:
    """Run one simulation. ``controller`` (any object with controller hooks, e.g. a chain) defaults
    to ``chain(config.bound)``; the budget asks its ``admit`` and
    ``behavior_version``, the learner its ``keep``."""
    cfg = config or SimConfig()
    if overrides:
        cfg = SimConfig(**{**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, **overrides})
    return _Sim(cfg, controller).run()


__all__ = [
    "DROPPED",
    "KEPT",
    "LOST",
    "PENDING",
    "TRACE_COLUMNS",
    "SimConfig",
    "SimResult",
    "SimulationError",
    "ideal_throughput",
    "simulate",
]
