"""The discrete-event model of the pipeline (``asyncrl.lab.simulator``): the ordering rule and the
staleness bound over adversarial schedules (spec 7.1 a-g), and what a straggler costs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.controllers import BoundedStaleness, chain
from asyncrl.lab.simulator import DROPPED, KEPT, LOST, PENDING, SimConfig, ideal_throughput, simulate

SETTINGS = settings(max_examples=60, deadline=None)

DURATIONS = [0.05, 0.3, 1.0, 2.5, 12.0]  # 12 = a straggler many learner steps long


@st.composite
def schedules(draw, **fixed):
    """Adversarial schedules over the scale-out space: request order and delays, stragglers,
    generator deaths (retries of admitted blocks), a learner crash and restore."""
    W = draw(st.integers(1, 2))
    N = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2]))
    kw = dict(
        max_lag=draw(st.integers(0, 3)),
        lag_mode=draw(st.sampled_from(["bound", "fixed"])),
        learner_workers=W,
        minibatches=N,
        group_size=G,
        batch_size=W * N * G * draw(st.integers(1, 2)),
        generators=draw(st.integers(1, 4)),
        scorers=draw(st.integers(1, 2)),
        score_time=draw(st.sampled_from([0.0, 0.2])),
        steps=N * draw(st.integers(2, 6)),
        poll_order=draw(st.sampled_from(["fifo", "lifo", "random"])),
        request_delays=tuple(draw(st.lists(st.sampled_from([0.0, 0.05, 0.7, 3.0]), max_size=5))),
        gen_times=tuple(draw(st.lists(st.sampled_from(DURATIONS), min_size=1, max_size=6))),
        step_times=tuple(draw(st.lists(st.sampled_from([0.1, 1.0, 2.0]), min_size=1, max_size=3))),
        gen_crashes=tuple(draw(st.sets(st.integers(1, 12), max_size=3))),
        restart_time=draw(st.sampled_from([0.1, 4.0])),
        gate=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    if draw(st.booleans()):
        kw["crash_after_step"] = draw(st.integers(1, kw["steps"] - 1))
    kw.update(fixed)
    return SimConfig(**kw)


def controllers(cfg: SimConfig, extra: str | None):
    """The run's chain: the bound, plus a user admission hook that limits what may start."""
    bound = BoundedStaleness(cfg.max_lag, mode=cfg.lag_mode)
    if extra == "capacity":  # one rollout batch in flight: first-come admission deadlocks on it
        return chain(bound, CapacityAdmission(1))
    if extra == "throttle":
        return chain(bound, OneBatchPerVersion())
    return chain(bound)


def check_books(r) -> None:
    """Conservation (spec 7.1 f), in the budget's counters and in the trace; nothing leaks."""
    tr, c = r.trace, r.counters
    assert c["dispatched"] == c["trained"] + c["dropped"] + c["lost"] + c["in_flight"] == len(tr["sample_id"])
    assert c["trained"] == (tr["dropped_at"] == KEPT).sum()
    assert c["dropped"] == (tr["dropped_at"] == DROPPED).sum()
    assert c["lost"] == (tr["dropped_at"] == LOST).sum()
    assert c["in_flight"] == (tr["dropped_at"] == PENDING).sum() == 0  # drained: every admission released


@settings(max_examples=300, deadline=None)
@given(schedules(), st.sampled_from([None, "capacity", "throttle"]))
def test_ordering_rule_never_deadlocks_and_bounds_every_lag(cfg, extra):
    """The scale-out contract over generators 1-4, W 1-2, N 1-2, S 0-3, bound and fixed modes, with
    and without a user admission hook that holds back blocks the bound would admit."""
    r = simulate(cfg, controller=controllers(cfg, extra))
    tr, S, N = r.trace, cfg.max_lag, cfg.minibatches
    assert not r.deadlocked, r.counters
    assert r.steps_done >= cfg.steps
    trained = tr["dropped_at"] == KEPT
    # the bound holds by admission alone: nothing needs dropping, with or without the gate
    assert (tr["dropped_at"] != DROPPED).all()
    assert (tr["lag"][trained] <= S).all()
    # the k-th mini-batch of a rollout batch is k versions older (PPO-style), never more
    assert (tr["train_version"][trained] - tr["version_first"][trained] <= S + N - 1).all()
    # admission knew the version that trains each block
    assert (tr["consume_version"][trained] == tr["expected_version"][trained]).all()
    # blocks are consumed in stream order, one rollout batch = W consecutive blocks
    for rows in r.rollouts:
        blocks = np.unique(tr["block_index"][rows])
        assert (np.diff(blocks) == 1).all() and blocks[0] % cfg.learner_workers == 0
    if cfg.lag_mode == "fixed":  # lag exactly S once the learner is S versions in
        assert (tr["lag"][trained] == np.minimum(S, tr["consume_version"][trained])).all()
    check_books(r)
    assert r.counters["retries"] <= len(cfg.gen_crashes)


def test_a_later_block_asking_first_waits_its_turn():
    """Why the rule: first-come admission let block 1, asking first, take the last slot of a
    capacity budget and wait forever behind block 0, which the learner needs first. In order,
    block 1's request just waits until block 0 is admitted."""
    cfg = SimConfig(
        max_lag=2,
        batch_size=4,
        generators=2,
        steps=4,
        gen_times=(1.0,),
        request_delays=(0.5, 0.0),  # the request for block 1 reaches the store first
    )
    r = simulate(cfg, controller=controllers(cfg, "capacity"))
    assert not r.deadlocked and r.steps_done == 4
    first = r.trace["t_admit"][r.trace["block_index"] == 0].min()
    second = r.trace["t_admit"][r.trace["block_index"] == 1].min()
    assert first < second


@SETTINGS
@given(
    schedules(
        gate=True,
        gen_dist="lognormal",
        gen_times=(),
        gen_crashes=(),
        crash_after_step=None,
        lag_mode="bound",
        request_delays=(),
    )
)
def test_capacity_lock_step_and_group_atomicity(cfg):  # spec 7.1 b, d, e
    r = simulate(cfg)
    B, S, N = cfg.batch_size, cfg.max_lag, cfg.minibatches
    # (b) at most ceil(S / N) + 1 rollout batches started-but-untrained (floor(S / N) + 1 at a batch
    # boundary; during a batch's mini-batch steps the next one may already start)
    assert r.in_flight.max() <= (-(-S // N) + 1) * B
    # (d) liveness: every rollout batch before the drain is whole, B fresh samples
    done = [rows for rows in r.rollouts if r.trace["consume_version"][rows[0]] < cfg.steps]
    assert len(done) == cfg.steps // N and all(len(rows) == B for rows in done)
    # (e) one verdict per group
    tr = r.trace
    for g in np.unique(tr["group_id"]):
        assert len(set(tr["dropped_at"][tr["group_id"] == g].tolist())) == 1


@SETTINGS
@given(schedules(max_lag=0, crash_after_step=None, gen_crashes=(), lag_mode="bound"))
def test_s0_reproduces_the_synchronous_schedule(cfg):  # spec 7.1 c
    r = simulate(cfg)
    tr, B, N = r.trace, cfg.batch_size, cfg.minibatches
    assert r.in_flight.max() <= B
    for k, rows in enumerate(r.rollouts):
        # rollout batch k = the next B samples of the stream, generated and first trained at version kN
        assert sorted(tr["sample_id"][rows].tolist()) == list(range(k * B, k * B + len(rows)))
        assert (tr["admit_version"][rows] == k * N).all() and (tr["consume_version"][rows] == k * N).all()
        assert (tr["version_first"][rows] == k * N).all() and (tr["version_last"][rows] == k * N).all()
    for v, rows in enumerate(r.steps):  # mini-batch j of batch k is the step from version kN + j
        assert (tr["train_version"][rows] == v).all()


def test_restore_loses_in_flight_and_resumes_the_bound():  # spec 7.1 g
    r = simulate(max_lag=2, batch_size=4, generators=4, steps=8, gen_dist="fixed", crash_after_step=3, seed=1)
    tr = r.trace
    assert r.after_restore["in_flight"] == 0 and r.after_restore["version"] == 3
    assert r.after_restore["lost"] == (tr["dropped_at"] == LOST).sum() > 0
    restarted = tr["stream"] == 1
    assert tr["block_index"][restarted].min() == 0
    assert tr["expected_version"][restarted & (tr["block_index"] == 0)][0] == 3
    assert not r.deadlocked and (tr["lag"][tr["dropped_at"] == KEPT] <= 2).all()
    check_books(r)


def test_retried_block_keeps_its_admission():
    r = simulate(max_lag=1, batch_size=4, generators=2, steps=6, gen_dist="fixed", gen_crashes=(2,), seed=0)
    assert r.counters["retries"] == 1 and r.counters["dispatched"] == len(r.trace["sample_id"])
    assert r.trace["sample_id"].size == np.unique(r.trace["sample_id"]).size
    check_books(r)


class CapacityAdmission:
    """AReaL/SkyRL-style admission, ``in_flight + n <= batches * B``: blind to block order and
    to mini-batches (AReaL's bound is ``batches = S + 1``)."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def admit(self, req) -> bool:
        return req.in_flight + req.n <= self.batches * req.batch_size


class OneBatchPerVersion:
    """A throttle: at most one rollout batch of samples started per learner version. Blocks are
    admitted in order, so the last request seen for a block is the one that was granted."""

    def __init__(self) -> None:
        self.asked: tuple[int, int, int] | None = None  # (block, version, n) of the latest request
        self.started: dict[int, int] = {}

    def admit(self, req) -> bool:
        if self.asked is not None and self.asked[0] < req.block_index:
            _, version, n = self.asked  # granted: a later block is being asked about
            self.started[version] = self.started.get(version, 0) + n
        self.asked = (req.block_index, req.learner_version, req.n)
        return self.started.get(req.learner_version, 0) + req.n <= req.batch_size


class GateOnly:
    """BoundedStaleness's consumption gate without its admission rule."""

    def __init__(self, max_lag: int) -> None:
        self.bound = BoundedStaleness(max_lag)

    def keep(self, info, learner_version):
        return self.bound.keep(info, learner_version)


def test_gate_catches_what_a_looser_admission_lets_through():
    """With N mini-batch steps per batch the capacity rule admits S + 1 batches, N times too many
    versions ahead; the consumption gate is what keeps the bound strict."""
    kw = dict(max_lag=1, batch_size=4, minibatches=2, generators=4, steps=16, gen_dist="fixed", seed=0)
    loose = chain(CapacityAdmission(2))
    ungated = simulate(controller=loose, gate=False, **kw)
    assert ungated.trace["lag"][ungated.trained].max() > 1
    gated = simulate(controller=chain(CapacityAdmission(2), GateOnly(1)), **kw)
    assert gated.trace["lag"][gated.trained].max() <= 1
    assert (gated.trace["dropped_at"] == DROPPED).any()
    check_books(gated)


def test_a_straggler_delays_its_successors_consumption_not_their_generation():
    """In-order consumption with several generators: while block 4 takes 10x as long, the next
    blocks inside the staleness window are generated anyway and trained back to back once it
    lands; the learner waits for the straggler, never for its successors."""
    times = (1.0,) * 4 + (10.0,) + (1.0,) * 40
    r = simulate(max_lag=4, batch_size=4, generators=4, steps=16, gen_times=times, step_times=(0.5,))
    tr = r.trace
    done = {b: tr["t_done"][tr["block_index"] == b].max() for b in range(12)}
    consumed = {b: tr["t_consumed"][tr["block_index"] == b].min() for b in range(12)}
    successors = [b for b in range(5, 9)]  # within S = 4 of the straggler: admitted while it runs
    assert all(done[b] < done[4] for b in successors)
    assert all(consumed[b] >= done[4] for b in successors)
    # once the straggler lands, its successors need no more waiting: one step after another
    starts = [consumed[b] for b in [4, *successors]]
    assert np.allclose(np.diff(starts), 0.5)


def test_throughput_grows_with_s_and_approaches_the_ideal():
    """Generation-dominated (one block = 4 learner steps): 4 generators need S >= 3 to keep the
    learner busy; S = 0 runs at one generator's rate."""
    base = dict(batch_size=4, generators=4, steps=40, gen_dist="fixed", gen_mean=4.0, step_time=1.0)
    tput = {S: simulate(max_lag=S, **base).throughput for S in (0, 1, 4)}
    ideal = ideal_throughput(SimConfig(**base))
    assert ideal == pytest.approx(4.0)
    assert tput[0] < tput[1] < tput[4]
    assert tput[0] == pytest.approx(4 / 5, rel=0.05)  # generate (4) then train (1), in turn
    assert tput[4] >= 0.9 * ideal


def test_deterministic_given_seed():
    cfg = SimConfig(max_lag=2, gen_dist="pareto", step_sigma=0.5, generators=5, tail_prob=0.1, seed=7)
    a, b, c = simulate(cfg), simulate(cfg), simulate(cfg, seed=8)
    assert all(np.array_equal(a.trace[k], b.trace[k], equal_nan=True) for k in a.trace)
    assert not np.array_equal(a.trace["t_done"], c.trace["t_done"], equal_nan=True)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="whole groups"):
        SimConfig(batch_size=4, learner_workers=2, minibatches=2, group_size=2)
    with pytest.raises(ValueError, match="multiple of minibatches"):
        SimConfig(steps=3, minibatches=2)
