"""``ContinuousBatcher``: the rollouts of several blocks decoded together by one HF engine.

Why: with heavy-tailed completion lengths a block's decode batch empties long before its longest
row ends (``engine_options.compact`` drops the finished rows, but the step still runs for the few
that are left). At the sizes asyncrl's CPU engine serves, a decode step is mostly reading the
weights (a step with 8 live rows costs far less than 8 steps of one; BENCHMARKS.md, "Batching
headroom"), so the next block's rows can share those steps almost for free. A generator actor
that runs two blocks at once (Ray Data's ``max_concurrent_calls_per_actor``,
``pipeline.continuous_batching``) hands both to one batcher:
while block k's long tail decodes, block k+1's rows fill the batch beside it.

What stays as it was: each block is still one admission, one Ray Data call and one output block
of its own rows, so the books, the ordering rule, exactly-once and GRPO's groups are untouched;
each rollout keeps its own K/V buffers, slots, positions and generator stream
(``HFEngine.start_rollout``), so its draws depend only on its logits; a rollout's logits equal
its own ``step``'s to float rounding (``step_together``: one matmul over every live row, attention
per rollout).

What changes: the engine's weights are shared, so a block admitted with newer weights loads them
while older blocks are still decoding. That is an in-flight update for those (their later tokens
carry the new version; ``inflight_kv`` decides their prefix's K/V), which is why
``pipeline.continuous_batching`` requires ``pipeline.inflight_updates``. Weights change only
between a draw and the next step, as in ``HFEngine.generate``, so every token's version is the
version of the weights that computed its distribution.

One thread owns the engine: every load, prefill, step and draw runs in it, so the calling
threads (Ray Data's) only submit and wait.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.engines.llama_decode import step_together
from asyncrl.sampling import SamplingParams

#: ``load(version, state)``: put weights into the engine (the stage counts loads and injects faults)
Load = Callable[[int, Mapping[str, torch.Tensor]], None]
#: ``poll()``: newer published weights ``(version, state)``, or None (``coordinator.VersionWatch``)
Poll = Callable[[], "tuple[int, Mapping[str, torch.Tensor]] | None"]


@dataclass
class BatchedRollout:
    """What a ``submit`` resolves to: the ``RolloutEngine.generate`` columns, and how many of the
    rollout's decode steps there were and how many of them it shared with another rollout."""

    columns: dict[str, torch.Tensor]
    steps: int
    shared_steps: int

    @property
    def shared_frac(self) -> float:
        """The fraction of the rollout's decode steps that other rollouts' rows shared."""
        return self.shared_steps / self.steps if self.steps else 0.0


@dataclass
class _Request:
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    params: SamplingParams
    seed: int
    weights: tuple[int, Mapping[str, torch.Tensor]] | None
    future: Future


@dataclass(eq=False)  # compared and hashed by identity: one entry per rollout in flight
class _Active:
    rollout: Any  # HFEngine._Rollout
    future: Future
    steps: int = 0  # decode steps taken
    shared: int = 0  # of them, steps another rollout shared


_STOP = object()


class ContinuousBatcher:
    """Decode the rollouts submitted from any thread together, in one thread of its own.

    Args:
        engine: an ``HFEngine`` on its fast decode path (``LlamaDecoder``: the path whose steps can
            be fused; ``decode_path == "fast"``).
        load: how weights are loaded (default ``engine.load_weights``); called in the batcher's thread.
        poll: newer weights between steps (in-flight updates), asked every ``poll_every`` steps.

    ``submit`` returns a ``Future`` of a ``BatchedRollout``: the ``RolloutEngine.generate`` columns
    (``token_versions`` per token) and the rollout's shared steps. An error in one request's
    prefill (bad prompts) fails that request only; an error of the engine or of ``poll`` / ``load``
    (``EngineDeadError``) fails every request in flight and every later ``submit``: the engine's
    state is unknown, the caller restarts it.
    """

    def __init__(
        self,
        engine: Any,
        *,
        load: Load | None = None,
        poll: Poll | None = None,
        poll_every: int = 1,
        name: str = "asyncrl-batcher",
    ) -> None:
        if getattr(engine, "decode_path", None) != "fast":
            why = getattr(engine, "decode_reason", None) or "the engine has no fast decode path"
            raise ValueError(
                f"continuous batching fuses the decode steps of LlamaDecoder (HFEngine's fast path), which "
                f"cannot run this model: {why}; set pipeline.continuous_batching=false"
            )
        if poll_every < 1:
            raise ValueError(f"poll_every must be >= 1 decode steps, got {poll_every}")
        self.engine = engine
        self._load = load or (lambda version, state: engine.load_weights(state, version))
        self._poll = poll
        self.poll_every = poll_every
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        #: telemetry: fused steps taken, live rows summed over them, most rollouts in one step
        self.steps = 0
        self.rows_stepped = 0
        self.most_rollouts = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- the callers' side ---------------------------------------------------------------
    def submit(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        seed: int,
        weights: tuple[int, Mapping[str, torch.Tensor]] | None = None,
    ) -> Future:
        """Queue one rollout of left-padded prompts [B, P]; ``weights``: ``(version, state)`` the
        rollout must start with at least (loaded before its prefill unless the engine holds a
        version as new)."""
        fut: Future = Future()
        with self._lock:
            if self._error is not None:
                fut.set_exception(self._error)
                return fut
            self._queue.put(_Request(prompt_ids, prompt_mask, params, int(seed), weights, fut))
        return fut

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, *, seed: int
    ) -> dict[str, torch.Tensor]:
        """``RolloutEngine.generate`` through the batcher (waits for the result)."""
        return self.submit(prompt_ids, prompt_mask, params, seed=seed).result().columns

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the rollouts in flight, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def stats(self) -> dict[str, float]:
        """Mean live rows per fused step and the most rollouts that shared one."""
        return {
            "steps": float(self.steps),
            "rows_per_step": self.rows_stepped / self.steps if self.steps else 0.0,
            "most_rollouts": float(self.most_rollouts),
        }

    # --- the batcher's thread ----------------------------------------------------------------
    def _run(self) -> None:
        active: list[_Active] = []
        try:
            with torch.inference_mode():
                self._loop(active)
        except BaseException as err:  # the engine's state is unknown: fail everything, now and later
            with self._lock:
                self._error = err
                leftover = [a.future for a in active]
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not _STOP:
                        leftover.append(item.future)
            for fut in leftover:
                if not fut.done():
                    fut.set_exception(err)

    def _loop(self, active: list[_Active]) -> None:
        """Rounds of: weights (between the last draw and the next step), one fused step, the new
        rollouts' prefills, one draw for every rollout. ``active`` is updated in place, so that a
        failure can fail its futures."""
        stopping, rounds = False, 0
        while True:
            new: list[_Request] = []
            if not active:
                if stopping:
                    return
                item = self._queue.get()  # idle: wait for work
                if item is _STOP:
                    return
                new.append(item)
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                else:
                    new.append(item)
            rounds += 1
            fresh = self._update_weights(active, new, poll=bool(active) and rounds % self.poll_every == 0)
            stepping = [a for a in active if a not in fresh]
            if stepping:
                rollouts = [a.rollout for a in stepping]
                decs, toks, ts = (
                    [ro.dec for ro in rollouts],
                    [ro.tokens for ro in rollouts],
                    [ro.t for ro in rollouts],
                )
                shared = len(stepping) > 1
                started = time.perf_counter()
                fused = step_together(decs, toks, ts)
                self.engine.pace(started)  # HFEngine.step_latency_s: one fused step, one floor
                for a, logits in zip(stepping, fused):
                    a.rollout.logits = logits
                    a.steps += 1
                    a.shared += shared
                self.steps += 1
                self.rows_stepped += sum(int(tok.shape[0]) for tok in toks)
                self.most_rollouts = max(self.most_rollouts, len(stepping))
            for req in new:
                started = self._start(req, active)
                if started is not None:
                    active.append(_Active(started, req.future))
            still = []
            for a in active:
                if a.rollout.draw():
                    a.future.set_result(BatchedRollout(a.rollout.result(), a.steps, a.shared))
                else:
                    still.append(a)
            active[:] = still

    def _update_weights(self, active: list[_Active], new: list[_Request], *, poll: bool) -> set[_Active]:
        """Load the newest of the new requests' admission weights and (``poll``) the published
        ones, if newer than the engine's; switch the active rollouts to them. Returns the rollouts
        whose logits the switch recomputed (they take no step this round)."""
        offers = [r.weights for r in new if r.weights is not None]
        if poll and self._poll is not None:
            got = self._poll()
            if got is not None:
                offers.append(got)
        engine = self.engine
        before = engine.version
        if offers:
            version, state = max(offers, key=lambda o: o[0])
            if version > engine.version:  # only the newest: an older offer would be replaced at once
                self._load(version, state)
        if engine.version == before or not active:
            return set()
        engine.refresh_decoders([a.rollout.dec for a in active])
        return {a for a in active if a.rollout.switched(engine.version, engine.inflight_kv)}

    def _start(self, req: _Request, active: list[_Active]) -> Any | None:
        """Prefill ``req``'s prompts into a new rollout that shares the active rollouts' weights."""
        try:  # (in the thread's inference mode, ``_run``)
            ro = self.engine.start_rollout(
                req.prompt_ids, req.prompt_mask, req.params, seed=req.seed, track_versions=True
            )
        except (ValueError, TypeError) as err:  # this request's input: fail it alone
            req.future.set_exception(err)
            return None
        if active:
            ro.dec.adopt_weights(active[0].rollout.dec)
        return ro


__all__ = ["BatchedRollout", "ContinuousBatcher"]
