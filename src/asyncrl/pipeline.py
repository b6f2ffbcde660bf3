"""Builds and runs the Ray graph of a ``RunPlan`` (``asyncrl.plan``)::

    prompt blocks (one per learner worker per rollout batch, in stream order: cut in the driver
                   for a built-in task, or streamed from prompt files by StreamBlocks, asyncrl.stream)
      -> map_batches(Generate, actor pool)      admitted by the PolicyStore in block order
      -> map_batches(ScoreTeacher | ScoreReward, actor pool)
         (pipeline.fuse_scoring: one map_batches(GenerateAndScore) does both per block)
      -> Ray Train TorchTrainer (asyncrl.ray_internals.torch_trainer: less Ray Train's helper processes
         a local run cannot use; train_loop_per_worker in asyncrl.learner), blocks in the same order
           rank 0 publishes weights after every optimizer step and releases each rollout batch

``pipeline.colocate`` (strict on-policy): the stream carries the prompt blocks only, and each learner
worker generates and scores its blocks itself, on its own model (``asyncrl.stages.Colocated``):
lock-step has nothing to overlap, so one process per rank does it with no weight publication, no
stage hand-offs and no stage actors to start.

Ordering rule: blocks are admitted in stream order (``AdmissionBudget``) and consumed in stream
order (Ray Data ``preserve_order``; with W learner workers the split hands rank ``k`` blocks
``k, k+W, ...``), so any number of generators, scorers and learner workers can neither deadlock
nor train a sample later than the controller chain admitted it for. ``max_lag = 0`` is strict
synchronous on-policy training through the same graph.

Latency choices (docs/performance.md, "Ray Data's scheduling loop"): one task in flight per
actor (Ray Data's default of 2 keeps a gated task active and adds a tick per hand-off; with the
executor patch a second task was a little faster, but 4 generators at ``max_lag=0`` then stalled:
an admitted block never reached the learner while the other actors' queued tasks waited for
admission; cause not pinned down, so one it stays: docs/known_issues.md), consumer
``prefetch_batches=0`` (lock-step deadlocks otherwise), no shard locality (deadlocks with
small blocks), and with one learner worker the executor runs inside that worker, which skips
the OutputSplitter hop: that worker builds the stream itself (``LearnerSpec.stream``), so no
Ray Train DatasetManager process has to start (and import torch) before the stream can; and
``asyncrl.ray_internals.torch_trainer`` starts none for a trainer without datasets.

Faults (``docs/reliability.md``): a dead generator or scorer actor is restarted by Ray Data
and its block re-run (a generator's under the same admission); a dead learner worker makes Ray
Train restart the worker group (``pipeline.max_learner_failures``), and the stream is rebuilt by
``StreamFactory`` (called at every start of the worker group: by Ray Train, or by the single
learner worker itself) from the same latest checkpoint the learners load; a dead driver is
resumed by running the same command again. Every sample drawn is accounted for in
``summary.json`` (``asyncrl.coordinator`` "Books").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

# torch-free imports only: ``run`` starts Ray's processes first and imports the rest (torch,
# transformers, the components: about 2 s of CPU) beside them (``prepare_driver``)
from asyncrl.config import RunConfig, parse_config, resolve_auto, resolve_components, save_config
from asyncrl.configurable import to_dict
from asyncrl.faults import Faults
from asyncrl.raysetup import RAY_ENV, apply_env, local_cpus
from asyncrl.telemetry.progress import Display

if TYPE_CHECKING:
    from asyncrl.plan import RunPlan


@dataclass
class RunResult:
    """What ``run`` returns: the run directory (``config.yaml``, ``metrics.jsonl``,
    ``samples.parquet``, ``summary.json``, ``checkpoints/``), its summary and the resolved config."""

    run_dir: Path
    summary: dict[str, Any]
    config: RunConfig


def ray_runtime_env(cfg: RunConfig) -> dict[str, Any]:
    """The ``runtime_env`` of the Ray instance a run starts or joins (``asyncrl.raysetup``):
    ``RAY_ENV`` and the console's quiet settings; on a Ray instance the run starts itself (no
    ``pipeline.ray_address``) also ``LOCAL_RAY_ENV``, except a variable set in this process, and
    ``LOCAL_RAY_MARKER``."""
    from asyncrl.raysetup import LOCAL_RAY_ENV, LOCAL_RAY_MARKER, runtime_env
    from asyncrl.telemetry import console

    env_vars = {**RAY_ENV, **console.quiet_env()}
    if not cfg.pipeline.ray_address:
        env_vars |= {k: v for k, v in LOCAL_RAY_ENV.items() if k not in os.environ}
        env_vars[LOCAL_RAY_MARKER] = "1"  # ray_internals.is_local: no autoscaler, stops with the run
    return runtime_env(env_vars, cfg.pipeline.data_tick_s)


#: ``_system_config`` of a local Ray instance a run starts: Ray starts idle workers for the first
#: driver, without the run's runtime_env, so no actor of the run can use them: 2 processes' imports
#: during the start-up, when every core is busy (docs/performance.md, "Start-up")
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def init_ray(cfg: RunConfig) -> bool:
    """Start (or join) Ray; returns True if this call started it (and so must shut it down).
    Worker logs reach the driver through ``asyncrl.telemetry.console``'s filter (``-v``: all)."""
    import ray

    from asyncrl.telemetry import console

    if ray.is_initialized():
        console.install_log_filter()
        return False
    env = ray_runtime_env(cfg)
    level = console.ray_logging_level()
    if cfg.pipeline.ray_address:
        ray.init(address=cfg.pipeline.ray_address, runtime_env=env, log_to_driver=True, logging_level=level)
    else:
        ray.init(
            num_cpus=local_cpus(cfg),
            include_dashboard=False,
            runtime_env=env,
            log_to_driver=True,
            logging_level=level,
            _system_config=LOCAL_SYSTEM_CONFIG,
        )
    console.install_log_filter()
    return True


@contextmanager
def ray_session(cfg: RunConfig) -> Iterator[None]:
    """One Ray instance for several ``run`` calls (``asyncrl demo``'s two runs): Ray's start and
    stop are paid once, and later runs find its processes warm. The runs must agree on the Ray
    settings (``pipeline.ray_address``, ``num_cpus``, ``data_tick_s``): ``cfg``'s are used."""
    import ray

    apply_env()
    started = init_ray(cfg)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def process_started_at() -> float | None:
    """When this process (the command) started, epoch seconds: the origin of ``first_step_s``.
    Read from Linux's /proc (the process's start tick and the uptime, both since boot); None
    where there is no /proc."""
    import os

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))


def _to_arrow(block: dict[str, np.ndarray]) -> Any:
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    cols = {}
    for k, v in block.items():
        if v.dtype == object:
            cols[k] = pa.array([str(x) for x in v])
        elif v.ndim > 1:
            cols[k] = ArrowTensorArray.from_numpy(np.ascontiguousarray(v))
        else:
            cols[k] = pa.array(v)
    return pa.table(cols)


def dense_reference(cfg: RunConfig) -> dict[str, int] | None:
    """Which blocks the scoring stage adds the teacher's full logits to (the gradient probe's)."""
    if cfg.telemetry.grad_reference != "dense":
        return None
    return {
        "every": cfg.telemetry.grad_every,
        "workers": cfg.pipeline.learner_workers,
        "minibatches": cfg.train.minibatches,
    }


def configure_data_context(cfg: RunConfig) -> None:
    """This process's Ray Data context: in-order consumption (the ordering rule), the stall timeout,
    no progress bars. Ray Train hands the driver's context to its workers."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the ordering rule: consumption in block order
    ctx.execution_no_progress_timeout_s = cfg.pipeline.no_progress_timeout_s
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    # a generator whose admission ends with the run returns a zero-row block, and Arrow cannot type
    # a zero-row 2-D column, so Ray falls back to its object column for that (empty) block: Ray's
    # default, made explicit here so it is not logged as a conversion failure on every run
    ctx.enable_fallback_to_arrow_object_ext_type = True


def faults_of(cfg: RunConfig) -> Faults:
    """The run's fault plan; once-only markers live in ``RUN/faults``."""
    return Faults(cfg.faults, str(Path(cfg.run_dir, "faults")))


@dataclass(frozen=True)
class StageSpecs:
    """The rollout stages' constructor arguments: ``Generate(**generate)`` and ``scorer(**score)``
    (``ScoreTeacher`` for OPD, ``ScoreReward`` for RL). Ray Data builds them in its actor pools;
    a colocated run (``pipeline.colocate``) in each learner worker (``asyncrl.stages.Colocated``)."""

    generate: dict[str, Any]
    scorer: type
    score: dict[str, Any]


def stage_specs(plan: RunPlan, namespace: str, store_name: str, *, stream: int | None = None) -> StageSpecs:
    """The stages of ``plan``; ``stream``: the PolicyStore's id of the stream they serve."""
    from asyncrl.stages import ScoreReward, ScoreTeacher

    cfg = plan.cfg
    pc = cfg.pipeline
    faults = faults_of(cfg)
    generate = dict(
        engine=pc.engine,
        student_dir=plan.models.student_dir,
        sampling=to_dict(cfg.sampling),
        namespace=namespace,
        store_name=store_name,
        seed=cfg.seed,
        rpc_timeout_s=pc.rpc_timeout_s,
        admit_timeout_s=pc.no_progress_timeout_s,
        torch_threads=pc.torch_threads,
        engine_options=plan.engine_options,
        max_engine_restarts=pc.max_engine_restarts,
        stream=stream,
        faults=faults,
        inflight_updates=pc.inflight_updates,
        inflight_poll_steps=pc.inflight_poll_steps,
        continuous_batching=pc.continuous_batching,
    )
    if plan.rl:
        return StageSpecs(
            generate,
            ScoreReward,
            dict(task=cfg.workload.task, tokenizer_dir=plan.models.student_dir, faults=faults),
        )
    score = dict(
        teacher_dir=plan.models.teacher_dir,
        cache=plan.cache_kind,
        cache_options=plan.cache_options,
        task=cfg.workload.task,
        seed=cfg.seed,
        torch_threads=pc.torch_threads,
        device=pc.device,
        dtype=pc.teacher_dtype,
        faults=faults,
        dense_reference=dense_reference(cfg),
    )
    return StageSpecs(generate, ScoreTeacher, score)


#: a stage actor's memory besides its models: Python, torch, Ray's worker and Ray Data's buffers
#: (the resident set of a stage actor holding a 1M-parameter model); see ``actor_memory``
ACTOR_BASE_MEMORY = 768 << 20


def actor_memory(*model_dirs: str | None, dtype_bytes: int = 4, extra: int = 0) -> int:
    """Bytes of memory a stage actor asks Ray for (``memory=``): its models' weights three times
    (the model, a received state dict, and the copy a weight load makes), ``extra`` (the logits of
    a batch), plus ``ACTOR_BASE_MEMORY``.

    Why: an operator that asks for no memory but uses more than Ray's per-CPU default, or uses
    more than 4/5 of what it asked for, gets Ray Data's "consider setting memory=..." warning in
    the terminal on every run at a real model size, and Ray cannot keep actors that do not fit off
    one node; a request sized from the checkpoint lets the scheduler know and gives the warning no
    cause. Weight files are read as float32 (``dtype_bytes`` scales them for another dtype)."""
    total = ACTOR_BASE_MEMORY + int(extra)
    for d in model_dirs:
        if d:
            stored = sum(f.stat().st_size for f in Path(d).glob("*.safetensors"))
            stored += sum(f.stat().st_size for f in Path(d).glob("pytorch_model*.bin"))
            total += 3 * stored * dtype_bytes // 4
    return int(total)


def generator_pool(pc: Any) -> Any:
    """The generator stage's actor pool: one block per actor at a time, or, with
    ``pipeline.continuous_batching``, ``pipeline.continuous_blocks`` running at once in threads of
    the actor (Ray Data's ``max_concurrent_calls_per_actor``, equal to the tasks in flight, so no
    block queues behind one waiting for admission) whose rows one ``ContinuousBatcher`` decodes
    together."""
    import ray

    if not pc.continuous_batching:
        return ray.data.ActorPoolStrategy(size=pc.generators, max_tasks_in_flight_per_actor=1)
    return ray.data.ActorPoolStrategy(
        size=pc.generators,
        max_tasks_in_flight_per_actor=pc.continuous_blocks,
        max_concurrent_calls_per_actor=pc.continuous_blocks,
        enable_true_multi_threading=True,
    )


def _stage_memory(plan: RunPlan) -> tuple[int, int, int]:
    """(generator, scorer, prompt stream) memory requests: ``actor_memory`` of each, the scorer's
    with its [B/W, T, V] float32 logits three times (logits, log-softmax, the cache's gathers), each
    capped at the node's memory over the number of actors (a request Ray cannot grant would leave
    the actor unscheduled)."""
    import ray

    from asyncrl.workloads.checkpoints import model_config

    cfg, pc = plan.cfg, plan.cfg.pipeline
    local = cfg.train.batch_size // pc.learner_workers
    vocab = int(model_config(plan.models.student_dir).get("vocab_size") or 0)
    logits = 3 * local * int(cfg.sampling.max_new_tokens) * vocab * 4
    gen = actor_memory(plan.models.student_dir, extra=local * vocab * 4 * 3)
    teacher_bytes = 2 if pc.teacher_dtype == "bfloat16" else 4
    score = actor_memory(
        None if plan.rl else plan.models.teacher_dir, dtype_bytes=teacher_bytes, extra=logits
    )
    try:
        node = float(ray.cluster_resources().get("memory", 0.0))
    except Exception:  # not connected: no cap to apply
        node = 0.0
    cap = int(node / (pc.generators + pc.teacher_scorers + 1)) if node > 0 else None
    stream = ACTOR_BASE_MEMORY
    return tuple(min(m, cap) if cap else m for m in (gen, score, stream))  # type: ignore[return-value]


def build_dataset(
    plan: RunPlan,
    blocks: list[dict[str, np.ndarray]] | None,
    namespace: str,
    store_name: str,
    *,
    stream: int | None = None,
    skip_ids: np.ndarray | None = None,
) -> Any:
    """The Ray Data graph: prompt blocks -> generation -> teacher (or reward) scoring, in order.
    ``blocks`` cut in the driver (a built-in task), or None: ``plan.prompts`` streamed
    (``asyncrl.stream``), without the samples in ``skip_ids`` (a resume's ledger).
    ``stream``: the PolicyStore's id of this stream (``begin_stream``). A colocated run
    (``pipeline.colocate``): the prompt blocks only; each learner worker generates and scores them."""
    import ray.data

    from asyncrl.stages import Generate, GenerateAndScore

    cfg = plan.cfg
    pc = cfg.pipeline
    configure_data_context(cfg)
    local = cfg.train.batch_size // pc.learner_workers
    # from_blocks: each block's metadata is computed here, in this process; from_arrow would run one
    # Ray task per block for it (hundreds at start-up, competing with the stage actors' start)
    ds = (
        ray.data.from_blocks([_to_arrow(b) for b in blocks])
        if blocks is not None
        else streamed(plan, skip_ids)
    )
    if pc.colocate:
        return ds
    stages = stage_specs(plan, namespace, store_name, stream=stream)
    gen_memory, score_memory, _ = _stage_memory(plan)
    # on cuda every actor reserves a GPU share (Ray hides GPUs from actors that reserve none)
    actor_gpus = pc.gpus_per_actor if pc.device == "cuda" else None
    if pc.fuse_scoring:  # one actor pool generates and scores each block
        return ds.map_batches(
            GenerateAndScore,
            batch_size=local,
            compute=generator_pool(pc),
            num_cpus=pc.cpus_per_actor,
            num_gpus=actor_gpus,
            resources=dict(pc.generator_resources) or None,
            memory=gen_memory + score_memory - ACTOR_BASE_MEMORY,
            fn_constructor_kwargs=dict(generate=stages.generate, scorer=stages.scorer, score=stages.score),
        )
    ds = ds.map_batches(
        Generate,
        batch_size=local,
        compute=generator_pool(pc),
        num_cpus=pc.cpus_per_actor,
        num_gpus=actor_gpus,
        resources=dict(pc.generator_resources) or None,
        memory=gen_memory,
        fn_constructor_kwargs=stages.generate,
    )
    return ds.map_batches(
        stages.scorer,
        batch_size=local,
        compute=ray.data.ActorPoolStrategy(size=pc.teacher_scorers, max_tasks_in_flight_per_actor=1),
        num_cpus=pc.cpus_per_actor,
        num_gpus=None if plan.rl else actor_gpus,  # the reward stage needs no GPU
        resources=dict(pc.scorer_resources) or None,
        memory=score_memory,
        fn_constructor_kwargs=stages.score,
    )


def streamed(plan: RunPlan, skip_ids: np.ndarray | None) -> Any:
    """The prompt files as a stream of blocks: block indices (one row each) -> StreamBlocks, an
    actor pool of one (``asyncrl.stream``)."""
    import ray.data

    from asyncrl import records as R
    from asyncrl.plan import stream_blocks
    from asyncrl.stream import StreamBlocks

    cfg = plan.cfg
    n = stream_blocks(cfg)
    indices = ray.data.from_items([{R.BLOCK_INDEX: i} for i in range(n)], override_num_blocks=n)
    return indices.map_batches(
        StreamBlocks,
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=1),
        num_cpus=0.1,
        memory=_stage_memory(plan)[2],  # a tokenizer and a window of prompt rows (see actor_memory)
        fn_constructor_kwargs=dict(
            source=plan.prompts,
            tokenizer_dir=plan.models.student_dir,
            seed=cfg.seed,
            group_size=cfg.train.group_size,
            block_samples=cfg.train.batch_size // cfg.pipeline.learner_workers,
            window=cfg.workload.shuffle_window,
            max_prompt_tokens=cfg.workload.max_prompt_tokens,
            skip_ids=skip_ids,
            read_timeout_s=cfg.pipeline.no_progress_timeout_s,
        ),
    )


@dataclass(frozen=True)
class StreamFactory:
    """The run's Ray Data stream, built from the run directory's latest checkpoint.

    Called at every start of the learner worker group (the run's start, and each restart after a
    learner worker died): by the single learner worker itself (``LearnerSpec.stream``), or with
    several by Ray Train (``TorchTrainer(datasets={"train": factory})``, in its controller), which
    splits the stream among them. It reads the latest complete checkpoint, which is the one the
    learners will load: the PolicyStore's books go back to that checkpoint (``begin_stream``), and
    the new stream leaves out the ledger's samples and numbers its blocks from 0, as the restored
    learner's admission expects. Prompt files (``plan.prompts``) are streamed (``streamed``: the stream
    skips the same ledger); a built-in task's blocks are cut here (``prompt_blocks``), except at a
    start with no checkpoint, which takes ``fresh``: the same blocks, cut by the driver while Ray
    started (``fresh_blocks``), so the first stage actors are not kept waiting for a tokenizer."""

    plan: RunPlan
    namespace: str
    store_name: str
    #: an object ref to ``fresh_blocks(plan)`` (None: cut them here)
    fresh: Any = None

    def __call__(self) -> Any:
        import ray

        from asyncrl import checkpoint
        from asyncrl.coordinator import PolicyStoreClient
        from asyncrl.plan import load_examples

        cfg = self.plan.cfg
        ckpt = checkpoint.latest(cfg.run_dir)
        state, skip = None, None
        if ckpt is not None:
            coordinator = ckpt / checkpoint.COORDINATOR_FILE
            state = json.loads(coordinator.read_text()) if coordinator.is_file() else None
            skip = checkpoint.load_ledger(ckpt)
        store = PolicyStoreClient.connect(self.namespace, cfg.pipeline.rpc_timeout_s, name=self.store_name)
        stream = store.begin_stream(state)
        if self.plan.prompts is not None:  # prompt files: streamed by Ray Data, never held here
            return build_dataset(
                self.plan, None, self.namespace, self.store_name, stream=stream, skip_ids=skip
            )
        if ckpt is None and self.fresh is not None:
            blocks = ray.get(self.fresh)
        else:
            blocks = fresh_blocks(self.plan, load_examples(cfg)[0], skip)
        return build_dataset(self.plan, blocks, self.namespace, self.store_name, stream=stream)


def fresh_blocks(
    plan: RunPlan, train_ex: list[Any], skip: np.ndarray | None = None
) -> list[dict[str, np.ndarray]]:
    """A built-in task's prompt blocks of ``train_ex`` (``prompt_blocks``), without the ledger's ``skip``."""
    from asyncrl.plan import prompt_blocks
    from asyncrl.workloads.checkpoints import shared_tokenizer

    cfg = plan.cfg
    width = cfg.workload.max_prompt_tokens or plan.max_prompt_len
    return prompt_blocks(cfg, train_ex, shared_tokenizer(plan.models.student_dir), width, skip)


#: the PolicyStore's books, rewritten on every change (a resumed driver continues them)
BOOKS_FILE = "books.json"


class RunAborted(RuntimeError):
    """The learner stopped the run on purpose (the numerics guard); the message says why and how to resume."""


def prepare_run_dir(plan: RunPlan) -> None:
    """Before a run: drop what would claim an outcome (summary, abort note); a fresh run (nothing to
    resume) also drops the checkpoints, books and fault markers an earlier run left."""
    from asyncrl import checkpoint
    from asyncrl.telemetry.names import SUMMARY_FILE

    run_dir = Path(plan.cfg.run_dir)
    for name in (SUMMARY_FILE, checkpoint.ABORT_FILE):
        (run_dir / name).unlink(missing_ok=True)
    if plan.resume_dir is None:
        found = checkpoint.scan(run_dir)
        if plan.cfg.pipeline.resume and found:
            _, path, bad = found[0]
            print(
                f"asyncrl: no complete checkpoint to resume from (newest: {path}: {'; '.join(bad[:2])}); "
                f"starting over",
                file=sys.stderr,
                flush=True,
            )
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(run_dir / "faults", ignore_errors=True)
        (run_dir / BOOKS_FILE).unlink(missing_ok=True)
        return
    resume_step = checkpoint.step_of(plan.resume_dir)
    for step, path, bad in checkpoint.scan(run_dir):
        if bad and step >= resume_step:
            print(
                f"asyncrl: skipping incomplete checkpoint {path} ({'; '.join(bad[:2])}); resuming from step "
                f"{resume_step}",
                file=sys.stderr,
                flush=True,
            )


@dataclass(frozen=True)
class Prepared:
    """The driver's side of a run, made beside Ray's start (``prepare_driver``)."""

    cfg: RunConfig
    plan: RunPlan
    #: the held-out prompts the learner evaluates on (``asyncrl.plan.EvalPlan``)
    evals: Any
    #: a fresh run's prompt blocks (None: the stream's factory cuts them itself)
    fresh: list[dict[str, np.ndarray]] | None


def prepare_driver(cfg: RunConfig) -> Prepared:
    """``run``'s work beside ``ray.init``, which waits seconds for Ray's processes and leaves a core
    idle: the components' names and the workload's settings (``load_config`` less the parse), every
    check of ``make_plan``, the run directory and its config, the examples, the imports ``run``
    needs next (``import_run_modules``: torch, Ray Train, the learner) and a fresh run's prompt
    blocks. A failed check is raised (``run`` stops the Ray it started, then raises it); a failure
    to cut the blocks is left to the stream's factory, which cuts them itself and raises it there."""
    from asyncrl.plan import eval_plan, load_examples, make_plan

    # idempotent: a config loaded by load_config is resolved already; one built in code or parsed
    # (``parse_config``, the CLI's) is resolved here, and may still say sampling.max_new_tokens=auto
    cfg = resolve_auto(resolve_components(cfg))
    plan = make_plan(cfg)
    cfg = plan.cfg
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare_run_dir(plan)
    save_config(cfg, run_dir / "config.yaml")
    train_ex, eval_ex = load_examples(cfg)
    evals = eval_plan(cfg, plan.models, eval_ex[: cfg.train.eval_size])
    if evals.note and cfg.telemetry.progress:
        print(evals.note, flush=True)
    import_run_modules()
    fresh = None
    if plan.prompts is None and plan.resume_dir is None:
        try:
            fresh = fresh_blocks(plan, train_ex)
        except Exception:  # raised again where StreamFactory cuts them
            fresh = None
    return Prepared(cfg, plan, evals, fresh)


def import_run_modules() -> None:
    """Import what ``run`` needs after Ray's start (``run`` calls it in a thread beside
    ``ray.init``). A failed import is left for ``run``'s own import statement to raise. Only a
    speed-up: a module missing here is imported by ``run`` itself, serially."""
    import importlib

    for name in (
        "ray.train.torch",
        "asyncrl.ray_internals",
        "asyncrl.learner",
        "asyncrl.coordinator",
        "asyncrl.telemetry.summary",
        "asyncrl.telemetry.sinks",
    ):
        try:
            importlib.import_module(name)
        except Exception:  # re-raised where run imports it
            return


def run(cfg: RunConfig | str | Path, *, display: Display | None = None) -> RunResult:
    """Run a whole pipeline; returns the run directory and its summary. See the module docstring.

    Raises on failure (``RunAborted`` when the numerics guard stopped it); ``summary.json`` then
    says ``status: failed`` (or ``aborted``), never a success.

    Progress: a row in ``display`` (a caller's ``asyncrl.telemetry.progress.Display``, e.g. a
    sweep's, one row per run), else in a display of its own (``telemetry.progress``)."""
    apply_env()
    import ray

    marks = {"run_started_at": time.time(), "process_started_at": process_started_at()}
    if not isinstance(cfg, RunConfig):
        cfg = parse_config(cfg)
    t0 = time.perf_counter()
    # Ray's start waits seconds for its processes on one core; the driver's own preparation (the
    # checks, imports and prompt blocks: about 3 s of CPU) runs beside it (``prepare_driver``). A
    # failed check stops the Ray instance this call started before it is raised.
    with ThreadPoolExecutor(1, thread_name_prefix="asyncrl-prepare") as pool:
        preparing = pool.submit(prepare_driver, cfg)
        marks["ray_started_at"] = time.time()
        started = init_ray(cfg)
        marks["ray_ready_at"] = time.time()
        try:
            ready = preparing.result()
        except BaseException:
            if started:
                ray.shutdown()
            raise
    cfg, plan, evals, fresh = ready.cfg, ready.plan, ready.evals, ready.fresh
    run_dir = Path(cfg.run_dir)
    from ray.train import DataConfig, FailureConfig, ScalingConfig
    from ray.train import RunConfig as TrainRunConfig
    from ray.train.torch import TorchConfig

    from asyncrl import checkpoint
    from asyncrl.controllers.bounded import BoundedStaleness
    from asyncrl.coordinator import PolicyStore
    from asyncrl.learner import LearnerSpec, train_loop_per_worker
    from asyncrl.plan import check_cpus, check_gpus
    from asyncrl.ray_internals import is_local, torch_trainer
    from asyncrl.rollouts import StreamFailed
    from asyncrl.telemetry import names as N
    from asyncrl.telemetry.sinks import write_summary
    from asyncrl.telemetry.summary import failed_summary, summarize

    namespace = ray.get_runtime_context().namespace
    store_name = f"asyncrl-store-{uuid.uuid4().hex[:8]}"
    pc = cfg.pipeline
    cuda = pc.device == "cuda"
    try:
        resources = ray.cluster_resources()
        check_cpus(cfg, float(resources.get("CPU", 0.0)))
        check_gpus(cfg, float(resources.get("GPU", 0.0)), rl=plan.rl)
        store = PolicyStore.options(name=store_name).remote(
            plan.controller_specs,
            cfg.train.batch_size,
            blocks_per_rollout=pc.learner_workers,
            versions_per_rollout=cfg.train.minibatches,
            keep_versions=BoundedStaleness.from_config(cfg).kept_versions,
            books_path=str(run_dir / BOOKS_FILE),
            resume_books=plan.resume_dir is not None,
        )
        configure_data_context(cfg)  # captured by Ray Train for its workers
        fresh_ref = ray.put(fresh) if fresh is not None else None
        stream = StreamFactory(plan, namespace, store_name, fresh=fresh_ref)
        single = pc.learner_workers == 1  # the one worker builds and runs the whole stream itself
        spec = LearnerSpec(
            cfg=cfg,
            controller_specs=plan.controller_specs,
            student_dir=plan.models.student_dir,
            run_dir=str(run_dir),
            namespace=namespace,
            store_name=store_name,
            eval_prompts=[(e.prompt, e.answer) for e in evals.examples],
            teacher_dir=plan.models.teacher_dir,
            agreement_prompts=evals.prompt_ids,
            faults=faults_of(cfg),
            stream=stream if single else None,
            colocated=stage_specs(plan, namespace, store_name) if pc.colocate else None,
        )
        trainer = torch_trainer(
            train_loop_per_worker,
            local=is_local(),
            train_loop_config={"spec": spec},
            scaling_config=ScalingConfig(
                num_workers=pc.learner_workers,
                use_gpu=cuda,
                resources_per_worker={
                    "CPU": pc.cpus_per_worker,
                    **({"GPU": pc.gpus_per_worker} if cuda else {}),
                },
            ),
            torch_config=TorchConfig(backend="nccl" if cuda else "gloo"),
            run_config=TrainRunConfig(
                # one Ray Train experiment per driver process: its checkpoints sit beside earlier
                # sessions' under RUN/checkpoints, where asyncrl.checkpoint.latest finds the newest
                name=f"session-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
                storage_path=str(run_dir / "checkpoints"),
                failure_config=FailureConfig(max_failures=pc.max_learner_failures),
            ),
            datasets={} if single else {"train": stream},
            dataset_config=DataConfig(enable_shard_locality=False),
        )
        # the driver owns the progress display: it follows RUN/metrics.jsonl while the run trains
        start_step = checkpoint.step_of(plan.resume_dir) if plan.resume_dir else 0
        with (
            nullcontext(display) if display is not None else Display(enabled=cfg.telemetry.progress) as shown,
            shown.follow(run_dir, title=run_dir.name, total=cfg.train.steps, start=start_step),
        ):
            marks["fit_at"] = time.time()
            result = trainer.fit()
        note = checkpoint.read_abort(run_dir)
        if note is not None and note["kind"] == "stream":  # a stage raised (asyncrl.rollouts.StreamFailed)
            raise StreamFailed(note["message"])
        if result.error is not None:
            raise result.error
        store_stats = ray.get(store.stats.remote())
    except BaseException as err:
        write_summary(run_dir, failed_summary(run_dir, err, wall_s=time.perf_counter() - t0))
        raise
    finally:
        if started:
            ray.shutdown()
    aborted = note["message"] if note is not None else None  # the numerics guard's (a stream note raised)
    summary = summarize(
        run_dir,
        algo=cfg.algo,
        estimator=cfg.estimator.name,
        max_lag=pc.max_lag,
        teacher_accuracy=plan.models.teacher_accuracy,
        wall_s=time.perf_counter() - t0,
        store_stats=store_stats,
        status=N.STATUS_ABORTED if aborted else N.STATUS_COMPLETED,
        marks=marks,
    )
    if aborted:
        summary["error"] = aborted
    write_summary(run_dir, summary)
    if aborted:
        raise RunAborted(aborted)
    return RunResult(run_dir=run_dir, summary=summary, config=cfg)
