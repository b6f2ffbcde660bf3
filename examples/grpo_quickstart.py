"""GRPO (RL on the task's exact-match reward, no teacher) through the same pipeline.

    python examples/grpo_quickstart.py
    python examples/grpo_quickstart.py train.group_size=8 train.batch_size=32

Same graph as OPD, with the teacher-scoring stage replaced by the reward function; groups of
``train.group_size`` completions per prompt are admitted and dropped whole, so the
group-relative advantages are always computed over complete groups.
"""

from __future__ import annotations

import sys
from pathlib import Path

import asyncrl
from asyncrl.config import RunConfig, load_config
from asyncrl.lab.pretrain import pretrain
from asyncrl.pipeline import RunResult

CONFIG = Path(__file__).resolve().parent / "configs" / "grpo.yaml"

TINY = [
    "run_dir=runs/grpo_quickstart",
    "workload.preset=tiny",
    "workload.train_size=1024",
    "train.steps=6",
    "train.batch_size=16",  # 4 prompts x group_size 4
    "train.group_size=4",
    "train.eval_every=3",
    "train.eval_size=64",
    "telemetry.progress=false",
    "telemetry.tensorboard=false",
]


def build_config(argv: list[str] | None = None) -> RunConfig:
    """grpo.yaml shrunk to the tiny preset and 6 steps, plus ``argv`` key=value overrides."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    return load_config(CONFIG, [*TINY, *overrides])


def main(argv: list[str] | None = None) -> RunResult:
    """Pretrain (or reuse) the tiny student, run 6 GRPO steps; ``argv``: key=value overrides."""
    cfg = build_config(argv)
    pretrain(
        task=cfg.workload.task,
        preset=cfg.workload.preset,
        cache_dir=cfg.workload.cache_dir,
        seed=cfg.workload.pretrain_seed,
        progress=False,
    )
    result = asyncrl.run(cfg)
    s = result.summary
    print(
        f"GRPO: {s['steps']} steps, {s['samples_trained']} samples, mean reward "
        f"{s.get('reward_mean_first')} -> {s.get('reward_mean_last')}, "
        f"eval accuracy {s['eval_accuracy_initial']} -> {s['eval_accuracy_final']}"
    )
    print(f"run directory: {result.run_dir}  (asyncrl report {result.run_dir})")
    return result


if __name__ == "__main__":
    main()
