"""What the learner writes per optimizer step (metrics.jsonl) and per consumed sample (samples.parquet).

One owner of the learner's metric keys (``names``) and of how each is reduced over ranks:
``asyncrl.step.loss_step`` returns the raw quantities already reduced over all data-parallel
ranks (counts, the global loss and token KL, the kept samples' lags and sequence log-ratios of
every rank), and the functions here only name and summarise them. The estimator's and the
controllers' own metrics keep their keys; a learner key wins on a clash (the learner's figure
is the global one). ``StepLogger`` is the learner's writer of both files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.collectives import Collectives
from asyncrl.controllers.functional import ess_fraction
from asyncrl.telemetry import names as N
from asyncrl.telemetry.staleness import TOKEN_LAG_COUNTS, per_bucket, token_lag_columns, token_lag_histogram

if TYPE_CHECKING:
    from asyncrl.checkpoint import Restored
    from asyncrl.config import RunConfig


def eval_due(train: Any, version: int) -> bool:
    """Whether the learner evaluates at ``version`` (``train``: the ``train`` config): every
    ``eval_every`` steps from step 0 on, and at the last step."""
    ev = train.eval_every
    return ev > 0 and (version % ev == 0 or version >= train.steps)


class LoggerSpec(Protocol):
    """What ``StepLogger`` reads of the learner's ``asyncrl.learner.LearnerSpec`` (a protocol: the
    learner imports this module, so this module does not import the learner)."""

    cfg: RunConfig
    run_dir: str
    student_dir: str
    teacher_dir: str | None
    eval_prompts: list[tuple[str, str]]
    agreement_prompts: list[list[int]] | None


#: bookkeeping and timing columns copied from the batch into samples.parquet when present: the
#: block's position in the stream, the learner version at its admission and the version the
#: admission expected to train it (``AdmissionBudget``), placement and timings
BATCH_EXTRAS = (
    R.BLOCK_INDEX,
    "admit_version",
    "expected_version",
    "gen_node",
    "score_node",
    "gen_time_s",
    "gen_wait_s",
    "gen_done_at",
    "gen_shared_frac",
    "score_time_s",
    "score_done_at",
    "consumed_at",
)


def step_metrics(result: Any) -> dict[str, float]:
    """The learner's per-step figures (global over ranks) from a ``StepResult``."""
    out = dict(result.metrics)
    lags = result.lags_global.double()
    out[N.DROPPED] = float(result.n_dropped)
    # a skipped non-finite step trained nothing (its samples' drop_reason says so), and its
    # figures are NaN: only numerics/skipped is reported for it
    out[N.SAMPLES_KEPT] = 0.0 if result.nonfinite else float(result.n_kept)
    if result.n_kept and not result.nonfinite:
        out.update(
            {
                N.LOSS: result.loss,
                N.LAG_MEAN: float(lags.mean()),
                N.LAG_MAX: float(lags.max()),
                N.ESS_RHO: float(ess_fraction(result.seq_log_ratio_global.double())),
                N.LR_SCHEDULED: result.lr_scheduled,
                N.LR_APPLIED: result.lr_applied,
                N.KL_BEHAVIOR_CURRENT: result.kl_behavior_current,
                N.GRAD_NORM: result.grad_norm,
                N.TOKENS: float(result.tokens),
            }
        )
    if result.nonfinite:
        out[N.NUMERICS_SKIPPED] = 1.0
    return out


def sample_rows(batch: Mapping[str, Any], result: Any, version: int, step: int) -> dict[str, np.ndarray]:
    """This rank's per-sample columns: bookkeeping from the batch, values from the step.

    ``version``: the learner version the samples were consumed at; ``step``: the 1-based
    optimizer step that consumed them (= metrics.jsonl ``step``).
    """
    n = len(batch[R.SAMPLE_ID])
    mask = np.asarray(batch[R.COMPLETION_MASK]).astype(bool)
    rows: dict[str, np.ndarray] = {
        "sample_id": np.asarray(batch[R.SAMPLE_ID]),
        "prompt_id": np.asarray(batch[R.PROMPT_ID]),
        "group_id": np.asarray(batch[R.GROUP_ID]),
        "version_first": np.asarray(batch[R.VERSION_FIRST]),
        "version_last": np.asarray(batch[R.VERSION_LAST]),
        "learner_version": np.full(n, version),
        "reward": np.asarray(batch.get(R.REWARD, np.full(n, np.nan)), dtype=np.float64),
        "completion_len": mask.sum(1),
        "step": np.full(n, step),
        **result.samples,
    }
    rows.update({k: np.asarray(batch[k]) for k in BATCH_EXTRAS if k in batch})
    if R.TOKEN_VERSIONS in batch:  # the token-level lag distribution (in-flight updates)
        rows.update(token_lag_columns(batch[R.TOKEN_VERSIONS], mask, version))
    # the ledger per sample: a non-finite step trained nothing, so its samples count as dropped
    passed = np.asarray(result.samples["kept"]).astype(bool)
    rows["kept"] = passed & (not result.nonfinite)
    rows[N.DROP_REASON] = np.where(
        passed, N.DROPPED_NONFINITE if result.nonfinite else "", N.DROPPED_CONTROLLERS
    ).astype(object)
    if R.TEACHER_TOPK_LOGPROBS in batch:
        rows[N.SAMPLE_TEACHER_MASS] = teacher_mass(batch[R.TEACHER_TOPK_LOGPROBS], mask)
    return rows


def teacher_mass(topk_logprobs: Any, mask: np.ndarray) -> np.ndarray:
    """Per sample: the mean over its valid tokens of the teacher mass the top-k cache kept,
    ``M_p(S) = Σ_k p``; NaN for a sample with no valid token."""
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    mass = np.exp(lp).sum(-1)  # [B, T]
    n = mask.sum(1)
    total = np.where(mask, mass, 0.0).sum(1)
    return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def bucket_metrics(rows: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``bucket/<lag>/<metric>`` over the kept samples (every rank's rows): loss, KL(behavior ||
    current), reward, the top-k cache's teacher mass (when the rows have it), the count ``n`` and
    ``ess``, the ESS fraction of the bucket's sequence weights ``exp(seq_log_ratio)`` (how far
    importance weighting would thin that bucket out)."""
    kept = np.asarray(rows["kept"]).astype(bool)
    out: dict[str, float] = {}
    if not kept.any():
        return out
    lags = rows["lag"][kept]
    for name in ("loss", "kl_behavior_current", "reward", N.SAMPLE_TEACHER_MASS):
        if name in rows:
            out.update(per_bucket(rows[name][kept], lags, name=name))
    out.update(per_bucket(np.ones(int(kept.sum())), lags, name="n", reduce="sum"))
    out.update(per_bucket(rows["seq_log_ratio"][kept], lags, reduce=_ess, name="ess"))
    if TOKEN_LAG_COUNTS in rows:  # trained tokens per token-lag bucket, and their largest lag
        out.update(token_lag_histogram(rows[TOKEN_LAG_COUNTS][kept]))
        out[N.TOKEN_LAG_MAX] = float(np.max(rows["token_lag_max"][kept]))
    return out


def _ess(log_weights: np.ndarray) -> float:
    return float(ess_fraction(torch.as_tensor(log_weights, dtype=torch.float64)))


class StepLogger:
    """The learner's step log: one record per optimizer step in metrics.jsonl, one row per
    consumed sample in samples.parquet. Every rank calls ``log`` (the rows are gathered); rank 0
    writes, and owns the ``RunWriter``, the ``mem/*`` probe and the eval cadence (``eval/accuracy``
    every ``train.eval_every`` steps and at the last). The driver shows progress by following
    metrics.jsonl (``asyncrl.telemetry.progress``).

    A consumption without a step (every sample dropped, or non-finite numbers) logs its samples at
    once and its counts (and gradient figures) with the next step, so a step is never logged twice.
    """

    def __init__(
        self,
        spec: LoggerSpec,
        comm: Collectives,
        model: torch.nn.Module,
        *,
        resumed: Restored | None = None,
        snapshots: Callable[[int], Mapping[str, torch.Tensor] | None] | None = None,
    ) -> None:
        """``spec``: the ``LearnerSpec`` (config, run directory, student, held-out prompts); ``model``:
        the student, evaluated as it trains; ``resumed``: the ``checkpoint.Restored`` the run resumed
        from (the records after its step and the sample rows outside its ledger are dropped);
        ``snapshots``: the weights published at a version, if kept (the agreement eval ships those
        instead of copying the model again), else None."""
        cfg = self.cfg = spec.cfg
        self.comm = comm
        self.model = model
        self.snapshots = snapshots
        self.rank0 = comm.rank == 0
        self.pending: dict[str, float] = {}  # counts of consumptions without a step, logged with the next
        self.pending_extra: dict[str, float] = {}  # gradient figures of a batch that took no step
        #: start-up marks (names.STARTUP_MARKS), logged with this process's first step, then None
        self.marks: dict[str, float] | None = {}
        self.writer = self.evaluator = self.memory = None
        #: the agreement eval (prompts without answers), run beside training: ``BackgroundAgreement``
        self.agreement: Any = None
        self.run_dir = spec.run_dir
        if self.rank0:
            from asyncrl.telemetry.memory import MemoryProbe
            from asyncrl.telemetry.sinks import RunWriter
            from asyncrl.workloads.checkpoints import shared_tokenizer
            from asyncrl.workloads.evaluate import Evaluator

            self.writer = RunWriter(
                spec.run_dir,
                tensorboard=cfg.telemetry.tensorboard,
                resume=resumed is not None,
                truncate_after_step=resumed.version if resumed else 0,
                keep_sample_ids=resumed.ledger if resumed else None,
                samples_flush_s=cfg.telemetry.samples_flush_s,
            )
            self.memory = MemoryProbe(cfg.telemetry.memory_every_s)
            if spec.agreement_prompts and cfg.train.eval_every > 0:
                from asyncrl.workloads.evaluate import BackgroundAgreement

                self.agreement = BackgroundAgreement(
                    cfg, spec.teacher_dir, spec.student_dir, spec.agreement_prompts
                )
            else:
                tokenizer = shared_tokenizer(spec.student_dir)
                self.evaluator = Evaluator(cfg, tokenizer, spec.eval_prompts)
        self.eval_time = 0.0
        self.t_run0 = self.t_prev = time.perf_counter()

    def start(self, version: int) -> None:
        """Before the first step: a fresh run's eval of the starting weights (step 0)."""
        if self.rank0 and version == 0 and self.cfg.train.eval_every > 0:
            if self.agreement is not None:  # beside the first steps: nothing waits for it
                self.agreement.submit(0, self.model, snapshot=self._snapshot(0))
            else:
                self.writer.log_step(0, {N.EVAL_ACCURACY: self.evaluate(), N.TIME_S: 0.0})

    def ready(self, started_at: float) -> None:
        """The learner is loaded and its weights published: start-up marks, and the step clock starts."""
        self.t_prev = time.perf_counter()
        self.marks = {N.LEARNER_START_AT: started_at, N.LEARNER_READY_AT: time.time()}

    def first_batch(self) -> None:
        if self.marks is not None:
            self.marks.setdefault(N.FIRST_BATCH_AT, time.time())

    def log(
        self,
        batch: Mapping[str, Any],
        result: Any,
        version: int,
        *,
        t_got: float,
        t_computed: float,
        extra: dict[str, float] | None = None,
    ) -> None:
        """One ``loss_step`` at ``version`` (before it): its samples' rows now, its step record if it
        stepped. ``t_got``/``t_computed``: when its data arrived and its step was computed."""
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
        if self.memory.due():
            metrics.update(self.memory.sample())
        metrics.update(
            {
                N.VERSION: float(result.version),
                N.SAMPLES_PER_S: result.n_kept / max(dt, 1e-9),
                N.LEARNER_IDLE_FRAC: (t_got - self.t_prev) / max(dt, 1e-9),
                "time/step_s": dt,
                "time/data_wait_s": t_got - self.t_prev,
                "time/compute_s": t_computed - t_got,  # forward, loss, backward, optimizer step
                "time/publish_s": now - t_computed,  # gathers, weights to the store, release
                N.PADDING_FRAC: R.padding_fraction(batch),
            }
        )
        due = eval_due(self.cfg.train, result.version)
        if self.agreement is not None:
            final = result.version >= self.cfg.train.steps
            metrics.update(self.agreed(result.version, due=due, final=final))
        elif due:
            metrics[N.EVAL_ACCURACY] = self.evaluate()
        metrics[N.TIME_S] = time.perf_counter() - self.t_run0
        metrics["time/eval_total_s"] = self.eval_time
        self.writer.log_step(result.version, metrics)
        self.t_prev = time.perf_counter()

    def agreed(self, version: int, *, due: bool, final: bool) -> dict[str, float]:
        """The background agreement eval at a step: request one when ``due``, collect what has
        finished (every one at the ``final`` step, which waits for them: the run is over), write
        each to ``RUN/evals.jsonl``, and return the newest one's figures for the step record."""
        if due:
            self.agreement.submit(version, self.model, final=final, snapshot=self._snapshot(version))
        self.agreement.open()  # from the first step on (a no-op after the first call)
        t0 = time.perf_counter()
        done = self.agreement.drain() if final else self.agreement.poll()
        self.eval_time += time.perf_counter() - t0  # only the wait at the end holds the learner
        out: dict[str, float] = {}
        with open(Path(self.run_dir) / N.EVAL_FILE, "a", encoding="utf-8") as f:
            for res in done:
                f.write(json.dumps(res, allow_nan=False) + "\n")
                out = {f"eval/{k}": v for k, v in res["metrics"].items()}
                out[N.EVAL_STEP] = float(res["step"])
                out["time/eval_s"] = res["seconds"]
        return out

    def _snapshot(self, version: int) -> Mapping[str, torch.Tensor] | None:
        return self.snapshots(version) if self.snapshots is not None else None

    def evaluate(self) -> float:
        acc, dt = self.evaluator(self.model)
        self.eval_time += dt
        return acc

    def flush(self) -> None:
        """Make every logged sample row durable (before a checkpoint: what a resume keeps is on disk)."""
        if self.rank0:
            self.writer.flush_samples()

    def close(self) -> None:
        if self.rank0:
            self.writer.close()
            if self.agreement is not None:
                self.agreement.close()
