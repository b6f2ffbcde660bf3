"""asyncrl against TRL's on-policy ``DistillationTrainer``, side by side on one machine.

    python benchmarks/vs_trl.py --cache-dir /work/cache                  # short regime, 60 steps, 3 rounds
    python benchmarks/vs_trl.py --regime long --cache-dir /work/cache    # running_sum, 33 new tokens
    python benchmarks/vs_trl.py --regime long --task <task> --max-new-tokens 129
    python benchmarks/vs_trl.py --regime qwen --cache-dir /work/cache    # 151,936-token vocabulary
    python benchmarks/vs_trl.py --steps 10 --rounds 1                    # smoke
    python benchmarks/vs_trl.py --regime smollm2                         # real pair, chat prompts
    python benchmarks/vs_trl.py --regime smollm2 --rounds 1 --steps 6 --batch 8 --systems trl plain

Regimes: ``short`` = addition, 6 new tokens (3 digits + EOS, with slack), ``small`` pair; ``long`` =
running_sum, 33 new tokens (32 digits + EOS), ``tiny`` pair; ``qwen`` = the short regime at a real
vocabulary: the ``qwen-tiny`` pair (Qwen3 blocks, Qwen's 151,936 logits, BPE and ChatML prompts,
which TRL renders from conversational rows; ``check_trl_prompts`` checks both systems prompt with
the same ids) and its own default systems (``REGIMES`` says why); ``smollm2`` = a real pretrained
pair on real chat prompts (``asyncrl prepare smollm2``: SmolLM2-135M-Instruct teacher, a 6-layer
student pruned from it, vocabulary 49,152; ShareGPT first turns), from ``opd_smollm2.yaml`` (lr 1e-4,
warmup 5): completions of up to 128 tokens ending at EOS (heavy-tailed lengths), its own defaults
(B 16, 12 steps, one round) and systems, quality measured as held-out agreement with the teacher
(below). ``--task`` / ``--max-new-tokens`` / ``--preset`` override them; every child runs offline
(``HF_HUB_OFFLINE=1``).

The real regime (``smollm2``, ``REGIMES[...]["eval"] == "agreement"``) differs from the task regimes:
  * prompts: the prepared ``prompts/train.jsonl`` chat ``messages`` rows, streamed in asyncrl's seeded
    order (``asyncrl.stream.FileStream``, read here without Ray: ``stage_times.file_blocks``); TRL gets
    the same rows in the same order as conversational prompts and renders them with the student
    tokenizer's chat template (``check_trl_prompts``: the same token ids as asyncrl's blocks);
  * throughput in trained completion tokens/s (valid completion tokens of steps skip+1..N over the same
    interval as samples/s), since completions end at EOS and their lengths vary;
  * padding: the fraction of the learner's [B, P + T] positions that are padding after trimming to
    the batch's longest prompt and completion (``records.padding_fraction``; TRL pads the same way:
    prompts left to the batch's longest, completions right to its longest), mean over steps;
  * peak memory: the peak RSS (``VmHWM``) of the child process and of every process under it
    (Ray's workers: the learner, generators, scorers, ...), sampled every second until training ends;
  * quality: ``asyncrl.workloads.agreement.AgreementEvaluator`` on the first ``--eval-size`` rows of
    ``prompts/eval.jsonl`` (held out), seed 0, ``max_new_tokens`` as trained, fp32 teacher, on a fresh
    fp32 copy of the final student, identical for every system (the teacher's greedy responses are
    computed once, in the stages child). The stages child also evaluates the untrained student with
    seeds 0 and 1: the difference is the evaluation's own sampling noise at a fixed student.

Systems, all on the workload's pretrained pair from the asyncrl cache (``<cache>/<task>-<preset>-s0``,
loaded with ``local_files_only``), the same prompt stream (the pipeline's seeded blocks, in order),
batch B, T new tokens, temperature 1 from the untruncated softmax, AdamW lr 3e-4, weight decay 0,
linear warmup over the demo config's ``train.warmup_steps`` W (30 in ``opd_async.yaml``; it was 10
when this benchmark was written) then constant (lr * min(1, (k + 1) / W) at step k: asyncrl's
``scheduled_lr``, also given to TRL, so both systems follow the same schedule), grad-norm clip 1,
seed 0, ``--steps`` optimizer steps:

  trl          TRL DistillationTrainer, torch's default threads (2 on this 2-core machine; the table
               shows the count measured)
  trl_1t       the same with torch.set_num_threads(1)
  plain        asyncrl's parts in one process, one thread, dense forward KL
               (the plain loop of benchmarks/async_vs_sync.py, imported)
  lag0_dense   asyncrl.run(...), pipeline.max_lag=0, dense forward KL
  lag0_fused   the same with pipeline.fuse_scoring=true: in lock-step nothing overlaps a block's
               scoring anyway, so generating and scoring it in one actor only removes a hand-off
  lag0_colocated  max_lag=0, dense forward KL, pipeline.colocate=true: the learner process generates
               and scores its blocks itself (no stage actors, no weight publication): lock-step's
               own layout, one process like TRL and the plain loop
  lag0_colocated_2t  the same with pipeline.torch_threads=2: the one process uses both cores, as TRL does
  lag1_colocated  max_lag=1, dense forward KL, pipeline.colocate=true: asynchronous in one process, a
               rollout thread (its own engine, the published weights) generates and scores block k+1
               while the learner's thread trains block k; torch releases the GIL in its kernels
  lag2_colocated  the same with max_lag=2
  lag2_colocated_mb2  lag2_colocated with train.minibatches=2: the rollout thread generates and scores
               2B prompts at once (per-op overhead amortised over twice the rows), the learner takes
               2 optimizer steps of B from each batch (lags <= 3, as lag2_fused2_mb2)
  trl_bf16     TRL with ``bf16=True``: accelerate's bf16 autocast (mixed precision, fp32 weights)
  plain_bf16   the plain loop with every part in bf16: the learner's autocast (``train.precision=bf16``),
               the teacher (``pipeline.teacher_dtype=bfloat16``) and the engine
               (``pipeline.engine_options.dtype=bfloat16``); fp32 weights, optimizer and loss math
  lag2_colocated_mb2_bf16  lag2_colocated_mb2 with every part in bf16, as plain_bf16
  lag1_colocated_top16_bf16  lag1_colocated_top16 with every part in bf16 (the qwen regime's)
  lag1_colocated_bf16  lag1_colocated with every part in bf16 (the smollm2 regime's)
  lag2_colocated_mb2_top16  the ``opd_one_machine.yaml`` layout: max_lag=2, colocate, rollout batch 2B in
               2 optimizer steps, top-16 forward KL (tail bucket); ``..._bf16`` with every part in bf16
  lag2_top16_bf16  lag2_top16 (the stage-actor demo layout, ``opd_smollm2.yaml`` as shipped in the
               smollm2 regime) with every part in bf16
  lag1_colocated_top16  lag1_colocated on the demo's top-16 cache (tail bucket): what asyncrl runs at
               a real vocabulary, where TRL's full-vocabulary teacher logits are the cost
  lag2_dense   asyncrl.run(...), pipeline.max_lag=2, dense forward KL
  lag2_top16   asyncrl.run(...), pipeline.max_lag=2, the demo default (top-16 forward KL, tail bucket)
  lag2_fused   the same with pipeline.fuse_scoring=true: generation and scoring in one actor, the
               learner in the other process (one Ray Data hand-off fewer per block)
  lag2_fused2  max_lag=2, dense forward KL, fuse_scoring and 2 generate+score actors: one of them
               works while the other waits for its next block
  lag2_fused2_mb2  the same with train.minibatches=2: each rollout batch of 2B prompts (its own seeded
               blocks of 2B) gives 2 optimizer steps of B, so every optimizer step still trains B
               samples, with half the stage hand-offs per sample and generation at batch 2B. The second
               mini-batch is one version older: lags <= 3 (max_lag bounds a batch's first step). With
               max_lag=1 (lags <= 2) the gain was gone on 2 cores (418 vs 566 samples/s, long regime).

What TRL is configured to do, checked in trl 1.16.0's source (site-packages/trl):
  * on-policy, every step: with gradient_accumulation_steps=1, ``_prepare_inputs``
    (trainer/distillation_trainer.py L1775-1778) calls ``_generate_and_score_completions`` for every
    batch, which samples completions from the student being trained (``_generate_single_turn``,
    ``unwrapped_model.generate`` L1083 with ``GenerationConfig(do_sample=True, temperature, top_p,
    top_k, ...)`` L739-757; we pass top_p=1, top_k=0: the untruncated softmax) and masks everything
    after the first EOS (L1088-1095, EOS kept).
  * teacher scoring: ``_compute_loss`` runs the teacher backbone on prompt + completion under
    ``no_grad`` (L1850-1861) and projects both models' hidden states through their LM heads.
  * forward KL on the full vocabulary: ``beta=0.0`` ("When 0.0, the loss is the forward KL",
    trainer/distillation_config.py L134-136) goes to ``_chunked_divergence_loss`` (L1904) and
    ``ChunkedDivergenceFunction`` (kernels/chunked_divergence.py): every vocabulary chunk is folded
    in (L433, VOCAB_CHUNK_SIZE=32768 > |V|), and for beta == 0 the divergence is
    ``t_weighted_gap / t_sum - t_log_z + s_log_z`` = sum_y p_t (log p_t - log p_s) (L274, L482-483);
    its gradient is ``p_s - p_t`` (L341). Reduced as sum / number of valid completion tokens
    (L212 with ``num_items_in_batch``, L1597): the token mean asyncrl uses too.
  * activation_checkpointing=False (TRL's default is True, which re-runs forwards: off, as asyncrl has
    none, to compare equal work); bf16 only in the bf16 systems (``train.precision``); TRL's default
    optimizer (``adamw_torch_fused``); only the learning-rate schedule is replaced
    (``create_scheduler``) by asyncrl's warmup law, because HF's ``constant_with_warmup`` starts at
    lr 0 (k / W), which would waste TRL's first step.
  ``benchmarks/trl_parity.py`` checks that TRL's loss and asyncrl's dense forward KL agree on the
  first batch of this run (same weights, teacher and completions): the "parity" line below.

Measurement. Every system runs in a fresh process, launched by this script; the clock starts
just before the launch (``time.time()``), so start-up counts Python, imports, model loading, Ray.
``t_k`` = wall-clock time when optimizer step k finished (a TRL callback at ``on_step_end``; the
plain loop's ``on_step``; for the pipeline, the learner's ``consumed_at`` (wall clock, in
samples.parquet) of step k's batch plus that step's ``time/compute_s + time/publish_s`` from
metrics.jsonl, i.e. when its weights were published).
  steady samples/s = samples trained in steps skip+1..N / (t_N - t_skip)   (--skip, default 2)
  wall             = t_N - launch          (N steps including start-up; eval and teardown excluded)
  first step       = t_1 - launch
  exact match      = ``asyncrl.workloads.evaluate.exact_match`` (greedy) of the final student on
                     the task's first ``--eval-size`` eval prompts, identical for every system.
For pipeline systems the JSON and the notes under the table also split a step as the run's own
telemetry records it (``step_breakdown``: learner wait / compute / publish, generation, scoring,
hand-offs). Rounds are interleaved (every system once per round, the order rotated each round)
and round r runs seed r (sampling and prompt order; every system of a round gets the same prompts);
the table shows medians over rounds, and the final exact match also its mean ± sd over the seeds:
across seeds, 60-step runs of the same algorithm spread by sd 0.05 (short) to 0.13 (long regime).
The core-limit rows (``--cores``, default: this machine's, 2 here) come from ``stage_times.py``
(stages alone in one process, one thread each) for the two caches the systems use: the throughput
perfect overlap could reach. TRL's own ``train_samples_per_second`` and the pipeline summary's
``samples_per_s`` are kept in the JSON as cross-checks.
A child that fails (its log is named) is left out of the table and listed under it; the script
then exits 1 (the reference ``trl`` failing ends it: no ratios). Every number printed is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from asyncrl.raysetup import RAY_ENV, TORCH_ENV

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "examples" / "configs"
CONFIG = CONFIGS / "opd_async.yaml"
#: every child, TRL's included: the same process environment (``TORCH_ENV``: torch's allocator), and
#: offline: every model and prompt comes from the local cache, nothing from a hub
ENV = {**RAY_ENV, **TORCH_ENV, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}

#: the long regime's pair is ``tiny``: the ``small`` running_sum pair takes about 35 min of both cores
#: to pretrain here, and at 33 new tokens generation is the longest stage with the tiny models too
#: the ``qwen`` regime is the short one at a real vocabulary: Qwen's 151,936 logits, BPE and ChatML
#: (``qwen-tiny`` pair); its default systems leave out the stage-actor dense rows, which ship a
#: [B, T, V] fp32 teacher cache (117 MiB per batch of 32) through the object store: top-k is what
#: asyncrl runs at this vocabulary, and the dense rows that remain compare the same loss as TRL
REGIMES: dict[str, dict[str, Any]] = {
    "short": {"task": "addition", "max_new_tokens": 6, "preset": "small"},
    "long": {"task": "running_sum", "max_new_tokens": 33, "preset": "tiny"},
    "qwen": {
        "task": "addition",
        "max_new_tokens": 6,
        "preset": "qwen-tiny",
        "systems": [
            "trl",
            "trl_bf16",
            "plain",
            "lag0_colocated",
            "lag1_colocated",
            "lag1_colocated_top16",
            "lag1_colocated_top16_bf16",
            "lag2_top16",
        ],
    },
    #: a real pair and real chat prompts (``asyncrl prepare smollm2``), from its own config (lr 1e-4);
    #: completions up to 128 tokens, ending at EOS. Stage actors run top-16 only (the shipped
    #: opd_smollm2.yaml): a dense fp32 teacher cache is [B, T, 49152] (402 MB per batch of 16 x 128)
    #: through the object store. Defaults sized for a few minutes per system on 2 cores.
    "smollm2": {
        "task": None,
        "max_new_tokens": 128,
        "preset": "smollm2",
        "config": "opd_smollm2.yaml",
        #: before every system's overrides: the config ships bf16 (precision, teacher); a system
        #: without the bf16 overrides (``BF16``) runs fp32 as TRL without ``bf16=True`` does
        "base": ["train.precision=fp32", "pipeline.teacher_dtype=float32", "pipeline.engine_options={}"],
        "eval": "agreement",
        "defaults": {"steps": 12, "batch": 16, "rounds": 1, "eval_size": 16, "stage_repeats": 0},
        "systems": [
            "trl",
            "trl_bf16",
            "plain",
            "plain_bf16",
            "lag2_top16",
            "lag2_top16_bf16",
            "lag1_colocated",
            "lag1_colocated_bf16",
            "lag1_colocated_top16",
            "lag1_colocated_top16_bf16",
            "lag2_colocated_mb2_top16",
            "lag2_colocated_mb2_top16_bf16",
        ],
    },
}
#: CLI defaults of a regime without ``defaults`` of its own
DEFAULTS: dict[str, int] = {"steps": 60, "batch": 32, "rounds": 3, "eval_size": 256, "stage_repeats": 5}
DENSE = ["estimator.options.dense=true"]
#: mixed precision, every part: the learner's bf16 autocast, the teacher and the rollout engine in bf16
#: (TRL: ``bf16=True``, accelerate's autocast around its model's forward)
BF16 = [
    "train.precision=bf16",
    "pipeline.teacher_dtype=bfloat16",
    "pipeline.engine_options={dtype: bfloat16}",
]
#: name -> (label, kind, run-config overrides, torch threads or None for torch's default)
SYSTEMS: dict[str, tuple[str, str, list[str], int | None]] = {
    "trl": ("TRL DistillationTrainer, torch's default threads", "trl", DENSE, None),
    "trl_1t": ("TRL DistillationTrainer, 1 thread", "trl", DENSE, 1),
    "trl_bf16": (
        "TRL DistillationTrainer, `bf16=True`, torch's default threads",
        "trl",
        [*DENSE, *BF16],
        None,
    ),
    "plain": ("asyncrl plain single-process loop, dense forward KL", "plain", DENSE, 1),
    "plain_bf16": ("asyncrl plain single-process loop, dense forward KL, bf16", "plain", [*DENSE, *BF16], 1),
    "lag0_dense": ("asyncrl `max_lag=0`, dense forward KL", "pipeline", ["pipeline.max_lag=0", *DENSE], 1),
    "lag0_fused": (
        "asyncrl `max_lag=0`, dense forward KL, `fuse_scoring`",
        "pipeline",
        ["pipeline.max_lag=0", "pipeline.fuse_scoring=true", *DENSE],
        1,
    ),
    "lag0_colocated": (
        "asyncrl `max_lag=0`, dense forward KL, `colocate` (rollouts in the learner process)",
        "pipeline",
        ["pipeline.max_lag=0", "pipeline.colocate=true", *DENSE],
        1,
    ),
    "lag0_colocated_2t": (
        "asyncrl `max_lag=0`, dense forward KL, `colocate`, 2 torch threads",
        "pipeline",
        ["pipeline.max_lag=0", "pipeline.colocate=true", "pipeline.torch_threads=2", *DENSE],
        1,
    ),
    "lag1_colocated": (
        "asyncrl `max_lag=1`, dense forward KL, `colocate` (a rollout thread beside the learner's step)",
        "pipeline",
        ["pipeline.max_lag=1", "pipeline.colocate=true", *DENSE],
        1,
    ),
    "lag2_colocated": (
        "asyncrl `max_lag=2`, dense forward KL, `colocate` (a rollout thread beside the learner's step)",
        "pipeline",
        ["pipeline.max_lag=2", "pipeline.colocate=true", *DENSE],
        1,
    ),
    "lag2_colocated_mb2": (
        "asyncrl `max_lag=2`, dense forward KL, `colocate`, rollout batch 2B in 2 optimizer steps",
        "pipeline",
        ["pipeline.max_lag=2", "pipeline.colocate=true", "train.minibatches=2", *DENSE],
        1,
    ),
    "lag2_colocated_mb2_bf16": (
        "asyncrl `max_lag=2`, dense forward KL, `colocate`, rollout batch 2B in 2 optimizer steps, bf16",
        "pipeline",
        ["pipeline.max_lag=2", "pipeline.colocate=true", "train.minibatches=2", *DENSE, *BF16],
        1,
    ),
    "lag1_colocated_bf16": (
        "asyncrl `max_lag=1`, dense forward KL, `colocate` (a rollout thread beside the step), bf16",
        "pipeline",
        ["pipeline.max_lag=1", "pipeline.colocate=true", *DENSE, *BF16],
        1,
    ),
    "lag2_colocated_mb2_top16": (
        "asyncrl `max_lag=2`, top-16 forward KL, `colocate`, rollout batch 2B in 2 optimizer steps "
        "(the `opd_one_machine.yaml` layout)",
        "pipeline",
        ["pipeline.max_lag=2", "pipeline.colocate=true", "train.minibatches=2"],
        1,
    ),
    "lag2_colocated_mb2_top16_bf16": (
        "asyncrl `max_lag=2`, top-16 forward KL, `colocate`, rollout batch 2B in 2 optimizer steps, bf16",
        "pipeline",
        ["pipeline.max_lag=2", "pipeline.colocate=true", "train.minibatches=2", *BF16],
        1,
    ),
    "lag1_colocated_top16": (
        "asyncrl `max_lag=1`, top-16 forward KL, `colocate` (a rollout thread beside the learner's step)",
        "pipeline",
        ["pipeline.max_lag=1", "pipeline.colocate=true"],
        1,
    ),
    "lag1_colocated_top16_bf16": (
        "asyncrl `max_lag=1`, top-16 forward KL, `colocate` (a rollout thread beside the step), bf16",
        "pipeline",
        ["pipeline.max_lag=1", "pipeline.colocate=true", *BF16],
        1,
    ),
    "lag2_dense": ("asyncrl `max_lag=2`, dense forward KL", "pipeline", ["pipeline.max_lag=2", *DENSE], 1),
    "lag2_top16": (
        "asyncrl `max_lag=2`, top-16 forward KL (demo default)",
        "pipeline",
        ["pipeline.max_lag=2"],
        1,
    ),
    "lag2_top16_bf16": (
        "asyncrl `max_lag=2`, top-16 forward KL (demo default), bf16",
        "pipeline",
        ["pipeline.max_lag=2", *BF16],
        1,
    ),
    "lag2_fused": (
        "asyncrl `max_lag=2`, top-16, `fuse_scoring` (generate + score in one actor)",
        "pipeline",
        ["pipeline.max_lag=2", "pipeline.fuse_scoring=true"],
        1,
    ),
    "lag2_fused2": (
        "asyncrl `max_lag=2`, dense forward KL, `fuse_scoring`, 2 generators",
        "pipeline",
        ["pipeline.max_lag=2", "pipeline.fuse_scoring=true", "pipeline.generators=2", *DENSE],
        1,
    ),
    "lag2_fused2_mb2": (
        "asyncrl `max_lag=2`, dense, `fuse_scoring`, 2 generators, rollout batch 2B in 2 optimizer steps",
        "pipeline",
        [
            "pipeline.max_lag=2",
            "pipeline.fuse_scoring=true",
            "pipeline.generators=2",
            "train.minibatches=2",
            *DENSE,
        ],
        1,
    ),
}
REFERENCE = "trl"


# --- shared by every child --------------------------------------------------------------------------
def run_config(spec: dict[str, Any], more: list[str], *, parse_only: bool = False) -> Any:
    """The regime's config (the demo's, ``opd_async.yaml``, unless the regime names its own) with the
    benchmark's settings and a system's overrides. A system's ``train.minibatches=N`` keeps B samples
    per optimizer step: its rollout batch is N x B. ``parse_only``: ``parse_config`` (no torch import;
    ``asyncrl.run`` resolves it beside Ray's start, as for ``asyncrl run``), else ``load_config``."""
    from asyncrl.config import load_config, parse_config

    minibatches = [int(m.split("=", 1)[1]) for m in more if m.startswith("train.minibatches=")]
    rollout_batch = spec["batch"] * (minibatches[-1] if minibatches else 1)
    task = [f"workload.task={spec['task']}"] if spec.get("task") else []
    return (parse_config if parse_only else load_config)(
        CONFIGS / spec.get("config", CONFIG.name),
        [
            *task,
            f"workload.preset={spec['preset']}",
            f"workload.cache_dir={spec['cache_dir']}",
            f"seed={spec['seed']}",
            f"train.steps={spec['steps']}",
            f"train.batch_size={rollout_batch}",
            f"sampling.max_new_tokens={spec['max_new_tokens']}",
            "sampling.temperature=1.0",
            "train.eval_every=0",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
            f"run_dir={spec['run_dir']}",
            *spec.get("base", []),
            *more,
        ],
    )


def is_agreement(spec: dict[str, Any]) -> bool:
    """Whether the regime's quality is held-out agreement with the teacher (a real preset's chat
    prompts have no answers), not the task's exact match."""
    return spec.get("eval") == "agreement"


def final_exact_match(model: Any, tokenizer: Any, spec: dict[str, Any]) -> float:
    from asyncrl.workloads import exact_match, get_task

    task = get_task(spec["task"])
    examples = task.make_examples("eval", spec["eval_size"], 0)
    return exact_match(model.eval(), tokenizer, task, examples, spec["max_new_tokens"])


def agreement_prompt_ids(spec: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    """Token ids of the first ``eval_size`` held-out prompts (``prompts/eval.jsonl``), chat-templated
    as the run's own agreement eval prompts them (``asyncrl.plan.eval_plan``)."""
    from asyncrl.workloads import prompts as P
    from asyncrl.workloads.real import paths

    source = P.PromptSource.open(paths(spec["preset"], spec["cache_dir"])["eval_prompts"])
    return [
        [int(t) for t in ids]
        for f, table, _ in source.head(spec["eval_size"])
        for ids in P.prompt_token_ids(table, source.prompt_column, tokenizer, f)
    ]


def agreement(
    student: Any,
    tokenizer: Any,
    spec: dict[str, Any],
    *,
    seed: int = 0,
    teacher_texts: list[str] | None = None,
) -> tuple[dict[str, float], list[str]]:
    """``AgreementEvaluator`` metrics of ``student`` (and the teacher's greedy responses), the same
    for every system: fp32 teacher, a fresh fp32 copy of the student (no trainer's autocast wrapper),
    the regime's ``max_new_tokens``, eval seed ``seed``. ``teacher_texts``: the teacher's greedy
    responses when already computed (the teacher is frozen and greedy decoding deterministic)."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.workloads.agreement import AgreementEvaluator

    torch.set_num_threads(os.cpu_count() or 1)  # not timed: the eval may use every core
    teacher_dir, student_dir = pair_dirs(spec)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32, local_files_only=True)
    fresh = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32, local_files_only=True)
    fresh.load_state_dict({k: v.detach().float() for k, v in student.state_dict().items()})
    ev = AgreementEvaluator(
        teacher,
        tokenizer,
        agreement_prompt_ids(spec, tokenizer),
        max_new_tokens=spec["max_new_tokens"],
        seed=seed,
    )
    if teacher_texts is not None:
        ev._teacher_texts = list(teacher_texts)  # computed once, in the stages child (same prompts)
    res = ev(fresh)
    return {**res.metrics, "eval_s": res.seconds}, ev.teacher_texts()


def final_quality(model: Any, tokenizer: Any, spec: dict[str, Any]) -> dict[str, float]:
    """The final student's quality, identical for every system: ``exact_match`` for a task regime,
    the agreement metrics (``agreement``, seed 0) for a real one."""
    if not is_agreement(spec):
        return {"exact_match": final_exact_match(model, tokenizer, spec)}
    texts = json.loads(Path(spec["teacher_texts"]).read_text()) if spec.get("teacher_texts") else None
    return agreement(model, tokenizer, spec, teacher_texts=texts)[0]


def pair_dirs(spec: dict[str, Any]) -> tuple[Path, Path]:
    """(teacher, student) checkpoint directories; a clear error naming the command that creates them."""
    from asyncrl.workloads.checkpoints import missing_parts, run_dir_for
    from asyncrl.workloads.real import is_real, paths

    if is_real(spec["preset"]):
        made = paths(spec["preset"], spec["cache_dir"])
        root = Path(made["root"])
        command = f"asyncrl prepare {spec['preset']} --cache-dir {spec['cache_dir']}"
        need = [Path(made["train_prompts"]), Path(made["eval_prompts"])]
        gone = [str(f) for f in need if not f.is_file()]
        if gone:
            raise SystemExit(f"vs_trl: the prepared prompts {', '.join(gone)} are missing; run: {command}")
    else:
        root = run_dir_for(spec["task"], spec["preset"], 0, spec["cache_dir"])
        command = f"asyncrl pretrain --task {spec['task']} --preset {spec['preset']}"
        command += f" --cache-dir {spec['cache_dir']}"
    for role in ("teacher", "student"):
        missing = missing_parts(root / role)
        if missing:
            raise SystemExit(
                f"vs_trl: the pretrained {role} {root / role} is missing ({', '.join(missing)}); create the "
                f"pair with: {command}"
            )
    return root / "teacher", root / "student"


def prompt_stream(cfg: Any, tokenizer: Any) -> tuple[list[Any], list[list[int]]]:
    """The prompts of the first ``train.steps`` batches, in the order asyncrl trains on them: TRL's
    ``prompt`` column (``trl_rows``) and the token ids asyncrl prompts the student with.

    A task's split: the driver's blocks (``prompt_blocks``). Prompt files (a real preset): the
    stream's blocks (``stage_times.file_blocks``), and each row's ``messages`` chat by ``prompt_id``."""
    from asyncrl import records as R
    from asyncrl.plan import load_examples, make_plan
    from asyncrl.workloads.tasks import prompt_token_ids

    plan = make_plan(cfg)  # its config has a real preset's prompt files (workload.prompts_path)
    blocks = stage_blocks(cfg, tokenizer)[: cfg.train.steps]
    train, _ = load_examples(plan.cfg)
    if train is None:
        from asyncrl.stream import local_reader
        from asyncrl.workloads import prompts as P

        source = plan.prompts
        by_id: dict[int, Any] = {}
        for table in local_reader(source.kind)(source.files):
            ids = P.prompt_ids(table, source.prompt_column)
            by_id.update(zip(map(int, ids), table.column(source.prompt_column).to_pylist()))
        rows = [by_id[int(i)] for b in blocks for i in b[R.PROMPT_ID]]
        ids = [
            [int(t) for t in row[mask]]
            for b in blocks
            for row, mask in zip(b[R.PROMPT_IDS], b[R.PROMPT_MASK].astype(bool))
        ]
        return rows, ids
    by_text = {e.prompt_id: e.prompt for e in train}
    prompts = [by_text[int(i)] for b in blocks for i in b[R.PROMPT_ID]]
    return trl_rows(tokenizer, prompts), prompt_token_ids(tokenizer, prompts)


def trl_rows(tokenizer: Any, prompts: list[str]) -> list[Any]:
    """TRL's ``prompt`` column: with a chat template (ChatML for qwen-tiny) one user turn per prompt,
    which TRL renders with ``add_generation_prompt=True`` as asyncrl's ``prompt_token_ids`` does;
    as raw text TRL would tokenize it without the template."""
    if getattr(tokenizer, "chat_template", None):
        return [[{"role": "user", "content": p}] for p in prompts]
    return list(prompts)


def check_trl_prompts(trainer: Any, rows: list[Any], ours: list[list[int]]) -> None:
    """TRL must prompt the student with the token ids asyncrl prompts it with (chat template or
    raw text with the tokenizer's special tokens), or the two systems train different tasks."""
    theirs = [list(ids) for ids in trainer._tokenize_prompts(rows)[0]]
    if theirs != ours:
        bad = next(i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b)
        raise SystemExit(
            f"vs_trl: TRL tokenizes prompt {bad} ({rows[bad]!r}) as {theirs[bad]}, asyncrl as {ours[bad]}"
        )


class PeakRSS:
    """Peak resident memory (``VmHWM``) of this process and of every process under it (Ray's
    raylet, workers, Train workers: started by this process's ``ray.init``), sampled every
    ``every_s`` seconds in a thread until ``stop()``. ``VmHWM`` is a process's own high-water mark,
    so a process read at least once before it exits is reported at its true peak."""

    def __init__(self, every_s: float = 1.0) -> None:
        import threading

        self.every_s = every_s
        self.peaks: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()

    @staticmethod
    def _hwm_mb(pid: int) -> float | None:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
        except OSError:
            return None
        return None

    def sample(self) -> None:
        import psutil

        me = psutil.Process()
        procs = [me]
        with contextlib.suppress(psutil.Error):
            procs += me.children(recursive=True)
        for p in procs:
            hwm = self._hwm_mb(p.pid)
            if hwm is None:
                continue
            if p.pid == me.pid:
                name = "main"
            else:
                try:
                    cmd = p.cmdline()
                    name = (cmd[0] if cmd and cmd[0].startswith("ray::") else p.name()) or "?"
                except psutil.Error:
                    continue
            old = self.peaks.get(p.pid)
            self.peaks[p.pid] = (name, max(hwm, old[1] if old else 0.0))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def stop(self) -> dict[str, Any]:
        """Stop sampling (one last sample first); ``{"main": MiB, "processes": [[name, MiB], ...]}``,
        the others largest first."""
        self._stop.set()
        self._thread.join()
        self.sample()
        main = next(mb for name, mb in self.peaks.values() if name == "main")
        others = sorted((v for v in self.peaks.values() if v[0] != "main"), key=lambda v: -v[1])
        return {"main": main, "processes": [[n, round(mb, 1)] for n, mb in others]}


# --- children ---------------------------------------------------------------------------------------
def child_trl(spec: dict[str, Any], threads: int | None, overrides: list[str]) -> dict[str, Any]:
    peaks = PeakRSS()
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from datasets import Dataset
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    from asyncrl import records as R
    from asyncrl.backends.base import scheduled_lr

    cfg = run_config(spec, overrides)
    teacher_dir, student_dir = pair_dirs(spec)
    tok = AutoTokenizer.from_pretrained(student_dir, local_files_only=True)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32, local_files_only=True)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32, local_files_only=True)
    tc = cfg.train
    step_ends: list[float] = []
    tokens: list[int] = []
    padding: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # after the optimizer step
            step_ends.append(time.time())

    class Trainer(DistillationTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:  # asyncrl's law, as a multiplier of the peak lr
                self.lr_scheduler = LambdaLR(
                    optimizer or self.optimizer, lambda k: scheduled_lr(tc, k) / tc.lr
                )
            return self.lr_scheduler

        def _generate_and_score_completions(self, inputs):
            # what the step trains: its valid completion tokens and its padding (asyncrl's definition)
            out = super()._generate_and_score_completions(inputs)
            masks = {R.PROMPT_MASK: out["prompt_mask"].cpu(), R.COMPLETION_MASK: out["completion_mask"].cpu()}
            tokens.append(int(masks[R.COMPLETION_MASK].sum()))
            padding.append(R.padding_fraction(masks))
            return out

    args = DistillationConfig(
        output_dir=spec["run_dir"],
        max_steps=tc.steps,
        per_device_train_batch_size=tc.batch_size,
        gradient_accumulation_steps=1,
        learning_rate=tc.lr,
        weight_decay=tc.weight_decay,
        max_grad_norm=tc.grad_clip,
        beta=0.0,
        temperature=cfg.sampling.temperature,
        top_p=1.0,
        top_k=0,
        max_completion_length=cfg.sampling.max_new_tokens,
        shuffle_dataset=False,
        activation_checkpointing=False,  # alias gradient_checkpointing, which TRL defaults to True
        bf16=tc.precision == "bf16",
        use_cpu=True,
        seed=cfg.seed,
        logging_steps=10**9,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    rows, ids = prompt_stream(cfg, tok)
    trainer = Trainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": rows}),
        processing_class=tok,
        callbacks=[StepClock()],
    )
    check_trl_prompts(trainer, rows[: tc.batch_size], ids[: tc.batch_size])
    own = trainer.train().metrics
    memory = peaks.stop()
    return {
        "step_ends": step_ends,
        "kept": [tc.batch_size] * len(step_ends),
        "tokens": tokens,
        "padding": padding,
        "memory": memory,
        **final_quality(trainer.model, tok, spec),
        "threads": torch.get_num_threads(),
        "checkpointing": bool(trainer.args.activation_checkpointing),
        "trl_train_samples_per_s": own.get("train_samples_per_second"),  # TRL's own figure, incl. step 1
    }


def child_plain(spec: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    peaks = PeakRSS()
    import stage_times
    from async_vs_sync import plain_loop
    from transformers import AutoTokenizer

    from asyncrl import records as R

    cfg = run_config(spec, overrides)
    _, student_dir = pair_dirs(spec)
    step_ends: list[float] = []
    trained: dict[str, Any] = {}
    tokens: list[int] = []
    padding: list[float] = []
    learn = stage_times.Stages.learn

    def counted(self: Any, batch: dict[str, Any], step: int) -> float:
        # what the step trains (this child only): valid completion tokens and padding after trimming
        tokens.append(int(batch[R.COMPLETION_MASK].sum()))
        padding.append(R.padding_fraction(batch))
        return learn(self, batch, step)

    stage_times.Stages.learn = counted

    def on_step(step: int, student: Any) -> None:
        step_ends.append(time.time())
        trained["model"] = student

    plain_loop(cfg, warmup=min(2, cfg.train.steps - 1), on_step=on_step)
    memory = peaks.stop()
    tok = AutoTokenizer.from_pretrained(student_dir, local_files_only=True)
    return {
        "step_ends": step_ends,
        "kept": [cfg.train.batch_size] * len(step_ends),
        "tokens": tokens,
        "padding": padding,
        "memory": memory,
        **final_quality(trained["model"], tok, spec),
    }


def child_pipeline(spec: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    peaks = PeakRSS()
    import asyncrl

    # as `asyncrl run` does: nothing heavy imported before asyncrl.run, which imports torch and
    # the components beside Ray's start (the first step is measured from this process's launch)
    res = asyncrl.run(run_config(spec, overrides, parse_only=True))
    memory = peaks.stop()
    cfg = res.config
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, student_dir = pair_dirs(spec)
    run_dir = res.run_dir
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = sorted((r for r in rows if r.get("step", 0) >= 1), key=lambda r: r["step"])
    samples = pd.read_parquet(run_dir / "samples.parquet")
    for name in ("time/compute_s", "time/publish_s"):
        if name not in steps[0]:
            raise SystemExit(f"vs_trl: metrics.jsonl lacks {name!r}; the step clock needs it")
    if "consumed_at" not in samples.columns:
        raise SystemExit("vs_trl: samples.parquet lacks 'consumed_at'; the step clock needs it")
    consumed = samples.groupby("step")["consumed_at"].max()
    # the learner's step k ends compute_s + publish_s after it took its batch (wall clock consumed_at)
    step_ends = [float(consumed[r["step"]]) + r["time/compute_s"] + r["time/publish_s"] for r in steps]
    models = sorted({p.parent for p in (run_dir / "checkpoints").glob("**/model.safetensors")})
    if len(models) != 1:
        raise SystemExit(
            f"vs_trl: expected one final checkpoint under {run_dir / 'checkpoints'}, found {models}"
        )
    model = AutoModelForCausalLM.from_pretrained(models[0], local_files_only=True)
    tok = AutoTokenizer.from_pretrained(student_dir, local_files_only=True)
    # the run trained the prompt stream TRL and the plain loop get (stream positions = sample ids)
    trained = samples.sort_values("sample_id")["prompt_id"].astype(int).tolist()
    stream = [int(i) for b in stage_blocks(cfg, tok) for i in b["prompt_id"]][: len(trained)]
    s = res.summary
    mem = {
        k: max(r[k] for r in rows if k in r)
        for k in ("mem/learner_rss_mb", "mem/ray_workers_rss_mb")
        if any(k in r for r in rows)
    }
    return {
        "breakdown": step_breakdown(steps, samples, spec["skip"]),
        "step_ends": step_ends,
        "kept": [r.get("samples/kept", cfg.train.batch_size) for r in steps],
        "tokens": [r["tokens/trained"] for r in steps] if all("tokens/trained" in r for r in steps) else None,
        "padding": [r["tokens/padding_frac"] for r in steps if "tokens/padding_frac" in r] or None,
        "memory": {**memory, "run_metrics_max": mem},
        **final_quality(model, tok, spec),
        "summary_samples_per_s": s.get("samples_per_s"),
        "summary_tokens_per_s": s.get("tokens_per_s"),
        "summary_first_step_s": s.get("first_step_s"),
        "summary_wall_s": s.get("wall_time_s"),
        "lag_max": s.get("lag_max"),
        "samples_dropped": s.get("samples_dropped"),
        "same_prompts": trained == stream,
    }


def stage_blocks(cfg: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """The run's prompt blocks in stream order (a task's split or the prompt files), as ``prompt_stream``."""
    from asyncrl.plan import load_examples, make_plan, prompt_blocks
    from asyncrl.workloads.tasks import prompt_token_ids

    plan = make_plan(cfg)
    train, _ = load_examples(plan.cfg)
    if train is None:
        from stage_times import file_blocks

        return file_blocks(plan.cfg, plan.prompts, tokenizer)
    width = max(map(len, prompt_token_ids(tokenizer, [e.prompt for e in train])))
    return prompt_blocks(plan.cfg, train, tokenizer, width)


def step_breakdown(steps: list[dict[str, Any]], samples: Any, skip: int) -> dict[str, float]:
    """Where a pipeline step goes, median ms over steps after ``skip``, from the run's own telemetry.

    Learner: ``step = data_wait + compute + publish``. Per batch: generation and scoring time in
    their actors, the generator's wait for admission, and the two hand-offs (generator -> scorer:
    ``score_done - gen_done - score_time``; scorer -> learner: ``consumed - score_done``).
    """
    rows = [r for r in steps if r["step"] > skip]
    out = {
        key: 1e3 * statistics.median(r[f"time/{key}_s"] for r in rows)
        for key in ("step", "data_wait", "compute", "publish")
    }
    b = samples[samples["step"] > skip].groupby("step").first()
    cols = {"gen_time_s", "gen_wait_s", "score_time_s", "gen_done_at", "score_done_at", "consumed_at"}
    if cols <= set(b.columns):
        out.update(
            generate=1e3 * b["gen_time_s"].median(),
            admission_wait=1e3 * b["gen_wait_s"].median(),
            score=1e3 * b["score_time_s"].median(),
            handoff_gen_to_score=1e3 * (b["score_done_at"] - b["gen_done_at"] - b["score_time_s"]).median(),
            handoff_score_to_learner=1e3 * (b["consumed_at"] - b["score_done_at"]).median(),
        )
    return out


def child_stages(spec: dict[str, Any]) -> dict[str, Any]:
    """Stage times and two-core limits per cache (none with ``stage_repeats`` 0), the untrained
    student's quality (an agreement regime: at eval seeds 0 and 1, the evaluation's own noise, and
    the teacher's greedy responses saved for every system's final eval), and the parity."""
    import torch
    from stage_times import Stages, measure_stage_times, throughput_bound
    from trl_parity import compare

    from asyncrl import records as R

    out: dict[str, Any] = {"limits": {}}
    caches = (("dense", DENSE), ("top16", []), ("dense_bf16", [*DENSE, *BF16]))
    for key, more in caches if spec["stage_repeats"] > 0 else ():
        cfg = run_config(spec, ["pipeline.torch_threads=1", *more])
        times = measure_stage_times(cfg, repeats=spec["stage_repeats"], warmup=2)
        out["limits"][key] = {
            "stage_s": times,
            **throughput_bound(times, cfg.train.batch_size, spec["cores"]),
        }
    stages = Stages(run_config(spec, ["pipeline.torch_threads=1", *DENSE]))
    if is_agreement(spec):
        out["initial"], texts = agreement(stages.student, stages.tokenizer, spec, seed=0)
        out["initial_seed1"], _ = agreement(
            stages.student, stages.tokenizer, spec, seed=1, teacher_texts=texts
        )
        Path(spec["teacher_texts"]).write_text(json.dumps(texts))
        torch.set_num_threads(1)  # the parity below, as before
    else:
        out["initial_exact_match"] = final_exact_match(stages.student, stages.tokenizer, spec)
    stages.student.train()
    batch = stages.generate(0)
    torch.manual_seed(0)
    out["parity"] = compare(stages.student, stages.teacher, batch)
    out["parity"]["left_padded"] = not bool(batch[R.PROMPT_MASK].all())
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    if spec["system"] == "stages":
        return child_stages(spec)
    _, kind, overrides, threads = SYSTEMS[spec["system"]]
    if kind == "trl":
        return child_trl(spec, threads, overrides)
    if kind == "plain":
        return child_plain(spec, overrides)
    return child_pipeline(spec, overrides)


# --- parent -----------------------------------------------------------------------------------------
def launch(spec: dict[str, Any], log: Path) -> dict[str, Any]:
    """Run one child process; returns its result with the launch time and process wall time."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    env = {**os.environ, **ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent / "src"), env.get("PYTHONPATH")) if p)
    load_before = os.getloadavg()[0]
    t_launch = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    t_exit = time.time()
    load_after = os.getloadavg()[0]
    lines = log.read_text().splitlines()
    result = [ln for ln in lines if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not result:
        tail = "\n".join(lines[-25:])
        raise SystemExit(f"vs_trl: {spec['system']} failed (exit {proc.returncode}); log {log}:\n{tail}")
    out = json.loads(result[-1][len("RESULT ") :])
    out["launch"], out["process_s"] = t_launch, t_exit - t_launch
    out["loadavg_1m"] = [load_before, load_after]  # the machine's 1-minute load at launch and exit
    return out


def figures(res: dict[str, Any], skip: int) -> dict[str, float]:
    """Steady samples/s, wall and first-step latency from one child's step clock (module docstring)."""
    ends, kept, n = res["step_ends"], res["kept"], len(res["step_ends"])
    if n <= skip:
        raise SystemExit(f"vs_trl: {n} steps leave nothing after --skip {skip}; raise --steps")
    dt = ends[-1] - ends[skip - 1]
    out = {
        "steady_samples_per_s": sum(kept[skip:]) / dt,
        "wall_s": ends[-1] - res["launch"],
        "first_step_s": ends[0] - res["launch"],
        "process_s": res["process_s"],
    }
    if res.get("tokens"):  # trained completion tokens over the same steps and interval
        if len(res["tokens"]) != n:
            raise SystemExit(f"vs_trl: {len(res['tokens'])} token counts for {n} steps")
        out["steady_tokens_per_s"] = sum(res["tokens"][skip:]) / dt
    if res.get("padding"):
        out["padding_frac"] = statistics.mean(res["padding"])
    if res.get("memory"):
        out["peak_rss_main_mb"] = res["memory"]["main"]
        out["peak_rss_other_max_mb"] = max((mb for _, mb in res["memory"]["processes"]), default=0.0)
    out.update({k: res[k] for k in QUALITY if k in res})
    return out


#: the quality figures a child may report (``final_quality``)
QUALITY = ("exact_match", "kl_forward", "kl_reverse", "top1_agree", "teacher_nll", "rouge_l")


def exact_match_spread(rows: list[dict[str, float]]) -> str:
    """Mean ± sample sd of the final exact match over rounds (one seed per round): the spread of
    training outcomes, which is what a difference between systems must be read against."""
    xs = [r["exact_match"] for r in rows]
    if len(xs) < 2:
        return f"{xs[0]:.3f} (one seed)"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f} ({len(xs)} seeds)"


def is_bf16(system: str) -> bool:
    return "train.precision=bf16" in SYSTEMS[system][2]


def reference_for(system: str, medians: dict[str, Any]) -> str:
    """The TRL row a system is compared with: TRL at the same precision when it ran, else ``trl``."""
    return "trl_bf16" if is_bf16(system) and "trl_bf16" in medians else REFERENCE


#: issue 41's floors for the real regime: tokens/s ratio to TRL, first step, learner padding
GOALS = {"tokens_ratio": 1.5, "first_step_s": 20.0, "padding_frac": 0.25}


def markdown_agreement(report: dict[str, Any]) -> str:
    """The real regime's table: tokens/s, samples/s, first step, padding, peak memory and held-out
    agreement per system, then the goals, the evaluation's noise, memory per process, step breakdowns."""
    m, st, cfg = report["medians"], report["stages"], report["settings"]
    steps, skip = cfg["steps"], cfg["skip"]
    lines = [
        f"B={cfg['batch']} samples per optimizer step, completions up to {cfg['max_new_tokens']} tokens "
        f"(ending at EOS), {steps} steps (steady state: steps {skip + 1}..{steps}), "
        f"{cfg['rounds']} round(s), lr {cfg['lr']:g}, held-out agreement on the first {cfg['eval_size']} "
        f"rows of prompts/eval.jsonl (eval seed 0). 1-minute load average at each launch / exit: "
        + ", ".join(
            f"{n} {r[0]['loadavg_1m'][0]:.1f}/{r[0]['loadavg_1m'][1]:.1f}"
            for n, r in report["rounds"].items()
            if "loadavg_1m" in r[0]
        )
        + ".",
        "",
        "| system | tokens/s | × TRL | samples/s | first step | wall for "
        f"{steps} steps | learner padding | peak RSS main / largest other process | "
        "held-out KL(student‖teacher) | KL(teacher‖student) | top-1 agree | teacher NLL | ROUGE-L |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in m.items():
        label, threads = SYSTEMS[name][0], report["rounds"][name][0].get("threads")
        if SYSTEMS[name][3] is None and threads is not None:
            label += f" ({threads})"
        ref = reference_for(name, m)
        tok = row.get("steady_tokens_per_s")
        ratio = f"{tok / m[ref]['steady_tokens_per_s']:.2f}" + (" (vs TRL bf16)" if ref != REFERENCE else "")
        pad = f"{100 * row['padding_frac']:.1f} %" if "padding_frac" in row else "n/a"
        other = row.get("peak_rss_other_max_mb")
        mem = (
            f"{row['peak_rss_main_mb']:.0f} / {other:.0f} MiB"
            if other
            else f"{row['peak_rss_main_mb']:.0f} MiB / -"
        )
        lines.append(
            f"| {label} | {tok:.1f} | {ratio} | {row['steady_samples_per_s']:.2f} "
            f"| {row['first_step_s']:.1f} s "
            f"| {row['wall_s']:.1f} s | {pad} | {mem} | {row['kl_reverse']:.4f} | {row['kl_forward']:.4f} "
            f"| {row['top1_agree']:.3f} | {row['teacher_nll']:.3f} | {row['rouge_l']:.3f} |"
        )
    for key, tag in (("initial", "seed 0"), ("initial_seed1", "seed 1")):
        q = st[key]
        lines.append(
            f"| untrained student (eval {tag}) | | | | | | | | {q['kl_reverse']:.4f} | {q['kl_forward']:.4f} "
            f"| {q['top1_agree']:.3f} | {q['teacher_nll']:.3f} | {q['rouge_l']:.3f} |"
        )
    noise = {
        k: abs(st["initial"][k] - st["initial_seed1"][k]) for k in ("kl_reverse", "kl_forward", "top1_agree")
    }
    asyncrl_rows = {n: r for n, r in m.items() if SYSTEMS[n][1] != "trl"}
    lines += ["", "Goals (issue 41, floors):"]
    for bf16 in (False, True):
        rows = {n: r for n, r in asyncrl_rows.items() if is_bf16(n) == bf16 and "steady_tokens_per_s" in r}
        ref = "trl_bf16" if bf16 else REFERENCE
        if not rows or ref not in m:
            continue
        best = max(rows, key=lambda n: rows[n]["steady_tokens_per_s"])
        ratio = rows[best]["steady_tokens_per_s"] / m[ref]["steady_tokens_per_s"]
        verdict = "met" if ratio >= GOALS["tokens_ratio"] else "**missed**"
        lines.append(
            f"- tokens/s, {'bf16' if bf16 else 'fp32'}: best asyncrl layout `{best}` "
            f"{rows[best]['steady_tokens_per_s']:.1f} vs `{ref}` {m[ref]['steady_tokens_per_s']:.1f} = "
            f"{ratio:.2f}x (goal >= {GOALS['tokens_ratio']}x): {verdict}; its held-out KL(student‖teacher) "
            f"{rows[best]['kl_reverse']:.4f} vs TRL's {m[ref]['kl_reverse']:.4f} (eval noise at a fixed "
            f"student, seeds 0 vs 1: {noise['kl_reverse']:.4f}; one training seed per system"
            + (")" if cfg["rounds"] < 2 else f", medians of {cfg['rounds']} seeds)")
            + "."
        )
    over = {
        n: r["first_step_s"] for n, r in asyncrl_rows.items() if r["first_step_s"] > GOALS["first_step_s"]
    }
    firsts = ", ".join(f"`{n}` {r['first_step_s']:.1f} s" for n, r in asyncrl_rows.items())
    lines.append(
        f"- first optimizer step <= {GOALS['first_step_s']:.0f} s after the command: "
        + ("met by every asyncrl system" if not over else f"**missed** by {len(over)} of {len(asyncrl_rows)}")
        + f" ({firsts})."
    )
    pads = {n: r["padding_frac"] for n, r in m.items() if "padding_frac" in r}
    bad = {n: v for n, v in pads.items() if v > GOALS["padding_frac"] and SYSTEMS[n][1] != "trl"}
    lines.append(
        f"- learner padding <= {100 * GOALS['padding_frac']:.0f} %: "
        + ("met" if not bad else "**missed**: " + ", ".join(f"`{n}` {100 * v:.1f} %" for n, v in bad.items()))
        + " (every system: "
        + ", ".join(f"`{n}` {100 * v:.1f} %" for n, v in pads.items())
        + ")."
    )
    lines += ["", "Peak RSS per process (MiB, VmHWM sampled every second; processes over 100 MiB):"]
    for name, rows in report["rounds"].items():
        mem = rows[0].get("memory")
        if not mem:
            continue
        procs = "; ".join(f"{n} {mb:.0f}" for n, mb in mem["processes"] if mb >= 100)
        lines.append(f"- `{name}`: main {mem['main']:.0f}" + (f"; {procs}" if procs else ""))
    lines += breakdown_lines(report)
    p = st["parity"]
    lines += [
        "",
        f"Parity on the first batch (same weights, teacher, completions): asyncrl dense forward KL "
        f"{p['loss_asyncrl']:.6f} vs TRL beta=0 {p['loss_trl']:.6f} (relative difference "
        f"{p['loss_rel_diff']:.1e}; gradients {p['grad_rel_diff']:.1e}).",
    ]
    return "\n".join(lines)


def breakdown_lines(report: dict[str, Any]) -> list[str]:
    """Each pipeline system's step breakdown (median ms over rounds), from the run's own telemetry."""
    lines = []
    for name, rows in report["rounds"].items():
        if "breakdown" in rows[0]:
            b = {k: statistics.median(r["breakdown"][k] for r in rows) for k in rows[0]["breakdown"]}
            lines.append(
                f"\n{name} step (median ms): {b['step']:.0f} = data wait {b['data_wait']:.0f} + compute "
                f"{b['compute']:.0f} + publish {b['publish']:.0f}"
                + (
                    f"; per batch: generate {b['generate']:.0f}, score {b['score']:.0f}, hand-offs "
                    f"{b['handoff_gen_to_score']:.0f} + {b['handoff_score_to_learner']:.0f}, generator "
                    f"admission wait {b['admission_wait']:.0f}."
                    if "generate" in b
                    else "."
                )
            )
    return lines


def markdown(report: dict[str, Any]) -> str:
    if report["settings"].get("eval") == "agreement":
        return markdown_agreement(report)
    m, ref = report["medians"], report["medians"][REFERENCE]
    steps = report["settings"]["steps"]
    head = (
        f"| system | steady samples/s | × TRL | wall for {steps} steps | × TRL | first step "
        "| final exact match (median; mean ± sd over seeds) |"
    )
    lines = [
        head,
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in m.items():
        label, threads = SYSTEMS[name][0], report["rounds"][name][0].get("threads")
        if SYSTEMS[name][3] is None and threads is not None:
            label += f" ({threads})"
        lines.append(
            f"| {label} | {row['steady_samples_per_s']:.1f} "
            f"| {row['steady_samples_per_s'] / ref['steady_samples_per_s']:.2f} | {row['wall_s']:.1f} s "
            f"| {row['wall_s'] / ref['wall_s']:.2f} | {row['first_step_s']:.1f} s "
            f"| {row['exact_match']:.3f}; {exact_match_spread(report['rounds'][name])} |"
        )
    names = {
        "dense": "dense forward KL",
        "top16": "top-16 forward KL",
        "dense_bf16": "dense forward KL, bf16",
    }
    cores = report["settings"]["cores"]
    for key, lim in report["stages"]["limits"].items():
        lines.append(
            f"| {cores}-core limit, {names[key]} (min of {cores}·B/Σ = {lim['work_bound']:.0f}, "
            f"B/max process = {lim['pipeline_bound']:.0f}, {lim['bottleneck']}) | {lim['limit']:.1f} "
            f"| {lim['limit'] / ref['steady_samples_per_s']:.2f} | | | | |"
        )
    st = report["stages"]
    dense = st["limits"].get("dense")  # no limit rows with --stage-repeats 0
    stage_ms = (
        ", ".join(f"{k} {1e3 * v:.1f}" for k, v in dense["stage_s"].items()) if dense else "not measured"
    )
    p = st["parity"]
    lines += breakdown_lines(report)
    padded = "1e-4: this batch has left-padded prompts (RoPE float error)"
    tol = padded if p.get("left_padded") else "1e-5"
    lines += [
        "",
        f"Initial exact match (the pretrained student): {st['initial_exact_match']:.3f}. "
        f"Stage times alone, one thread, dense cache (ms): {stage_ms}.",
        f"Parity on the first batch (same weights, teacher, completions): asyncrl dense forward KL "
        f"{p['loss_asyncrl']:.6f} vs TRL beta=0 {p['loss_trl']:.6f} (relative difference "
        f"{p['loss_rel_diff']:.1e}; gradients {p['grad_rel_diff']:.1e}; unit-tested tolerance {tol}).",
    ]
    return "\n".join(lines)


def cpu_model() -> str:
    """This machine's CPU model (``/proc/cpuinfo``), as BENCHMARKS.md names it."""
    from make_benchmarks_md import cpu_model as model

    return model()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", choices=sorted(REGIMES), default="short")
    ap.add_argument("--task", default=None, help="override the regime's task")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override the regime's new tokens")
    ap.add_argument("--preset", default=None, help="override the regime's model preset")
    ap.add_argument("--cache-dir", default=".asyncrl_cache", help="where the pretrained pairs are")
    regime_default = "default: the regime's ({})".format(
        ", ".join(f"{k}: {v}" for k, v in DEFAULTS.items())
        + "; smollm2: "
        + ", ".join(f"{k} {v}" for k, v in REGIMES["smollm2"]["defaults"].items())
    )
    ap.add_argument("--steps", type=int, default=None, help=regime_default)
    ap.add_argument("--batch", type=int, default=None, help="samples per optimizer step")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds, round r runs seed r")
    ap.add_argument("--skip", type=int, default=2, help="steps excluded from steady samples/s")
    ap.add_argument("--eval-size", type=int, default=None, help="held-out prompts of the final eval")
    ap.add_argument(
        "--stage-repeats",
        type=int,
        default=None,
        help="stage-time rounds of the limit rows (0: no limit rows)",
    )
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU cores of the limit rows")
    ap.add_argument(
        "--systems", nargs="*", default=None, choices=list(SYSTEMS), help="default: the regime's, else all"
    )
    ap.add_argument("--out", default=None, help="directory for vs_trl.json, vs_trl.md and the child logs")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        out = child(json.loads(args.child))
        print("RESULT " + json.dumps(out), flush=True)
        return out
    if args.skip < 1:
        ap.error("--skip must be >= 1: steady throughput starts at the end of step --skip")
    regime = REGIMES[args.regime]
    for key, value in {**DEFAULTS, **regime.get("defaults", {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.systems is None:
        args.systems = list(regime.get("systems", SYSTEMS))
    if REFERENCE not in args.systems:
        ap.error(f"--systems must include {REFERENCE!r}: the ratios are against it")
    settings = {
        "regime": args.regime,
        "task": args.task or regime["task"],
        "max_new_tokens": args.max_new_tokens or regime["max_new_tokens"],
        "preset": args.preset or regime["preset"],
        "cache_dir": str(Path(args.cache_dir).resolve()),
        "steps": args.steps,
        "batch": args.batch,
        "seed": 0,  # the stage/parity child's; round r runs seed r
        "eval_size": args.eval_size,
        "skip": args.skip,
        "stage_repeats": args.stage_repeats,
        "cores": args.cores,
        "rounds": args.rounds,
        "config": regime.get("config", CONFIG.name),
        "base": regime.get("base", []),
        "eval": regime.get("eval", "exact_match"),
    }
    pair_dirs(settings)  # fail now, with the pretrain / prepare command, if the pair is missing
    settings["lr"] = run_config({**settings, "run_dir": "unused"}, [], parse_only=True).train.lr
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="vs_trl-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    settings["teacher_texts"] = str(out_dir.resolve() / "teacher_texts.json")  # agreement regimes
    scratch = Path(tempfile.mkdtemp(prefix="vs_trl-runs-"))

    def spec(system: str, tag: str, seed: int = 0) -> dict[str, Any]:
        return {**settings, "seed": seed, "system": system, "run_dir": str(scratch / tag)}

    try:
        print(f"[vs_trl] stage times, initial accuracy, parity ({out_dir / 'stages.log'})", flush=True)
        stages = launch(spec("stages", "stages"), out_dir / "stages.log")
        per_round: dict[str, list[dict[str, float]]] = {s: [] for s in args.systems}
        failed: dict[str, list[str]] = {}
        for r in range(args.rounds):
            order = args.systems[r % len(args.systems) :] + args.systems[: r % len(args.systems)]
            for system in order:
                tag = f"{system}-r{r}"
                # round r runs seed r (prompt order and sampling; the pretrained pair stays seed 0):
                # a run is deterministic given its seed, so repeating one seed measures no training variance
                try:
                    res = launch(spec(system, tag, seed=r), out_dir / f"{tag}.log")
                except SystemExit as err:  # one failed child (a crash, the machine): the others still count
                    failed.setdefault(system, []).append(f"round {r + 1}: {str(err).splitlines()[0]}")
                    print(f"[vs_trl] round {r + 1}/{args.rounds} {system}: FAILED ({err})", flush=True)
                    continue
                fig = figures(res, args.skip)
                extra = (
                    "summary_samples_per_s",
                    "trl_train_samples_per_s",
                    "lag_max",
                    "threads",
                    "checkpointing",
                    "breakdown",
                )
                fig.update({k: res[k] for k in extra if k in res})
                extra_real = (
                    "memory",
                    "loadavg_1m",
                    "summary_tokens_per_s",
                    "summary_first_step_s",
                    "eval_s",
                    "same_prompts",
                )
                fig.update({k: res[k] for k in extra_real if k in res})
                per_round[system].append(fig)
                quality = (
                    f"held-out KL(student||teacher) {fig['kl_reverse']:.4f}  "
                    f"tokens/s {fig.get('steady_tokens_per_s', float('nan')):.1f}  "
                    f"padding {fig.get('padding_frac', float('nan')):.3f}"
                    if settings["eval"] == "agreement"
                    else f"exact match {fig['exact_match']:.3f}"
                )
                print(
                    f"[vs_trl] round {r + 1}/{args.rounds} {system:11s} "
                    f"{fig['steady_samples_per_s']:7.1f} samples/s  wall {fig['wall_s']:5.1f} s  "
                    f"first step {fig['first_step_s']:5.1f} s  {quality}",
                    flush=True,
                )
                shutil.rmtree(scratch / tag, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    per_round = {s: rows for s, rows in per_round.items() if rows}
    medians = {
        s: {
            k: statistics.median(f[k] for f in rows)
            for k, v in rows[0].items()
            if isinstance(v, (int, float)) and all(isinstance(f.get(k), (int, float)) for f in rows)
        }
        for s, rows in per_round.items()
    }
    report = {
        "settings": settings,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "cpu": cpu_model(),
        },
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/vs_trl.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "rounds": per_round,
        "medians": medians,
        "stages": stages,
        "failed": failed,
    }
    if REFERENCE not in medians:
        (out_dir / "vs_trl.json").write_text(json.dumps(report, indent=2))
        raise SystemExit(f"vs_trl: the reference {REFERENCE!r} failed: no ratios; JSON in {out_dir}")
    (out_dir / "vs_trl.json").write_text(json.dumps(report, indent=2))  # first: a table bug loses nothing
    table = markdown(report)
    if failed:
        table += "\n\nFailed (left out above): " + "; ".join(
            f"`{n}` ({'; '.join(msgs)})" for n, msgs in failed.items()
        )
    (out_dir / "vs_trl.json").write_text(json.dumps(report, indent=2))
    (out_dir / "vs_trl.md").write_text(table + "\n")
    print(
        f"\nregime={args.regime} task={settings['task']} T={settings['max_new_tokens']} "
        f"preset={settings['preset']} B={args.batch} steps={args.steps} rounds={args.rounds} (medians); "
        f"JSON and Markdown in {out_dir}\n"
    )
    print(table)
    return report


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]).get("failed") else 0)
