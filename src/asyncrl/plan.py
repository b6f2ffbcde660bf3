"""The plan of a run, made without Ray: models, build-time checks, component options, prompt blocks.

Everything that can be decided or refused before a stage or learner process starts lives here, so
that ``asyncrl validate`` (and ``asyncrl run``, beside Ray's start:
``asyncrl.pipeline.prepare_driver``) gives the same one-line errors the pipeline would: unknown or
mismatched components, estimator/cache/engine pairings, missing checkpoints, resources that
cannot be satisfied. ``asyncrl.pipeline`` turns a ``RunPlan`` into
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
from asyncrl.configurable import ConfigError, to_dict
from asyncrl.controllers.bounded import BoundedStaleness
from asyncrl.raysetup import local_cpus
from asyncrl.stream import WIDTH_SAMPLE, BlockCutter
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
    #: longest training prompt in tokens (the prompt width P of the built-in task's blocks; for
    #: prompt files, of the rows checked: ``check_prompts``); 0 when models=False
    max_prompt_len: int = 0
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
    return [BoundedStaleness.from_config(cfg).spec()] + [(c.name, dict(c.options)) for c in cfg.controllers]


# --- models ----------------------------------------------------------------------------------------
def resolve_models(cfg: RunConfig, *, rl: bool) -> ModelPaths:
    """Find the teacher and student checkpoints and check them without loading weights (complete,
    weight files intact, one vocabulary); fail with the command that creates them. A ``.gguf``
    path is converted once to a cached checkpoint directory (``asyncrl.workloads.gguf.materialize``),
    which is what the rest of the run sees."""
    from asyncrl.workloads.checkpoints import CheckpointError, check_pair, read_meta, run_dir_for
    from asyncrl.workloads.gguf import materialize
    from asyncrl.workloads.real import PREPARED_FILE, is_real, prepare_hint
    from asyncrl.workloads.real import paths as real_paths

    w = cfg.workload
    sources: dict[str, str] = {}  # converted directory -> the GGUF file it came from
    if w.student_path or w.teacher_path:
        teacher_dir, student_dir = w.teacher_path, w.student_path
        if student_dir is None:
            raise ValueError("workload.student_path is required when workload.teacher_path is given")
        if teacher_dir is None and not rl:
            raise ValueError(
                f"workload.teacher_path is required: estimator {cfg.estimator.name!r} distils from a teacher"
            )
        given = {"teacher": teacher_dir, "student": student_dir}
        found = {
            r: materialize(p, w.cache_dir, field=f"workload.{r}_path") if p else None
            for r, p in given.items()
        }
        sources = {str(Path(found[r]).resolve()): str(given[r]) for r in given if found[r] != given[r]}
        teacher_dir, student_dir = found["teacher"], found["student"]
    elif is_real(w.preset):  # asyncrl prepare's directories
        made = real_paths(w.preset, w.cache_dir)
        if not Path(made["root"], PREPARED_FILE).is_file():
            hint = prepare_hint(w.preset, w.cache_dir)
            raise CheckpointError(f"real preset {w.preset!r} is not prepared in {made['root']}; {hint}")
        teacher_dir, student_dir = made["teacher_dir"], made["student_dir"]
    else:
        root = run_dir_for(w.task, w.preset, w.pretrain_seed, w.cache_dir)
        teacher_dir, student_dir = str(root / "teacher"), str(root / "student")
    # absolute: Ray actors and Train workers do not run in the driver's working directory
    teacher_dir = str(Path(teacher_dir).resolve()) if teacher_dir else None
    student_dir = str(Path(student_dir).resolve())
    try:  # missing/incomplete/truncated dirs, vocab mismatch
        check_pair(teacher_dir or student_dir, student_dir)
    except ValueError as err:  # name the GGUF file a converted directory came from
        if not sources:
            raise
        msg = str(err)
        for d, gguf in sources.items():
            msg = msg.replace(d, f"{d} (converted from {gguf})")
        raise type(err)(msg) from None
    tmeta = read_meta(teacher_dir) if teacher_dir else {}
    smeta = read_meta(student_dir)
    return ModelPaths(
        teacher_dir=None if rl else teacher_dir,
        student_dir=student_dir,
        teacher_accuracy=tmeta.get("accuracy"),
        student_accuracy=smeta.get("accuracy"),
    )


# --- checks made before any stage or learner process starts --------------------------------------
def check_components(cfg: RunConfig, student_dir: str | None) -> tuple[Any, str | None, dict[str, Any]]:
    """Names, pairings, capabilities: returns (estimator, cache kind or None for RL, cache options)."""
    from asyncrl.caches import CACHES, check_pairing
    from asyncrl.caches import cache_options as options_for
    from asyncrl.controllers import build_chain
    from asyncrl.engines import ENGINES
    from asyncrl.engines.base import SamplingParams, check_engine, supports_inflight
    from asyncrl.estimators import build as build_estimator
    from asyncrl.step import check_composition

    # sampling.temperature=0, train.batch_size over learner workers and train.minibatches into
    # groups are checked at load (``RunConfig.__post_init__``), before Ray starts
    estimator = build_estimator(cfg.estimator.name, dict(cfg.estimator.options))
    kind = None
    opts: dict[str, Any] = {}
    if estimator.cache_kind is None:  # an RL estimator: rewards, no teacher
        if cfg.cache.kind != "auto":
            raise ConfigError(
                "cache.kind",
                cfg.cache.kind,
                f"estimator {cfg.estimator.name!r} is an RL estimator (rewards, no teacher cache): "
                f"remove cache.kind",
            )
        if R.GROUP_ID in estimator.required_columns() and cfg.train.group_size < 2:
            raise ConfigError(
                "train.group_size",
                cfg.train.group_size,
                f"estimator {cfg.estimator.name!r} normalises rewards within groups: "
                f"set train.group_size >= 2",
            )
    else:
        kind = estimator.cache_kind if cfg.cache.kind == "auto" else cfg.cache.kind
        check_pairing(estimator, kind)
        # the teacher is scored at the sampling temperature, as the learner computes the student
        opts = options_for(kind, k=cfg.cache.k, m=cfg.cache.m, temperature=cfg.sampling.temperature)
        CACHES.get(kind)(**opts)  # validates the options
    needs_mc = R.MC_IDS in estimator.required_columns() or kind == "behavior_mc"
    if needs_mc and cfg.sampling.mc_samples < 1:
        raise ConfigError(
            "sampling.mc_samples",
            cfg.sampling.mc_samples,
            f"estimator {cfg.estimator.name!r} needs behavior MC samples: set sampling.mc_samples >= 1 "
            f"(e.g. sampling.mc_samples=8)",
        )
    # a registered name or a dotted path: the class must be an engine that takes the options, and
    # it decides what it can serve for this checkpoint (MC draws, kernels, its extra)
    engine = ENGINES.get(cfg.pipeline.engine)
    check_engine(engine, cfg.pipeline.engine, generator_engine_options(cfg))
    options = lora_engine_options(cfg, cfg.pipeline.engine_options)
    if cfg.pipeline.inflight_updates:  # the engine must poll between decode steps, or refuse here
        # the engine's own reason first (vllm: no pause / update / resume in its offline API)
        params = SamplingParams(**to_dict(cfg.sampling))
        engine.check_supported(None, params, **options, inflight_updates=True)
        if not supports_inflight(engine):
            raise ConfigError(
                "pipeline.inflight_updates",
                True,
                f"engine {cfg.pipeline.engine!r} takes no generate(..., poll_weights=...) (asyncrl.engines."
                f"base.WeightsPoll), so it cannot load weights between decode steps: use pipeline.engine=hf "
                f"or inflight_updates=false",
            )
        options = {**options, "inflight_updates": True}
    if cfg.pipeline.continuous_batching:  # the engine must step several rollouts together
        if not getattr(engine, "supports_continuous_batching", False):
            raise ConfigError(
                "pipeline.continuous_batching",
                True,
                f"engine {cfg.pipeline.engine!r} cannot decode several blocks in shared steps "
                f"(asyncrl.engines.continuous needs HFEngine's fast decode path): use pipeline.engine=hf "
                f"or continuous_batching=false",
            )
        options = {**options, "continuous_batching": True}
    engine.check_supported(student_dir, SamplingParams(**to_dict(cfg.sampling)), **options)
    pc = cfg.pipeline
    chain = build_chain(controller_specs(cfg))
    check_composition(estimator, chain)  # estimator x controller pairings with no documented gradient
    check_gradient_telemetry(cfg, estimator, student_dir)
    if pc.backend == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ValueError(
                "pipeline.backend=deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'"
            )
        if chain.transforms_gradients or chain.transforms_updates:
            raise ValueError(
                "gradient- or update-transform controllers (e.g. gradient_alignment) need full gradients "
                "and weights on every rank; they are not supported with pipeline.backend=deepspeed (ZeRO "
                "partitions them): use pipeline.backend=ddp"
            )
    return estimator, kind, opts


def check_gradient_telemetry(cfg: RunConfig, estimator: Any, student_dir: str | None) -> None:
    """``telemetry.grad_reference=dense`` needs a KL estimator (its direction is the reference), a
    teacher, and a vocabulary small enough to ship the teacher's full logits (4·V bytes per token);
    both gradient telemetries read full gradients, which ZeRO partitions."""
    from asyncrl.telemetry.gradients import MAX_VOCAB, estimand

    tel = cfg.telemetry
    if cfg.pipeline.backend == "deepspeed" and (tel.grad_reference != "none" or tel.grad_cos_prev):
        raise ValueError(
            "telemetry.grad_reference and telemetry.grad_cos_prev read full gradients; they are not "
            "supported with pipeline.backend=deepspeed (ZeRO partitions gradients): turn them off or use ddp"
        )
    if tel.grad_reference != "dense":
        return
    if estimator.cache_kind is None:
        raise ValueError(
            f"telemetry.grad_reference=dense compares with the exact KL to a teacher, but estimator "
            f"{cfg.estimator.name!r} learns from rewards (no teacher): set telemetry.grad_reference=none"
        )
    estimand(estimator)  # raises for an estimator with no KL direction
    if student_dir:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(student_dir, local_files_only=True).get_text_config().vocab_size
        if vocab > MAX_VOCAB:
            raise ValueError(
                f"telemetry.grad_reference=dense ships the teacher's full logits (4 x V bytes per token) and "
                f"is for small vocabularies (V <= {MAX_VOCAB}); this student's vocabulary has V={vocab}: "
                f"set telemetry.grad_reference=none"
            )


def generator_engine_options(cfg: RunConfig) -> dict[str, Any]:
    """``pipeline.engine_options`` plus what ``pipeline.device=cuda`` implies, unless set: the HF
    engine on ``cuda``, and vLLM's ``gpu_memory_utilization`` within the actor's GPU share (vLLM
    otherwise claims 90% of the device, which the learner and the teacher share)."""
    from asyncrl.engines import ENGINES, HFEngine, VLLMEngine

    pc = cfg.pipeline
    options = lora_engine_options(cfg, pc.engine_options)
    engine = ENGINES.get(pc.engine)  # also a dotted path, e.g. to a subclass
    if pc.device == "cuda" and isinstance(engine, type) and issubclass(engine, HFEngine):
        options.setdefault("device", "cuda")
    if pc.device == "cuda" and isinstance(engine, type) and issubclass(engine, VLLMEngine):
        options.setdefault("gpu_memory_utilization", round(0.9 * min(pc.gpus_per_actor, 1.0), 4))
    return options


def lora_engine_options(cfg: RunConfig, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus ``lora`` (``train.lora``'s options) for a LoRA student: the engines build the
    same adapters on the base student and load adapter versions (``asyncrl.lora``)."""
    options = dict(options)
    if cfg.train.lora is not None:
        options["lora"] = cfg.train.lora.options()
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
    need, parts = _reserved(
        cfg, "gpus", 0 if pc.colocate else pc.generators + (0 if rl else pc.teacher_scorers)
    )
    if cluster_gpus + 1e-9 < need:
        raise ValueError(
            f"pipeline.device=cuda reserves {need:g} GPUs ({parts}) but the Ray cluster has "
            f"{cluster_gpus:g}: lower the shares (e.g. pipeline.gpus_per_worker=0.5 "
            f"pipeline.gpus_per_actor=0.25 on one GPU) or use pipeline.device=cpu"
        )


def _reserved(cfg: RunConfig, unit: str, actors: int) -> tuple[float, str]:
    """What the run reserves of ``unit`` (``cpus`` | ``gpus``): the total and its breakdown."""
    pc = cfg.pipeline
    per_worker, per_actor = getattr(pc, f"{unit}_per_worker"), getattr(pc, f"{unit}_per_actor")
    need = pc.learner_workers * per_worker + actors * per_actor
    parts = (
        f"{pc.learner_workers} learner worker(s) x {unit}_per_worker={per_worker:g} + {actors} actor(s) x "
        f"{unit}_per_actor={per_actor:g}"
    )
    return need, parts


def check_cpus(cfg: RunConfig, cluster_cpus: float) -> None:
    """The CPU shares the run reserves (learner workers, generators, scorers; a colocated run
    only its learner workers) must fit the Ray cluster's logical CPUs, else an actor waits for
    them forever."""
    pc = cfg.pipeline
    need, parts = _reserved(cfg, "cpus", 0 if pc.colocate else pc.generators + pc.teacher_scorers)
    if cluster_cpus + 1e-9 < need:
        raise ValueError(
            f"the run reserves {need:g} CPUs ({parts}) but the Ray cluster has {cluster_cpus:g}: lower "
            f"pipeline.cpus_per_actor / pipeline.cpus_per_worker or the actor counts, or raise "
            f"pipeline.num_cpus"
        )


def check_local_resources(cfg: RunConfig, *, rl: bool) -> None:
    """Before Ray starts: a run on a local Ray instance (no ``pipeline.ray_address``) must fit its
    logical CPUs and this machine's GPUs (a cluster is checked once joined, by the pipeline)."""
    if cfg.pipeline.ray_address:
        return
    check_cpus(cfg, local_cpus(cfg))
    if cfg.pipeline.device == "cuda":
        import torch

        check_gpus(cfg, float(torch.cuda.device_count()), rl=rl)


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """Workers do not share the driver's working directory: make every local path absolute."""
    from asyncrl.workloads import real

    w = cfg.workload
    prompts, evals = w.prompts_path, w.eval_prompts_path
    made = real.paths(w.preset, w.cache_dir) if real.is_real(w.preset) else None
    prepared = made is not None and Path(made["root"], real.PREPARED_FILE).is_file()
    if prepared and not (w.teacher_path or w.student_path):  # its prepared prompt splits
        prompts, evals = prompts or made["train_prompts"], evals or made["eval_prompts"]
    return replace(
        cfg,
        run_dir=str(Path(cfg.run_dir).resolve()),
        workload=replace(
            w,
            cache_dir=str(Path(w.cache_dir).resolve()),
            prompts_path=str(Path(prompts).resolve()) if prompts else None,
            eval_prompts_path=str(Path(evals).resolve()) if evals else None,
        ),
    )


def make_plan(cfg: RunConfig, *, models: bool = True) -> RunPlan:
    """Check ``cfg`` and resolve everything the pipeline needs. ``models=False`` skips the
    checkpoint lookup (``asyncrl validate`` of a config whose models are not trained yet)."""
    from asyncrl.checkpoint import latest

    cfg = absolute_paths(cfg)
    paths = resolve_models(cfg, rl=cfg.algo == "rl") if models else None
    _, kind, opts = check_components(cfg, paths.student_dir if paths else None)
    check_local_resources(cfg, rl=kind is None)
    prompts = PromptSource.open(cfg.workload.prompts_path) if cfg.workload.prompts_path else None
    max_prompt_len = check_prompts(cfg, paths, source=prompts)
    resume = latest(cfg.run_dir) if cfg.pipeline.resume else None
    return RunPlan(
        cfg=cfg,
        models=paths if paths is not None else ModelPaths(None, "", None, None),
        cache_kind=kind,
        cache_options=opts,
        controller_specs=controller_specs(cfg),
        engine_options=generator_engine_options(cfg),
        resume_dir=str(resume) if resume else None,
        max_prompt_len=max_prompt_len,
        prompts=prompts,
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


@dataclass(frozen=True)
class EvalPlan:
    """What the learner evaluates: ``kind`` ``exact_match`` (``examples``: prompt/answer pairs of
    the task or of an eval file with answers) or ``agreement`` (``prompt_ids``: token ids of
    held-out prompts without answers, scored against the teacher: ``asyncrl.workloads.agreement``).
    ``note``: said to the user when the eval prompts are not held out."""

    kind: str
    examples: list[Any]
    prompt_ids: list[list[int]] | None = None
    source: str | None = None
    note: str | None = None


def eval_plan(cfg: RunConfig, models: ModelPaths, examples: list[Any]) -> EvalPlan:
    """Choose the eval. Prompts without a reference answer have no verifier: a run with a teacher
    evaluates them by agreement with it. ``workload.eval_prompts_path`` (else the training file
    ``workload.prompts_path``, with a note) gives the prompts, its first ``train.eval_size`` rows;
    rows that all carry answers keep exact match (on the eval file's own rows when it was given,
    else, as before, on the task's held-out split); an RL run always uses exact match."""
    from asyncrl.workloads import prompts as P
    from asyncrl.workloads.checkpoints import shared_tokenizer
    from asyncrl.workloads.tasks import Example

    w = cfg.workload
    path = w.eval_prompts_path or w.prompts_path
    if models.teacher_dir is None or path is None:
        return EvalPlan("exact_match", examples)
    source = P.PromptSource.open(path)
    pieces = source.head(cfg.train.eval_size)
    answers = [
        a
        for _, t, _ in pieces
        for a in (t.column(P.ANSWER).to_pylist() if P.ANSWER in t.column_names else [])
    ]
    rows = sum(t.num_rows for _, t, _ in pieces)
    if rows and len(answers) == rows and all(isinstance(a, str) and a.strip() for a in answers):
        if w.eval_prompts_path and source.prompt_column == P.PROMPT:
            texts = [p for _, t, _ in pieces for p in t.column(P.PROMPT).to_pylist()]
            own = [Example(prompt=p, answer=a, prompt_id=i) for i, (p, a) in enumerate(zip(texts, answers))]
            return EvalPlan("exact_match", own, source=w.eval_prompts_path)
        return EvalPlan("exact_match", examples)
    tokenizer = shared_tokenizer(models.student_dir)
    ids = [i for f, t, _ in pieces for i in P.prompt_token_ids(t, source.prompt_column, tokenizer, f)]
    note = None
    if not w.eval_prompts_path:
        note = (
            f"eval: agreement with the teacher on the first {len(ids)} rows of the training prompts "
            f"(workload.prompts_path); set workload.eval_prompts_path to held-out prompts"
        )
    return EvalPlan("agreement", [], prompt_ids=[list(map(int, i)) for i in ids], source=path, note=note)


def stream_blocks(cfg: RunConfig) -> int:
    """Blocks the stream offers a run: every rollout batch, the batches the bound lets run ahead
    (``BoundedStaleness.batches_ahead``) and one more, plus a quarter for dropped samples."""
    tc, pc = cfg.train, cfg.pipeline
    need = (tc.steps // tc.minibatches + BoundedStaleness.from_config(cfg).batches_ahead + 1) * tc.batch_size
    need = int(need * 1.25) + tc.batch_size
    return need // (tc.batch_size // pc.learner_workers)


def check_prompts(cfg: RunConfig, models: ModelPaths | None, *, source: PromptSource | None = None) -> int:
    """The prompts read and fit the models' context; returns the longest training prompt in tokens.

    Without ``models`` only the prompts themselves are checked. A prompt file
    (``workload.prompts_path``, ``source`` if already opened) is opened by ``PromptSource`` (it
    exists, parses, has rows and a ``prompt`` or ``messages`` column) and its first
    ``asyncrl.stream.WIDTH_SAMPLE`` rows, in file order, are checked row by row (text, not
    empty, within the context), as the streamed width is measured: the driver never reads the
    whole file; the stream checks every row it emits. Errors name the file, the row and the fix.
    """
    from asyncrl.workloads import prompts as P

    if cfg.workload.prompts_path and source is None:
        source = P.PromptSource.open(cfg.workload.prompts_path)
    head = source.head(WIDTH_SAMPLE) if source is not None else []
    train, evals = load_examples(cfg)
    if models is None:
        return 0
    from asyncrl.workloads.checkpoints import context_length, shared_tokenizer
    from asyncrl.workloads.tasks import prompt_token_ids

    tokenizer = shared_tokenizer(models.student_dir)
    chats = source is not None and source.prompt_column == P.MESSAGES
    if chats and not getattr(tokenizer, "chat_template", None):  # rendered with the student's template
        raise ValueError(P.no_chat_template(source.path, models.student_dir))
    dirs = [d for d in (models.student_dir, models.teacher_dir) if d]
    contexts = [c for c in (context_length(d) for d in dirs) if c]
    context = min(contexts) if contexts else None
    # (where, the row numbers, their token counts) as the models are prompted: a chat template's
    # turn markers count against the context
    parts: list[tuple[str, str, list[int], list[int]]] = []
    for file, table, first in head:
        lengths = [len(ids) for ids in P.prompt_token_ids(table, source.prompt_column, tokenizer, file)]
        parts.append((f"prompt file {file!r}", "train", list(range(first, first + len(lengths))), lengths))
    for split, examples in (("train", train), ("eval", evals)):
        if not examples:
            continue
        prompts = [e.prompt for e in examples]
        empty = next((i for i, p in enumerate(prompts) if not p.strip()), None)
        if empty is not None:
            raise ValueError(f"task prompts: {split} row {empty} is an empty prompt; remove empty prompts")
        lengths = [len(ids) for ids in prompt_token_ids(tokenizer, prompts)]
        parts.append(("task prompts", split, list(range(len(lengths))), lengths))
    longest = 0
    for where, split, rows, lengths in parts:
        if not lengths:
            continue
        i = int(np.argmax(lengths))
        if context is not None and lengths[i] + cfg.sampling.max_new_tokens > context:
            raise ValueError(
                f"{where}: {split} row {rows[i]} has {lengths[i]} tokens + sampling.max_new_tokens="
                f"{cfg.sampling.max_new_tokens} > the models' context of {context} tokens "
                f"(max_position_embeddings); shorten the prompt or lower sampling.max_new_tokens"
            )
        if split == "train":
            longest = max(longest, lengths[i])
    return longest


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
