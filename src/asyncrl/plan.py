"""The plan of a run, made without Ray: models, build-time checks, component options, prompt blocks.

Everything that can be decided or refused before a process starts lives here, so that
``asyncrl validate`` (and ``asyncrl run`` before Ray starts) gives the same one-line errors the
pipeline would: unknown or mismatched components, estimator/cache/engine pairings, missing
checkpoints, resources that cannot be satisfied. ``asyncrl.pipeline`` turns a ``RunPlan`` into
the Ray graph.

The prompt stream (``asyncrl.stream``): seeded epochs over the training prompts, ``G`` samples
per prompt (a group), cut into blocks of ``B / W`` samples (one learner worker's share of one
rollout batch) with ``sample_id`` = position in the stream and ``block_index`` = position of
the block. A built-in task's blocks are cut here, in the driver, before Ray sees the data
(``prompt_blocks``); prompt files are opened and checked here (``RunPlan.prompts``) and
streamed by one Ray Data actor. Either way a run config always yields the same blocks, and a
resumed run removes the samples its ledger says were consumed and generates the rest again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl import records as R
from asyncrl.config import RunConfig
from asyncrl.configurable import to_dict
from asyncrl.stream import BlockCutter
from asyncrl.workloads.prompts import PromptSource


@dataclass(frozen=True)
class ModelPaths:
    teacher_dir: str | None  # None for RL
    student_dir: str
    teacher_accuracy: float | None
    student_accuracy: float | None


@dataclass(frozen=True)
class RunPlan:
    """A checked run: the config (local paths absolute) and what the pipeline builds from it."""

    cfg: RunConfig
    models: ModelPaths
    #: the teacher-cache kind the scoring stage builds (None for RL) and its options
    cache_kind: str | None
    cache_options: dict[str, Any]
    #: the run's controller chain as (name, options): bounded staleness first, then the user's
    controller_specs: list[tuple[str, dict[str, Any]]]
    engine_options: dict[str, Any]
    resume_dir: str | None
    #: ``workload.prompts_path`` resolved and its schema checked (None: the task's own split)
    prompts: PromptSource | None = None

    @property
    def rl(self) -> bool:
        return self.cache_kind is None


# --- the controller chain: one owner of the staleness bound ---------------------------------------
def controller_specs(cfg: RunConfig) -> list[tuple[str, dict[str, Any]]]:
    """``bounded_staleness`` from ``pipeline.max_lag`` / ``pipeline.lag_mode`` first, then the
    configured controllers. The bound is configured in one place: listing ``bounded_staleness``
    under ``controllers:`` as well is refused."""
    for i, c in enumerate(cfg.controllers):
        if c.name == "bounded_staleness":
            raise ValueError(
                f"controllers[{i}]: bounded_staleness is built from pipeline.max_lag "
                f"(={cfg.pipeline.max_lag}) and pipeline.lag_mode; remove it from controllers: and set "
                f"those instead (e.g. pipeline.max_lag={c.options.get('max_lag', cfg.pipeline.max_lag)})"
            )
    bound = {"max_lag": cfg.pipeline.max_lag, "mode": cfg.pipeline.lag_mode}
    return [("bounded_staleness", bound)] + [(c.name, dict(c.options)) for c in cfg.controllers]


def kept_versions(cfg: RunConfig) -> int:
    """Past weight versions the PolicyStore must keep fetchable: a fixed-lag run generates up to
    ``S + N - 1`` versions back (N mini-batch steps per rollout batch); otherwise only the latest."""
    if cfg.pipeline.lag_mode == "fixed":
        return cfg.pipeline.max_lag + cfg.train.minibatches
    return 0


# --- models ----------------------------------------------------------------------------------------
def resolve_models(cfg: RunConfig, *, rl: bool) -> ModelPaths:
    """Find the teacher and student checkpoints; fail with the command that creates them."""
    from asyncrl.workloads.checkpoints import load_pair, read_meta
    from asyncrl.workloads.pretrain import run_dir_for

    w = cfg.workload
    if w.student_path or w.teacher_path:
        teacher_dir, student_dir = w.teacher_path, w.student_path
        if student_dir is None:
            raise ValueError("workload.student_path is required when workload.teacher_path is given")
        if teacher_dir is None and not rl:
            raise ValueError(
                f"workload.teacher_path is required: estimator {cfg.estimator.name!r} distils from a teacher"
            )
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
        teacher_dir=None if rl else teacher_dir,
        student_dir=student_dir,
        teacher_accuracy=tmeta.get("accuracy"),
        student_accuracy=smeta.get("accuracy"),
    )


# --- checks made before any process starts -------------------------------------------------------
def check_components(cfg: RunConfig, student_dir: str | None) -> tuple[Any, str | None, dict[str, Any]]:
    """Names, pairings, capabilities: returns (estimator, cache kind or None for RL, cache options)."""
    from asyncrl.caches import CACHES, check_pairing
    from asyncrl.caches import cache_options as options_for
    from asyncrl.controllers import build_chain
    from asyncrl.engines import ENGINES
    from asyncrl.engines.base import SamplingParams
    from asyncrl.estimators import build as build_estimator

    estimator = build_estimator(cfg.estimator.name, dict(cfg.estimator.options))
    kind = None
    opts: dict[str, Any] = {}
    if estimator.cache_kind is None:  # an RL estimator: rewards, no teacher
        if cfg.cache.kind != "auto":
            raise ValueError(
                f"cache.kind={cfg.cache.kind!r} but estimator {cfg.estimator.name!r} is an RL estimator "
                f"(rewards, no teacher cache): remove cache.kind"
            )
        if R.GROUP_ID in estimator.required_columns() and cfg.train.group_size < 2:
            raise ValueError(
                f"estimator {cfg.estimator.name!r} normalises rewards within groups: "
                f"set train.group_size >= 2"
            )
    else:
        kind = estimator.cache_kind if cfg.cache.kind == "auto" else cfg.cache.kind
        check_pairing(estimator, kind)
        opts = options_for(kind, k=cfg.cache.k, m=cfg.cache.m)
        CACHES.get(kind)(**opts)  # validates the options
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
    ENGINES.get(cfg.pipeline.engine).check_supported(
        student_dir, SamplingParams(**to_dict(cfg.sampling)), **dict(cfg.pipeline.engine_options)
    )
    tc, pc = cfg.train, cfg.pipeline
    if tc.batch_size % pc.learner_workers:
        raise ValueError(
            f"train.batch_size={tc.batch_size} must divide evenly over "
            f"pipeline.learner_workers={pc.learner_workers}"
        )
    local = tc.batch_size // pc.learner_workers
    if local % (tc.group_size * tc.minibatches):
        raise ValueError(
            f"each learner worker's share of train.batch_size ({local}) must split into train.minibatches="
            f"{tc.minibatches} mini-batches of whole groups (train.group_size={tc.group_size})"
        )
    chain = build_chain(controller_specs(cfg))
    if pc.backend == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ValueError(
                "pipeline.backend=deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'"
            )
        if getattr(chain, "transforms_gradients", False):
            raise ValueError(
                "gradient-transform controllers (e.g. gradient_alignment) need full gradients; "
                "they are not supported with pipeline.backend=deepspeed (ZeRO partitions gradients)"
            )
    return estimator, kind, opts


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


def check_gpus(cfg: RunConfig, cluster_gpus: float, *, rl: bool) -> None:
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
    actors = pc.generators + (0 if rl else pc.teacher_scorers)
    need = pc.learner_workers * pc.gpus_per_worker + actors * pc.gpus_per_actor
    if cluster_gpus + 1e-9 < need:
        raise ValueError(
            f"pipeline.device=cuda reserves {need:g} GPUs ({pc.learner_workers} learner worker(s) x "
            f"gpus_per_worker={pc.gpus_per_worker:g} + {actors} actor(s) x gpus_per_actor="
            f"{pc.gpus_per_actor:g}) but the Ray cluster has {cluster_gpus:g}: lower the shares "
            f"(e.g. pipeline.gpus_per_worker=0.5 pipeline.gpus_per_actor=0.25 on one GPU) or use "
            f"pipeline.device=cpu"
        )


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """Workers do not share the driver's working directory: make every local path absolute."""
    w = cfg.workload
    return replace(
        cfg,
        run_dir=str(Path(cfg.run_dir).resolve()),
        workload=replace(
            w,
            cache_dir=str(Path(w.cache_dir).resolve()),
            prompts_path=str(Path(w.prompts_path).resolve()) if w.prompts_path else None,
        ),
    )


def make_plan(cfg: RunConfig, *, models: bool = True) -> RunPlan:
    """Check ``cfg`` and resolve everything the pipeline needs. ``models=False`` skips the
    checkpoint lookup (``asyncrl validate`` of a config whose models are not trained yet)."""
    from asyncrl.checkpoint import latest

    cfg = absolute_paths(cfg)
    paths = resolve_models(cfg, rl=cfg.algo == "rl") if models else None
    _, kind, opts = check_components(cfg, paths.student_dir if paths else None)
    resume = latest(cfg.run_dir) if cfg.pipeline.resume else None
    return RunPlan(
        cfg=cfg,
        models=paths if paths is not None else ModelPaths(None, "", None, None),
        cache_kind=kind,
        cache_options=opts,
        controller_specs=controller_specs(cfg),
        engine_options=generator_engine_options(cfg),
        resume_dir=str(resume) if resume else None,
        prompts=PromptSource.open(cfg.workload.prompts_path) if cfg.workload.prompts_path else None,
    )


# --- prompts -------------------------------------------------------------------------------------------
def load_examples(cfg: RunConfig) -> tuple[list[Any] | None, list[Any]]:
    """Training prompts of the task's split (None when ``workload.prompts_path`` streams them
    instead, ``asyncrl.stream``) and the task's held-out eval prompts."""
    from asyncrl.workloads.tasks import get_task

    task = get_task(cfg.workload.task)
    train = None
    if not cfg.workload.prompts_path:
        train = task.make_examples("train", cfg.workload.train_size, cfg.workload.pretrain_seed)
    evals = task.make_examples("eval", cfg.workload.eval_size, cfg.workload.pretrain_seed)
    return train, evals


def stream_blocks(cfg: RunConfig) -> int:
    """Blocks the stream offers a run: every rollout batch, the ``max_lag`` ahead and a margin,
    plus a quarter for dropped samples."""
    tc, pc = cfg.train, cfg.pipeline
    need = (tc.steps // tc.minibatches + pc.max_lag + 2) * tc.batch_size
    need = int(need * 1.25) + tc.batch_size
    return need // (tc.batch_size // pc.learner_workers)


def prompt_blocks(
    cfg: RunConfig,
    examples: list[Any],
    tokenizer: Any,
    max_prompt_len: int,
    skip_ids: np.ndarray | None = None,
) -> list[dict[str, np.ndarray]]:
    """The built-in task's blocks, cut in the driver: epoch ``e`` is ``rng([seed, e])``'s
    permutation of ``examples`` (see ``asyncrl.stream`` for ids, groups and blocks)."""
    from asyncrl.workloads.tasks import encode_prompts

    tc, pc = cfg.train, cfg.pipeline
    local = tc.batch_size // pc.learner_workers
    n_rows = -(-stream_blocks(cfg) * local // tc.group_size)
    order: list[int] = []
    epoch = 0
    while len(order) < n_rows:
        rng = np.random.default_rng([cfg.seed, epoch])
        order.extend(rng.permutation(len(examples)).tolist())
        epoch += 1
    ids, mask = encode_prompts(tokenizer, [examples[i].prompt for i in order], max_prompt_len)
    rows = {
        R.PROMPT_IDS: ids.numpy(),
        R.PROMPT_MASK: mask.numpy(),
        R.ANSWER: np.asarray([examples[i].answer for i in order], dtype=object),
        R.PROMPT_ID: np.asarray([examples[i].prompt_id for i in order], dtype=np.int64),
    }
    cutter = BlockCutter(tc.group_size, local, skip_ids)
    cutter.add(rows, np.arange(len(order), dtype=np.int64))
    return list(cutter.blocks())
