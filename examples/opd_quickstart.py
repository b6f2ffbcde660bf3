"""Asynchronous on-policy distillation in a few lines: the tiny config, a few steps, one call.

    python examples/opd_quickstart.py                      # defaults below
    python examples/opd_quickstart.py pipeline.max_lag=0   # any key=value override

``asyncrl.run`` starts a local Ray instance, streams rollouts (Ray Data) into a Ray Train
learner, and writes the run directory (config, metrics.jsonl, samples.parquet, summary.json,
checkpoints). The tiny teacher/student pair is pretrained on first use and cached.
"""

from __future__ import annotations

import sys
from pathlib import Path

import asyncrl
from asyncrl.config import RunConfig, load_config
from asyncrl.lab.pretrain import pretrain
from asyncrl.lab.report import write_report
from asyncrl.pipeline import RunResult

CONFIG = Path(__file__).resolve().parent / "configs" / "opd_tiny.yaml"


def build_config(argv: list[str] | None = None) -> RunConfig:
    """The tiny OPD config with 6 steps, into runs/opd_quickstart, plus ``argv`` key=value overrides."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    base = ["run_dir=runs/opd_quickstart", "train.steps=6", "train.eval_every=3", "telemetry.progress=false"]
    return load_config(CONFIG, [*base, *overrides])


def main(argv: list[str] | None = None) -> RunResult:
    """Pretrain (or reuse) the tiny pair, run 6 async OPD steps, write the report; ``argv``: overrides."""
    cfg = build_config(argv)
    pair = pretrain(
        task=cfg.workload.task,
        preset=cfg.workload.preset,
        cache_dir=cfg.workload.cache_dir,
        seed=cfg.workload.pretrain_seed,
        progress=False,
    )
    print(f"teacher exact match {pair.teacher_accuracy:.3f}, student {pair.student_accuracy:.3f}")
    result = asyncrl.run(cfg)
    s = result.summary
    print(
        f"{s['steps']} steps, {s['samples_trained']} samples trained, {s['samples_dropped']} dropped, "
        f"lag p50 {s['lag_p50']} max {s['lag_max']}, eval accuracy "
        f"{s['eval_accuracy_initial']} -> {s['eval_accuracy_final']}"
    )
    print(f"report: {write_report([result.run_dir])}")
    return result


if __name__ == "__main__":
    main()
