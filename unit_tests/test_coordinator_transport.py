"""The PolicyStore's Ray-free parts: the weights' wire format, the background publisher,
event-driven admission waits (the actor's class driven directly on an event loop), and the
in-process hand-off to a colocated rollout thread (``LocalWeights``)."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from asyncrl.coordinator import (
    BackgroundPublisher,
    CoordinatorError,
    LearnerPublication,
    LocalWeights,
    PolicyStore,
    PolicyStoreClient,
    pack_weights,
    unpack_weights,
)
from asyncrl.plan import controller_specs


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 5, generator=g),
        "half": torch.randn(3, 4, generator=g).bfloat16(),
        "scalar": torch.tensor(7),
        "empty": torch.zeros(0, 5),
        "transposed": torch.randn(4, 3, generator=g).t(),
        "flags": torch.tensor([True, False, True]),
        "f64": torch.randn(2, generator=g, dtype=torch.float64),
    }


def test_weights_round_trip_every_dtype_and_shape():
    state = _state()
    back = unpack_weights(pickle.loads(pickle.dumps(pack_weights(state), protocol=5)))
    assert back.keys() == state.keys()
    for key, t in state.items():
        assert back[key].dtype == t.dtype and back[key].shape == t.shape, key
        assert torch.equal(back[key], t), key


def test_packed_weights_travel_out_of_band():
    """The tensors' bytes leave pickle as out-of-band buffers (a plain copy into the object store),
    not through torch's own tensor pickling."""
    state = {"w": torch.randn(256, 256)}
    buffers: list[pickle.PickleBuffer] = []
    inband = pickle.dumps(pack_weights(state), protocol=5, buffer_callback=buffers.append)
    assert sum(memoryview(b).nbytes for b in buffers) == 256 * 256 * 4
    assert len(inband) < 1024


def test_unpacked_weights_are_writable_copies():
    packed = pack_weights({"w": torch.ones(3)})
    key_data = packed["w"][2]
    key_data.flags.writeable = False  # as when read from the object store
    back = unpack_weights(packed)
    back["w"].add_(1.0)  # no warning, no error: a copy
    assert float(back["w"].sum()) == 6.0


class _RecordingClient:
    def __init__(self, fail_at: int | None = None, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[int, tuple[int, int] | None]] = []
        self.fail_at = fail_at
        self.delay_s = delay_s
        self.thread_names: set[str] = set()

    def publish(self, state: dict, version: int, consumed: tuple[int, int] | None = None) -> None:
        time.sleep(self.delay_s)
        self.thread_names.add(threading.current_thread().name)
        if version == self.fail_at:
            raise CoordinatorError("the store actor died")
        self.calls.append((version, consumed))


def test_publisher_sends_in_order_off_the_caller_thread():
    client = _RecordingClient(delay_s=0.01)
    pub = BackgroundPublisher(client)
    t0 = time.perf_counter()
    for v in range(1, 6):
        pub.submit({}, v, (32, 0) if v % 2 else None)
    submitted = time.perf_counter() - t0
    pub.flush()
    assert client.calls == [(1, (32, 0)), (2, None), (3, (32, 0)), (4, None), (5, (32, 0))]
    assert submitted < 0.04  # submit does not wait for the 10 ms calls
    assert threading.current_thread().name not in client.thread_names
    pub.close()


def test_publisher_raises_a_failure_on_the_next_call_and_sends_nothing_after_it():
    client = _RecordingClient(fail_at=2)
    pub = BackgroundPublisher(client)
    pub.submit({}, 1, None)
    pub.submit({}, 2, None)
    with pytest.raises(CoordinatorError, match="publishing weights failed"):
        pub.flush()
    with pytest.raises(CoordinatorError):
        pub.submit({}, 3, None)
    assert client.calls == [(1, None)]


class _StoreClient(_RecordingClient):
    def start(self, state: dict, version: int) -> None:
        self.calls.append((version, None))

    def close(self) -> None:
        pass


class _NoProvenance:
    def record(self, version: int, state: object) -> None:
        pass


def test_publication_hands_the_published_snapshot_to_an_eval_once():
    """The agreement eval reads the weights published at an eval step (no second copy): the very
    tensors the store was sent, unchanged by later steps, given once, only for the version asked."""
    model = torch.nn.Linear(3, 2)
    client = _StoreClient()
    pub = LearnerPublication(
        client, model, _NoProvenance(), rank0=True, colocated=False, keep_snapshot=lambda v: v % 2 == 0
    )
    pub.start(0)
    snap0 = pub.take_snapshot(0)
    assert snap0 is not None and torch.equal(snap0["weight"], model.weight)
    assert pub.take_snapshot(0) is None  # given once: its memory is not held after the eval took it
    pub.publish(1, stepped=True, consumed=None)
    assert pub.take_snapshot(1) is None  # not an eval step
    with torch.no_grad():
        model.weight.add_(1.0)
    pub.publish(2, stepped=True, consumed=None)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step mutates the model in place
    assert pub.take_snapshot(3) is None  # another version's snapshot is never handed out
    pub.publish(4, stepped=True, consumed=None)
    snap4 = pub.take_snapshot(4)
    assert snap4 is not None and torch.equal(snap4["weight"], model.weight)
    assert snap4["weight"].data_ptr() != model.weight.data_ptr()
    assert not torch.equal(snap4["weight"], snap0["weight"])
    pub.close()
    assert [v for v, _ in client.calls] == [0, 1, 2, 4]
    colocated = LearnerPublication(
        _StoreClient(), model, _NoProvenance(), rank0=True, colocated=True, keep_snapshot=lambda v: True
    )
    colocated.start(0)
    assert colocated.take_snapshot(0) is None  # nothing published: the eval copies itself
    colocated.close()


def _store(max_lag: int):
    """The PolicyStore actor's class, without Ray (its methods run on one event loop, as in Ray)."""
    from asyncrl.config import load_config

    cfg = load_config(None, [f"pipeline.max_lag={max_lag}"])
    return PolicyStore.__ray_actor_class__(controller_specs(cfg), 4)


def test_admission_waits_wake_on_publish_without_polling():
    async def scenario() -> tuple[list, int]:
        store = _store(max_lag=0)
        calls = 0
        try_acquire = store.budget.try_acquire

        def counting(n: int, block: int):
            nonlocal calls
            calls += 1
            return try_acquire(n, block)

        store.budget.try_acquire = counting
        first = asyncio.ensure_future(store.acquire(4, 0))  # waits for the learner's start
        await asyncio.sleep(0.05)
        assert not first.done()
        store.start([object()], 0)
        got = [await asyncio.wait_for(first, 1.0)]
        second = asyncio.ensure_future(store.acquire(4, 1))  # lock-step: waits for the release
        await asyncio.sleep(0.2)
        assert not second.done()
        store.publish([object()], 1, (4, 0))
        got.append(await asyncio.wait_for(second, 1.0))
        return got, calls

    got, calls = asyncio.run(scenario())
    assert [g["ticket"] for g in got] == [0, 1]
    assert got[1]["version"] == 1  # admitted only after the new weights
    assert calls <= 4  # woken by changes, not a poll (a 2 ms poll makes ~100 calls in 0.2 s)


def test_admitting_a_block_wakes_the_next_in_stream_order():
    async def scenario() -> list[int]:
        store = _store(max_lag=2)
        later = asyncio.ensure_future(store.acquire(4, 1))  # not its turn until block 0 is admitted
        await asyncio.sleep(0.01)
        store.start([object()], 0)
        await asyncio.sleep(0.01)
        assert not later.done()
        first = await asyncio.wait_for(store.acquire(4, 0), 1.0)
        second = await asyncio.wait_for(later, 1.0)
        return [first["ticket"], second["ticket"]]

    assert asyncio.run(scenario()) == [0, 1]


def test_close_releases_waiting_generators():
    async def scenario() -> object:
        store = _store(max_lag=0)
        waiting = asyncio.ensure_future(store.acquire(4, 0))
        await asyncio.sleep(0.01)
        store.close()
        return await asyncio.wait_for(waiting, 1.0)

    assert asyncio.run(scenario()) is None


def test_pack_weights_rejects_nothing_numpy_lacks():
    """bfloat16 has no numpy dtype: it still packs (as bytes) and comes back bit-exact."""
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    dtype, shape, data = pack_weights({"x": t})["x"]
    assert (dtype, shape, data.dtype) == ("bfloat16", (3,), np.uint8)
    assert torch.equal(unpack_weights({"x": (dtype, shape, data)})["x"], t)


def test_admission_carries_the_weights_to_load():
    """One round trip: the admission names the weights (latest, or pinned) unless they are held."""

    async def scenario() -> list:
        store = _store(max_lag=2)
        v0, v1 = object(), object()
        store.start([v0], 0)
        got = [await store.acquire(4, 0, have=-1), await store.acquire(4, 1, have=0)]
        store.publish([v1], 1, None)
        got.append(await store.acquire(4, 2, have=0))
        got.append(await store.acquire(4, 3))  # without ``have``: admission only
        return [g.get("weights", "absent") for g in got], (v0, v1)

    weights, (v0, v1) = asyncio.run(scenario())
    assert weights == [(0, [v0]), None, (1, [v1]), "absent"]


def test_unpublished_weights_are_an_error_naming_colocate() -> None:
    """A colocated run publishes versions without weights (ref None): an engine that asks for them
    gets an error naming the setting, never an empty or stale state dict."""
    with pytest.raises(CoordinatorError, match=r"pipeline\.colocate"):
        PolicyStoreClient(handle=None)._fetch(3, None)


def test_local_weights_serve_a_rollout_thread_the_version_the_store_names() -> None:
    """A colocated rollout thread's client reads weights the store knows by version only (ref None)
    from its own learner process: the very snapshot put, the latest keep + 1 versions kept."""
    local = LocalWeights(keep=1)
    snaps = {v: {"w": torch.full((2,), float(v))} for v in range(4)}
    for v in range(4):
        local.put(v, snaps[v])
    client = PolicyStoreClient(handle=None, timeout_s=1.0, local=local)
    assert client._fetch(3, None) is snaps[3] and client._fetch(2, None) is snaps[2]
    with pytest.raises(CoordinatorError, match=r"v1 are no longer kept .*have \[2, 3\]"):
        client._fetch(1, None)


def test_local_weights_wait_for_their_rank_to_put_the_version() -> None:
    """Rank 0 tells the store v first; another rank's thread may ask before its own rank put v."""
    local = LocalWeights()
    local.put(0, {"w": torch.zeros(1)})
    later = {"w": torch.ones(1)}
    timer = threading.Timer(0.1, local.put, args=(1, later))
    timer.start()
    t0 = time.perf_counter()
    assert local.get(1, timeout_s=5.0) is later
    assert time.perf_counter() - t0 >= 0.05  # it waited for the put
    timer.join()
    with pytest.raises(CoordinatorError, match=r"v2 are not put within 0s"):
        local.get(2, timeout_s=0.01)
    with pytest.raises(ValueError, match="keep"):
        LocalWeights(keep=-1)
