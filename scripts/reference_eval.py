"""Re-evaluate finished runs' final students with every agreement instrument, on their own eval prompts.

Why: the agreement figures a run logs at its end are measured on the student's own samples, which a
student can move to states its teacher finds easy (a response repeating one token). The reference
instruments (``kl_forward_ref``, ``top1_agree_ref``: teacher-forced on the teacher's greedy responses)
and ``distinct_2`` cannot be moved that way; this measures them on checkpoints that already exist,
with each run's own evaluator settings (its held-out prompts, ``sampling.max_new_tokens``, seed and
teacher dtype), so the on-sample figures it prints reproduce the run's logged final ones.

    python scripts/reference_eval.py runs/sweeps/real_pair/runs/* \\
        --out experiments/data/real_pair/reference.csv
    python scripts/gen_experiments.py            # section 10 reads reference.csv

Writes one row per run (its last complete checkpoint), one per seed for the starting student
(``variant`` ``initial``) and one per seed for the teacher evaluated as its own student (``teacher``:
its distinct-2 is the reference for a degenerate student): ``variant``, ``pipeline.max_lag``, ``seed``,
``step`` and every ``asyncrl.workloads.agreement.METRICS`` figure. The teacher against itself does not
depend on the seed (its greedy responses are its reference), so it is evaluated once per set of prompts.

``--teacher-only`` writes only the teacher's rows: for runs that logged the reference instruments
themselves (every run since they exist), the teacher's distinct-2 is all the study still needs.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

import torch

from asyncrl.lab.evidence import format_value
from asyncrl.workloads.agreement import METRICS, AgreementEvaluator

KEYS = ("variant", "pipeline.max_lag", "seed", "step")


def cell_settings(run_dir: Path) -> dict[str, str]:
    """``variant=a__pipeline.max_lag=2__seed=0`` -> its settings (a sweep's run directory name)."""
    out = dict(part.split("=", 1) for part in run_dir.name.split("__") if "=" in part)
    missing = [k for k in ("variant", "pipeline.max_lag", "seed") if k not in out]
    if missing:
        raise SystemExit(f"{run_dir}: not a sweep cell's run directory (its name lacks {', '.join(missing)})")
    return out


def evaluator_of(cfg: Any) -> tuple[AgreementEvaluator, str]:
    """The run's agreement evaluator (as ``BackgroundAgreement`` builds it) and its student directory."""
    from asyncrl.plan import eval_plan, make_plan
    from asyncrl.workloads.checkpoints import load_model

    plan = make_plan(cfg)
    evals = eval_plan(plan.cfg, plan.models, [])
    if evals.kind != "agreement" or not evals.prompt_ids:
        raise SystemExit(f"{cfg.run_dir}: its eval is {evals.kind}, not agreement with a teacher")
    teacher, tokenizer = load_model(
        plan.models.teacher_dir, role="teacher", dtype=getattr(torch, cfg.pipeline.teacher_dtype)
    )
    ev = AgreementEvaluator(
        teacher, tokenizer, evals.prompt_ids, max_new_tokens=int(cfg.sampling.max_new_tokens), seed=cfg.seed
    )
    return ev, plan.models.student_dir


def main(argv: list[str] | None = None) -> int:
    from asyncrl.checkpoint import MODEL_DIR, scan
    from asyncrl.config import load_config
    from asyncrl.workloads.checkpoints import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="sweep cells' run directories")
    ap.add_argument("--out", type=Path, required=True, help="the CSV to write")
    ap.add_argument(
        "--teacher-only", action="store_true", help="only the teacher's rows (the runs logged their own)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    rows: list[dict[str, Any]] = []
    evaluators: dict[tuple, tuple[AgreementEvaluator, str]] = {}
    seen_seeds: set[int] = set()
    teacher_of: dict[tuple, dict[str, float]] = {}
    for run_dir in sorted(args.runs):
        settings = cell_settings(run_dir)
        found = [(step, path) for step, path, bad in scan(run_dir) if not bad]
        if not found:
            print(f"{run_dir}: no complete checkpoint, skipped", file=sys.stderr)
            continue
        step, path = found[-1]
        cfg = load_config(str(run_dir / "config.yaml"))
        w = cfg.workload
        key = (cfg.seed, str(w.eval_prompts_path), w.preset, cfg.train.eval_size, cfg.sampling.max_new_tokens)
        seed = int(settings["seed"])
        jobs = (
            []
            if args.teacher_only
            else [(settings["variant"], settings["pipeline.max_lag"], step, str(path / MODEL_DIR))]
        )
        if seed not in seen_seeds:
            seen_seeds.add(seed)
            jobs += [] if args.teacher_only else [("initial", "", 0, "")]  # "": the run's starting student
            jobs += [("teacher", "", 0, None)]
        for variant, lag, at, model_dir in jobs:
            if model_dir is None and key[1:] in teacher_of:
                metrics, seconds = teacher_of[key[1:]], 0.0
            else:
                if key not in evaluators:  # built (the teacher loaded) only when something is evaluated
                    evaluators[key] = evaluator_of(cfg)
                ev, student_dir = evaluators[key]
                model_dir = student_dir if model_dir == "" else model_dir
                model = ev.teacher if model_dir is None else load_model(model_dir, role="student")[0]
                res = ev(model)
                metrics, seconds = res.metrics, res.seconds
                if model_dir is None:
                    teacher_of[key[1:]] = metrics
            rows.append(dict(zip(KEYS, (variant, lag, seed, at))) | metrics)
            print(
                f"{variant} S={lag or '-'} seed {seed} step {at}: "
                + "  ".join(f"{k} {metrics[k]:.4f}" for k in METRICS)
                + f"  ({seconds:.0f} s)",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[*KEYS, *METRICS], lineterminator="\n")
        w.writeheader()
        for row in rows:
            w.writerow({k: format_value(v) if isinstance(v, float) else v for k, v in row.items()})
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
