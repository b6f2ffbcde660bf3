"""The learner: ``train_loop_per_worker`` for Ray Train, a recipe over the parts.

Per rollout batch (one Ray Data block per learner worker, in stream order)::

    keep = controllers.keep(...)                      the consumption gate, once per rollout batch
    for each of N mini-batches:                       train.minibatches (1 = one step per batch)
        loss_step(...)                                asyncrl.step: forward, loss, backward, step
        publish weights v+1, releasing the batch after its last step     asyncrl.coordinator
        log the step                                  asyncrl.telemetry.steps.StepLogger
    checkpoint when due                               asyncrl.checkpoint.Checkpointer

With ``pipeline.colocate`` the stream holds prompt blocks, and each one is generated and scored
in this process (``asyncrl.stages.Colocated``): at ``max_lag = 0`` from this worker's own model at
``v``, as it is taken; at ``max_lag >= 1`` by a rollout thread (``asyncrl.rollouts.RunAhead``)
with its own engine and the published weights, while the step runs.

Learner version ``v`` = optimizer steps applied; generators tag tokens with it, and a sample's
lag at consumption is ``v - version_first``. The math is in ``asyncrl.step`` (Ray-free, the same
function users' own loops call); this module wires it to the stream, the weight publication,
telemetry and checkpoints.

Restarts: every (re)start of the worker group loads the latest complete checkpoint of the run
directory, the same one the prompt stream was rebuilt from (``asyncrl.pipeline.StreamFactory``),
so the restored ledger and the stream agree: no sample is trained twice and none is skipped.
Numerics guard (``asyncrl.step.NumericsGuard``): a step whose loss or gradient is not finite is
skipped, its samples counted as dropped (``nonfinite``); ``train.max_nonfinite_steps`` in a row
stop the run with a checkpoint of the weights from before the first (unchanged: every bad step was
skipped) and the reason in ``RUN/abort.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl import checkpoint
from asyncrl import records as R
from asyncrl.backends import learner_backend
from asyncrl.collectives import Collectives
from asyncrl.config import RunConfig
from asyncrl.controllers import BoundedStaleness, build_chain
from asyncrl.coordinator import (
    PUBLISH_BYTES,
    PUBLISH_SNAPSHOT_S,
    BackgroundPublisher,
    LocalWeights,
    PolicyStoreClient,
    publishable_state,
)
from asyncrl.estimators import build as build_estimator
from asyncrl.faults import NO_FAULTS, Faults, InjectedNaN
from asyncrl.lora import policy_state, state_bytes
from asyncrl.provenance import ProvenanceCheck, ProvenanceError
from asyncrl.rollouts import RunAhead, StreamFailed, rollout_batches, started_early, taken
from asyncrl.step import NumericsGuard, StepOptions, StepParts, loss_step, sample_info, split_minibatches
from asyncrl.telemetry.gradients import LearnerGradients
from asyncrl.telemetry.steps import StepLogger


@dataclass(frozen=True)
class LearnerSpec:
    """Everything a Train worker needs (picklable)."""

    cfg: RunConfig
    controller_specs: list[tuple[str, dict[str, Any]]]
    student_dir: str
    run_dir: str
    namespace: str
    store_name: str
    eval_prompts: list[tuple[str, str]]  # (prompt, answer) held-out split
    #: the teacher checkpoint (None for RL) and, for prompts without answers, the held-out prompts'
    #: token ids the agreement eval scores against it (``asyncrl.plan.EvalPlan``)
    teacher_dir: str | None = None
    agreement_prompts: list[list[int]] | None = None
    faults: Faults = NO_FAULTS
    #: the rollout stream's factory (``asyncrl.pipeline.StreamFactory``) when this worker is the
    #: only learner: it builds its Ray Data stream itself at every (re)start, instead of through
    #: Ray Train's dataset integration, whose DatasetManager actor (a process that imports torch)
    #: the stream would otherwise wait for. None: Ray Train's shard (``datasets={"train": ...}``)
    stream: Callable[[], Any] | None = None
    #: ``pipeline.colocate``: the stages' arguments (``asyncrl.pipeline.StageSpecs``); this worker
    #: generates and scores its prompt blocks itself, on its own model (``asyncrl.stages.Colocated``)
    colocated: Any | None = None


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config["spec"]`` is a ``LearnerSpec``.

    Ray Train restarts the worker group after any worker error (``pipeline.max_learner_failures``),
    which is right for a dead worker and wrong for a stage that raised (``StreamFailed``): that one
    leaves a note (``checkpoint.write_stream_failure``) and the restarted group stops at once."""
    spec: LearnerSpec = config["spec"]
    started_at = time.time()
    note = checkpoint.read_abort(spec.run_dir)
    if note is not None and note["kind"] == "stream":  # the driver raises the note's message
        return
    try:
        _train(spec, started_at)
    except (StreamFailed, ProvenanceError) as err:  # every rank whose stream raised leaves the same note
        checkpoint.write_stream_failure(spec.run_dir, str(err))
        raise


def _train(spec: LearnerSpec, started_at: float) -> None:
    tc = spec.cfg.train
    # sympy first, in this thread: loading the model imports it (transformers' LlamaConfig pulls
    # it in through torch), and a first import racing another thread's once failed a soak run's
    # learner start with "No module named 'sympy.matrices.expressions.slice'" (a restart, no
    # data lost). Imported now, before the stream thread exists, it costs the same 0.2 s of CPU.
    import sympy  # noqa: F401

    # built before the Learner publishes its first weights: building resets the PolicyStore's
    # books to the checkpoint the Learner loads (``PolicyStore.begin_stream``)
    dataset = spec.stream() if spec.stream is not None else None
    # the stream starts now, so its executor and the stage actors (a process each, seconds to
    # import torch and load a model) start while this worker loads its model and evaluates
    batches = started_early(rollout_batches(tc.batch_size // Collectives.current().world, dataset))
    w = Learner(spec)
    ahead: RunAhead[dict[str, np.ndarray]] | None = None
    if spec.colocated is not None:  # the stream holds prompt blocks: rollouts are made here
        from asyncrl.stages import Colocated

        if w.local is None:  # in step, from this worker's model
            rollout = Colocated(spec.colocated, w.parts.backend.module)
            batches = (taken(rollout(prompts, w.version)) for prompts in batches)
        else:  # by a thread beside the step: its own engine, this rank's weights
            rollout = Colocated(spec.colocated, weights=w.local)
            ahead = RunAhead((rollout(prompts) for prompts in batches), depth=1)  # see Learner.local
            batches = (taken(b) for b in ahead)
    try:
        _steps(spec, w, batches, started_at)
    finally:
        if ahead is not None:  # at its next hand-off; a wait for admission ends as the store closes
            ahead.close()


def _steps(
    spec: LearnerSpec, w: Learner, batches: Iterator[dict[str, np.ndarray]], started_at: float
) -> None:
    tc = spec.cfg.train
    w.start()  # publish the starting weights (admission opens), then the step-0 eval
    w.steps.ready(started_at)
    if w.version >= tc.steps:  # resumed from the final checkpoint: nothing left to train
        w.finish()
        return
    for batch in batches:
        t_got = time.perf_counter()
        w.steps.first_batch()
        checked = w.provenance.check(batch)  # the weights each block was sampled with (asyncrl.provenance)
        keep = w.parts.controllers.keep(sample_info(batch), w.version)
        consumed = [0, 0]  # (trained, dropped) samples of the rollout batch
        for i, (mb, mb_keep) in enumerate(split_minibatches(batch, keep, tc.minibatches)):
            version = w.version
            extra = w.gradients.before(mb, mb_keep, version) | checked if i == 0 else {}
            with w.injected_nan(version + 1):
                result = loss_step(mb, w.parts, version, keep=mb_keep)
            extra |= w.gradients.after(result, w.parts.backend)
            consumed = [c + n for c, n in zip(consumed, result.consumed)]
            t_computed = time.perf_counter()
            w.publish(result, consumed=tuple(consumed) if i == tc.minibatches - 1 else None)
            w.steps.log(mb, result, version, t_got=t_got, t_computed=t_computed, extra=extra | w.published)
            w.guard.update(result)
            if w.rank0 and result.stepped:
                spec.faults.exit_if("learner_exit", w.version)
            t_got = time.perf_counter()
        w.consumed(batch, consumed)
        if w.guard.tripped:
            w.abort()
            return
        if w.checkpoints.due(w.version):
            w.checkpoint()
        if w.version >= tc.steps:
            break
    w.finish()


class Learner:
    """One Train worker's state: the step's parts, the store, the books, and the step log."""

    def __init__(self, spec: LearnerSpec) -> None:
        self.spec = spec
        cfg, tc = spec.cfg, spec.cfg.train
        torch.set_num_threads(cfg.pipeline.torch_threads)
        checkpoint.seed_rngs(cfg.seed)
        self.comm = Collectives.current()
        self.rank0 = self.comm.rank == 0
        # a fresh run, a resumed driver and a restarted worker group alike: the latest complete
        # checkpoint of this run directory (the driver removed those of an earlier run)
        resume = checkpoint.latest(spec.run_dir)
        model_dir = Path(resume, checkpoint.MODEL_DIR) if resume else Path(spec.student_dir)
        backend = learner_backend(
            cfg, model_dir, self.comm.world, checkpointed=resume is not None, base_dir=spec.student_dir
        )
        self.parts = StepParts(
            backend=backend,
            estimator=build_estimator(cfg.estimator.name, dict(cfg.estimator.options)),
            controllers=build_chain(spec.controller_specs),
            options=StepOptions(
                grad_clip=tc.grad_clip,
                logits_chunk=tc.logits_chunk,
                temperature=cfg.sampling.temperature,
                precision=tc.precision,
            ),
            comm=self.comm,
        )
        # the books: optimizer steps, samples trained and dropped, and the ledger of consumed sample ids
        self.version, self.counters, self.ledger = 0, {"trained": 0, "dropped": 0}, []
        restored = None
        if resume:
            ctrl = self.parts.controllers
            restored = checkpoint.load(resume, rank=self.comm.rank, backend=backend, controllers=ctrl)
            self.version = restored.version
            self.counters.update(restored.counters)
            self.ledger.append(restored.ledger)
        self.checkpoints = checkpoint.Checkpointer(
            self.comm, every=tc.checkpoint_every, steps=tc.steps, version=self.version
        )
        self.guard = NumericsGuard(tc.max_nonfinite_steps)
        self.injected_nan = InjectedNaN(spec.faults, backend.module)  # faults.nonfinite_step
        self.gradients = LearnerGradients(cfg, backend.module, self.parts.estimator, rank0=self.rank0)
        pc, bound = cfg.pipeline, BoundedStaleness.from_config(cfg)
        self.store = PolicyStoreClient.connect(
            spec.namespace, timeout_s=pc.rpc_timeout_s, name=spec.store_name
        )
        self.publisher = BackgroundPublisher(self.store) if self.rank0 else None
        #: a colocated rollout thread's weights (``pipeline.colocate``, ``max_lag >= 1``): every rank
        #: keeps its own snapshots and the store is told versions only. Between an admission naming
        #: version v and the thread's read of v, this learner can finish the batch it trains and the
        #: one the thread handed over (``RunAhead`` depth 1): 2 N steps (N = train.minibatches), so v
        #: is kept for that many steps on top of the store's own ``kept_versions``
        colocated_thread = spec.colocated is not None and not bound.synchronous
        keep = bound.kept_versions + 2 * tc.minibatches
        self.local = LocalWeights(keep=keep) if colocated_thread else None
        self.steps = StepLogger(spec, self.comm, backend.module, resumed=restored)
        #: the fingerprints of the versions a consumed block may carry (every rank checks its own)
        keep_fp = bound.kept_versions + bound.max_lag + 2 * tc.minibatches + 2
        self.provenance = ProvenanceCheck(pc.provenance, keep=keep_fp)
        self.published: dict[str, float] = {}  # the last publication's size and snapshot time (rank 0)

    def start(self) -> None:
        """Publish the starting weights (admission opens), then evaluate them (a fresh run): the
        first rollout batch is generated and scored while the step-0 eval runs, not after it
        (colocated lock-step: after it, in this process; a rollout thread: beside it)."""
        self.keep_local()
        self.provenance.record(self.version, policy_state(self.parts.backend.module))
        if self.rank0:
            self.store.start(self.weights(), self.version)
        self.steps.start(self.version)

    def publish(self, result: Any, *, consumed: tuple[int, int] | None) -> None:
        """Rank 0: new weights after a step; ``consumed`` releases the rollout batch in the same call.
        The snapshot is taken now; the put and the store call run in the publisher's thread. Every
        rank of a colocated run with a rollout thread first keeps its own snapshot (``local``)."""
        self.version = result.version
        if result.stepped:
            self.keep_local()
            self.provenance.record(self.version, policy_state(self.parts.backend.module))
        if self.rank0 and (result.stepped or consumed is not None):
            t0 = time.perf_counter()
            weights = self.weights()
            if weights is not None:
                self.published = {
                    PUBLISH_BYTES: float(state_bytes(weights)),
                    PUBLISH_SNAPSHOT_S: time.perf_counter() - t0,
                }
            self.publisher.submit(weights, self.version, consumed)

    def keep_local(self) -> None:
        """Every rank: this version's snapshot for the rollout thread of this process, if it has one."""
        if self.local is not None:
            self.local.put(self.version, publishable_state(self.parts.backend.module))

    def weights(self) -> dict[str, torch.Tensor] | None:
        """What the store ships to the engines; None in a colocated run: they sample from this
        model (in step) or read this process's ``LocalWeights`` (a rollout thread)."""
        return None if self.spec.colocated is not None else publishable_state(self.parts.backend.module)

    def consumed(self, batch: dict[str, np.ndarray], counts: list[int]) -> None:
        """Books of a finished rollout batch: counts and the ledger of consumed sample ids (all ranks)."""
        self.counters["trained"] += counts[0]
        self.counters["dropped"] += counts[1]
        self.ledger.append(self.comm.all_cat(torch.from_numpy(batch[R.SAMPLE_ID])).numpy())

    def checkpoint(self, *, aborted: bool = False) -> None:
        self.steps.flush()  # the sample rows the checkpoint's ledger keeps are on disk before it
        books = self.publisher.books() if self.rank0 else None  # after every publication so far
        self.checkpoints.save(self.version, self.parts, self.ledger, self.counters, books, aborted=aborted)

    def abort(self) -> None:
        """Numerics guard: checkpoint (always: the skipped samples enter the ledger as dropped, so a
        resume does not draw them again), leave the reason in ``RUN/abort.json`` and close. Returns
        normally, so Ray Train does not restart a run that would only fail the same way."""
        self.checkpoint(aborted=True)
        self.comm.barrier()
        if self.rank0:
            checkpoint.write_abort(self.spec.run_dir, self.guard)
        self.finish(aborted=True)

    def finish(self, *, aborted: bool = False) -> None:
        if self.rank0:
            self.publisher.close()
            self.store.close()
        self.steps.close()
        steps = self.spec.cfg.train.steps
        if self.version < steps and not aborted:
            raise RuntimeError(
                f"the rollout stream ended after {self.version} of {steps} steps: too few prompts for the "
                f"drops seen (dropped {self.counters['dropped']}); raise workload.train_size"
            )
