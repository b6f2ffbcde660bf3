"""summary.json: the final figures of a run, computed from what the run directory holds.

Written by the driver when the pipeline finishes (``asyncrl.pipeline.run``); every figure is
derived from ``metrics.jsonl`` and ``samples.parquet`` plus the coordinator's counters, so a
summary can be recomputed from a run directory at any time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.telemetry import names as N
from asyncrl.telemetry.sinks import read_metrics
from asyncrl.telemetry.sinks import read_samples as read_table


def read_samples(run_dir: str | Path) -> Any:
    """samples.parquet (or its live part files) as a pandas DataFrame; empty if none yet."""
    import pandas as pd

    table = read_table(run_dir)
    return table.to_pandas() if table is not None else pd.DataFrame()


def _mean(values: Any) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def steady_throughput(metrics: list[dict[str, Any]], key: str = N.SAMPLES_KEPT) -> float | None:
    """Samples/s (or, with ``key=names.TOKENS``, trained tokens/s) between the first and last step,
    excluding evaluation time and start-up."""
    steps = [m for m in metrics if m.get(N.STEP, 0) >= 1 and key in m]
    if len(steps) < 2:
        return None
    first, last = steps[0], steps[-1]
    dt = (last[N.TIME_S] - last.get("time/eval_total_s", 0.0)) - (
        first[N.TIME_S] - first.get("time/eval_total_s", 0.0)
    )
    n = sum(m[key] for m in steps[1:])
    return n / dt if dt > 0 else None


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """``RUN/evals.jsonl`` (the agreement evaluations), by step; the latest record of a step wins
    (a resumed run may evaluate a step again)."""
    import json

    f = Path(run_dir) / N.EVAL_FILE
    if not f.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in f.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[int(rec["step"])] = rec
    return [by_step[k] for k in sorted(by_step)]


def agreement(run_dir: str | Path) -> dict[str, float | None]:
    """summary.json's ``eval_<metric>_initial`` / ``_final``: the first and last agreement evaluation."""
    evals = read_evals(run_dir)
    out: dict[str, float | None] = {}
    for key in N.EVAL_AGREEMENT:
        name = key.split("/", 1)[1]
        out[f"eval_{name}_initial"] = evals[0]["metrics"].get(name) if evals else None
        out[f"eval_{name}_final"] = evals[-1]["metrics"].get(name) if evals else None
    return out


def summarize(
    run_dir: str | Path,
    *,
    algo: str,
    estimator: str,
    max_lag: int,
    teacher_accuracy: float | None,
    wall_s: float,
    store_stats: dict[str, Any],
    status: str = N.STATUS_COMPLETED,
    marks: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The figures of ``summary.json`` (keys: ``names.SUMMARY_KEYS``), the sample ledger among them.

    ``marks``: the driver's wall-clock marks (epoch s) for the start-up figures (``startup``)."""
    metrics = read_metrics(run_dir)
    samples = read_samples(run_dir)
    evals = [m[N.EVAL_ACCURACY] for m in metrics if N.EVAL_ACCURACY in m]
    kept = samples[samples["kept"]] if len(samples) else samples
    lags = kept["lag"].to_numpy() if len(kept) else np.zeros(0)
    return {
        "status": status,
        "algo": algo,
        "estimator": estimator,
        "max_lag": max_lag,
        "steps": max((m.get(N.STEP, 0) for m in metrics), default=0),
        "samples_trained": len(kept),
        "samples_dropped": int(len(samples) - len(kept)),
        "wall_time_s": wall_s,
        "samples_per_s": steady_throughput(metrics),
        "tokens_per_s": steady_throughput(metrics, key=N.TOKENS),
        "padding_frac": _mean(m.get(N.PADDING_FRAC) for m in metrics),
        "lag_p50": float(np.median(lags)) if len(lags) else None,
        "lag_max": int(lags.max()) if len(lags) else None,
        "eval_accuracy_initial": evals[0] if evals else None,
        "eval_accuracy_final": evals[-1] if evals else None,
        **agreement(run_dir),
        "teacher_accuracy": teacher_accuracy,
        "reward_mean_first": _mean_reward(kept, first=True),
        "reward_mean_last": _mean_reward(kept, first=False),
        "admission_wait_s": store_stats.get("admission_wait_s"),
        **ledger(samples, store_stats),
        # blocks re-run after their generator died (they kept their admission: no budget leaked)
        "generation_retries": store_stats.get("budget/retries", 0),
        "engine_restarts": store_stats.get("engine_deaths", 0),
        **startup(metrics, marks or {}),
        "run_dir": str(run_dir),
    }


def ledger(samples: Any, store_stats: dict[str, Any]) -> dict[str, Any]:
    """Where every sample drawn ended, and whether the books balance.

    The PolicyStore counts draws (``books/*``: drawn, trained, dropped, regenerated after a fault,
    in flight at the end); samples.parquet has one row per consumed sample with its
    ``drop_reason``. Balanced means ``drawn = trained + dropped + regenerated + in_flight``, the
    store's trained and dropped counts equal the rows', and no sample id has two rows (none
    trained twice)."""
    books = {k.split("/", 1)[1]: int(v) for k, v in store_stats.items() if k.startswith("books/")}
    n = len(samples)
    kept = int(samples["kept"].sum()) if n else 0
    reasons = samples[N.DROP_REASON] if n and N.DROP_REASON in samples else None
    nonfinite = int((reasons == N.DROPPED_NONFINITE).sum()) if reasons is not None else 0
    unique = bool(samples["sample_id"].is_unique) if n else True
    balanced = bool(
        books
        and books["drawn"] == books["trained"] + books["dropped"] + books["regenerated"] + books["in_flight"]
        and books["trained"] == kept
        and books["dropped"] == n - kept
        and unique
    )
    return {
        "samples_drawn": books.get("drawn"),
        "samples_dropped_controllers": n - kept - nonfinite,
        "samples_dropped_nonfinite": nonfinite,
        "samples_regenerated": books.get("regenerated"),
        "samples_in_flight_end": books.get("in_flight"),
        "ledger_balanced": balanced,
        "learner_restarts": books.get("learner_restarts", 0),
        "driver_resumes": books.get("driver_resumes", 0),
    }


def failed_summary(run_dir: str | Path, error: BaseException, *, wall_s: float) -> dict[str, Any]:
    """``summary.json`` of a run that raised: ``status: failed``, the one-line error, the steps done."""
    try:
        steps = max((m.get(N.STEP, 0) for m in read_metrics(run_dir)), default=0)
    except FileNotFoundError:
        steps = 0
    text = " ".join(str(error).split()) or type(error).__name__
    return {
        "status": N.STATUS_FAILED,
        "error": f"{type(error).__name__}: {text[:2000]}",
        "steps": steps,
        "wall_time_s": wall_s,
        "run_dir": str(run_dir),
    }


def startup(metrics: list[dict[str, Any]], marks: dict[str, float]) -> dict[str, float | None]:
    """The fixed cost before training: ``startup_s`` from the start of ``asyncrl.run`` to the first
    optimizer step, ``first_step_s`` from the start of the command (its process), and where the
    time went (``names.STARTUP_PARTS``: the driver's part (config, plan, prompts, Ray's start),
    of which ``startup_ray_init_s``; the Train controller and worker processes; the learner's
    model, optimizer, first eval and first publish; the stage actors' start and the first
    rollouts; the first step). Uses the learner's marks logged with its first step in this
    process (``names.STARTUP_MARKS``) and the driver's ``marks``: ``process_started_at``,
    ``run_started_at``, ``ray_started_at``, ``ray_ready_at`` and ``fit_at`` (epoch seconds)."""
    out: dict[str, float | None] = dict.fromkeys(("startup_s", "first_step_s", *N.STARTUP_PARTS))
    if "run_started_at" not in marks:
        return out
    # a row of an earlier process of the same run directory (a resume that had nothing left to
    # train logs no step) is not this run's start-up
    learner = next(
        (m for m in reversed(metrics) if m.get(N.FIRST_STEP_AT, -1.0) >= marks["run_started_at"]), None
    )
    if learner is None:
        return out
    first_step = learner[N.FIRST_STEP_AT]
    points = [
        marks["run_started_at"],
        marks.get("fit_at"),
        learner.get(N.LEARNER_START_AT),
        learner.get(N.LEARNER_READY_AT),
        learner.get(N.FIRST_BATCH_AT),
        first_step,
    ]
    parts = [p for p in N.STARTUP_PARTS if p != "startup_ray_init_s"]
    for name, begin, end in zip(parts, points[:-1], points[1:]):
        out[name] = end - begin if begin is not None and end is not None else None
    if marks.get("ray_ready_at") is not None and marks.get("ray_started_at") is not None:
        out["startup_ray_init_s"] = marks["ray_ready_at"] - marks["ray_started_at"]
    process = marks.get("process_started_at")
    out["startup_s"] = first_step - marks["run_started_at"]
    out["first_step_s"] = first_step - process if process is not None else None
    return out


def _mean_reward(kept: Any, *, first: bool) -> float | None:
    if not len(kept) or "reward" not in kept:
        return None
    steps = sorted(kept["step"].unique())
    k = max(1, len(steps) // 4)
    sel = steps[:k] if first else steps[-k:]
    return float(kept[kept["step"].isin(sel)]["reward"].mean())
