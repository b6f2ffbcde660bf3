"""The learner's end of the rollout stream: this rank's rollout batches, in stream order.

Ray Train hands each learner worker its shard of the Ray Data stream (``asyncrl.pipeline``
builds it); ``rollout_batches`` reads it as numpy batches, ``started_early`` starts it while the
learner is still loading.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np

from asyncrl import records as R

T = TypeVar("T")


def rollout_batches(local_batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """This rank's blocks of the stream, in order, as numpy batches (empty ones skipped)."""
    import ray.train

    it = ray.train.get_dataset_shard("train").iter_batches(
        batch_size=local_batch_size, prefetch_batches=0, batch_format="numpy"
    )
    for batch in it:
        if len(batch[R.SAMPLE_ID]):
            batch = R.writable(batch)  # Ray Data's zero-copy arrays are read-only
            batch["consumed_at"] = np.full(len(batch[R.SAMPLE_ID]), time.time())
            yield batch


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
