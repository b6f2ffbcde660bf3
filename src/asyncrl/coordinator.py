"""PolicyStore: the one named Ray actor that holds the latest weights, their version, and the
admission budget that bounds staleness.

Generators call ``acquire`` before they start a batch (it returns when the budget admits the
batch) and ``latest`` to reload weights when the version moved. The learner calls
``publish`` after every optimizer step and then ``consumed`` to release budget. Publishing
*before* releasing is what makes ``max_lag = 0`` strictly on-policy: a batch admitted after
step v finished always sees weights v+1.

Weights travel through the object store on CPU: the learner ``ray.put``s its state dict and
the store keeps only the reference (wrapped in a list so Ray does not resolve it). The
``WeightTransport`` seam is where NCCL / vLLM weight-transfer engines plug in.

Every client call goes through ``PolicyStoreClient``, which puts a timeout on it and turns a
dead or silent store into a ``CoordinatorError`` that says what to check, never a hang.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import ray

from asyncrl.controllers.admission import AdmissionBudget

STORE_NAME = "asyncrl-policy-store"


class CoordinatorError(RuntimeError):
    """The PolicyStore did not answer in time, or raised; the message names the call."""


@ray.remote(num_cpus=0, max_concurrency=64)
class PolicyStore:
    """Async actor: weights (object ref), version, admission budget, sample ledger counts."""

    def __init__(self, max_lag: int, batch_size: int, admit_poll_s: float = 0.002) -> None:
        self.budget = AdmissionBudget(max_lag=max_lag, batch_size=batch_size)
        self.version = -1  # no weights published yet: admission waits for the first publish
        self.weights_ref: Any = None
        self.admit_poll_s = admit_poll_s
        self.closed = False
        self._wait_s = 0.0
        self.engine_deaths = 0

    async def acquire(self, n: int, key: int | None = None) -> tuple[int, int] | None:
        """Block until ``n`` samples may start; return (ticket, version) or None once closed.

        ``key`` names the input block: a retry of an admitted block (its actor died and Ray Data
        re-ran it) gets the same ticket back at once and takes no new budget."""
        t0 = time.perf_counter()
        while True:
            if self.closed:
                return None
            if self.version >= 0:
                ticket = self.budget.try_acquire(n, self.version, key=key)
                if ticket is not None:
                    self._wait_s += time.perf_counter() - t0
                    return ticket, self.version
            await asyncio.sleep(self.admit_poll_s)

    def publish(self, refs: list[Any], version: int) -> int:
        """Store new weights (``refs[0]`` is an ObjectRef to a state dict) at ``version``."""
        if version < self.version:
            raise ValueError(f"published version {version} is older than the current {self.version}")
        self.weights_ref = refs[0]
        self.version = version
        self.budget.set_version(version)
        return version

    def latest(self, have: int) -> tuple[int, list[Any] | None]:
        """(version, [ref]) if newer than ``have`` else (version, None)."""
        if self.version <= have or self.weights_ref is None:
            return self.version, None
        return self.version, [self.weights_ref]

    def consumed(self, n_trained: int, n_dropped: int) -> None:
        self.budget.on_consumed(n_trained, n_dropped)

    def close(self) -> None:
        """Stop admitting: blocked generators return and the stream drains."""
        self.closed = True

    def engine_died(self) -> int:
        """A generator's engine died (it is about to restart); returns the run's death count."""
        self.engine_deaths += 1
        return self.engine_deaths

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "admission_wait_s": self._wait_s,
            "engine_deaths": self.engine_deaths,
            **{f"budget/{k}": v for k, v in self.budget.counters().items()},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "budget": self.budget.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.budget.load_state_dict(state["budget"])
        self.version = -1  # admission resumes at the learner's first publish


@dataclass
class PolicyStoreClient:
    """Timeout-guarded calls to the PolicyStore (usable from Ray Data actors and Train workers)."""

    handle: Any
    timeout_s: float = 60.0

    @classmethod
    def connect(cls, namespace: str, timeout_s: float = 60.0, name: str = STORE_NAME) -> PolicyStoreClient:
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError as err:
            raise CoordinatorError(
                f"PolicyStore {name!r} not found in namespace {namespace!r}: the driver that created it "
                f"exited, or the pipeline was not started through asyncrl.pipeline"
            ) from err
        return cls(handle, timeout_s)

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        ref = getattr(self.handle, method).remote(*args)
        try:
            return ray.get(ref, timeout=timeout_s if timeout_s is not None else self.timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise CoordinatorError(
                f"PolicyStore.{method} did not answer within {self.timeout_s:.0f}s "
                f"(pipeline.rpc_timeout_s): the store is overloaded or hung"
            ) from err
        except ray.exceptions.RayActorError as err:
            raise CoordinatorError(f"PolicyStore.{method} failed: the store actor died ({err})") from err

    def acquire(self, n: int, timeout_s: float, key: int | None = None) -> tuple[int, int] | None:
        """Waits for admission; ``timeout_s`` bounds a stalled learner (pipeline.no_progress_timeout_s).
        ``key`` identifies the input block, so a retried block keeps its admission."""
        return self._call("acquire", n, key, timeout_s=timeout_s)

    def publish(self, state_dict: dict[str, Any], version: int) -> None:
        self._call("publish", [ray.put(state_dict)], version)

    def latest(self, have: int) -> tuple[int, Any | None]:
        version, refs = self._call("latest", have)
        if refs is None:
            return version, None
        try:
            return version, ray.get(refs[0], timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise CoordinatorError(
                f"fetching weights v{version} timed out after {self.timeout_s:.0f}s"
            ) from err

    def consumed(self, n_trained: int, n_dropped: int) -> None:
        self._call("consumed", n_trained, n_dropped)

    def close(self) -> None:
        self._call("close")

    def engine_died(self) -> int:
        return self._call("engine_died")

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)
