"""AdmissionBudget and the discrete-event simulator: spec 7.1 a-h over random and adversarial traces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.controllers import AdmissionBudget, BoundedStaleness, chain
from asyncrl.simulator import (
    DROPPED_AT_ASSEMBLY,
    DROPPED_ON_ARRIVAL,
    KEPT,
    LOST,
    PENDING,
    SimConfig,
    simulate,
)

SETTINGS = settings(max_examples=40, deadline=None)


# --- AdmissionBudget ---------------------------------------------------------------------------
def test_capacity_tickets_and_conservation():
    b = AdmissionBudget(max_lag=1, batch_size=4)
    assert [b.try_acquire(2, 0) for _ in range(5)] == [0, 1, 2, 3, None]  # capacity (1+1)*4 = 8
    assert b.in_flight == 8 and b.available == 0
    b.on_consumed(0, 2)  # a dropped group frees its slot
    assert b.try_acquire(2, 0) == 4
    b.set_version(1)
    b.on_consumed(4, 0)
    c = b.counters()
    assert c["dispatched"] == c["trained"] + c["dropped"] + c["lost"] + c["in_flight"] == 10
    with pytest.raises(ValueError, match="releases more"):
        b.on_consumed(10, 0)
    with pytest.raises(ValueError, match="went back"):
        b.set_version(0)
    with pytest.raises(ValueError, match="can never fit"):
        b.try_acquire(9, 1)


def test_lock_step_at_s0_and_stale_weights_refused():
    b = AdmissionBudget(max_lag=0, batch_size=4)
    assert b.try_acquire(4, 0) == 0
    assert b.try_acquire(1, 0) is None  # exactly one step of work in flight
    b.set_version(1)
    b.on_consumed(4, 0)
    assert b.try_acquire(4, 0) is None  # weights v0 are already 1 > S versions old: reload first
    assert b.try_acquire(4, 1) == 1


def test_restore_counts_in_flight_as_lost_and_frees_full_capacity():  # 7.1 g
    b = AdmissionBudget(max_lag=2, batch_size=4)
    for _ in range(5):
        b.try_acquire(2, 0)
    b.set_version(1)
    b.on_consumed(4, 0)
    state = b.state_dict()
    r = AdmissionBudget(max_lag=2, batch_size=4)
    r.load_state_dict(state)
    assert r.in_flight == 0 and r.available == r.capacity == 12
    assert r.lost == 6 and r.trained == 4 and r.version == 1 and r.next_ticket == 5
    with pytest.raises(ValueError, match="same settings"):
        AdmissionBudget(max_lag=1, batch_size=4).load_state_dict(state)


def test_budget_consults_the_controller_chain():
    class NeverBeforeVersion2:
        def admit(self, req):
            return req.learner_version >= 2

    b = AdmissionBudget(max_lag=3, batch_size=2, controller=chain(BoundedStaleness(3), NeverBeforeVersion2()))
    assert b.try_acquire(2, 0) is None
    b.set_version(2)
    assert b.try_acquire(2, 2) == 0


# --- simulator properties ----------------------------------------------------------------------
@st.composite
def sim_configs(draw, **fixed):
    group = draw(st.integers(1, 3))
    kw = dict(
        max_lag=draw(st.integers(0, 4)),
        group_size=group,
        batch_size=group * draw(st.integers(1, 4)),
        generators=draw(st.integers(1, 8)),
        steps=draw(st.integers(3, 12)),
        gen_dist=draw(st.sampled_from(["lognormal", "pareto", "adversarial"])),
        gen_sigma=draw(st.sampled_from([0.5, 1.5])),
        pareto_alpha=draw(st.sampled_from([1.1, 1.5, 3.0])),
        step_sigma=draw(st.sampled_from([0.0, 0.7])),
        inflight_updates=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
    )
    if draw(st.booleans()):
        kw["crash_after_step"] = draw(st.integers(1, kw["steps"] - 1))
    kw.update(fixed)
    return SimConfig(**kw)


@SETTINGS
@given(sim_configs())
def test_simulator_invariants(cfg):  # 7.1 a, b, d, e, f, g
    r = simulate(cfg)
    tr = r.trace
    S, B = cfg.max_lag, cfg.batch_size
    trained = tr["dropped_at"] == KEPT
    # (a) safety: no trained sample exceeds lag S (head lag at consumption)
    assert (tr["lag"][trained] <= S).all()
    assert (tr["consume_version"][trained] - tr["version_first"][trained] <= S).all()
    # (b) capacity: started-but-untrained never exceeds (S+1)B
    assert r.in_flight.max() <= (S + 1) * B
    # (d) liveness: every step happens, B samples each
    assert not r.deadlocked and r.steps_done == cfg.steps
    assert all(len(b) == B for b in r.batches)
    # (e) group atomicity: one verdict per group
    for g in np.unique(tr["group_id"]):
        assert len(set(tr["dropped_at"][tr["group_id"] == g].tolist())) == 1
    # (f) conservation, in the budget's counters and in the trace
    c = r.counters
    assert c["dispatched"] == c["trained"] + c["dropped"] + c["lost"] + c["in_flight"] == len(tr["sample_id"])
    assert c["trained"] == trained.sum() == B * cfg.steps
    assert c["dropped"] == np.isin(tr["dropped_at"], [DROPPED_ON_ARRIVAL, DROPPED_AT_ASSEMBLY]).sum()
    assert c["lost"] == (tr["dropped_at"] == LOST).sum()
    assert c["in_flight"] == (tr["dropped_at"] == PENDING).sum()
    # (g) restore: the first capacity after a restore is the full (S+1)B
    if cfg.crash_after_step is not None:
        assert r.capacity_after_restore == (S + 1) * B


@SETTINGS
@given(sim_configs(max_lag=0))
def test_s0_is_lock_step_and_reproduces_synchronous_batches(cfg):  # 7.1 c
    r = simulate(cfg)
    tr = r.trace
    assert r.in_flight.max() <= cfg.batch_size
    assert not np.isin(tr["dropped_at"], [DROPPED_ON_ARRIVAL, DROPPED_AT_ASSEMBLY]).any()
    for v, batch in enumerate(r.batches):
        assert (tr["dispatch_version"][batch] == v).all() and (tr["consume_version"][batch] == v).all()
        assert (tr["version_last"][batch] == v).all()  # no weight update can happen mid-generation
    if cfg.crash_after_step is None:
        # the synchronous reference trains the v-th block of B samples (in dispatch order) at step v
        order = np.arange(cfg.batch_size * cfg.steps).reshape(cfg.steps, cfg.batch_size)
        assert [sorted(b.tolist()) for b in r.batches] == order.tolist()


def test_queue_aging_is_caught_at_batch_assembly():  # 7.1 h
    r = simulate(
        max_lag=2,
        batch_size=4,
        group_size=2,
        generators=6,
        steps=20,
        gen_dist="lognormal",
        step_sigma=0.5,
        seed=0,
    )
    aged = r.trace["dropped_at"] == DROPPED_AT_ASSEMBLY
    assert aged.sum() > 0  # admitted fresh, arrived within S, then aged in the queue
    assert (r.trace["lag"][aged] > 2).all()


def test_admission_alone_is_not_a_strict_bound():
    """Without the consumption gate (AReaL/SkyRL default), stragglers are trained beyond S."""
    cfg = SimConfig(
        max_lag=1, batch_size=4, group_size=2, generators=6, steps=20, gen_dist="adversarial", seed=0
    )
    loose, strict = simulate(cfg, gate=False), simulate(cfg)
    assert loose.trace["lag"][loose.trained].max() > 1
    assert strict.trace["lag"][strict.trained].max() <= 1


def test_deterministic_given_seed():
    cfg = SimConfig(max_lag=2, gen_dist="pareto", step_sigma=0.5, generators=5, seed=7)
    a, b, c = simulate(cfg), simulate(cfg), simulate(cfg, seed=8)
    assert all(np.array_equal(a.trace[k], b.trace[k], equal_nan=True) for k in a.trace)
    assert not np.array_equal(a.trace["t_done"], c.trace["t_done"], equal_nan=True)


def test_a_retried_block_keeps_its_admission_and_takes_no_budget():
    """A generator that died after admission is re-run by Ray Data with the same block key: the
    retry gets its ticket back; without keys the dead attempt's budget would never come back."""
    b = AdmissionBudget(max_lag=0, batch_size=4)
    t = b.try_acquire(4, 0, key=100)
    assert t == 0 and b.in_flight == 4
    assert b.try_acquire(4, 0, key=200) is None  # lock-step: the budget is full
    assert b.try_acquire(4, 0, key=100) == t  # the retry
    assert b.in_flight == 4 and b.dispatched == 4 and b.counters()["retries"] == 1
    b.set_version(1)
    b.on_consumed(4, 0)  # the retry's output is consumed once
    assert b.try_acquire(4, 1, key=200) == 1 and b.in_flight == 4
    unkeyed = AdmissionBudget(max_lag=0, batch_size=4)
    unkeyed.try_acquire(4, 0)
    assert unkeyed.try_acquire(4, 0) is None  # without a key a retry would wait forever


def test_restored_budget_forgets_block_keys():
    b = AdmissionBudget(max_lag=1, batch_size=4)
    b.try_acquire(4, 0, key=7)
    restored = AdmissionBudget(max_lag=1, batch_size=4)
    restored.load_state_dict(b.state_dict())  # the block in flight is counted lost, regenerated
    assert restored.in_flight == 0
    assert restored.try_acquire(4, 0, key=7) == 1 and restored.in_flight == 4
