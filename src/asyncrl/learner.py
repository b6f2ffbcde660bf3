"""The learner: ``train_loop_per_worker`` for Ray Train, a recipe over the parts.

Per rollout batch (one Ray Data block per learner worker, in stream order)::

    keep = controllers.keep(...)                      the consumption gate, once per rollout batch
    for each of N mini-batches:                       train.minibatches (1 = one step per batch)
        loss_step(...)                                asyncrl.step: forward, loss, backward, step
        publish weights v+1, releasing the batch after its last step     asyncrl.coordinator
        observer.on_step: log the step, faults        asyncrl.observers (telemetry, fault hooks)
    checkpoint when due                               asyncrl.checkpoint.Checkpointer

With ``pipeline.colocate`` the stream holds prompt blocks, each generated and scored in this
process (``asyncrl.rollouts.colocated_rollouts``: in step at S = 0, else by a rollout thread).

Learner version ``v`` = optimizer steps applied; generators tag tokens with it, and a sample's
lag at consumption is ``v - version_first`` (bounded by ``BoundedStaleness``, asked, not read).
The math is in ``asyncrl.step`` (Ray-free, the same function users' own loops call); this module
wires it to the stream, the weight publication, the observer and checkpoints.

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

import torch

from asyncrl import checkpoint
from asyncrl import records as R
from asyncrl.backends import learner_backend
from asyncrl.collectives import Collectives
from asyncrl.config import RunConfig
from asyncrl.controllers import BoundedStaleness, build_chain
from asyncrl.coordinator import LearnerPublication, PolicyStoreClient
from asyncrl.estimators import build as build_estimator
from asyncrl.faults import NO_FAULTS, Faults
from asyncrl.observers import learner_observer
from asyncrl.provenance import ProvenanceCheck, ProvenanceError
from asyncrl.rollouts import Batch, StreamFailed, colocated_rollouts, rollout_batches, started_early
from asyncrl.step import NumericsGuard, StepOptions, StepParts, loss_step, sample_info, split_minibatches
from asyncrl.telemetry.steps import eval_due
from asyncrl.workloads.checkpoints import shared_tokenizer


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
    #: the rollout stream's factory (``asyncrl.pipeline.StreamFactory``) when this worker is the only
    #: learner: it builds its Ray Data stream itself at every (re)start, not through Ray Train's dataset
    #: integration, whose DatasetManager actor (a process that imports torch) the stream would wait
    #: for. None: Ray Train's shard (``datasets={"train": ...}``)
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
    # sympy first, in this thread: loading the model imports it (through torch), and a first
    # import racing another thread's once failed a soak run's learner start ("No module named
    # 'sympy.matrices.expressions.slice'"). Now, before the stream thread exists: the same 0.2 s.
    import sympy  # noqa: F401

    # built before the Learner publishes its first weights: building resets the PolicyStore's
    # books to the checkpoint the Learner loads (``PolicyStore.begin_stream``)
    dataset = spec.stream() if spec.stream is not None else None
    # the stream starts now, so its executor and the stage actors (a process each, seconds to
    # import torch and load a model) start while this worker loads its model and evaluates
    batches = started_early(rollout_batches(tc.batch_size // Collectives.current().world, dataset))
    w = Learner(spec)
    ahead = None
    if spec.colocated is not None:  # the stream holds prompt blocks: rollouts are made here
        model, local = w.parts.backend.module, w.weights.local  # see Learner.__init__ for local
        batches, ahead = colocated_rollouts(
            spec.colocated, batches, model=model, version=lambda: w.version, local=local
        )
    try:
        _steps(spec, w, batches, started_at)
    finally:
        if ahead is not None:  # at its next hand-off; a wait for admission ends as the store closes
            ahead.close()


def _steps(spec: LearnerSpec, w: Learner, batches: Iterator[Batch], started_at: float) -> None:
    tc = spec.cfg.train
    w.start(started_at)  # publish the starting weights (admission opens), then the step-0 eval
    if w.version >= tc.steps:  # resumed from the final checkpoint: nothing left to train
        w.finish()
        return
    for batch in batches:
        t_got = time.perf_counter()
        w.observer.on_batch()
        checked = w.provenance.check(batch)  # the weights each block was sampled with (asyncrl.provenance)
        keep = w.parts.controllers.keep(sample_info(batch), w.version)
        consumed = [0, 0]  # (trained, dropped) samples of the rollout batch
        for i, (mb, mb_keep) in enumerate(split_minibatches(batch, keep, tc.minibatches)):
            version = w.version
            extra = w.observer.before_step(mb, mb_keep, version, first=i == 0) | (checked if i == 0 else {})
            with w.observer.attempt(version + 1):  # faults.nonfinite_step
                result = loss_step(mb, w.parts, version, keep=mb_keep)
            extra |= w.observer.after_step(result)
            consumed = [c + n for c, n in zip(consumed, result.consumed)]
            t_computed = time.perf_counter()
            w.publish(result, consumed=tuple(consumed) if i == tc.minibatches - 1 else None)
            w.guard.update(result)
            extra |= w.weights.metrics
            w.observer.on_step(mb, result, version, t_got=t_got, t_computed=t_computed, extra=extra)
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
            options=StepOptions.from_config(cfg),
            comm=self.comm,
        )
        # the books: optimizer steps, samples trained and dropped, and the ledger of consumed sample ids
        ctrl, rank = self.parts.controllers, self.comm.rank
        restored = checkpoint.load(resume, rank=rank, backend=backend, controllers=ctrl) if resume else None
        self.version = restored.version if restored else 0
        self.counters = {"trained": 0, "dropped": 0} | (dict(restored.counters) if restored else {})
        self.ledger = [restored.ledger] if restored else []
        self.checkpoints = checkpoint.Checkpointer(
            self.comm, every=tc.checkpoint_every, steps=tc.steps, version=self.version,
            tokenizer=shared_tokenizer(spec.student_dir) if self.rank0 else None,
        )  # fmt: skip
        self.guard = NumericsGuard(tc.max_nonfinite_steps)
        pc, bound = cfg.pipeline, BoundedStaleness.from_config(cfg)
        store = PolicyStoreClient.connect(spec.namespace, timeout_s=pc.rpc_timeout_s, name=spec.store_name)
        #: the fingerprints of the versions a consumed block may carry (every rank checks its own)
        keep_fp = bound.kept_versions + bound.max_lag + 2 * tc.minibatches + 2
        self.provenance = ProvenanceCheck(pc.provenance, keep=keep_fp)
        #: a colocated rollout thread (S >= 1) reads its rank's own snapshots. Between an admission
        #: naming v and the thread's read of v this learner can finish the batch it trains and the one
        #: the thread handed over (``RunAhead`` depth 1): 2 N steps more than ``kept_versions``
        colocated = spec.colocated is not None
        keep = bound.kept_versions + 2 * tc.minibatches if colocated and not bound.synchronous else None
        #: the agreement eval reads the snapshot published at each eval step instead of copying again
        agreement = self.rank0 and bool(spec.agreement_prompts)
        self.weights = LearnerPublication(
            store, backend.module, self.provenance, rank0=self.rank0, colocated=colocated, local_keep=keep,
            keep_snapshot=(lambda v: eval_due(tc, v)) if agreement else None,
        )  # fmt: skip
        #: telemetry (the step log, gradient diagnostics) and fault injection, as one observer
        self.observer = learner_observer(
            spec, self.comm, backend, self.parts.estimator, resumed=restored,
            snapshots=self.weights.take_snapshot,
        )  # fmt: skip

    def start(self, started_at: float) -> None:
        """Publish the starting weights (admission opens), then evaluate them (a fresh run): the first
        rollout batch is made during the step-0 eval (colocated: after it in step, or beside it)."""
        self.weights.start(self.version)
        self.observer.on_start(self.version, started_at)

    def publish(self, result: Any, *, consumed: tuple[int, int] | None) -> None:
        """New weights after a step; ``consumed`` releases the rollout batch in the same call."""
        self.version = result.version
        self.weights.publish(self.version, stepped=result.stepped, consumed=consumed)

    def consumed(self, batch: Batch, counts: list[int]) -> None:
        """Books of a finished rollout batch: counts and the ledger of consumed sample ids (all ranks)."""
        self.counters["trained"] += counts[0]
        self.counters["dropped"] += counts[1]
        self.ledger.append(self.comm.all_cat(torch.from_numpy(batch[R.SAMPLE_ID])).numpy())

    def checkpoint(self, *, aborted: bool = False) -> None:
        self.observer.on_checkpoint()  # the sample rows the checkpoint's ledger keeps are on disk
        books = self.weights.books()  # rank 0: after every publication so far
        self.checkpoints.save(self.version, self.parts, self.ledger, self.counters, books, aborted=aborted)

    def abort(self) -> None:
        """Numerics guard: checkpoint (the skipped samples enter the ledger as dropped: a resume does
        not draw them), leave the reason in ``RUN/abort.json``, close; return normally (no restart)."""
        self.checkpoint(aborted=True)
        self.comm.barrier()
        if self.rank0:
            checkpoint.write_abort(self.spec.run_dir, self.guard)
        self.finish(aborted=True)

    def finish(self, *, aborted: bool = False) -> None:
        self.weights.close()
        self.observer.on_finish()
        steps = self.spec.cfg.train.steps
        if self.version < steps and not aborted:
            raise RuntimeError(
                f"the rollout stream ended after {self.version} of {steps} steps: too few prompts for the "
                f"drops seen (dropped {self.counters['dropped']}); raise workload.train_size"
            )
