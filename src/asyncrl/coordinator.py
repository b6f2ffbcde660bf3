"""PolicyStore: the one named Ray actor that holds the latest weights, their version, and the
admission budget that bounds staleness.

Generators call ``acquire`` before they start an input block (it returns when the block is
admitted: in stream order, when the controller chain's ``admit`` says yes) and then load the
latest weights, or the version a controller pinned. The learner calls ``start`` once, then
``publish`` after every optimizer step, releasing the rollout batch in the same call after its
last step. Publishing *before* releasing is what makes ``max_lag = 0`` strictly on-policy: a
block admitted after step v finished always sees weights v+1.

Weights travel through the object store on CPU: the learner ``ray.put``s its state dict and
the store keeps only the reference (wrapped in a list so Ray does not resolve it). They travel
as raw byte buffers (``pack_weights``), which pickle 5 moves out of band: a plain copy into the
object store and out of it, where torch's own tensor pickling runs every tensor through
``torch.save`` (measured on the ``small`` student, 4.3 MB: 6.8 ms to pickle and 6.3 ms to
unpickle, against 0.1 ms and a 0.3 ms copy). ``pack_weights`` / ``unpack_weights`` are the
seam where NCCL / vLLM weight-transfer engines plug in.

Admission waits are event-driven: a waiting ``acquire`` re-evaluates its block whenever the
store's state changes (start, publish, an admission, close) and sleeps otherwise, so waiting
generators cost no CPU (a controller's ``admit`` is a function of the request it is given).

Every client call goes through ``PolicyStoreClient``, which puts a timeout on it and turns a
dead or silent store into a ``CoordinatorError`` that says what to check, never a hang.

**Streams and faults.** A prompt stream is one Ray Data dataset: the run's start, a driver
resume and every learner worker-group restart build a new one (``asyncrl.pipeline.StreamFactory``)
from the latest checkpoint, with block indices from 0 and the ledger's samples left out.
``begin_stream`` restores the admission books to that checkpoint, counts every sample drawn since
it as regenerated, closes admission until the restored learner calls ``start``, and returns the
stream's id; generators pass it with every ``acquire``, so a request left over from the dead
stream (its generator was killed mid-wait) is refused instead of taking the new stream's budget.

**Books.** Every sample drawn (admitted for generation, counting a block re-run after its
generator died as a second draw) ends trained, dropped, regenerated after a fault, or in flight
when the run ends: ``drawn = trained + dropped + regenerated + in_flight`` (``books``). With
``books_path`` the store rewrites them to that file on every change, so a resumed driver counts
the draws of the process that died after its last checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from asyncrl.controllers.admission import AdmissionBudget
from asyncrl.lora import policy_state, state_bytes
from asyncrl.tied import copy_once, tied_aliases

STORE_NAME = "asyncrl-policy-store"
#: metric keys of a weight publication (rank 0, per step): bytes shipped (a LoRA run's adapters only),
#: and seconds the learner's thread spent on the snapshot (the put and the store call run beside it)
PUBLISH_BYTES = "weights/publish_bytes"
PUBLISH_SNAPSHOT_S = "weights/snapshot_s"


class CoordinatorError(RuntimeError):
    """The PolicyStore did not answer in time, or raised; the message names the call."""


@ray.remote(num_cpus=0, max_concurrency=64)
class PolicyStore:
    """Async actor: published weights (object refs) by version, the admission books and the
    admission side of the controller chain.

    ``controller_specs``: the run's controller chain as ``(name, options)`` pairs, built here (its
    ``admit`` / ``behavior_version`` hooks decide admission; the learner builds its own copy for
    the other hooks). ``keep_versions``: how many past versions stay fetchable besides the latest
    (a pinning controller, e.g. fixed lag S with N mini-batches, needs S + N).
    """

    def __init__(
        self,
        controller_specs: list[tuple[str, dict[str, Any]]],
        batch_size: int,
        *,
        blocks_per_rollout: int = 1,
        versions_per_rollout: int = 1,
        keep_versions: int = 0,
        books_path: str | None = None,
        resume_books: bool = False,
    ) -> None:
        from asyncrl.controllers import build_chain

        self.budget = AdmissionBudget(
            build_chain(controller_specs),
            batch_size,
            blocks_per_rollout=blocks_per_rollout,
            versions_per_rollout=versions_per_rollout,
        )
        self.version = -1  # nothing published yet: admission waits for the learner's start
        self.weights: dict[int, Any] = {}  # version -> ObjectRef of a state dict
        self.keep_versions = keep_versions
        self._changed = asyncio.Event()  # set (and replaced) whenever admission may have changed
        self.closed = False
        self._wait_s = 0.0
        self.engine_deaths = 0
        self.stream = 0  # id of the current prompt stream (begin_stream)
        self.stream_version: int | None = None  # the checkpoint version the stream was built from
        self.retried = 0  # samples drawn again because their generator died mid-block
        self.learner_restarts = 0
        self.driver_resumes = 0
        self.books_path = books_path
        self.prior: dict[str, int] = {}  # the books of the driver process this one resumes
        if books_path and resume_books and Path(books_path).is_file():
            self.prior = json.loads(Path(books_path).read_text())
            self.retried = int(self.prior.get("retried", 0))
            self.learner_restarts = int(self.prior.get("learner_restarts", 0))
            self.driver_resumes = int(self.prior.get("driver_resumes", 0)) + 1

    async def acquire(
        self, n: int, block_index: int, stream: int | None = None, have: int | None = None
    ) -> dict[str, Any] | None:
        """Block until input block ``block_index`` (``n`` samples) of ``stream`` may start; None once
        closed, or once ``stream`` is not the current stream (a request left over from a restart).

        Returns ``{"ticket", "version", "expected_version", "behavior_version"}``: generate with
        the weights of ``behavior_version`` (pinned by a controller) or, when it is None, the
        latest. With ``have`` (the version the generator holds) the answer also carries
        ``"weights"``: ``(version, [ref])`` of the weights to load, or None if ``have`` is them,
        so admission and weights take one round trip. Blocks are admitted in stream order
        (``AdmissionBudget``); a retried block gets its admission back."""
        t0 = time.perf_counter()
        while True:
            if self.closed or (stream is not None and stream != self.stream):
                return None
            changed = self._changed
            if self.version >= 0:
                retries = self.budget.retries
                admission = self.budget.try_acquire(n, block_index)
                if admission is not None:
                    if self.budget.retries > retries:  # the block's generator died: drawn again
                        self.retried += n
                    self._write_books()
                    self._wait_s += time.perf_counter() - t0
                    self._notify()  # the next block in stream order may be admissible now
                    answer = {
                        "ticket": admission.ticket,
                        "version": admission.version,
                        "expected_version": admission.expected_version,
                        "behavior_version": admission.behavior_version,
                    }
                    if have is not None:
                        answer["weights"] = self._weights_for(admission.behavior_version, have)
                    return answer
            await changed.wait()

    def _weights_for(self, behavior: int | None, have: int) -> tuple[int, list[Any]] | None:
        """(version, [ref]) of the weights an admitted block is generated with (the pinned version,
        else the latest), or None when the generator already holds them."""
        if behavior is not None:
            return None if behavior == have else (behavior, self.weights_at(behavior))
        version, refs = self.latest(have)
        return None if refs is None else (version, refs)

    def _notify(self) -> None:
        """Wake every waiting ``acquire`` to re-evaluate (all methods run on the actor's event loop)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def begin_stream(self, state: dict[str, Any] | None) -> int:
        """A new prompt stream starts from the checkpoint whose coordinator state (``state_dict``)
        is ``state`` (None: from scratch). Samples drawn and not trained or dropped by that
        checkpoint count as regenerated; admission waits for the learner's ``start``. Returns the
        stream's id."""
        if self.stream > 0:
            self.learner_restarts += 1
        self.stream += 1
        self.version = -1
        drawn = max(self.budget.dispatched, int(self.prior.get("dispatched", 0)))
        if state:
            restored = dict(state["budget"])
        else:
            restored = {"version": 0, "dispatched": 0, "trained": 0, "dropped": 0}
        restored.setdefault("batch_size", self.budget.batch_size)
        restored["dispatched"] = max(int(restored["dispatched"]), drawn)
        restored["retries"] = max(int(restored.get("retries", 0)), self.budget.retries)
        self.budget.load_state_dict(restored)
        self.stream_version = int(restored["version"])
        self.prior = {}
        self._write_books()
        self._notify()  # requests of the old stream return None
        return self.stream

    def start(self, refs: list[Any], version: int) -> int:
        """The learner (re)starts at ``version`` with weights ``refs[0]``; the stream starts at block 0."""
        if self.stream_version is not None and version != self.stream_version:
            raise ValueError(
                f"the learner restored version {version} but prompt stream {self.stream} was built from the "
                f"checkpoint of version {self.stream_version}: both must read the same latest checkpoint"
            )
        self.weights = {version: refs[0]}
        self.version = version
        self.budget.start(version)
        self._notify()
        return version

    def publish(self, refs: list[Any], version: int, consumed: tuple[int, int] | None = None) -> int:
        """Store new weights at ``version`` (``refs[0]`` is an ObjectRef to a state dict), then, if
        ``consumed = (n_trained, n_dropped)``, release the rollout batch. One call, so no block is
        admitted between the new version and the release (their order is what makes S = 0
        lock-step)."""
        if version < self.version:
            raise ValueError(f"published version {version} is older than the current {self.version}")
        self.weights[version] = refs[0]
        self.version = version
        self.weights = {v: r for v, r in self.weights.items() if v >= version - self.keep_versions}
        self.budget.set_version(version)
        if consumed is not None:
            self.budget.on_consumed(*consumed)
            self._write_books()
        self._notify()
        return version

    def latest(self, have: int) -> tuple[int, list[Any] | None]:
        """(version, [ref]) if newer than ``have`` else (version, None)."""
        if self.version <= have or self.version not in self.weights:
            return self.version, None
        return self.version, [self.weights[self.version]]

    def weights_at(self, version: int) -> list[Any]:
        """[ref] of the weights published at ``version`` (a pinned behavior version)."""
        if version not in self.weights:
            raise KeyError(
                f"weights of version {version} are no longer kept (have {sorted(self.weights)}); "
                f"the PolicyStore keeps {self.keep_versions} past versions"
            )
        return [self.weights[version]]

    def close(self) -> None:
        """Stop admitting: blocked generators return and the stream drains."""
        self.closed = True
        self._notify()

    def current_stream(self) -> int:
        """The id of the current prompt stream (``begin_stream``): a colocated learner's generator
        tags its requests with it, so a request left over from a dead worker is never admitted."""
        return self.stream

    def engine_died(self) -> int:
        """A generator's engine died (it is about to restart); returns the run's death count."""
        self.engine_deaths += 1
        return self.engine_deaths

    def books(self) -> dict[str, int]:
        """Every sample drawn and where it ended: ``drawn = trained + dropped + regenerated + in_flight``."""
        b = self.budget
        return {
            "drawn": b.dispatched + self.retried,
            "trained": b.trained,
            "dropped": b.dropped,
            "regenerated": b.lost + self.retried,
            "in_flight": b.in_flight,
            # what a resumed driver needs to continue the books
            "dispatched": b.dispatched,
            "retried": self.retried,
            "learner_restarts": self.learner_restarts,
            "driver_resumes": self.driver_resumes,
        }

    def _write_books(self) -> None:
        if not self.books_path:
            return
        tmp = f"{self.books_path}.tmp"
        Path(tmp).write_text(json.dumps(self.books()))
        os.replace(tmp, self.books_path)

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "admission_wait_s": self._wait_s,
            "engine_deaths": self.engine_deaths,
            **{f"budget/{k}": v for k, v in self.budget.counters().items()},
            **{f"books/{k}": v for k, v in self.books().items()},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "budget": self.budget.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.budget.load_state_dict(state["budget"])
        self.version = -1  # admission resumes at the learner's start


class LocalWeights:
    """Weight versions handed from a learner worker to the rollout thread of its own process
    (``pipeline.colocate`` with ``max_lag >= 1``), instead of through the object store.

    The thread's engine needs the weights the store's admission names, and they are already in
    this process: every rank ``put``s its own snapshot (``publishable_state``: DDP replicas and
    ZeRO-1/2 hold the same full parameters after a step) and the store is told the version only.
    That saves packing, ``ray.put``, ``ray.get`` and unpacking on the two cores the step and the
    rollouts share. ``get`` waits for a version its rank has not put yet (rank 0 tells the store
    first; the other ranks finish the same step a moment later). Keeps the latest ``keep + 1``
    versions, as the store keeps ``keep`` past ones for a controller that pins one."""

    def __init__(self, keep: int = 0) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._versions: dict[int, Mapping[str, torch.Tensor]] = {}
        self._changed = threading.Condition()

    def put(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Version ``version`` (a snapshot nobody mutates); older ones beyond ``keep`` are dropped."""
        with self._changed:
            self._versions[version] = state_dict
            for old in [v for v in self._versions if v < version - self.keep]:
                del self._versions[old]
            self._changed.notify_all()

    def get(self, version: int, timeout_s: float) -> Mapping[str, torch.Tensor]:
        """The weights of ``version``, waiting up to ``timeout_s`` for this rank to put them."""
        with self._changed:
            ok = self._changed.wait_for(
                lambda: version in self._versions or any(v > version + self.keep for v in self._versions),
                timeout=timeout_s,
            )
            if version in self._versions:
                return self._versions[version]
            kept = sorted(self._versions)  # under the lock: the learner's thread may be putting
        why = "no longer kept" if ok else f"not put within {timeout_s:.0f}s"
        raise CoordinatorError(
            f"weights v{version} are {why} in this learner process (have {kept}, keeping {self.keep} "
            f"past versions): a colocated rollout thread reads the weights its own learner rank put"
        )


@dataclass
class PolicyStoreClient:
    """Timeout-guarded calls to the PolicyStore (usable from Ray Data actors and Train workers).

    ``local``: where weights the store only knows by version come from (a colocated rollout
    thread's learner process, ``LocalWeights``)."""

    handle: Any
    timeout_s: float = 60.0
    local: LocalWeights | None = None

    @classmethod
    def connect(
        cls,
        namespace: str,
        timeout_s: float = 60.0,
        name: str = STORE_NAME,
        local: LocalWeights | None = None,
    ) -> PolicyStoreClient:
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError as err:
            raise CoordinatorError(
                f"PolicyStore {name!r} not found in namespace {namespace!r}: the driver that created it "
                f"exited, or the pipeline was not started through asyncrl.pipeline"
            ) from err
        return cls(handle, timeout_s, local)

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return self._call_ref(getattr(self.handle, method).remote(*args), method, timeout_s=timeout_s)

    def _call_ref(self, ref: Any, method: str, *, timeout_s: float | None = None) -> Any:
        """The answer of a store call already sent (``ref``), with ``_call``'s timeout and errors."""
        try:
            return ray.get(ref, timeout=timeout_s if timeout_s is not None else self.timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise CoordinatorError(
                f"PolicyStore.{method} did not answer within {self.timeout_s:.0f}s "
                f"(pipeline.rpc_timeout_s): the store is overloaded or hung"
            ) from err
        except ray.exceptions.RayActorError as err:
            raise CoordinatorError(f"PolicyStore.{method} failed: the store actor died ({err})") from err

    def acquire(
        self, n: int, block_index: int, timeout_s: float, stream: int | None = None, have: int | None = None
    ) -> dict[str, Any] | None:
        """Waits for admission of input block ``block_index`` of ``stream``; ``timeout_s`` bounds a
        stalled learner (pipeline.no_progress_timeout_s). With ``have``, ``"weights"`` is
        ``(version, state_dict)`` of the weights to load first, or None (see ``PolicyStore.acquire``)."""
        admitted = self._call("acquire", n, block_index, stream, have, timeout_s=timeout_s)
        if admitted is not None and admitted.get("weights") is not None:
            version, refs = admitted["weights"]
            admitted["weights"] = (version, self._fetch(version, refs[0]))
        return admitted

    def begin_stream(self, state: dict[str, Any] | None) -> int:
        return self._call("begin_stream", state)

    def start(self, state_dict: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """The learner starts at ``version``; ``state_dict`` None: no engine reads weights from the
        store (``pipeline.colocate``: they sample from the learner's own model)."""
        self._call("start", [_put(state_dict)], version)

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor] | None,
        version: int,
        consumed: tuple[int, int] | None = None,
    ) -> None:
        self._call("publish", [_put(state_dict)], version, consumed)

    def _fetch(self, version: int, ref: Any) -> Mapping[str, torch.Tensor]:
        if ref is None and self.local is not None:
            return self.local.get(version, self.timeout_s)
        if ref is None:
            raise CoordinatorError(
                f"weights v{version} were not published: in a colocated run (pipeline.colocate) the engines "
                f"sample from the learner's own model, which holds the current version only"
            )
        try:
            return unpack_weights(ray.get(ref, timeout=self.timeout_s))
        except ray.exceptions.GetTimeoutError as err:
            raise CoordinatorError(
                f"fetching weights v{version} timed out after {self.timeout_s:.0f}s"
            ) from err

    def latest(self, have: int) -> tuple[int, Any | None]:
        version, refs = self._call("latest", have)
        return (version, None) if refs is None else (version, self._fetch(version, refs[0]))

    def weights_at(self, version: int) -> Any:
        return self._fetch(version, self._call("weights_at", version)[0])

    def close(self) -> None:
        self._call("close")

    def current_stream(self) -> int:
        return self._call("current_stream")

    def engine_died(self) -> int:
        return self._call("engine_died")

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)


class VersionWatch:
    """A generator's in-flight weight check (``pipeline.inflight_updates``): ``poll`` is the
    ``WeightsPoll`` an engine calls between decode steps.

    A check never waits on the store: it sends ``PolicyStore.latest(have)`` and returns; a later
    check reads the answer if it has come (``ray.wait`` with no timeout) and sends the next. So a
    decode step pays a few microseconds, newer weights are seen one store round trip after they
    are published, and only then fetched (the one blocking part: ``ray.get`` of the weights and
    their unpacking). ``have``: the version the engine holds; ``on_load(version)`` is called
    before the weights are handed to the engine (the stage counts loads and injects its faults).
    """

    def __init__(self, client: PolicyStoreClient, have: int) -> None:
        self.client = client
        self.have = have
        self._pending: Any = None
        self.checks = 0  # answers read
        self.loads = 0  # newer versions handed to the engine

    def poll(self) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """``(version, state_dict)`` of weights newer than ``have`` if the last check found them."""
        if self._pending is None:
            self._pending = self.client.handle.latest.remote(self.have)
            return None
        ready, _ = ray.wait([self._pending], timeout=0)
        if not ready:
            return None
        version, refs = self.client._call_ref(self._pending, "latest")
        self._pending = self.client.handle.latest.remote(max(self.have, version))
        self.checks += 1
        if refs is None or version <= self.have:
            return None
        state = self.client._fetch(version, refs[0])
        self.have = version
        self.loads += 1
        return version, state


def _put(state_dict: Mapping[str, torch.Tensor] | None) -> Any:
    """An object ref to the packed weights, or None (weights not published)."""
    return None if state_dict is None else ray.put(pack_weights(state_dict))


class BackgroundPublisher:
    """Publishes weights from a background thread, in submission order, so the learner's next
    step overlaps the object-store put and the store's round trip instead of waiting for them.

    ``submit`` takes a snapshot the caller no longer mutates (``publishable_state``
    copies). ``flush`` returns once every submitted publication is applied (call it before
    reading the store's books, e.g. for a checkpoint, and before ``close``). A failure in the
    thread is raised by the next ``submit`` or ``flush``; later submissions are not sent.
    Lock-step (``max_lag = 0``) is unaffected: the next block is admitted only by the publish
    that releases the batch, whichever thread sends it.
    """

    def __init__(self, client: PolicyStoreClient) -> None:
        self.client = client
        self._queue: queue.Queue[tuple[Any, int, tuple[int, int] | None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncrl-publisher", daemon=True)
        self._thread.start()

    def submit(
        self, state_dict: Mapping[str, torch.Tensor] | None, version: int, consumed: tuple[int, int] | None
    ) -> None:
        self._raise()
        self._queue.put((state_dict, version, consumed))

    def flush(self) -> None:
        self._queue.join()
        self._raise()

    def books(self) -> dict[str, Any]:
        """The store's books once every submitted publication is applied (what a checkpoint saves)."""
        self.flush()
        return self.client.state_dict()

    def close(self) -> None:
        """Flush, then stop the thread."""
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise CoordinatorError(f"publishing weights failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    self.client.publish(*item)
            except BaseException as err:  # handed to the learner's thread
                self._error = err
            finally:
                self._queue.task_done()


def publishable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the PolicyStore ships to engines: compact CPU copies of ``model.state_dict()``,
    tied keys sharing one copy (``asyncrl.tied``; qwen3's tied embedding and LM head are half the
    ``qwen-tiny`` student's keyed bytes).

    Engines live in other processes, maybe on other devices, hence CPU. A copy even on CPU: the
    publisher thread sends it while the next step updates the parameters in place.

    A LoRA student (``train.lora``, a peft model) publishes its adapter tensors only
    (``asyncrl.lora.adapter_state``): the engines hold the frozen base weights themselves.
    """
    return copy_once(policy_state(model), lambda v: v.detach().to("cpu", copy=True))


#: a packed tensor: (torch dtype name, shape, its bytes as a flat uint8 array), or the key of an
#: earlier entry it is tied to (the same tensor: its bytes travel once)
PackedTensor = tuple[str, tuple[int, ...], np.ndarray] | str


def pack_weights(state_dict: Mapping[str, torch.Tensor]) -> dict[str, PackedTensor]:
    """A CPU state dict as raw byte buffers, the form weights take in the object store (see the
    module docstring: numpy buffers travel out of band, torch tensors through ``torch.save``).
    Bytes rather than ``Tensor.numpy()`` so that dtypes numpy lacks (bfloat16) travel too. The
    buffers alias the tensors: ``ray.put`` copies them before it returns. A key tied to an earlier
    one (``asyncrl.tied.tied_aliases``) is packed as that key's name."""
    aliases = tied_aliases(state_dict)
    packed: dict[str, PackedTensor] = {}
    for key, t in state_dict.items():
        if key in aliases:
            packed[key] = aliases[key]
            continue
        t = t.detach().cpu().contiguous()
        packed[key] = (
            str(t.dtype).removeprefix("torch."),
            tuple(t.shape),
            t.reshape(-1).view(torch.uint8).numpy(),
        )
    return packed


def unpack_weights(packed: Mapping[str, PackedTensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``pack_weights``: writable tensors (one copy out of the read-only object store);
    tied keys get the same tensor, as they had when packed."""
    out: dict[str, torch.Tensor] = {}
    for key, entry in packed.items():
        if isinstance(entry, str):
            continue
        dtype, shape, data = entry
        if data.size == 0:  # an empty uint8 buffer cannot be viewed as a wider dtype
            out[key] = torch.empty(shape, dtype=getattr(torch, dtype))
            continue
        out[key] = torch.from_numpy(np.array(data)).view(getattr(torch, dtype)).reshape(shape)
    for key, entry in packed.items():
        if isinstance(entry, str):
            if entry not in out:
                raise ValueError(f"packed weights: {key!r} is tied to {entry!r}, which was not packed")
            out[key] = out[entry]
    return {key: out[key] for key in packed}  # the packed order


class LearnerPublication:
    """A learner worker's side of weight publication: rank 0 tells the PolicyStore each new version
    (the snapshot taken now, the put and the store call in a ``BackgroundPublisher`` thread, its
    size and snapshot time in ``metrics``); in a colocated run (``pipeline.colocate``) no weights
    travel: the engines sample from the learner's model (in step), or, with a rollout thread
    (``local_keep`` not None), every rank keeps its own snapshots in ``local`` (``LocalWeights``).
    Every rank records each version's fingerprint in ``provenance`` (``asyncrl.provenance``)."""

    def __init__(
        self,
        store: PolicyStoreClient,
        model: torch.nn.Module,
        provenance: Any,
        *,
        rank0: bool,
        colocated: bool,
        local_keep: int | None = None,
        keep_snapshot: Callable[[int], bool] | None = None,
    ) -> None:
        self.store, self.model, self.rank0, self.colocated = store, model, rank0, colocated
        self.provenance = provenance
        self.publisher = BackgroundPublisher(store) if rank0 else None
        self.local = LocalWeights(keep=local_keep) if local_keep is not None else None
        self.metrics: dict[str, float] = {}  # the last publication's size and snapshot time (rank 0)
        #: versions whose published snapshot another reader wants (the agreement eval): kept until taken
        self.keep_snapshot = keep_snapshot
        self._snapshot: tuple[int, dict[str, torch.Tensor]] | None = None

    def start(self, version: int) -> None:
        """The starting weights: admission opens."""
        self.keep_local(version)
        self.provenance.record(version, policy_state(self.model))
        if self.rank0:
            weights = self.weights()
            self._hold(version, weights)
            self.store.start(weights, version)

    def publish(self, version: int, *, stepped: bool, consumed: tuple[int, int] | None) -> None:
        """After a step (``stepped``) and/or releasing a rollout batch (``consumed``, in the same call)."""
        if stepped:
            self.keep_local(version)
            self.provenance.record(version, policy_state(self.model))
        if self.rank0 and (stepped or consumed is not None):
            t0 = time.perf_counter()
            weights = self.weights()
            if weights is not None:
                self.metrics = {
                    PUBLISH_BYTES: float(state_bytes(weights)),
                    PUBLISH_SNAPSHOT_S: time.perf_counter() - t0,
                }
                self._hold(version, weights)
            self.publisher.submit(weights, version, consumed)

    def _hold(self, version: int, weights: dict[str, torch.Tensor] | None) -> None:
        """Keep this publication's snapshot if asked for, else let go of an untaken one."""
        wanted = weights is not None and self.keep_snapshot is not None and self.keep_snapshot(version)
        self._snapshot = (version, weights) if wanted else None

    def take_snapshot(self, version: int) -> dict[str, torch.Tensor] | None:
        """Rank 0: the snapshot published as ``version`` if ``keep_snapshot`` asked for it (then
        released), else None. Nobody mutates it (the publisher thread reads it too), so a reader saves
        a second copy of the weights."""
        held, self._snapshot = self._snapshot, None
        return held[1] if held is not None and held[0] == version else None

    def keep_local(self, version: int) -> None:
        """Every rank: this version's snapshot for the rollout thread of this process, if it has one."""
        if self.local is not None:
            self.local.put(version, publishable_state(self.model))

    def weights(self) -> dict[str, torch.Tensor] | None:
        """What the store ships to the engines; None in a colocated run (see the class)."""
        return None if self.colocated else publishable_state(self.model)

    def books(self) -> dict[str, Any] | None:
        """Rank 0: the store's books after every publication so far (what a checkpoint saves)."""
        return self.publisher.books() if self.rank0 else None

    def close(self) -> None:
        if self.rank0:
            self.publisher.close()
            self.store.close()
