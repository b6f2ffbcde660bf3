"""The run config: one typed, frozen tree, loaded from YAML plus ``key=value`` overrides.

Component configs live beside their components (``SamplingParams`` in ``asyncrl.sampling``, each
estimator's and controller's options in their classes); this module composes them into
``RunConfig`` and resolves component names against their registries at load time, so a
typo fails before any process starts. ``parse_config`` is the same load without the names (no
torch import): ``asyncrl run`` checks that first, then resolves beside Ray's start.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncrl.configurable import ConfigError, check, field, from_dict, to_dict
from asyncrl.faults import FaultConfig
from asyncrl.lora import LoRAConfig
from asyncrl.ray_internals import DEFAULT_TICK_S
from asyncrl.sampling import SamplingParams


@dataclass(frozen=True)
class WorkloadConfig:
    task: str = field("addition", help="built-in task (asyncrl ls tasks) or a dotted path to a Task")
    preset: str = field(
        "small",
        help="model preset (asyncrl ls presets): a built-in pair pretrained on the task, or a real preset "
        "(e.g. smollm2: a pretrained teacher, a student pruned from it and chat prompts; asyncrl prepare)",
    )
    cache_dir: str = field(".asyncrl_cache", help="where pretrained checkpoints are cached")
    teacher_path: str | None = field(None, help="HF checkpoint dir of a teacher on disk (overrides preset)")
    student_path: str | None = field(None, help="HF checkpoint dir of a student on disk (overrides preset)")
    prompts_path: str | None = field(
        None,
        help="training prompts instead of the task's split, streamed by Ray Data: a Parquet or JSONL file, a "
        "directory of them, or a datasets save_to_disk folder, with a 'prompt' or chat 'messages' column, "
        "optional 'answer'; other columns reach the task's reward as metadata",
    )
    eval_prompts_path: str | None = field(
        None,
        help="held-out eval prompts (same formats as prompts_path), the first train.eval_size rows; rows "
        "without 'answer' are evaluated by agreement with the teacher (eval/kl_forward, eval/kl_reverse, "
        "eval/top1_agree, eval/teacher_nll, eval/rouge_l); None = the task's split, or the first rows of "
        "prompts_path when those have no answers (a real preset sets both)",
    )
    shuffle_window: int = field(
        65536,
        help="prompts_path: rows permuted together per epoch (files in seeded order, rows shuffled within "
        "windows of this many rows); the most rows the stream holds",
    )
    max_prompt_tokens: int | None = field(
        None,
        help="prompt width P in tokens; None = the longest of the first 2048 prompts (a longer streamed "
        "prompt is skipped with a warning)",
    )
    pretrain_seed: int = field(0, help="seed of the pretrained teacher/student pair and of the task splits")
    train_size: int = field(4096, help="number of training prompts drawn from the task")
    eval_size: int = field(256, help="number of held-out eval prompts")

    def __post_init__(self) -> None:
        check(self.shuffle_window >= 1, "shuffle_window", self.shuffle_window, "use a number of rows >= 1")
        check(
            self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
            "max_prompt_tokens",
            self.max_prompt_tokens,
            "use a number of tokens >= 1, or null to measure it",
        )


@dataclass(frozen=True)
class ComponentSpec:
    """A registered component by name plus its options (validated by the component's own config)."""

    name: str = field(help="registered name or dotted path 'package.module:Class'")
    options: dict[str, Any] = field(default_factory=dict, help="keyword options of the component")


@dataclass(frozen=True)
class CacheConfig:
    kind: str = field(
        "auto", help="teacher cache kind (asyncrl ls caches); 'auto' = what the estimator needs"
    )
    k: int = field(16, help="top-k size for the 'topk' cache")
    m: int = field(8, help="MC samples per position for the 'behavior_mc' and 'teacher_mc' caches")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = field(40, help="optimizer steps")
    batch_size: int = field(32, help="samples per optimizer step, over all learner workers (B)")
    group_size: int = field(1, help="completions per prompt (G); GRPO needs >= 2")
    lr: float = field(3e-4, help="peak learning rate (AdamW)")
    warmup_steps: int = field(10, help="linear warmup steps (a fresh Adam's first steps are sign-like)")
    weight_decay: float = field(0.0, help="AdamW weight decay")
    grad_clip: float = field(1.0, help="global grad-norm clip; 0 disables")
    eval_every: int = field(10, help="greedy exact-match eval every N steps; 0 disables")
    eval_size: int = field(128, help="eval prompts per evaluation")
    minibatches: int = field(
        1,
        help="optimizer steps per rollout batch (N): the batch is split into N mini-batches of whole "
        "groups; versions count optimizer steps, so steps must be a multiple of N",
    )
    checkpoint_every: int = field(0, help="Ray Train checkpoint every N steps; 0 = only at the end")
    logits_chunk: int = field(0, help="sequence chunk for log-softmax gathers; 0 = no chunking")
    precision: Literal["fp32", "bf16"] = field(
        "fp32",
        help="the learner's forward: fp32, or bf16 autocast (weights, gradients, optimizer state and the "
        "estimator's log-softmax stay fp32; matmuls run in bf16: mixed-precision training)",
    )
    lora: LoRAConfig | None = field(
        None,
        help="train LoRA adapters only ({r, alpha, dropout, target_modules}, through peft) and publish only "
        "them to the engines; null = full fine-tuning",
    )
    max_nonfinite_steps: int = field(
        3,
        help="abort the run after this many optimizer steps in a row with a non-finite loss or gradient "
        "(each is skipped and counted in numerics/skipped); the checkpoint holds the weights from before "
        "the first; 0 = never abort",
    )

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", self.steps, "use an integer >= 1")
        check(self.batch_size >= 1, "batch_size", self.batch_size, "use an integer >= 1")
        check(self.group_size >= 1, "group_size", self.group_size, "use an integer >= 1")
        check(
            self.batch_size % self.group_size == 0,
            "batch_size",
            self.batch_size,
            f"make it a multiple of group_size={self.group_size}",
        )
        check(self.lr > 0, "lr", self.lr, "use a positive learning rate")
        check(self.minibatches >= 1, "minibatches", self.minibatches, "use an integer >= 1")
        check(self.max_nonfinite_steps >= 0, "max_nonfinite_steps", self.max_nonfinite_steps, "use >= 0")
        check(
            self.steps % self.minibatches == 0,
            "steps",
            self.steps,
            f"make it a multiple of minibatches={self.minibatches} (whole rollout batches)",
        )


@dataclass(frozen=True)
class PipelineConfig:
    max_lag: int = field(2, help="S: hard per-sample staleness bound in optimizer steps; 0 = synchronous")
    lag_mode: Literal["bound", "fixed"] = field(
        "bound",
        help="bound: every kept sample has lag <= max_lag; fixed (studies): every batch after the first "
        "max_lag is generated exactly max_lag versions before it is trained",
    )
    learner_workers: int = field(1, help="Ray Train workers (DDP over gloo on CPU, NCCL on CUDA)")
    backend: Literal["ddp", "deepspeed"] = field("ddp", help="learner backend")
    zero_stage: int = field(2, help="DeepSpeed ZeRO stage (1 or 2) when backend=deepspeed")
    engine: str = field("hf", help="rollout engine (asyncrl ls engines)")
    engine_options: dict[str, Any] = field(
        default_factory=dict,
        help="keyword options of the engine's from_pretrained (hf: decode=auto|fast|hf, compact=true|false "
        "(finished rows leave the decode batch; default true), inflight_kv=recompute|keep, "
        "step_latency_s (a study tool: each decode step lasts at least this long, sleeping, to emulate an "
        "accelerator's flat step cost; default 0); vllm: max_model_len)",
    )
    teacher_dtype: Literal["float32", "bfloat16"] = field(
        "float32",
        help="dtype the teacher scores in (its cache columns are computed in fp32 from these logits); "
        "bfloat16 is how inference engines serve teachers (the rollout engine's own dtype: "
        "engine_options.dtype)",
    )
    generators: int = field(1, help="generation actors in the Ray Data actor pool")
    teacher_scorers: int = field(1, help="teacher-scoring actors in the Ray Data actor pool")
    fuse_scoring: bool = field(
        False,
        help="score each block in the generator actor that generated it (one stage hand-off fewer; "
        "teacher_scorers must then be 1)",
    )
    colocate: bool = field(
        False,
        help="generate and score inside each learner worker: no stage actors, no stage hand-offs "
        "(engine=hf). max_lag=0: from the learner's own model, in step, no weight publication (verl's "
        "hybrid engine); max_lag>=1: in a rollout thread beside the learner's step, on its own engine "
        "loading its learner rank's weights at admission (asynchronous in one process: one core "
        "generates and scores, one learns)",
    )
    cpus_per_actor: float = field(0.5, help="logical CPUs reserved per generator/teacher actor")
    cpus_per_worker: float = field(0.5, help="logical CPUs reserved per learner worker")
    generator_resources: dict[str, float] = field(
        default_factory=dict,
        help="extra Ray resources per generator actor (e.g. {node_a: 0.01} to pin a node)",
    )
    scorer_resources: dict[str, float] = field(
        default_factory=dict, help="extra Ray resources per teacher/reward scorer actor"
    )
    device: Literal["cpu", "cuda"] = field(
        "cpu",
        help="where learner workers, the HF engine and the teacher run; cuda: NCCL, and GPU shares "
        "from gpus_per_worker / gpus_per_actor (checked against the Ray cluster at start)",
    )
    max_engine_restarts: int = field(
        3, help="rollout-engine deaths a run survives (the generator actor restarts, the block re-runs)"
    )
    max_learner_failures: int = field(
        3,
        help="learner worker-group failures a run survives: Ray Train restarts the learners from the latest "
        "checkpoint and the prompt stream resumes after its ledger",
    )
    gpus_per_worker: float = field(1.0, help="GPUs per learner worker when device=cuda (< 1 shares one)")
    gpus_per_actor: float = field(
        0.25,
        help="GPUs per generation / scoring actor when device=cuda (vLLM's gpu_memory_utilization "
        "defaults to 0.9 x this share)",
    )
    torch_threads: int = field(1, help="torch intra-op threads per actor and worker")
    num_cpus: int | None = field(
        None, help="logical CPUs for a local ray.init (default: max(4, 2x cores)); ignored on a cluster"
    )
    ray_address: str | None = field(None, help="existing Ray cluster ('auto' or host:port); None = local")
    data_tick_s: float | None = field(
        DEFAULT_TICK_S,
        help="longest sleep (s) of Ray Data's scheduling loop when no task finishes; asyncrl makes the "
        "loop wake when a task finishes, so a finished block moves on at once (asyncrl.raysetup); None "
        "keeps Ray's own loop (which waits for all running tasks, up to 0.1 s, per stage hand-off)",
    )
    no_progress_timeout_s: float = field(120.0, help="fail a stalled Ray Data stream after this many s")
    rpc_timeout_s: float = field(60.0, help="timeout of every PolicyStore call")
    resume: bool = field(True, help="resume from the run directory's latest checkpoint if present")
    inflight_updates: bool = field(
        False,
        help="a generator that sees a newer published version between decode steps loads it and continues "
        "its unfinished sequences with the new weights (token_versions records which version made each "
        "token; the staleness bound then holds per token); engine=hf (its KV cache of the prefix: "
        "engine_options.inflight_kv=recompute|keep); not with colocate or lag_mode=fixed",
    )
    inflight_poll_steps: int = field(
        1,
        help="with inflight_updates: decode steps between version checks (a check never waits: it reads "
        "the answer of the PolicyStore call sent at the previous check)",
    )
    continuous_batching: bool = field(
        False,
        help="each generator runs continuous_blocks blocks at once and decodes their rows in shared steps "
        "(Ray Data's max_concurrent_calls_per_actor; asyncrl.engines.continuous): while a block's long rows "
        "finish, the "
        "next block's rows fill the decode batch. A block admitted with newer weights switches the older "
        "one's unfinished rows to them, so it requires inflight_updates=true; engine=hf on its fast "
        "decode path (Llama / Qwen3)",
    )
    continuous_blocks: int = field(
        2,
        help="with continuous_batching: blocks a generator runs at once (Ray Data calls in threads of the "
        "actor); more fill more of the decode batch when lengths are heavy-tailed, and need max_lag >= "
        "continuous_blocks - 1 to be admitted together",
    )
    provenance: Literal["strict", "warn", "off"] = field(
        "strict",
        help="check that every rollout was sampled with the weights the learner published at the version it "
        "carries (a fingerprint per block, asyncrl.provenance): strict fails the run naming the engine and "
        "both versions, warn logs and counts provenance/mismatches, off checks nothing",
    )

    def __post_init__(self) -> None:
        check(self.max_lag >= 0, "max_lag", self.max_lag, "use 0 (synchronous) or a positive bound")
        check(self.learner_workers >= 1, "learner_workers", self.learner_workers, "use >= 1")
        check(self.generators >= 1, "generators", self.generators, "use >= 1")
        check(self.teacher_scorers >= 1, "teacher_scorers", self.teacher_scorers, "use >= 1")
        check(
            not self.fuse_scoring or self.teacher_scorers == 1,
            "teacher_scorers",
            self.teacher_scorers,
            "with fuse_scoring=true every generator scores its own blocks: set teacher_scorers=1 "
            "(or fuse_scoring=false)",
        )
        if self.colocate:  # each learner worker generates and scores its own blocks
            fix = "or set pipeline.colocate=false"
            why = {
                "engine": (
                    self.engine == "hf",
                    "colocate=true generates in the learner's process with the HF engine: use 'hf'",
                ),
                "generators": (self.generators == 1, "colocate=true runs no stage actors: leave it at 1"),
                "teacher_scorers": (
                    self.teacher_scorers == 1,
                    "colocate=true runs no stage actors: leave it at 1",
                ),
                "fuse_scoring": (
                    not self.fuse_scoring,
                    "colocate=true scores in the learner: leave it false",
                ),
            }
            for name, (ok, what) in why.items():
                check(ok, name, getattr(self, name), f"{what} ({fix})")
            # in step (max_lag=0) the engine samples from the learner's model; a rollout thread
            # (max_lag>=1) builds its own engine, so every engine option applies there
            extra = sorted(set(self.engine_options) - {"decode", "compact"}) if self.max_lag == 0 else []
            check(
                not extra,
                "engine_options",
                self.engine_options,
                f"colocate=true with max_lag=0 samples from the learner's model (its dtype, device and "
                f"threads): only 'decode' and 'compact' apply; drop {extra}, use max_lag>=1 (a rollout "
                f"thread with its own engine) ({fix})",
            )
        check(self.inflight_poll_steps >= 1, "inflight_poll_steps", self.inflight_poll_steps, "use >= 1")
        check(self.continuous_blocks >= 2, "continuous_blocks", self.continuous_blocks, "use >= 2")
        check(
            not self.continuous_batching or self.inflight_updates,
            "continuous_batching",
            self.continuous_batching,
            "a block admitted with newer weights loads them while the other block's rows are still "
            "decoding, which is an in-flight update: set pipeline.inflight_updates=true (or "
            "continuous_batching=false)",
        )
        if self.inflight_updates:
            check(
                not self.colocate,
                "inflight_updates",
                self.inflight_updates,
                "colocate=true is not supported with in-flight updates: in step (max_lag=0) the engine "
                "samples from the learner's model, which does not change during a rollout; a rollout "
                "thread (max_lag>=1) reads its rank's weights at admission only. Set "
                "pipeline.colocate=false (stage actors) or inflight_updates=false",
            )
            check(
                self.lag_mode == "bound",
                "inflight_updates",
                self.inflight_updates,
                "lag_mode=fixed generates every block with one pinned version, which in-flight updates "
                "would replace mid-sequence: use lag_mode=bound or inflight_updates=false",
            )
        check(self.zero_stage in (1, 2), "zero_stage", self.zero_stage, "use 1 or 2")
        check(self.max_engine_restarts >= 0, "max_engine_restarts", self.max_engine_restarts, "use >= 0")
        check(self.max_learner_failures >= 0, "max_learner_failures", self.max_learner_failures, "use >= 0")
        check(self.gpus_per_worker > 0, "gpus_per_worker", self.gpus_per_worker, "use a share > 0, e.g. 0.5")
        check(self.gpus_per_actor > 0, "gpus_per_actor", self.gpus_per_actor, "use a share > 0, e.g. 0.25")


@dataclass(frozen=True)
class TelemetryConfig:
    progress: bool = field(True, help="live progress bar; false for CI and logs")
    tensorboard: bool = field(True, help="write TensorBoard event files to RUN/tb")
    grad_reference: Literal["none", "dense"] = field(
        "none",
        help="dense: every grad_every steps, compare the estimator's gradient with the exact dense-KL "
        "gradient on the same batch (gradref/* metrics; OPD, small vocabularies: the scoring stage ships "
        "the teacher's full logits for those batches)",
    )
    grad_every: int = field(10, help="steps between gradient diagnostics (telemetry.grad_reference)")
    grad_cos_prev: bool = field(
        False, help="log grad/cos_prev, the cosine between consecutive applied gradients (keeps one copy)"
    )
    memory_every_s: float = field(
        10.0,
        help="seconds between mem/* samples (a raylet RPC and a read per Ray worker, ~5 ms: off the "
        "per-step path); the first step always has one; 0: every step",
    )
    samples_flush_s: float = field(
        5.0,
        help="the learner buffers samples.parquet rows and writes a part at most this often, and before "
        "every checkpoint (a part per step cost ~4 ms of the learner's step); 0: a part per step",
    )

    def __post_init__(self) -> None:
        check(self.grad_every >= 1, "grad_every", self.grad_every, "use an integer >= 1")
        check(self.memory_every_s >= 0, "memory_every_s", self.memory_every_s, "use seconds >= 0")
        check(self.samples_flush_s >= 0, "samples_flush_s", self.samples_flush_s, "use seconds >= 0")


@dataclass(frozen=True)
class RunConfig:
    """A whole run: one typed, frozen section per part. Built by ``load_config`` from YAML and
    ``key=value`` overrides; unknown keys and bad values fail at load time with the field name and
    the nearest valid key. Every field is listed in docs/config_reference.md."""

    run_dir: str = field("runs/latest", help="run directory: config, metrics, samples, checkpoints")
    seed: int = field(0, help="global seed: data order, sampling, init")
    workload: WorkloadConfig = field(default_factory=WorkloadConfig, help="task and models")
    sampling: SamplingParams = field(default_factory=SamplingParams, help="rollout sampling")
    estimator: ComponentSpec = field(
        default_factory=lambda: ComponentSpec("forward_kl"),
        help="loss estimator (asyncrl ls estimators); forward KL on the teacher top-k is robust to staleness",
    )
    cache: CacheConfig = field(default_factory=CacheConfig, help="teacher-score cache")
    controllers: tuple[ComponentSpec, ...] = field(
        default=(),
        help="staleness controllers after the always-on bounded_staleness (configured by pipeline.max_lag "
        "and pipeline.lag_mode, so it is not listed here)",
    )
    train: TrainConfig = field(default_factory=TrainConfig, help="optimisation")
    pipeline: PipelineConfig = field(default_factory=PipelineConfig, help="Ray pipeline")
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig, help="progress and sinks")
    faults: FaultConfig = field(
        default_factory=FaultConfig, help="fault injection for reliability tests and soak runs (off)"
    )

    def __post_init__(self) -> None:
        """Checks across sections that need no component: they fail at load (``asyncrl run``
        reports them before Ray starts). Each names the field to change."""
        sp, tc, pc = self.sampling, self.train, self.pipeline
        # greedy decoding is for evaluation: training needs a sampling distribution (eval builds
        # its own SamplingParams)
        check(
            sp.temperature != 0,
            "sampling.temperature",
            sp.temperature,
            "0 is greedy; training needs a sampling distribution (e.g. 1.0)",
        )
        check(
            tc.batch_size % pc.learner_workers == 0,
            "train.batch_size",
            tc.batch_size,
            f"must divide evenly over pipeline.learner_workers={pc.learner_workers}",
        )
        local = tc.batch_size // pc.learner_workers
        check(
            local % (tc.group_size * tc.minibatches) == 0,
            "train.minibatches",
            tc.minibatches,
            f"each learner worker's share of train.batch_size ({local}) must split into train.minibatches="
            f"{tc.minibatches} mini-batches of whole groups (train.group_size={tc.group_size})",
        )

    @property
    def algo(self) -> Literal["opd", "rl"]:
        """``rl`` when the estimator learns from rewards (needs no teacher cache, e.g. ``grpo``),
        else ``opd``: derived from the estimator, never configured separately."""
        from asyncrl.estimators import build

        est = build(self.estimator.name, dict(self.estimator.options))
        return "rl" if est.cache_kind is None else "opd"


# --- loading -------------------------------------------------------------------------------
def _parse_value(text: str, key: str = "") -> Any:
    if text == "":
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        fix = f"not a valid YAML value ({_yaml_problem(err)}); quote strings"
        raise ConfigError(key, text, fix) from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(getattr(err, "problem", None) or err).split())


def _read_yaml(path: Path) -> Any:
    """A YAML file's content; a file that is not UTF-8 or not YAML is a one-line ConfigError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            "config", str(path), f"the file is not UTF-8 text (byte {err.start}); save it as UTF-8 YAML"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        fix = f"not valid YAML at {_yaml_problem(err)}; fix it there"
        raise ConfigError("config", str(path), fix) from None


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b.c=value"`` -> ``("a.b.c", value)``, the value parsed as YAML."""
    if "=" not in item:
        raise ConfigError(item, item, "overrides look like key.sub=value")
    key, _, raw = item.partition("=")
    return key.strip(), _parse_value(raw, key.strip())


def set_key(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of the nested dict ``data`` with the node at dotted ``key`` set to ``value`` (replaced, not
    merged: ``estimator.options={...}`` replaces the options; ``estimator.options.tail=drop`` sets one)."""
    data = dict(data)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        child = dict(child) if isinstance(child, dict) else {}
        node[p] = child
        node = child
    node[parts[-1]] = value
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Apply overrides to a nested dict, in order: ``a.b.c=value`` strings (values parsed as YAML), or a
    mapping of dotted keys to values (used as they are, e.g. from a sweep file)."""
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    else:
        items = [parse_override(item) for item in overrides]
    for key, value in items:
        data = set_key(data, key, value)
    return dict(data)


def load_config(
    path: str | Path | None = None, overrides: list[str] | Mapping[str, Any] | None = None
) -> RunConfig:
    """YAML file (or defaults) + overrides (see ``apply_overrides``) -> validated RunConfig. Names are
    resolved now (``resolve_components``), and the settings left to the workload (``resolve_auto``)."""
    return resolve_auto(resolve_components(parse_config(path, overrides)))


def parse_config(
    path: str | Path | None = None, overrides: list[str] | Mapping[str, Any] | None = None
) -> RunConfig:
    """``load_config`` without resolving names: fields, types and values checked, components not
    imported. Imports no torch (about 1.5 s with the components), so ``asyncrl run`` can start Ray
    first and resolve beside it (``asyncrl.pipeline.run``)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("config", str(p), "the file does not exist; see examples/configs/")
        loaded = _read_yaml(p) or {}
        if not isinstance(loaded, dict):
            raise ConfigError("config", str(p), "the YAML top level must be a mapping")
        data = loaded
    data = apply_overrides(data, overrides or [])
    if "algo" in data:
        raise ConfigError(
            "algo",
            data["algo"],
            "remove it: OPD vs RL is derived from the estimator (an RL estimator such as 'grpo' "
            "needs no teacher)",
        )
    return from_dict(RunConfig, data)


def resolve_auto(cfg: RunConfig) -> RunConfig:
    """Fill the settings left to the workload (idempotent; ``load_config`` and ``asyncrl.run`` call it).

    ``sampling.max_new_tokens: auto`` becomes the task's longest answer in tokens of the run's
    tokenizer + 1 for EOS (``asyncrl.workloads.tasks.answer_token_budget``): long answers are
    never cut and short ones waste no generation. The tokenizer is the student's
    (``workload_tokenizer``), so a BPE that packs digits or letters is measured as it encodes.
    """
    if cfg.sampling.max_new_tokens != "auto":
        return cfg
    from dataclasses import replace

    from asyncrl.workloads.real import is_real

    w = cfg.workload
    if is_real(w.preset) and not w.student_path:
        raise ConfigError(
            "sampling.max_new_tokens",
            "auto",
            f"auto sizes generation from a task's answers; real preset {w.preset!r} has chat prompts "
            f"without answers: set a response budget, e.g. sampling.max_new_tokens=64",
        )
    student = str(Path(w.student_path).resolve()) if w.student_path else None
    budget = _answer_budget(w.task, w.preset, str(Path(w.cache_dir).resolve()), w.pretrain_seed, student)
    return replace(cfg, sampling=replace(cfg.sampling, max_new_tokens=budget))


@functools.lru_cache(maxsize=64)
def _answer_budget(task: str, preset: str, cache_dir: str, seed: int, student_path: str | None) -> int:
    """``answer_token_budget`` of a workload, once per process: it tokenizes 4096 answers (about 0.15 s),
    and a sweep or a test session loads hundreds of configs of the same few workloads. The arguments
    determine the tokenizer and the draws."""
    from asyncrl.workloads.models import workload_tokenizer
    from asyncrl.workloads.tasks import answer_token_budget, get_task

    tokenizer = workload_tokenizer(task, preset, cache_dir=cache_dir, seed=seed, student_path=student_path)
    return answer_token_budget(get_task(task), tokenizer, seed=seed)


def resolve_components(cfg: RunConfig) -> RunConfig:
    """Fail at load time on unknown component names or options (nearest name suggested); returns ``cfg``."""
    from asyncrl import caches, controllers, engines, estimators
    from asyncrl.registry import RegistryError
    from asyncrl.workloads import models, tasks

    def _try(fieldname: str, fn, value: Any, component: str | None = None) -> None:
        try:
            fn()
        except RegistryError as err:
            raise ConfigError(fieldname, value, str(err)) from None
        except ConfigError as err:
            unknown_option = err.field.startswith("options.") and err.fix.startswith("unknown key")
            if component is not None and unknown_option:
                # most often a config written for another estimator, renamed on the command line
                # (``estimator.name=...`` overrides the name only: the options stay)
                err = ConfigError(
                    err.field,
                    err.value,
                    f"{err.fix} (the options of {component}); a config written for another one keeps its "
                    f"options when only the name is overridden: reset them too "
                    f"({fieldname}.options={{}}, then {fieldname}.options.KEY=VALUE for any you want)",
                )
            raise err.prefixed(fieldname) from None

    est = cfg.estimator
    _try("estimator", lambda: estimators.build(est.name, est.options), est.name, f"estimator {est.name!r}")
    for i, c in enumerate(cfg.controllers):
        _try(f"controllers[{i}]", lambda c=c: controllers.build(c.name, c.options), c.name)
    if cfg.cache.kind != "auto":
        _try("cache.kind", lambda: caches.CACHES.get(cfg.cache.kind), cfg.cache.kind)
    _try("workload.task", lambda: tasks.TASKS.get(cfg.workload.task), cfg.workload.task)
    from asyncrl.workloads.real import is_real

    if not is_real(cfg.workload.preset):
        _try("workload.preset", lambda: models.PRESETS.get(cfg.workload.preset), cfg.workload.preset)
    _try("pipeline.engine", lambda: engines.ENGINES.get(cfg.pipeline.engine), cfg.pipeline.engine)
    return cfg


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
