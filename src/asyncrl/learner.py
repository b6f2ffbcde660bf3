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
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl import checkpoint
from asyncrl import records as R
from asyncrl.backends import make_backend
from asyncrl.collectives import Collectives
from asyncrl.config import RunConfig
from asyncrl.controllers import build_chain
from asyncrl.estimators import build as build_estimator
from asyncrl.step import StepOptions, StepParts, loss_step, sample_info, split_minibatches
from asyncrl.telemetry import names as N
from asyncrl.telemetry.steps import bucket_metrics, sample_rows, step_metrics


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
    resume_dir: str | None = None
    fail_at_step: int | None = None  # fault injection for resume tests


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config["spec"]`` is a ``LearnerSpec``."""
    spec: LearnerSpec = config["spec"]
    tc = spec.cfg.train
    w = Learner(spec)
    w.start()  # publish the starting weights: admission opens
    for batch in w.rollout_batches():
        t_got = time.perf_counter()
        keep = w.parts.controllers.keep(sample_info(batch), w.version)
        n_mb = tc.minibatches
        consumed = [0, 0]
        for i, (mb, mb_keep) in enumerate(split_minibatches(batch, keep, n_mb)):
            version = w.version
            result = loss_step(mb, w.parts, version, keep=mb_keep)
            consumed[0] += result.n_kept
            consumed[1] += result.n_dropped
            t_computed = time.perf_counter()
            w.publish(result, consumed=tuple(consumed) if i == n_mb - 1 else None)
            w.log(mb, result, version, t_got=t_got, t_computed=t_computed)
            t_got = time.perf_counter()
        w.consumed(batch, consumed)
        if w.checkpoint_due():
            w.checkpoint()
        if spec.fail_at_step is not None and w.version >= spec.fail_at_step:
            raise RuntimeError(f"fault injected at step {w.version} (pipeline fail_at_step)")
        if w.version >= tc.steps:
            break
    w.finish()


class Learner:
    """One Train worker's state: the step's parts, the store, the books, and rank 0's writers."""

    def __init__(self, spec: LearnerSpec) -> None:
        import ray.train.torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from asyncrl.coordinator import PolicyStoreClient

        self.spec = spec
        cfg = self.cfg = spec.cfg
        tc, pc = cfg.train, cfg.pipeline
        torch.set_num_threads(pc.torch_threads)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        self.comm = Collectives.current()
        self.rank0 = self.comm.rank == 0
        model_dir = Path(spec.resume_dir, checkpoint.MODEL_DIR) if spec.resume_dir else Path(spec.student_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
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
        self.version = 0
        self.counters = {"trained": 0, "dropped": 0}
        self.ledger: list[np.ndarray] = []
        if spec.resume_dir:
            restored = checkpoint.load(
                spec.resume_dir, rank=self.comm.rank, backend=backend, controllers=self.parts.controllers
            )
            self.version = restored.version
            self.counters.update(restored.counters)
            self.ledger.append(restored.ledger)
        self.last_checkpoint = self.version
        self.store = PolicyStoreClient.connect(
            spec.namespace, timeout_s=pc.rpc_timeout_s, name=spec.store_name
        )
        self.pending: dict[str, float] = {}  # figures of consumptions without a step, logged with the next
        # the driver shows progress by following metrics.jsonl (asyncrl.telemetry.progress)
        self.writer = self.evaluator = None
        if self.rank0:
            from asyncrl.telemetry.sinks import RunWriter

            self.writer = RunWriter(
                spec.run_dir,
                tensorboard=cfg.telemetry.tensorboard,
                resume=spec.resume_dir is not None,
                truncate_after_step=self.version,
            )
            tokenizer = AutoTokenizer.from_pretrained(spec.student_dir, local_files_only=True)
            self.evaluator = Evaluator(cfg, tokenizer, spec.eval_prompts)
        self.eval_time = 0.0
        self.t_run0 = self.t_prev = time.perf_counter()

    # -- data and weights ------------------------------------------------------------------------
    def rollout_batches(self) -> Any:
        """This rank's blocks of the stream, in order, as numpy batches (empty ones skipped)."""
        import ray.train

        local = self.cfg.train.batch_size // self.comm.world
        it = ray.train.get_dataset_shard("train").iter_batches(
            batch_size=local, prefetch_batches=0, batch_format="numpy"
        )
        for batch in it:
            if len(batch[R.SAMPLE_ID]):
                batch = R.writable(batch)  # Ray Data's zero-copy arrays are read-only
                batch["consumed_at"] = np.full(len(batch[R.SAMPLE_ID]), time.time())
                yield batch

    def start(self) -> None:
        """Evaluate the starting weights (a fresh run) and publish them: admission opens."""
        if self.rank0:
            if self.version == 0 and self.cfg.train.eval_every > 0:
                self.writer.log_step(0, {N.EVAL_ACCURACY: self.evaluate(), N.TIME_S: 0.0})
            self.store.start(publishable_state(self.parts.backend.module), self.version)
        self.t_prev = time.perf_counter()

    def publish(self, result: Any, *, consumed: tuple[int, int] | None) -> None:
        """Rank 0: new weights after a step; ``consumed`` releases the rollout batch in the same call."""
        self.version = result.version
        if self.rank0 and (result.stepped or consumed is not None):
            self.store.publish(publishable_state(self.parts.backend.module), self.version, consumed)

    def consumed(self, batch: dict[str, np.ndarray], counts: list[int]) -> None:
        """Books of a finished rollout batch: counts and the ledger of consumed sample ids (all ranks)."""
        self.counters["trained"] += counts[0]
        self.counters["dropped"] += counts[1]
        self.ledger.append(self.comm.all_cat(torch.from_numpy(batch[R.SAMPLE_ID])).numpy())

    # -- telemetry ---------------------------------------------------------------------------------
    def log(
        self, batch: dict[str, np.ndarray], result: Any, version: int, *, t_got: float, t_computed: float
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
        if not result.stepped:
            return
        metrics.update(self.pending)
        self.pending = {}
        now = time.perf_counter()
        dt = now - self.t_prev
        metrics.update(bucket_metrics(rows))
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

    def checkpoint(self) -> None:
        """Every rank writes its part (rank 0: model, shared state, ledger, coordinator books) and
        reports it; Ray Train copies them into one ``step_<v>`` folder."""
        import tempfile

        import ray.train
        from ray.train import Checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            checkpoint.save(
                Path(tmp),
                rank=self.comm.rank,
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
                checkpoint_dir_name=f"step_{self.version:06d}",
            )
        self.comm.barrier()  # every shard is on storage before any rank moves on (and might fail)
        self.last_checkpoint = self.version

    def finish(self) -> None:
        if self.rank0:
            self.store.close()
            self.writer.close()
        if self.version < self.cfg.train.steps:
            raise RuntimeError(
                f"the rollout stream ended after {self.version} of {self.cfg.train.steps} steps: too few "
                f"prompts for the drops seen (dropped {self.counters['dropped']}); raise workload.train_size"
            )


def publishable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the PolicyStore ships to engines: compact CPU copies of ``model.state_dict()``.

    Engines live in other processes, maybe on other devices, hence CPU. A copy even on CPU:
    ZeRO keeps parameters as views of one flat buffer, and pickling a view writes its whole
    storage (measured on the `small` student: 191 ms vs 13 ms per publish).
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
