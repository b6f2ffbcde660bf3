"""``rollouts.started_early``: the rollout stream is started in a background thread while the
learner loads, and behaves like the plain iterator otherwise. ``rollouts.rollout_batches`` over a
stream the (single) learner worker built itself. ``rollouts.RunAhead``: a colocated run's rollout
thread, bounded, in order, its errors raised in the consumer's thread."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl.rollouts import RunAhead, started_early


def test_first_item_is_pulled_in_the_background_before_the_caller_asks():
    pulled: list[str] = []

    def items():
        pulled.append(threading.current_thread().name)
        yield 1
        pulled.append(threading.current_thread().name)
        yield 2

    stream = started_early(items())
    deadline = time.monotonic() + 5
    while not pulled and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pulled == ["asyncrl-stream-start"]  # started before the caller iterated
    assert list(stream) == [1, 2]
    assert pulled[1] == threading.current_thread().name  # the rest in the caller's thread


def test_an_empty_stream_yields_nothing():
    assert list(started_early(iter(()))) == []


def test_an_error_of_the_first_pull_reaches_the_caller():
    def items():
        raise RuntimeError("the stream failed to start")
        yield 0

    stream = started_early(items())
    with pytest.raises(RuntimeError, match="failed to start"):
        next(stream)


class _Dataset:
    """What ``rollout_batches`` reads of a Ray Data dataset: ``iter_batches``."""

    def __init__(self, batches):
        self.batches, self.calls = batches, []

    def iter_batches(self, **kwargs):
        self.calls.append(kwargs)
        yield from self.batches


def test_rollout_batches_reads_a_given_dataset_in_order_and_skips_empty_blocks():
    import numpy as np

    from asyncrl import records as R
    from asyncrl.rollouts import rollout_batches

    blocks = [
        {R.SAMPLE_ID: np.array([0, 1])},
        {R.SAMPLE_ID: np.array([], dtype=np.int64)},
        {R.SAMPLE_ID: np.array([2, 3])},
    ]
    ds = _Dataset(blocks)
    got = list(rollout_batches(2, ds))
    assert [b[R.SAMPLE_ID].tolist() for b in got] == [[0, 1], [2, 3]]
    assert all(b["consumed_at"].shape == (2,) for b in got)
    # one block per step, nothing read ahead (lock-step deadlocks otherwise), numpy columns
    assert ds.calls == [dict(batch_size=2, prefetch_batches=0, batch_format="numpy")]


def _made(log: list[int], n: int):
    for i in range(n):
        log.append(i)
        yield i


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)


@pytest.mark.parametrize("depth", [1, 3])
def test_run_ahead_yields_in_order_and_makes_at_most_depth_plus_one_ahead(depth):
    made: list[int] = []
    ahead = RunAhead(_made(made, 10), depth=depth)
    _wait_for(lambda: len(made) >= depth + 1)
    time.sleep(0.05)  # it would go on now if it were unbounded
    assert len(made) == depth + 1  # depth finished in the queue, one blocked handing over
    got = [next(ahead)]
    _wait_for(lambda: len(made) >= depth + 2)
    assert len(made) == depth + 2  # taking one lets it make exactly one more
    got += list(ahead)
    assert got == list(range(10))
    with pytest.raises(StopIteration):
        next(ahead)


def test_run_ahead_makes_items_in_its_own_thread():
    names: list[str] = []

    def items():
        for i in range(3):
            names.append(threading.current_thread().name)
            yield i

    assert list(RunAhead(items(), name="rollouts-test")) == [0, 1, 2]
    assert set(names) == {"rollouts-test"}


def test_run_ahead_raises_the_producers_error_after_the_items_before_it():
    class Refused(RuntimeError):
        pass

    def items():
        yield 0
        yield 1
        raise Refused("block 2 was refused admission")

    ahead = RunAhead(items(), depth=2)
    assert [next(ahead), next(ahead)] == [0, 1]
    with pytest.raises(Refused, match="block 2"):  # its own type, in the consumer's thread
        next(ahead)
    with pytest.raises(StopIteration):  # and nothing after it
        next(ahead)


def test_run_ahead_close_stops_the_thread_at_its_next_hand_off():
    made: list[int] = []
    ahead = RunAhead(_made(made, 1000), depth=1)
    assert next(ahead) == 0
    ahead.close(timeout_s=5.0)
    assert not ahead._thread.is_alive()
    assert len(made) <= 3  # it stopped instead of making all 1000
    with pytest.raises(StopIteration):
        next(ahead)


def test_run_ahead_rejects_a_depth_below_one():
    with pytest.raises(ValueError, match="depth"):
        RunAhead(iter(()), depth=0)
