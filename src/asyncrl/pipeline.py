"""Builds and runs the Ray graph of the design card::

    prompts (in-memory blocks, one learner step per block, seeded epochs)
      -> map_batches(Generate, actor pool)      asks PolicyStore for admission, tags versions
      -> map_batches(ScoreTeacher | ScoreReward, actor pool)
      -> Ray Train TorchTrainer (train_loop_per_worker in asyncrl.learner)
           rank 0 publishes weights v+1 to the PolicyStore after every step

``max_lag = 0`` is strict synchronous on-policy training through the same graph: the
admission budget lets exactly one step of work be in flight, and it is released only after
the new weights were published.

Latency choices (measured in shared/research/raydata_latency.md): one task in flight per
actor (Ray Data's default of 2 keeps a gated task active and adds 100 ms ticks), consumer
``prefetch_batches=0`` (lock-step deadlocks otherwise), no shard locality (deadlocks with
small blocks), and with one learner worker the executor runs inside that worker
(``datasets_to_split=[]``), which skips the OutputSplitter hop.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl import records as R
from asyncrl.config import RunConfig, load_config, save_config
from asyncrl.configurable import to_dict
from asyncrl.telemetry.sinks import read_metrics

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DS_ACCELERATOR": "cpu",
}
for _k, _v in RAY_ENV.items():
    os.environ.setdefault(_k, _v)


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    config: RunConfig


@dataclass(frozen=True)
class ModelPaths:
    teacher_dir: str | None  # None for RL
    student_dir: str
    teacher_accuracy: float | None
    student_accuracy: float | None


# --- models and data --------------------------------------------------------------------------------
def resolve_models(cfg: RunConfig) -> ModelPaths:
    """Find the teacher and student checkpoints; fail with the command that creates them."""
    from asyncrl.workloads.checkpoints import load_pair, read_meta
    from asyncrl.workloads.pretrain import run_dir_for

    w = cfg.workload
    if w.student_path or w.teacher_path:
        teacher_dir, student_dir = w.teacher_path, w.student_path
        if student_dir is None:
            raise ValueError("workload.student_path is required when workload.teacher_path is given")
        if teacher_dir is None and cfg.algo == "opd":
            raise ValueError("workload.teacher_path is required for algo=opd when student_path is given")
    else:
        root = run_dir_for(w.task, w.preset, w.pretrain_seed, w.cache_dir)
        teacher_dir, student_dir = str(root / "teacher"), str(root / "student")
    # absolute: Ray actors and Train workers do not run in the driver's working directory
    teacher_dir = str(Path(teacher_dir).resolve()) if teacher_dir else None
    student_dir = str(Path(student_dir).resolve())
    load_pair(teacher_dir or student_dir, student_dir)  # raises on missing/incomplete dirs and vocab mismatch
    tmeta = read_meta(teacher_dir) if teacher_dir else {}
    smeta = read_meta(student_dir)
    return ModelPaths(
        teacher_dir=teacher_dir if cfg.algo == "opd" else None,
        student_dir=student_dir,
        teacher_accuracy=tmeta.get("accuracy"),
        student_accuracy=smeta.get("accuracy"),
    )


def load_examples(cfg: RunConfig) -> tuple[list[Any], list[Any]]:
    from asyncrl.workloads.tasks import get_task, load_prompts

    task = get_task(cfg.workload.task)
    if cfg.workload.prompts_path:
        train = load_prompts(cfg.workload.prompts_path)
    else:
        train = task.make_examples("train", cfg.workload.train_size, cfg.workload.pretrain_seed)
    evals = task.make_examples("eval", cfg.workload.eval_size, cfg.workload.pretrain_seed)
    return train, evals


def prompt_blocks(
    cfg: RunConfig,
    examples: list[Any],
    tokenizer: Any,
    max_prompt_len: int,
    skip_ids: np.ndarray | None = None,
) -> list[dict[str, np.ndarray]]:
    """One block per learner-worker step: seeded epochs, groups of G, ids assigned before Ray sees them.

    ``sample_id`` is the global position in this deterministic stream, so the same run config
    always produces the same blocks; on resume, samples already consumed (``skip_ids``) are
    removed and everything after them is generated again.
    """
    from asyncrl.workloads.tasks import encode_prompts

    tc, pc = cfg.train, cfg.pipeline
    G = tc.group_size
    local = tc.batch_size // pc.learner_workers
    need = (tc.steps + pc.max_lag + 2) * tc.batch_size
    need = int(need * 1.25) + tc.batch_size
    order: list[int] = []
    epoch = 0
    while len(order) * G < need:
        rng = np.random.default_rng([cfg.seed, epoch])
        order.extend(rng.permutation(len(examples)).tolist())
        epoch += 1
    prompts = [examples[i].prompt for i in order]
    ids, mask = encode_prompts(tokenizer, prompts, max_prompt_len)
    ids, mask = ids.numpy(), mask.numpy()
    n_prompts = len(order)
    group = np.repeat(np.arange(n_prompts), G)
    rows = {
        R.PROMPT_IDS: np.repeat(ids, G, axis=0),
        R.PROMPT_MASK: np.repeat(mask, G, axis=0),
        "answer": np.repeat(np.asarray([examples[i].answer for i in order], dtype=object), G),
        R.PROMPT_ID: np.repeat(np.asarray([examples[i].prompt_id for i in order], dtype=np.int64), G),
        R.GROUP_ID: group.astype(np.int64),
        R.SAMPLE_ID: np.arange(n_prompts * G, dtype=np.int64),
    }
    if skip_ids is not None and len(skip_ids):
        keep = ~np.isin(rows[R.SAMPLE_ID], skip_ids)
        rows = {k: v[keep] for k, v in rows.items()}
    n_blocks = len(rows[R.SAMPLE_ID]) // local
    return [{k: v[b * local : (b + 1) * local] for k, v in rows.items()} for b in range(n_blocks)]


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


# --- checks made when the pipeline is built ---------------------------------------------------------------
def cache_kind(cfg: RunConfig, estimator: Any) -> str | None:
    """The cache kind the teacher stage builds: the estimator's own, or a configured one it accepts."""
    from asyncrl.caches import check_pairing

    if cfg.algo == "grpo":
        return None
    kind = estimator.cache_kind if cfg.cache.kind == "auto" else cfg.cache.kind
    check_pairing(estimator, kind)
    return kind


def cache_options(cfg: RunConfig, kind: str | None) -> dict[str, Any]:
    """Options of the cache kind from ``cache.k`` / ``cache.m`` (validated by building it now)."""
    from asyncrl.caches import CACHES
    from asyncrl.caches import cache_options as options_for

    if kind is None:
        return {}
    opts = options_for(kind, k=cfg.cache.k, m=cfg.cache.m)
    CACHES.get(kind)(**opts)
    return opts


def check_build(cfg: RunConfig, models: ModelPaths) -> tuple[Any, str | None]:
    """Everything that can be checked before a process starts: names, pairings, capabilities."""
    from asyncrl.engines import ENGINES
    from asyncrl.engines.base import SamplingParams
    from asyncrl.estimators import build as build_estimator

    estimator = build_estimator(cfg.estimator.name, dict(cfg.estimator.options))
    if cfg.algo == "grpo" and estimator.cache_kind is not None:
        raise ValueError(f"algo=grpo needs an RL estimator (e.g. 'grpo'), got {cfg.estimator.name!r}")
    if cfg.algo == "opd" and estimator.cache_kind is None:
        raise ValueError(
            f"algo=opd needs a distillation estimator, got the RL estimator {cfg.estimator.name!r}"
        )
    kind = cache_kind(cfg, estimator)
    needs_mc = R.MC_IDS in estimator.required_columns() or kind == "behavior_mc"
    if needs_mc and cfg.sampling.mc_samples < 1:
        raise ValueError(
            f"estimator {cfg.estimator.name!r} needs behavior MC samples: set sampling.mc_samples >= 1 "
            f"(e.g. sampling.mc_samples=8)"
        )
    if cfg.sampling.temperature == 0:
        raise ValueError(
            "sampling.temperature=0 is greedy; training needs a sampling distribution (e.g. 1.0)"
        )
    # the engine decides what it can serve for this checkpoint (MC draws, kernels, its extra)
    engine_cls = ENGINES.get(cfg.pipeline.engine)
    engine_cls.check_supported(
        models.student_dir if models is not None else None,
        SamplingParams(**to_dict(cfg.sampling)),
        **dict(cfg.pipeline.engine_options),
    )
    if cfg.train.batch_size % cfg.pipeline.learner_workers:
        raise ValueError(
            f"train.batch_size={cfg.train.batch_size} must divide evenly over "
            f"pipeline.learner_workers={cfg.pipeline.learner_workers}"
        )
    if (cfg.train.batch_size // cfg.pipeline.learner_workers) % cfg.train.group_size:
        raise ValueError(
            "each learner worker's share of train.batch_size must hold whole groups (group_size)"
        )
    if cfg.pipeline.backend == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ValueError(
                "pipeline.backend=deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'"
            )
        from asyncrl.controllers import build_chain
        from asyncrl.learner import controller_specs

        chain = build_chain(controller_specs(cfg))
        if getattr(chain, "transforms_gradients", False):
            raise ValueError(
                "gradient-transform controllers (e.g. gradient_alignment) need full gradients; "
                "they are not supported with pipeline.backend=deepspeed (ZeRO partitions gradients)"
            )
    return estimator, kind


# --- Ray -----------------------------------------------------------------------------------------------
def init_ray(cfg: RunConfig) -> bool:
    """Start (or join) Ray; returns True if this call started it (and so must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    from asyncrl.raysetup import runtime_env

    env = runtime_env(dict(RAY_ENV), cfg.pipeline.data_tick_s)
    if cfg.pipeline.ray_address:
        ray.init(address=cfg.pipeline.ray_address, runtime_env=env, log_to_driver=True)
    else:
        num_cpus = cfg.pipeline.num_cpus or max(4, 2 * (os.cpu_count() or 2))
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=True)
    return True


def generator_engine_options(cfg: RunConfig) -> dict[str, Any]:
    """``pipeline.engine_options`` plus what ``pipeline.device=cuda`` implies, unless set: the HF
    engine on ``cuda``, and vLLM's ``gpu_memory_utilization`` within the actor's GPU share (vLLM
    otherwise claims 90% of the device, which the learner and the teacher share)."""
    pc = cfg.pipeline
    options = dict(pc.engine_options)
    if pc.device == "cuda" and pc.engine == "hf":
        options.setdefault("device", "cuda")
    if pc.device == "cuda" and pc.engine == "vllm":
        options.setdefault("gpu_memory_utilization", round(0.9 * min(pc.gpus_per_actor, 1.0), 4))
    return options


def check_gpus(cfg: RunConfig, cluster_gpus: float) -> None:
    """``pipeline.device=cuda``: the GPU shares the run reserves must fit the Ray cluster's GPUs
    (else Ray would wait for them forever); checked once Ray is up, before any actor starts."""
    pc = cfg.pipeline
    if pc.device != "cuda":
        return
    if pc.learner_workers > 1 and pc.gpus_per_worker < 1:
        raise ValueError(
            f"pipeline.learner_workers={pc.learner_workers} with pipeline.gpus_per_worker="
            f"{pc.gpus_per_worker:g}: Ray would pack several ranks onto one GPU, which NCCL refuses; "
            f"use pipeline.gpus_per_worker=1 (one GPU per rank) or pipeline.learner_workers=1"
        )
    actors = pc.generators + (pc.teacher_scorers if cfg.algo == "opd" else 0)
    need = pc.learner_workers * pc.gpus_per_worker + actors * pc.gpus_per_actor
    if cluster_gpus + 1e-9 < need:
        raise ValueError(
            f"pipeline.device=cuda reserves {need:g} GPUs ({pc.learner_workers} learner worker(s) x "
            f"gpus_per_worker={pc.gpus_per_worker:g} + {actors} actor(s) x gpus_per_actor="
            f"{pc.gpus_per_actor:g}) but the Ray cluster has {cluster_gpus:g}: lower the shares "
            f"(e.g. pipeline.gpus_per_worker=0.5 pipeline.gpus_per_actor=0.25 on one GPU) or use "
            f"pipeline.device=cpu"
        )


def build_dataset(
    cfg: RunConfig,
    models: ModelPaths,
    kind: str | None,
    blocks: list[dict[str, np.ndarray]],
    namespace: str,
    store_name: str,
) -> Any:
    import ray.data

    from asyncrl.stages import Generate, ScoreReward, ScoreTeacher

    pc = cfg.pipeline
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.execution_no_progress_timeout_s = pc.no_progress_timeout_s
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    local = cfg.train.batch_size // pc.learner_workers
    ds = ray.data.from_arrow([_to_arrow(b) for b in blocks])
    sampling = to_dict(cfg.sampling)
    # on cuda every actor reserves a GPU share (Ray hides GPUs from actors that reserve none)
    actor_gpus = pc.gpus_per_actor if pc.device == "cuda" else None
    engine_options = generator_engine_options(cfg)
    ds = ds.map_batches(
        Generate,
        batch_size=local,
        compute=ray.data.ActorPoolStrategy(size=pc.generators, max_tasks_in_flight_per_actor=1),
        num_cpus=pc.cpus_per_actor,
        num_gpus=actor_gpus,
        resources=dict(pc.generator_resources) or None,
        fn_constructor_kwargs=dict(
            engine=pc.engine,
            student_dir=models.student_dir,
            sampling=sampling,
            namespace=namespace,
            store_name=store_name,
            seed=cfg.seed,
            rpc_timeout_s=pc.rpc_timeout_s,
            admit_timeout_s=pc.no_progress_timeout_s,
            torch_threads=pc.torch_threads,
            engine_options=engine_options,
            max_engine_restarts=pc.max_engine_restarts,
        ),
    )
    if cfg.algo == "opd":
        scorer, kwargs = (
            ScoreTeacher,
            dict(
                teacher_dir=models.teacher_dir,
                cache=kind,
                cache_options=cache_options(cfg, kind),
                task=cfg.workload.task,
                seed=cfg.seed,
                torch_threads=pc.torch_threads,
                device=pc.device,
            ),
        )
    else:
        scorer, kwargs = ScoreReward, dict(task=cfg.workload.task, tokenizer_dir=models.student_dir)
    ds = ds.map_batches(
        scorer,
        batch_size=local,
        compute=ray.data.ActorPoolStrategy(size=pc.teacher_scorers, max_tasks_in_flight_per_actor=1),
        num_cpus=pc.cpus_per_actor,
        num_gpus=actor_gpus if cfg.algo == "opd" else None,  # the reward stage needs no GPU
        resources=dict(pc.scorer_resources) or None,
        fn_constructor_kwargs=kwargs,
    )
    return ds


def run(cfg: RunConfig | str | Path, *, fail_at_step: int | None = None) -> RunResult:
    """Run a whole pipeline; returns the run directory and its summary. See the module docstring."""
    import ray
    from ray.train import DataConfig, FailureConfig, ScalingConfig
    from ray.train import RunConfig as TrainRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from asyncrl.coordinator import PolicyStore
    from asyncrl.learner import LearnerSpec, latest_checkpoint, train_loop_per_worker

    if not isinstance(cfg, RunConfig):
        cfg = load_config(cfg)
    t0 = time.perf_counter()
    # workers do not share the driver's working directory: make every local path absolute
    cfg = replace(
        cfg,
        run_dir=str(Path(cfg.run_dir).resolve()),
        workload=replace(cfg.workload, cache_dir=str(Path(cfg.workload.cache_dir).resolve())),
    )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    models = resolve_models(cfg)
    _, kind = check_build(cfg, models)
    resume_dir = latest_checkpoint(run_dir) if cfg.pipeline.resume else None
    save_config(cfg, run_dir / "config.yaml")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.student_dir, local_files_only=True)
    train_ex, eval_ex = load_examples(cfg)
    max_prompt_len = max(len(tokenizer(e.prompt)["input_ids"]) for e in train_ex[:2048])
    skip = np.load(resume_dir / "ledger.npy") if resume_dir else None
    blocks = prompt_blocks(cfg, train_ex, tokenizer, max_prompt_len, skip)

    started = init_ray(cfg)
    namespace = ray.get_runtime_context().namespace
    store_name = f"asyncrl-store-{uuid.uuid4().hex[:8]}"
    cuda = cfg.pipeline.device == "cuda"
    try:
        check_gpus(cfg, float(ray.cluster_resources().get("GPU", 0.0)))
        store = PolicyStore.options(name=store_name).remote(cfg.pipeline.max_lag, cfg.train.batch_size)
        if resume_dir is not None and (resume_dir / "coordinator.json").exists():
            ray.get(store.load_state_dict.remote(json.loads((resume_dir / "coordinator.json").read_text())))
        ds = build_dataset(cfg, models, kind, blocks, namespace, store_name)
        spec = LearnerSpec(
            cfg=cfg,
            student_dir=models.student_dir,
            run_dir=str(run_dir),
            namespace=namespace,
            store_name=store_name,
            eval_prompts=[(e.prompt, e.answer) for e in eval_ex[: cfg.train.eval_size]],
            resume_dir=str(resume_dir) if resume_dir else None,
            fail_at_step=fail_at_step,
        )
        if cfg.pipeline.learner_workers == 1:
            data_config = DataConfig(datasets_to_split=[], enable_shard_locality=False)
        else:
            data_config = DataConfig(enable_shard_locality=False)
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"spec": spec},
            scaling_config=ScalingConfig(
                num_workers=cfg.pipeline.learner_workers,
                use_gpu=cuda,
                resources_per_worker={
                    "CPU": cfg.pipeline.cpus_per_worker,
                    **({"GPU": cfg.pipeline.gpus_per_worker} if cuda else {}),
                },
            ),
            torch_config=TorchConfig(backend="nccl" if cuda else "gloo"),
            run_config=TrainRunConfig(
                name="checkpoints", storage_path=str(run_dir), failure_config=FailureConfig(max_failures=0)
            ),
            datasets={"train": ds},
            dataset_config=data_config,
        )
        result = trainer.fit()
        if result.error is not None:
            raise result.error
        store_stats = ray.get(store.stats.remote())
    finally:
        if started:
            ray.shutdown()
    summary = summarize(run_dir, cfg, models, time.perf_counter() - t0, store_stats)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return RunResult(run_dir=run_dir, summary=summary, config=cfg)


# --- summary ----------------------------------------------------------------------------------------------
def read_samples(run_dir: Path) -> Any:
    """samples.parquet (or its live part files) as a pandas DataFrame; empty if none yet."""
    import pandas as pd

    from asyncrl.telemetry.sinks import read_samples as read_table

    table = read_table(run_dir)
    return table.to_pandas() if table is not None else pd.DataFrame()


def steady_throughput(metrics: list[dict[str, Any]]) -> float | None:
    """Samples/s between the first and last step, excluding evaluation time and start-up."""
    steps = [m for m in metrics if m.get("step", 0) >= 1 and "samples/kept" in m]
    if len(steps) < 2:
        return None
    first, last = steps[0], steps[-1]
    dt = (last["time_s"] - last.get("time/eval_total_s", 0.0)) - (
        first["time_s"] - first.get("time/eval_total_s", 0.0)
    )
    n = sum(m["samples/kept"] for m in steps[1:])
    return n / dt if dt > 0 else None


def summarize(
    run_dir: Path, cfg: RunConfig, models: ModelPaths, wall: float, store_stats: dict
) -> dict[str, Any]:
    metrics = read_metrics(run_dir)
    samples = read_samples(run_dir)
    evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    kept = samples[samples["kept"]] if len(samples) else samples
    lags = kept["lag"].to_numpy() if len(kept) else np.zeros(0)
    return {
        "algo": cfg.algo,
        "estimator": cfg.estimator.name,
        "max_lag": cfg.pipeline.max_lag,
        "steps": max((m.get("step", 0) for m in metrics), default=0),
        "samples_trained": len(kept),
        "samples_dropped": int(len(samples) - len(kept)),
        "wall_time_s": wall,
        "samples_per_s": steady_throughput(metrics),
        "lag_p50": float(np.median(lags)) if len(lags) else None,
        "lag_max": int(lags.max()) if len(lags) else None,
        "eval_accuracy_initial": evals[0] if evals else None,
        "eval_accuracy_final": evals[-1] if evals else None,
        "teacher_accuracy": models.teacher_accuracy,
        "reward_mean_first": _mean_reward(kept, first=True),
        "reward_mean_last": _mean_reward(kept, first=False),
        "admission_wait_s": store_stats.get("admission_wait_s"),
        # samples that were in flight when the run was last checkpointed and had to be generated again
        "in_flight_regenerated_on_resume": store_stats.get("budget/lost", 0),
        # blocks re-run after their generator died (they kept their admission: no budget leaked)
        "generation_retries": store_stats.get("budget/retries", 0),
        "engine_restarts": store_stats.get("engine_deaths", 0),
        "run_dir": str(run_dir),
    }


def _mean_reward(kept: Any, *, first: bool) -> float | None:
    if not len(kept) or "reward" not in kept:
        return None
    steps = sorted(kept["step"].unique())
    k = max(1, len(steps) // 4)
    sel = steps[:k] if first else steps[-k:]
    return float(kept[kept["step"].isin(sel)]["reward"].mean())
