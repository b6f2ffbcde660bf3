"""The real demo as a user runs it, timed: ``asyncrl demo --preset smollm2`` (sync and async OPD of
SmolLM2-135M-Instruct into its 6-layer pruned student on ShareGPT prompts).

    python benchmarks/real_demo.py --cache-dir .asyncrl_cache          # the demo's defaults
    python benchmarks/real_demo.py --steps 4 -- train.eval_every=2    # a smoke run

Prepares the preset first (not timed: the one-time download and conversion), then runs the demo
command in a fresh process and prints what it printed, its wall time and the machine's load
average before and after (the demo's 15-minute budget is for an otherwise idle 2-core machine),
and each run's start-up parts from its ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: summary.json figures shown per run, besides the demo's own table
FIGURES = (
    "wall_time_s",
    "startup_s",
    "startup_driver_s",
    "startup_train_workers_s",
    "startup_learner_init_s",
    "startup_first_batch_s",
    "startup_first_step_s",
    "samples_per_s",
    "tokens_per_s",
    "padding_frac",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=".asyncrl_cache")
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--steps", type=int, default=None, help="default: the demo's")
    ap.add_argument("--run-root", default=None, help="default: a temporary directory")
    ap.add_argument("overrides", nargs="*", help="config overrides passed to the demo (after --)")
    args = ap.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "asyncrl.cli"]
    prep = subprocess.run(
        [*cli, "-q", "prepare", args.preset, "--cache-dir", args.cache_dir], env=env, cwd=ROOT
    )
    if prep.returncode != 0:
        return prep.returncode
    root = Path(args.run_root or f"/tmp/asyncrl-real-demo-{os.getpid()}")
    cmd = [*cli, "demo", "--preset", args.preset, "--cache-dir", args.cache_dir, "--run-root", str(root)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    cmd += args.overrides
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    print(res.stdout.strip() if res.returncode == 0 else (res.stdout + res.stderr)[-3000:])
    print(f"\ncommand: {' '.join(cmd[2:])}")
    print(f"wall time of the demo command: {wall:.0f} s ({wall / 60:.1f} min); exit {res.returncode}")
    print(f"load average (1/5/15 min) before {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
          f"after {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}")  # fmt: skip
    for label in ("sync", "async"):
        f = root / label / "summary.json"
        if f.is_file():
            s = json.loads(f.read_text())
            shown = "  ".join(
                f"{k} {s[k]:.3g}" if isinstance(s.get(k), float) else f"{k} {s.get(k)}" for k in FIGURES
            )
            print(f"{label}: {shown}")
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
