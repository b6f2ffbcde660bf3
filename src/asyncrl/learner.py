"""The learner: ``train_loop_per_worker`` for Ray Train, a recipe over the parts.

Per rollout batch (one Ray Data block per learner worker, in stream order)::

    keep = controllers.keep(...)                      the consumption gate, once per rollout batch
    for each of N mini-batches:                       train.minibatches (1 = one step per batch)
        loss_step(...)                                asyncrl.step: forward, loss, backward, step
        publish weights v+1 (release the batch after its last step)
        log the step (rank 0)
    checkpoint when due

Learner version ``v`` = optimizer steps applied; generators tag tokens with it, and a sample's
lag at consumption is ``v - version_first``. The math is in ``asyncrl.step`` (Ray-free, the same
function users' own loops call); this module adds data movement, weight publication,
telemetry and checkpoints.

Restarts: every (re)start of the worker group loads the latest complete checkpoint of the run
directory (``asyncrl.checkpoint.latest``), the same one the prompt stream was rebuilt from
(``asyncrl.pipeline.StreamFactory``), so the restored ledger and the stream agree: no sample is
trained twice and none is skipped. Numerics guard: ``loss_step`` skips a step whose loss or
gradient is not finite; its samples count as dropped (``nonfinite``) and after
``train.max_nonfinite_steps`` such steps in a row the run stops with a checkpoint of the weights
from before the first (they are unchanged: every bad step was skipped).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from asyncrl import checkpoint
from asyncrl import records as R
from asyncrl.backends import make_backend
from asyncrl.collectives import Collectives
from asyncrl.config import RunConfig
from asyncrl.controllers import build_chain
from asyncrl.estimators import build as build_estimator
from asyncrl.faults import NO_FAULTS, Faults
from asyncrl.step import StepOptions, StepParts, loss_step, sample_info, split_minibatches
from asyncrl.telemetry import names as N
from asyncrl.telemetry.gradients import GradientProbe, GradientTrace
from asyncrl.telemetry.steps import bucket_metrics, sample_rows, step_metrics

T = TypeVar("T")


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
    faults: Faults = NO_FAULTS


#: written by rank 0 when the numerics guard stops the run; the driver turns it into the run's error
ABORT_FILE = "abort.json"


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config["spec"]`` is a ``LearnerSpec``."""
    spec: LearnerSpec = config["spec"]
    tc = spec.cfg.train
    started_at = time.time()
    # the stream starts now, so its executor and the stage actors (a process each, seconds to
    # import torch and load a model) start while this worker loads its model and evaluates
    batches = started_early(rollout_batches(tc.batch_size // Collectives.current().world))
    w = Learner(spec)
    w.start()  # publish the starting weights: admission opens
    w.marks = {N.LEARNER_START_AT: started_at, N.LEARNER_READY_AT: time.time()}
    if w.version >= tc.steps:  # resumed from the final checkpoint: nothing left to train
        w.finish()
        return
    for batch in batches:
        t_got = time.perf_counter()
        if w.marks is not None:
            w.marks.setdefault(N.FIRST_BATCH_AT, time.time())
        keep = w.parts.controllers.keep(sample_info(batch), w.version)
        n_mb = tc.minibatches
        consumed = [0, 0]  # (trained, dropped): a non-finite step trains none of its samples
        for i, (mb, mb_keep) in enumerate(split_minibatches(batch, keep, n_mb)):
            version = w.version
            extra = w.probe_gradients(mb, mb_keep, version) if i == 0 else {}
            with w.injected_nan(version + 1):
                result = loss_step(mb, w.parts, version, keep=mb_keep)
            extra |= w.trace_gradients(result)
            trained = 0 if result.nonfinite else result.n_kept
            consumed[0] += trained
            consumed[1] += result.n_dropped + result.n_kept - trained
            t_computed = time.perf_counter()
            w.publish(result, consumed=tuple(consumed) if i == n_mb - 1 else None)
            w.log(mb, result, version, t_got=t_got, t_computed=t_computed, extra=extra)
            w.numerics(result)
            if w.rank0 and result.stepped:
                spec.faults.exit_if("learner_exit", w.version)
            t_got = time.perf_counter()
        w.consumed(batch, consumed)
        if w.numerics_abort():
            w.abort()
            return
        if w.checkpoint_due():
            w.checkpoint()
        if w.version >= tc.steps:
            break
    w.finish()


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


class Learner:
    """One Train worker's state: the step's parts, the store, the books, and rank 0's writers."""

    def __init__(self, spec: LearnerSpec) -> None:
        import ray.train.torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from asyncrl.coordinator import BackgroundPublisher, PolicyStoreClient

        self.spec = spec
        cfg = self.cfg = spec.cfg
        tc, pc = cfg.train, cfg.pipeline
        torch.set_num_threads(pc.torch_threads)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        self.comm = Collectives.current()
        self.rank0 = self.comm.rank == 0
        # a fresh run, a resumed driver and a restarted worker group alike: the latest complete
        # checkpoint of this run directory (the driver removed those of an earlier run)
        resume = checkpoint.latest(spec.run_dir)
        model_dir = Path(resume, checkpoint.MODEL_DIR) if resume else Path(spec.student_dir)
        # a run directory's weights are read as safetensors only (never unpickled)
        safe = {"use_safetensors": True} if resume else {}
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=torch.float32, **safe
        )
        # pipeline.device=cuda: this worker's GPU (Ray Train sets CUDA_VISIBLE_DEVICES and the index)
        device = ray.train.torch.get_device() if pc.device == "cuda" else torch.device("cpu")
        if pc.backend == "deepspeed":
            os.environ["DS_ACCELERATOR"] = (
                pc.device
            )  # DeepSpeed picks its accelerator (and NCCL/gloo) from it
        # eval mode: the engines sample without dropout, so pi_theta must be computed without it too,
        # or lag-0 importance ratios are not 1 (gradients flow in eval mode all the same)
        model.to(device).eval()
        backend = make_backend(
            pc.backend,
            model,
            tc,
            self.comm.world,
            zero_stage=pc.zero_stage,
            # DeepSpeed's JIT-op build cache goes with the model cache (absolute path), else its default
            extensions_dir=str(Path(cfg.workload.cache_dir, "torch_extensions")),
        )
        self.parts = StepParts(
            backend=backend,
            estimator=build_estimator(cfg.estimator.name, dict(cfg.estimator.options)),
            controllers=build_chain(spec.controller_specs),
            options=StepOptions(
                grad_clip=tc.grad_clip, logits_chunk=tc.logits_chunk, temperature=cfg.sampling.temperature
            ),
            comm=self.comm,
        )
        tel = cfg.telemetry
        # gradient telemetry (rank 0; gradients are all-reduced): asyncrl.telemetry.gradients
        self.probe = (
            GradientProbe(backend.module, self.parts.estimator, cfg.sampling.temperature)
            if tel.grad_reference == "dense" and self.rank0
            else None
        )
        self.trace = GradientTrace() if tel.grad_cos_prev and self.rank0 else None
        self.version = 0
        self.counters = {"trained": 0, "dropped": 0}
        self.ledger: list[np.ndarray] = []
        if resume:
            restored = checkpoint.load(
                resume, rank=self.comm.rank, backend=backend, controllers=self.parts.controllers
            )
            self.version = restored.version
            self.counters.update(restored.counters)
            self.ledger.append(restored.ledger)
        self.last_checkpoint = self.version
        self.nonfinite_streak = 0  # optimizer steps in a row skipped for non-finite numbers
        self.first_bad_step: int | None = None
        self.nan_left = 0  # injected NaN attempts still to come (faults.nonfinite_step)
        self.store = PolicyStoreClient.connect(
            spec.namespace, timeout_s=pc.rpc_timeout_s, name=spec.store_name
        )
        self.publisher = BackgroundPublisher(self.store) if self.rank0 else None
        self.pending: dict[str, float] = {}  # figures of consumptions without a step, logged with the next
        #: start-up marks (names.STARTUP_MARKS), logged with this process's first step, then None
        self.marks: dict[str, float] | None = {}
        self.pending_extra: dict[str, float] = {}  # gradient figures of a batch that took no step
        # the driver shows progress by following metrics.jsonl (asyncrl.telemetry.progress)
        self.writer = self.evaluator = self.memory = None
        if self.rank0:
            from asyncrl.telemetry.memory import MemoryProbe
            from asyncrl.telemetry.sinks import RunWriter

            self.writer = RunWriter(
                spec.run_dir,
                tensorboard=cfg.telemetry.tensorboard,
                resume=resume is not None,
                truncate_after_step=self.version,
                keep_sample_ids=np.concatenate(self.ledger) if self.ledger else None,
            )
            self.memory = MemoryProbe()
            tokenizer = AutoTokenizer.from_pretrained(spec.student_dir, local_files_only=True)
            self.evaluator = Evaluator(cfg, tokenizer, spec.eval_prompts)
        self.eval_time = 0.0
        self.t_run0 = self.t_prev = time.perf_counter()

    # -- weights ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Evaluate the starting weights (a fresh run) and publish them: admission opens."""
        if self.rank0:
            if self.version == 0 and self.cfg.train.eval_every > 0:
                self.writer.log_step(0, {N.EVAL_ACCURACY: self.evaluate(), N.TIME_S: 0.0})
            self.store.start(publishable_state(self.parts.backend.module), self.version)
        self.t_prev = time.perf_counter()

    def publish(self, result: Any, *, consumed: tuple[int, int] | None) -> None:
        """Rank 0: new weights after a step; ``consumed`` releases the rollout batch in the same call.
        The snapshot is taken now; the put and the store call run in the publisher's thread."""
        self.version = result.version
        if self.rank0 and (result.stepped or consumed is not None):
            self.publisher.submit(publishable_state(self.parts.backend.module), self.version, consumed)

    @contextlib.contextmanager
    def injected_nan(self, step: int) -> Iterator[None]:
        """Fault injection (``faults.nonfinite_step``): NaN student logits in this attempt at ``step``."""
        faults = self.spec.faults
        if self.nan_left == 0 and faults.once("nonfinite_step", step):
            self.nan_left = faults.config.nonfinite_count
        if self.nan_left == 0:
            yield
            return
        self.nan_left -= 1
        head = self.parts.backend.module.get_output_embeddings()
        handle = head.register_forward_hook(lambda module, args, out: out * float("nan"))
        try:
            yield
        finally:
            handle.remove()

    def numerics(self, result: Any) -> None:
        """Count optimizer steps skipped in a row for non-finite numbers (identical on every rank:
        the loss and the gradient norm are reduced over ranks)."""
        if result.nonfinite:
            if self.nonfinite_streak == 0:
                self.first_bad_step = self.version + 1
            self.nonfinite_streak += 1
        elif result.stepped:
            self.nonfinite_streak = 0

    def numerics_abort(self) -> bool:
        limit = self.cfg.train.max_nonfinite_steps
        return limit > 0 and self.nonfinite_streak >= limit

    def abort(self) -> None:
        """Stop the run (numerics guard): checkpoint the unchanged weights, leave the reason for the
        driver in ``RUN/abort.json``, close the store. Returns normally, so Ray Train does not
        restart a run that would only fail the same way."""
        # always: the skipped batches' samples enter the ledger as dropped (nonfinite), so a resume
        # does not draw the prompts that broke the numerics again; the weights are the unchanged ones
        self.checkpoint(suffix="" if self.last_checkpoint < self.version else "_aborted")
        self.comm.barrier()
        if self.rank0:
            where = checkpoint.latest(self.spec.run_dir)
            message = (
                f"{self.nonfinite_streak} optimizer steps in a row had a non-finite loss or gradient "
                f"(from step {self.first_bad_step}; train.max_nonfinite_steps="
                f"{self.cfg.train.max_nonfinite_steps}); the run stopped with the weights from before step "
                f"{self.first_bad_step} checkpointed in {where}: lower train.lr or check the prompts and the "
                f"teacher, then rerun the same command to resume from there"
            )
            path = Path(self.spec.run_dir, ABORT_FILE)
            path.write_text(json.dumps({"step": self.first_bad_step, "message": message}))
        self.finish(aborted=True)

    def consumed(self, batch: dict[str, np.ndarray], counts: list[int]) -> None:
        """Books of a finished rollout batch: counts and the ledger of consumed sample ids (all ranks)."""
        self.counters["trained"] += counts[0]
        self.counters["dropped"] += counts[1]
        self.ledger.append(self.comm.all_cat(torch.from_numpy(batch[R.SAMPLE_ID])).numpy())

    # -- telemetry ---------------------------------------------------------------------------------
    def probe_gradients(
        self, batch: dict[str, np.ndarray], keep: np.ndarray, version: int
    ) -> dict[str, float]:
        """Rank 0, before the step: the dense-reference gradient diagnostics of a rollout batch that
        carries the teacher's full logits (the scoring stage adds them every ``grad_every`` steps)."""
        if self.probe is None or R.TEACHER_LOGITS not in batch:
            return {}
        t0 = time.perf_counter()
        out = self.probe(batch, keep=keep, lags=sample_info(batch).lag(version))
        out["time/grad_probe_s"] = time.perf_counter() - t0
        return out

    def trace_gradients(self, result: Any) -> dict[str, float]:
        """Rank 0, after a step: ``grad/cos_prev`` of the gradients the optimizer applied."""
        if self.trace is None or not result.stepped:
            return {}
        return self.trace(self.parts.backend.gradients())

    def log(
        self,
        batch: dict[str, np.ndarray],
        result: Any,
        version: int,
        *,
        t_got: float,
        t_computed: float,
        extra: dict[str, float] | None = None,
    ) -> None:
        """One record per optimizer step in metrics.jsonl, one row per sample in samples.parquet.

        A consumption without a step (every sample dropped, or non-finite numbers) logs its
        samples now and its counts with the next step, so a step is never logged twice."""
        rows = self.comm.gather_rows(sample_rows(batch, result, version, step=version + 1))
        if not self.rank0:
            return
        metrics = step_metrics(result)
        for key in (N.DROPPED, N.NUMERICS_SKIPPED):
            if key in metrics:
                self.pending[key] = self.pending.get(key, 0.0) + metrics.pop(key)
        self.writer.log_samples(rows)
        self.pending_extra.update(extra or {})
        if not result.stepped:
            return
        metrics.update(self.pending)
        metrics.update(self.pending_extra)
        self.pending, self.pending_extra = {}, {}
        if self.marks is not None:
            metrics.update(self.marks, **{N.FIRST_STEP_AT: time.time()})
            self.marks = None
        now = time.perf_counter()
        dt = now - self.t_prev
        metrics.update(bucket_metrics(rows))
        metrics.update(self.memory.sample())
        metrics.update(
            {
                N.VERSION: float(self.version),
                N.SAMPLES_PER_S: result.n_kept / max(dt, 1e-9),
                N.LEARNER_IDLE_FRAC: (t_got - self.t_prev) / max(dt, 1e-9),
                "time/step_s": dt,
                "time/data_wait_s": t_got - self.t_prev,
                "time/compute_s": t_computed - t_got,  # forward, loss, backward, optimizer step
                "time/publish_s": now - t_computed,  # gathers, weights to the store, release
            }
        )
        ev = self.cfg.train.eval_every
        if ev > 0 and (self.version % ev == 0 or self.version >= self.cfg.train.steps):
            metrics[N.EVAL_ACCURACY] = self.evaluate()
        metrics[N.TIME_S] = time.perf_counter() - self.t_run0
        metrics["time/eval_total_s"] = self.eval_time
        self.writer.log_step(self.version, metrics)
        self.t_prev = time.perf_counter()

    def evaluate(self) -> float:
        acc, dt = self.evaluator(self.parts.backend.module)
        self.eval_time += dt
        return acc

    # -- checkpoints -------------------------------------------------------------------------------
    def checkpoint_due(self) -> bool:
        every = self.cfg.train.checkpoint_every
        if self.version >= self.cfg.train.steps:
            return True
        return every > 0 and self.version // every > self.last_checkpoint // every

    def checkpoint(self, suffix: str = "") -> None:
        """Every rank writes its part (rank 0: model, shared state, ledger, coordinator books) and
        reports it; Ray Train copies them into one ``step_<v>`` folder (``step_<v>_aborted``: the numerics
        guard's, at the version of the last checkpoint, with the skipped samples in the ledger)."""
        import tempfile

        import ray.train
        from ray.train import Checkpoint

        if self.rank0:
            self.publisher.flush()  # the store's books include every publication so far
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint.save(
                Path(tmp),
                rank=self.comm.rank,
                world=self.comm.world,
                model=self.parts.backend.module,
                backend=self.parts.backend,
                controllers=self.parts.controllers,
                version=self.version,
                ledger=np.concatenate(self.ledger) if self.ledger else np.zeros(0, dtype=np.int64),
                counters=self.counters,
                coordinator_state=self.store.state_dict() if self.rank0 else None,
            )
            wrote = any(Path(tmp).iterdir())  # ranks > 0 write only a sharded backend's state
            ray.train.report(
                {"step": self.version},
                checkpoint=Checkpoint.from_directory(tmp) if wrote else None,
                checkpoint_dir_name=f"step_{self.version:06d}{suffix}",
            )
        self.comm.barrier()  # every shard is on storage before any rank moves on (and might fail)
        self.last_checkpoint = self.version

    def finish(self, *, aborted: bool = False) -> None:
        if self.rank0:
            self.publisher.close()
            self.store.close()
            self.writer.close()
        if self.version < self.cfg.train.steps and not aborted:
            raise RuntimeError(
                f"the rollout stream ended after {self.version} of {self.cfg.train.steps} steps: too few "
                f"prompts for the drops seen (dropped {self.counters['dropped']}); raise workload.train_size"
            )


def publishable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the PolicyStore ships to engines: compact CPU copies of ``model.state_dict()``.

    Engines live in other processes, maybe on other devices, hence CPU. A copy even on CPU: the
    publisher thread sends it while the next step updates the parameters in place.
    """
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class Evaluator:
    """Greedy exact match on the held-out split (rank 0)."""

    def __init__(self, cfg: RunConfig, tokenizer: Any, prompts: list[tuple[str, str]]) -> None:
        from asyncrl.workloads.tasks import Example, get_task

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.task = get_task(cfg.workload.task)
        self.examples = [Example(prompt=p, answer=a, prompt_id=i) for i, (p, a) in enumerate(prompts)]

    def __call__(self, model: torch.nn.Module) -> tuple[float, float]:
        from asyncrl.workloads.evaluate import exact_match

        t0 = time.perf_counter()
        acc = exact_match(
            model,
            self.tokenizer,
            self.task,
            self.examples,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            batch_size=64,
        )
        return float(acc), time.perf_counter() - t0
