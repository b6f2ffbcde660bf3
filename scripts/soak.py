"""Soak test: a long tiny-preset run with random generator slowdowns and one fault of each kind.

    python scripts/soak.py --steps 60                           # CI variant (about 2 min on 2 cores)
    python scripts/soak.py --steps 1800 --run-dir runs/soak     # about 30 min on 2 cores

``examples/configs/soak.yaml`` plus, placed along the run: a generator process exit, a scorer
process exit, a learner process exit (Ray Train restarts the worker group), one non-finite step
(skipped), and a ``kill -9`` of the whole ``asyncrl run`` process group (the driver), after which
the same command is run again and resumes. Checks, each printed with its measured figure:

- the killed run left no ``summary.json`` and a complete checkpoint at a multiple of
  ``train.checkpoint_every``; the resumed command exits 0, ``summary.json`` says ``status: completed``
  and ``driver_resumes: 1``, and the killed process's draws are counted as regenerated;
- every step 1..N logged once; no sample trained twice; exactly N x B samples trained; every trained
  token's lag (learner version - the version that produced the token) <= ``pipeline.max_lag``, so
  with ``pipeline.inflight_updates=true`` (the CI soak) partial sequences, whose tokens come from
  several versions, are held to the same exactly-once and staleness contract across every fault;
- the sample ledger balances (drawn = trained + dropped + regenerated + in flight);
- every fault fired; the non-finite step was skipped and counted;
- memory: each ``mem/*`` metric's median over the last quarter of the steps exceeds its median
  over the second quarter by at most ``--rss-growth-mb`` (learner, Ray workers) or
  ``--store-growth-mb`` (object store);
- no deadlock: each phase ends within ``--timeout`` seconds (and a stalled stream fails the run
  after ``pipeline.no_progress_timeout_s``).

Writes ``RUN/soak.json`` with the figures; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "soak.yaml"


def fault_plan(steps: int) -> dict[str, int]:
    """Where each fault goes (counts scale with the run; the driver dies after a checkpoint)."""
    every = max(2, steps // 10)
    return {
        "train.checkpoint_every": every,
        "faults.generator_exit": max(2, steps // 8),  # the k-th admission of one generator
        "faults.scorer_exit": max(3, steps // 6),  # the k-th block of the scorer
        "kill_at": max(every + 1, int(steps * 0.35)),  # driver death (SIGKILL of the process group)
        "faults.learner_exit": max(every + 2, int(steps * 0.6)),
        "faults.nonfinite_step": max(every + 3, int(steps * 0.8)),
    }


def last_step(run_dir: Path) -> int:
    from asyncrl.telemetry.sinks import read_metrics

    if not (run_dir / "metrics.jsonl").exists():
        return 0
    return max((m.get("step", 0) for m in read_metrics(run_dir)), default=0)  # a torn last line is skipped


def launch(argv: list[str], log: Path) -> subprocess.Popen:
    """``asyncrl run`` in its own process group (what a terminal's ``kill -9 -PGID`` hits)."""
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "--quiet", "run", *argv],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def growth(metrics: list[dict], key: str, steps: int) -> float | None:
    """Median of ``key`` over the last quarter of the steps minus its median over the second quarter."""
    rows = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
    if not rows:
        return None
    early = [v for s, v in rows if steps * 0.25 <= s < steps * 0.5]
    late = [v for s, v in rows if s >= steps * 0.75]
    if not early or not late:
        return None
    return float(np.median(late) - np.median(early))


def within(growth: float | None, bound: float) -> bool:
    """A measured growth within ``bound``; no measurement (no samples in a quarter) fails."""
    return growth is not None and growth <= bound


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (60: ~2 min; 1800: ~30 min)")
    p.add_argument("--run-dir", default="runs/soak", help="run directory (started over)")
    p.add_argument("--cache-dir", default=os.environ.get("ASYNCRL_TEST_CACHE", ".asyncrl_cache"))
    p.add_argument("--timeout", type=float, default=0, help="seconds per phase (default: 120 + 4 s/step)")
    p.add_argument("--rss-growth-mb", type=float, default=150.0, help="allowed RSS growth per mem/* metric")
    p.add_argument("--store-growth-mb", type=float, default=64.0, help="allowed object-store growth")
    p.add_argument("overrides", nargs="*", help="extra config overrides")
    args = p.parse_args(argv)

    from asyncrl import checkpoint
    from asyncrl.telemetry import names as N
    from asyncrl.telemetry.sinks import read_metrics, read_summary
    from asyncrl.telemetry.summary import read_samples

    run_dir = Path(args.run_dir).resolve()
    timeout = args.timeout or 120 + 4 * args.steps
    plan = fault_plan(args.steps)
    kill_at = plan.pop("kill_at")
    base = [
        str(CONFIG),
        f"run_dir={run_dir}",
        f"workload.cache_dir={args.cache_dir}",
        f"train.steps={args.steps}",
        "telemetry.memory_every_s=0",  # mem/* at every step: the growth check compares quarters of the steps
        *(f"{k}={v}" for k, v in plan.items()),
        *args.overrides,
    ]
    log = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    t0 = time.perf_counter()

    # phase 1: a fresh run, killed (-9, whole process group) once it logged step kill_at
    proc = launch([*base, "pipeline.resume=false"], log)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and last_step(run_dir) < kill_at and time.monotonic() < deadline:
        time.sleep(0.5)
    if proc.poll() is not None:
        print(f"soak: phase 1 ended (exit {proc.returncode}) before step {kill_at}; see {log}")
        return 1
    killed_at = last_step(run_dir)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    t_kill = time.perf_counter() - t0
    # what the kill left: no outcome claimed, and a complete checkpoint at a multiple of checkpoint_every
    claimed_after_kill = read_summary(run_dir) is not None
    latest = checkpoint.latest(run_dir)
    resume_from = checkpoint.step_of(latest) if latest is not None else None

    # phase 2: the same command resumes and finishes
    proc = launch(base, log)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        print(f"soak: phase 2 did not finish within {timeout:.0f} s (deadlock?); see {log}")
        return 1
    wall = time.perf_counter() - t0

    summary = read_summary(run_dir) or {}
    metrics = read_metrics(run_dir)
    samples = read_samples(run_dir)
    kept = samples[samples["kept"]]
    batch = 16
    for item in args.overrides:
        if item.startswith("train.batch_size="):
            batch = int(item.split("=", 1)[1])
    steps_logged = sorted(m["step"] for m in metrics if "loss" in m)
    fired = {p.name for p in (run_dir / "faults").iterdir()} if (run_dir / "faults").is_dir() else set()
    mem = {
        key: growth(metrics, key, args.steps)
        for key in ("mem/learner_rss_mb", "mem/ray_workers_rss_mb", "mem/object_store_mb")
    }
    peak = {key: max((m[key] for m in metrics if m.get(key) is not None), default=None) for key in mem}
    checks = {
        "exit 0": code == 0,
        "status completed": summary.get("status") == "completed",
        "steps 1..N once": steps_logged == list(range(1, args.steps + 1)),
        "no sample trained twice": bool(kept["sample_id"].is_unique),
        "N x B trained": len(kept) == args.steps * batch,
        "token lag <= max_lag": "max_lag" in summary
        and bool((kept["token_lag_max"] <= summary["max_lag"]).all()),
        "ledger balanced": summary.get("ledger_balanced") is True,
        "every fault fired": fired >= {"generator_exit", "scorer_exit", "learner_exit", "nonfinite_step"},
        "driver resumed": summary.get("driver_resumes") == 1,
        "killed run claimed nothing": not claimed_after_kill,
        "resumed from a checkpoint": resume_from is not None
        and resume_from % plan["train.checkpoint_every"] == 0
        and 0 < resume_from <= killed_at,
        "killed draws regenerated": summary.get("samples_regenerated", 0) > 0,
        "learner restarted": summary.get("learner_restarts") == 1,
        "non-finite step skipped": summary.get("samples_dropped_nonfinite", 0) > 0,
        "learner RSS bound": within(mem["mem/learner_rss_mb"], args.rss_growth_mb),
        "Ray workers RSS bound": within(mem["mem/ray_workers_rss_mb"], args.rss_growth_mb),
        "object store bound": within(mem["mem/object_store_mb"], args.store_growth_mb),
    }
    report = {
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "driver_killed_at_step": killed_at,
        "resumed_from_step": resume_from,
        "driver_killed_after_s": round(t_kill, 1),
        "faults_fired": sorted(fired),
        "samples_spanning_versions": int((kept["version_last"] > kept["version_first"]).sum()),
        "token_lag_max": int(kept["token_lag_max"].max()),
        "mem_growth_mb": mem,
        "mem_peak_mb": peak,
        "ledger": {
            k: summary.get(k)
            for k in N.SUMMARY_KEYS
            if k.startswith("samples_") or k in ("ledger_balanced", "learner_restarts", "driver_resumes")
        },
        "checks": checks,
    }
    (run_dir / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        print(f"soak: FAILED {failed}; log: {log}")
        return 1
    print(f"soak: ok ({args.steps} steps, {wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
