"""``rollouts.started_early``: the rollout stream is started in a background thread while the
learner loads, and behaves like the plain iterator otherwise. ``rollouts.rollout_batches`` over a
stream the (single) learner worker built itself."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl.rollouts import started_early


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
