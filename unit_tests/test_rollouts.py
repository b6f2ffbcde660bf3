"""``rollouts.started_early``: the rollout stream is started in a background thread while the
learner loads, and behaves like the plain iterator otherwise."""

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
