"""AdmissionBudget, the pure state machine the PolicyStore wraps: admission in block order, the
expected training version, the chain's verdict and pin, retries, conservation and restore."""

from __future__ import annotations

import pytest

from asyncrl.controllers import AdmissionBudget, BoundedStaleness, chain


def budget(S: int = 0, B: int = 4, W: int = 1, N: int = 1, mode: str = "bound", *extra) -> AdmissionBudget:
    ctrl = chain(BoundedStaleness(S, mode=mode), *extra)
    return AdmissionBudget(ctrl, B, blocks_per_rollout=W, versions_per_rollout=N)


def release(b: AdmissionBudget, versions: int, n_trained: int, n_dropped: int = 0) -> None:
    """The learner's side of one rollout batch: ``versions`` steps, then the release."""
    for _ in range(versions):
        b.set_version(b.version + 1)
    b.on_consumed(n_trained, n_dropped)


def test_blocks_are_admitted_in_stream_order_only():
    b = budget(S=3)
    assert b.try_acquire(4, 1) is None  # block 0 has not been admitted: block 1 waits its turn
    first = b.try_acquire(4, 0)
    assert (first.ticket, first.version, first.expected_version, first.behavior_version) == (0, 0, 0, None)
    assert b.try_acquire(4, 2) is None
    assert b.try_acquire(4, 1).expected_version == 1
    assert b.next_block == 2 and b.dispatched == 8


def test_lock_step_at_s0():
    b = budget(S=0)
    assert b.try_acquire(4, 0).expected_version == 0
    assert b.try_acquire(4, 1) is None  # it would be trained at v1 with weights v0: lag 1 > 0
    release(b, 1, 4)
    a = b.try_acquire(4, 1)
    assert a.version == a.expected_version == 1  # generated with the weights that train it


def test_expected_version_with_learner_workers_and_minibatches():
    """Rollout batch r = blocks rW..rW+W-1 is trained from version v_rel + (r - released) N."""
    b = budget(S=4, W=2, N=2)
    expected = [b.try_acquire(2, i).expected_version for i in range(6)]
    assert expected == [0, 0, 2, 2, 4, 4]
    assert b.try_acquire(2, 6) is None  # batch 3 would start at v6: lag 6 > 4
    release(b, 2, 4)  # batch 0: two optimizer steps
    assert b.expected_version(6) == 6 and b.try_acquire(2, 6).expected_version == 6


@pytest.mark.parametrize("S,N,in_flight", [(0, 1, 1), (1, 1, 2), (1, 2, 1), (2, 2, 2), (3, 2, 2), (4, 2, 3)])
def test_batches_in_flight_are_floor_s_over_n_plus_one(S, N, in_flight):
    b = budget(S=S, N=N)
    admitted = 0
    while b.try_acquire(4, admitted) is not None:
        admitted += 1
    assert admitted == in_flight == S // N + 1


def test_retry_gets_its_admission_back_and_takes_no_budget():
    """A generator died after admission and Ray Data re-ran the block on a restarted actor."""
    b = budget(S=0)
    a = b.try_acquire(4, 0)
    assert b.try_acquire(4, 0) is a
    assert b.dispatched == 4 and b.in_flight == 4 and b.counters()["retries"] == 1
    release(b, 1, 4)
    with pytest.raises(ValueError, match="already admitted and its admission released"):
        b.try_acquire(4, 0)


def test_conservation_and_bad_reports():
    b = budget(S=1)
    b.try_acquire(4, 0)
    b.try_acquire(4, 1)
    release(b, 1, 3, 1)
    c = b.counters()
    assert c["dispatched"] == c["trained"] + c["dropped"] + c["lost"] + c["in_flight"] == 8
    assert (c["trained"], c["dropped"], c["in_flight"]) == (3, 1, 4)
    with pytest.raises(ValueError, match="releases more"):
        b.on_consumed(5, 0)
    with pytest.raises(ValueError, match="went back"):
        b.set_version(0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        b.try_acquire(0, 2)
    with pytest.raises(TypeError, match="admit"):
        AdmissionBudget(object(), 4)


def test_restore_counts_in_flight_as_lost_and_restarts_the_stream():  # spec 7.1 g
    b = budget(S=2)
    for i in range(3):
        b.try_acquire(4, i)
    release(b, 1, 4)
    state = b.state_dict()
    r = budget(S=2)
    r.load_state_dict(state)
    assert r.in_flight == 0 and r.lost == 8 and r.trained == 4 and r.version == 1
    # the new stream starts at block 0, trained from the restored version on: S + 1 batches admissible
    assert [r.try_acquire(4, i).expected_version for i in range(3)] == [1, 2, 3]
    assert r.try_acquire(4, 3) is None
    with pytest.raises(ValueError, match="batch_size"):
        budget(S=2, B=8).load_state_dict(state)


def test_budget_asks_every_controller_with_the_block_facts():
    seen = []

    class OneBlockPerVersion:
        def admit(self, req):
            seen.append((req.block_index, req.learner_version, req.expected_version, req.in_flight))
            return req.block_index <= req.learner_version

    b = budget(3, 2, 1, 1, "bound", OneBlockPerVersion())
    assert b.try_acquire(2, 0).expected_version == 0
    assert b.try_acquire(2, 1) is None  # bounded_staleness would admit it; the user's controller does not
    release(b, 1, 2)
    assert b.try_acquire(2, 1).expected_version == 1
    assert seen == [(0, 0, 0, 0), (1, 0, 1, 2), (1, 1, 1, 0)]


def test_fixed_mode_pins_the_behavior_version_s_before_training():
    b = budget(S=2, mode="fixed")
    pins = [b.try_acquire(4, i).behavior_version for i in range(3)]
    assert pins == [0, 0, 0]  # the first S batches cannot be older than v0
    release(b, 1, 4)
    assert b.try_acquire(4, 3).behavior_version == 1  # trained at v3, generated with v1


def test_a_pin_to_an_unpublished_version_is_refused():
    class PinsTheFuture:
        def behavior_version(self, req):
            return req.learner_version + 1

    b = AdmissionBudget(chain(BoundedStaleness(1), PinsTheFuture()), 4)
    with pytest.raises(ValueError, match="not a published version"):
        b.try_acquire(4, 0)
