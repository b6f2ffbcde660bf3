"""Builds and runs the Ray graph of a ``RunPlan`` (``asyncrl.plan``)::

    prompt blocks (one per learner worker per rollout batch, in stream order: cut in the driver
                   for a built-in task, or streamed from prompt files by StreamBlocks, asyncrl.stream)
      -> map_batches(Generate, actor pool)      admitted by the PolicyStore in block order
      -> map_batches(ScoreTeacher | ScoreReward, actor pool)
      -> Ray Train TorchTrainer (train_loop_per_worker in asyncrl.learner), blocks in the same order
           rank 0 publishes weights after every optimizer step and releases each rollout batch

Ordering rule: blocks are admitted in stream order (``AdmissionBudget``) and consumed in stream
order (Ray Data ``preserve_order``; with W learner workers the split hands rank ``k`` blocks
``k, k+W, ...``), so any number of generators, scorers and learner workers can neither deadlock
nor train a sample later than the controller chain admitted it for. ``max_lag = 0`` is strict
synchronous on-policy training through the same graph.

Latency choices (measured in shared/research/raydata_latency.md): one task in flight per
actor (Ray Data's default of 2 keeps a gated task active and adds 100 ms ticks), consumer
``prefetch_batches=0`` (lock-step deadlocks otherwise), no shard locality (deadlocks with
small blocks), and with one learner worker the executor runs inside that worker
(``datasets_to_split=[]``), which skips the OutputSplitter hop.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.config import RunConfig, load_config, save_config
from asyncrl.configurable import to_dict
from asyncrl.plan import RunPlan, check_gpus, kept_versions, load_examples, make_plan, prompt_blocks
from asyncrl.raysetup import RAY_ENV, apply_env
from asyncrl.telemetry.progress import Display


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    config: RunConfig


def init_ray(cfg: RunConfig) -> bool:
    """Start (or join) Ray; returns True if this call started it (and so must shut it down).
    Worker logs reach the driver through ``asyncrl.telemetry.console``'s filter (``-v``: all)."""
    import os

    import ray

    from asyncrl.telemetry import console

    if ray.is_initialized():
        console.install_log_filter()
        return False
    from asyncrl.raysetup import runtime_env

    env = runtime_env({**RAY_ENV, **console.quiet_env()}, cfg.pipeline.data_tick_s)
    level = console.ray_logging_level()
    if cfg.pipeline.ray_address:
        ray.init(address=cfg.pipeline.ray_address, runtime_env=env, log_to_driver=True, logging_level=level)
    else:
        num_cpus = cfg.pipeline.num_cpus or max(4, 2 * (os.cpu_count() or 2))
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            runtime_env=env,
            log_to_driver=True,
            logging_level=level,
        )
    console.install_log_filter()
    return True


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


def build_dataset(
    plan: RunPlan,
    blocks: list[dict[str, np.ndarray]] | None,
    namespace: str,
    store_name: str,
    *,
    skip_ids: np.ndarray | None = None,
) -> Any:
    """The Ray Data graph: prompt blocks -> generation -> teacher (or reward) scoring, in order.
    ``blocks`` cut in the driver (a built-in task), or None: ``plan.prompts`` streamed
    (``asyncrl.stream``), without the samples in ``skip_ids`` (a resume's ledger)."""
    import ray.data

    from asyncrl.stages import Generate, ScoreReward, ScoreTeacher

    cfg = plan.cfg
    pc = cfg.pipeline
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the ordering rule: consumption in block order
    ctx.execution_no_progress_timeout_s = pc.no_progress_timeout_s
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    local = cfg.train.batch_size // pc.learner_workers
    ds = (
        ray.data.from_arrow([_to_arrow(b) for b in blocks])
        if blocks is not None
        else streamed(plan, skip_ids)
    )
    # on cuda every actor reserves a GPU share (Ray hides GPUs from actors that reserve none)
    actor_gpus = pc.gpus_per_actor if pc.device == "cuda" else None
    ds = ds.map_batches(
        Generate,
        batch_size=local,
        compute=ray.data.ActorPoolStrategy(size=pc.generators, max_tasks_in_flight_per_actor=1),
        num_cpus=pc.cpus_per_actor,
        num_gpus=actor_gpus,
        resources=dict(pc.generator_resources) or None,
        fn_constructor_kwargs=dict(
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
        ),
    )
    if plan.rl:
        scorer, kwargs = ScoreReward, dict(task=cfg.workload.task, tokenizer_dir=plan.models.student_dir)
    else:
        scorer, kwargs = (
            ScoreTeacher,
            dict(
                teacher_dir=plan.models.teacher_dir,
                cache=plan.cache_kind,
                cache_options=plan.cache_options,
                task=cfg.workload.task,
                seed=cfg.seed,
                torch_threads=pc.torch_threads,
                device=pc.device,
            ),
        )
    return ds.map_batches(
        scorer,
        batch_size=local,
        compute=ray.data.ActorPoolStrategy(size=pc.teacher_scorers, max_tasks_in_flight_per_actor=1),
        num_cpus=pc.cpus_per_actor,
        num_gpus=None if plan.rl else actor_gpus,  # the reward stage needs no GPU
        resources=dict(pc.scorer_resources) or None,
        fn_constructor_kwargs=kwargs,
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


def run(
    cfg: RunConfig | str | Path, *, fail_at_step: int | None = None, display: Display | None = None
) -> RunResult:
    """Run a whole pipeline; returns the run directory and its summary. See the module docstring.

    Progress: a row in ``display`` (a caller's ``asyncrl.telemetry.progress.Display``, e.g. a
    sweep's, one row per run), else in a display of its own (``telemetry.progress``)."""
    apply_env()
    import ray
    from ray.train import DataConfig, FailureConfig, ScalingConfig
    from ray.train import RunConfig as TrainRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from transformers import AutoTokenizer

    from asyncrl.checkpoint import COORDINATOR_FILE, STATE_FILE, load_ledger
    from asyncrl.coordinator import PolicyStore
    from asyncrl.learner import LearnerSpec, train_loop_per_worker
    from asyncrl.telemetry.sinks import write_summary
    from asyncrl.telemetry.summary import summarize

    if not isinstance(cfg, RunConfig):
        cfg = load_config(cfg)
    t0 = time.perf_counter()
    plan = make_plan(cfg)
    cfg = plan.cfg
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")

    train_ex, eval_ex = load_examples(cfg)
    skip = load_ledger(plan.resume_dir) if plan.resume_dir else None
    start_step = json.loads(Path(plan.resume_dir, STATE_FILE).read_text())["step"] if plan.resume_dir else 0
    blocks = None  # prompt files: streamed by Ray Data (asyncrl.stream), never held here
    if train_ex is not None:
        tokenizer = AutoTokenizer.from_pretrained(plan.models.student_dir, local_files_only=True)
        max_prompt_len = cfg.workload.max_prompt_tokens or max(
            len(tokenizer(e.prompt)["input_ids"]) for e in train_ex[:2048]
        )
        blocks = prompt_blocks(cfg, train_ex, tokenizer, max_prompt_len, skip)

    started = init_ray(cfg)
    namespace = ray.get_runtime_context().namespace
    store_name = f"asyncrl-store-{uuid.uuid4().hex[:8]}"
    pc = cfg.pipeline
    cuda = pc.device == "cuda"
    try:
        check_gpus(cfg, float(ray.cluster_resources().get("GPU", 0.0)), rl=plan.rl)
        store = PolicyStore.options(name=store_name).remote(
            plan.controller_specs,
            cfg.train.batch_size,
            blocks_per_rollout=pc.learner_workers,
            versions_per_rollout=cfg.train.minibatches,
            keep_versions=kept_versions(cfg),
        )
        coordinator_state = Path(plan.resume_dir, COORDINATOR_FILE) if plan.resume_dir else None
        if coordinator_state is not None and coordinator_state.exists():
            ray.get(store.load_state_dict.remote(json.loads(coordinator_state.read_text())))
        ds = build_dataset(plan, blocks, namespace, store_name, skip_ids=skip)
        spec = LearnerSpec(
            cfg=cfg,
            controller_specs=plan.controller_specs,
            student_dir=plan.models.student_dir,
            run_dir=str(run_dir),
            namespace=namespace,
            store_name=store_name,
            eval_prompts=[(e.prompt, e.answer) for e in eval_ex[: cfg.train.eval_size]],
            resume_dir=plan.resume_dir,
            fail_at_step=fail_at_step,
        )
        if pc.learner_workers == 1:
            data_config = DataConfig(datasets_to_split=[], enable_shard_locality=False)
        else:
            data_config = DataConfig(enable_shard_locality=False)
        trainer = TorchTrainer(
            train_loop_per_worker,
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
                name="checkpoints", storage_path=str(run_dir), failure_config=FailureConfig(max_failures=0)
            ),
            datasets={"train": ds},
            dataset_config=data_config,
        )
        # the driver owns the progress display: it follows RUN/metrics.jsonl while the run trains
        with (
            nullcontext(display) if display is not None else Display(enabled=cfg.telemetry.progress) as shown,
            shown.follow(run_dir, title=run_dir.name, total=cfg.train.steps, start=start_step),
        ):
            result = trainer.fit()
        if result.error is not None:
            raise result.error
        store_stats = ray.get(store.stats.remote())
    finally:
        if started:
            ray.shutdown()
    summary = summarize(
        run_dir,
        algo=cfg.algo,
        estimator=cfg.estimator.name,
        max_lag=pc.max_lag,
        teacher_accuracy=plan.models.teacher_accuracy,
        wall_s=time.perf_counter() - t0,
        store_stats=store_stats,
    )
    write_summary(run_dir, summary)
    return RunResult(run_dir=run_dir, summary=summary, config=cfg)
