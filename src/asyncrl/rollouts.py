"""The learner's end of the rollout stream: this rank's rollout batches, in stream order.

Ray Train hands each learner worker its shard of the Ray Data stream (``asyncrl.pipeline``
builds it; a single learner worker builds the whole stream itself); ``rollout_batches`` reads it
as numpy batches, ``started_early`` starts it while the learner is still loading, ``RunAhead``
makes a colocated run's rollouts in a thread beside the learner's step (``pipeline.colocate``
with ``max_lag >= 1``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from asyncrl import records as R

T = TypeVar("T")
Batch = dict[str, np.ndarray]  # one rollout (or prompt) block: column -> array


class StreamFailed(RuntimeError):
    """A stage of the rollout stream raised (Ray Data's ``UserCodeException``): the message is the
    stage's own exception. Not retried by restarting the learners (``checkpoint.write_stream_failure``)."""


#: how Python joins a chained exception's tracebacks (Ray keeps the remote one only as text)
_CAUSE_MARKER = "The above exception was the direct cause of the following exception:"


def _stage_exception(text: str) -> str | None:
    """The stage's own exception (``"ValueError: ..."``) from a ``RayTaskError``'s text: Ray Data
    raises ``UserCodeException("UDF failed ...") from err`` in the actor, and only the remote
    traceback's text crosses the process boundary (``__cause__`` does not pickle). That text is
    the chain, innermost first, joined by ``_CAUSE_MARKER``; the part before the
    ``UserCodeException`` ends with the stage's exception, after its last frame's source lines."""
    parts = text.split(_CAUSE_MARKER)
    at = next((i for i in range(1, len(parts)) if "UserCodeException" in parts[i]), None)
    if at is None:
        return None
    lines = parts[at - 1].rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if not frames:
        return None
    rest = lines[frames[-1] + 1 :]
    while rest and rest[0].startswith(" "):  # the frame's source line and its ^^^ markers
        rest.pop(0)
    found = "\n".join(rest).strip()
    return found or None


def stream_failure(err: BaseException) -> StreamFailed | None:
    """``err`` (raised by the stream's iterator) as a ``StreamFailed`` when a stage's code raised it,
    else None: a dead actor or a stalled stream stays what it is, and Ray Train may restart the learners."""
    from ray.exceptions import UserCodeException

    chain, seen = err, set()
    while chain is not None and id(chain) not in seen:
        if isinstance(chain, UserCodeException):
            found = _stage_exception(str(chain))  # else all of Ray's text, on one line
            return StreamFailed(found or " ".join(str(chain).split()) or type(chain).__name__)
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__
    return None


def rollout_batches(local_batch_size: int, dataset: Any = None) -> Iterator[dict[str, np.ndarray]]:
    """This rank's blocks of the stream, in order, as numpy batches (empty ones skipped); a stage's
    exception arrives as ``StreamFailed``. ``dataset``: the whole stream, built by this (only)
    learner worker; None: Ray Train's shard of it (``get_dataset_shard("train")``)."""
    if dataset is None:
        import ray.train

        dataset = ray.train.get_dataset_shard("train")
    it = iter(dataset.iter_batches(batch_size=local_batch_size, prefetch_batches=0, batch_format="numpy"))
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as err:
            failed = stream_failure(err)
            if failed is None:
                raise
            raise failed from err
        if len(batch[R.SAMPLE_ID]):
            yield taken(R.writable(batch))  # Ray Data's zero-copy arrays are read-only


def taken(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``batch`` stamped with the time the learner took it (``consumed_at``, a sample's last hop)."""
    batch["consumed_at"] = np.full(len(batch[R.SAMPLE_ID]), time.time())
    return batch


def colocated_rollouts(
    stages: Any,
    prompts: Iterator[dict[str, np.ndarray]],
    *,
    model: Any,
    version: Callable[[], int],
    local: Any,
) -> tuple[Iterator[dict[str, np.ndarray]], RunAhead[dict[str, np.ndarray]] | None]:
    """A colocated learner's rollout batches from its prompt blocks (``asyncrl.stages.Colocated``,
    ``stages``: the pipeline's ``StageSpecs``), and the thread that makes them (None: in step).
    ``local`` None: in step, from the learner's ``model`` at ``version()`` as each block is taken;
    else by a thread beside the step (``RunAhead`` depth 1), on its own engine reading this rank's
    weights (``LocalWeights``)."""
    from asyncrl.stages import Colocated

    if local is None:
        rollout = Colocated(stages, model)
        return (taken(rollout(p, version())) for p in prompts), None
    rollout = Colocated(stages, weights=local)
    ahead = RunAhead((rollout(p) for p in prompts), depth=1)
    return (taken(b) for b in ahead), ahead


def started_early(items: Iterator[T]) -> Iterator[T]:
    """``items``, whose first item is pulled now in a background thread (the rest in the caller's).

    Pulling the first batch starts the Ray Data stream; it arrives once the learner has published
    its first weights, so the thread waits for that while the caller gets on with its start-up."""
    box: dict[str, Any] = {}

    def pull() -> None:
        try:
            box["item"] = next(items)
        except BaseException as err:  # StopIteration included: handed to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=pull, name="asyncrl-stream-start", daemon=True)
    thread.start()

    def rest() -> Iterator[T]:
        thread.join()
        if isinstance(box.get("error"), StopIteration):
            return
        if "error" in box:
            raise box["error"]
        yield box["item"]
        yield from items

    return rest()


class RunAhead(Iterator[T]):
    """``items`` produced by a background thread, at most ``depth`` finished ones ahead of the
    consumer (plus the one it is making): a colocated learner's rollout thread.

    Why a thread: with ``pipeline.colocate`` and ``max_lag >= 1`` the learner's process both makes
    rollouts (generation + scoring) and trains; torch releases the GIL inside its kernels, so
    the two overlap on two cores in one process, with no stage actors or hand-offs. The staleness
    bound is not this queue's: every block still waits for the PolicyStore's admission (``S``).

    An exception raised by ``items`` reaches the consumer at the item where it was raised, with
    its own type (``StreamFailed``, ``CoordinatorError``, ...); ``close`` stops the thread at its
    next hand-off (it is a daemon: a thread blocked inside ``items`` ends with the process)."""

    def __init__(self, items: Iterator[T], *, depth: int = 1, name: str = "asyncrl-rollouts") -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._pull, args=(items,), name=name, daemon=True)
        self._thread.start()

    def _put(self, item: tuple[bool, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _pull(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                if not self._put((True, item)):
                    return
        except BaseException as err:  # handed to the consumer's thread, raised there
            self._put((False, err))
            return
        self._put((False, None))

    def __iter__(self) -> RunAhead[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        ok, item = self._queue.get()
        if ok:
            return item
        self._done = True
        if item is None:
            raise StopIteration
        raise item

    def close(self, timeout_s: float = 0.0) -> None:
        """Stop the thread at its next hand-off; wait up to ``timeout_s`` for it (0: do not wait;
        a thread blocked inside ``items`` may only end once what blocks it does)."""
        self._done = True
        self._stop.set()
        if timeout_s > 0:
            self._thread.join(timeout_s)
