"""``mem/*`` step metrics: resident memory of the run's processes and Ray object-store usage.

What a soak run watches for leaks: the learner process's RSS, the summed RSS of every Ray worker
process on the learner's node (generators, scorers, the PolicyStore, Ray Data's executor) and
the bytes the node's object store holds. The worker list and the store figures come from the
raylet's ``GetNodeStats`` (one local RPC; ``asyncrl.ray_internals.raylet_node_stats``, patch
``node_stats``). Ray has no public API for either figure, so a Ray version without it leaves those
two metrics out with one warning, while the learner's own RSS is always logged.

Sampled at most every ``every_s`` seconds (``telemetry.memory_every_s``), not every step: the
raylet RPC opens a gRPC channel per call and each worker's RSS is a /proc read: together a
noticeable share of a tiny model's learner step. A leak shows over minutes, not steps.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

MB = 1024.0 * 1024.0
LEARNER_RSS = "mem/learner_rss_mb"
WORKERS_RSS = "mem/ray_workers_rss_mb"
OBJECT_STORE = "mem/object_store_mb"


class MemoryProbe:
    """Samples the ``mem/*`` figures; one per learner rank 0."""

    def __init__(self, every_s: float = 0.0) -> None:
        import psutil

        self.process = psutil.Process()
        self.every_s = every_s
        self._last: float | None = None  # when the last sample was taken (monotonic)
        self._raylet: tuple[str, int] | None = None
        self._ray_failed = False

    def _node_stats(self) -> Any:
        import ray

        from asyncrl.ray_internals import raylet_node_stats

        if not ray.is_initialized():  # never start a Ray instance just to read its memory
            raise RuntimeError("this process is not connected to Ray")
        if self._raylet is None:
            me = ray.get_runtime_context().get_node_id()
            node = next(n for n in ray.nodes() if n["NodeID"] == me)
            self._raylet = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
        stats = raylet_node_stats(*self._raylet)
        if stats is None:
            raise RuntimeError("patch node_stats is off for the installed Ray (asyncrl.ray_internals)")
        return stats

    def due(self) -> bool:
        """Whether a sample is due: the first call, then once ``every_s`` has passed since the last."""
        return self._last is None or time.monotonic() - self._last >= self.every_s

    def sample(self) -> dict[str, float]:
        import psutil

        self._last = time.monotonic()
        out = {LEARNER_RSS: self.process.memory_info().rss / MB}
        if self._ray_failed:
            return out
        try:
            stats = self._node_stats()
        except Exception as err:  # a private Ray API: report once, keep training
            self._ray_failed = True
            warnings.warn(f"mem/* metrics of Ray workers are off: {err}", stacklevel=2)
            return out
        rss = 0
        for worker in stats.core_workers_stats:
            try:
                rss += psutil.Process(worker.pid).memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # exited between the listing and the read
        out[WORKERS_RSS] = rss / MB
        out[OBJECT_STORE] = stats.store_stats.object_store_bytes_used / MB
        return out
