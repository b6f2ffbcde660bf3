"""Committed evidence: a sweep's per-cell, per-seed results as small text files a verdict can be re-read from.

Why: run directories (``runs/``) are large and not tracked, so a verdict computed from them cannot
be re-checked without rerunning the sweep. ``export_sweep`` reads what a sweep wrote (its
``sweep.json`` and each cell's ``summary.json`` and ``metrics.jsonl``) and writes, under a tracked
folder (``experiments/data/<sweep>/``):

- ``runs.csv``: one row per cell and seed: the swept settings, ``seed``, ``outcome`` (``completed``,
  ``aborted`` by the numerics guard, ``failed``, ``pending``), the end-point figures of
  ``summary.json`` (``EXPORTED_SUMMARY``: final accuracy, wall time, realised lag, ...) and
  ``last_eval_accuracy`` (the last evaluation logged, also for a run that aborted before its final one);
- ``steps.csv``: one row per cell and logged step (``cell``, ``step``, ``time_s`` and the metrics
  the caller names, empty where a step did not log one): the learning curves at the eval points,
  the probes' ``gradref/*`` sums, the controllers' ``active/*`` fractions;
- ``sweep.json``: the sweep's name, file, swept keys, seeds and the exported metric names.

Files are written with fixed float formatting and row order, so the same inputs give the same bytes
(a regenerated EXPERIMENTS.md can be checked byte for byte). ``load_evidence`` reads them back.
A value of 0.0 is a value: only an absent figure is empty in the files and NaN when read.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.telemetry import names as N
from asyncrl.telemetry.sinks import read_metrics, read_summary

__all__ = [
    "EXPORTED_SUMMARY",
    "Evidence",
    "EvidenceRun",
    "export_sweep",
    "format_value",
    "load_evidence",
    "write_csv",
]

RUNS_FILE, STEPS_FILE, META_FILE = "runs.csv", "steps.csv", "sweep.json"
PENDING = "pending"
#: summary.json figures kept per run
EXPORTED_SUMMARY = (
    "algo",
    "estimator",
    "steps",
    "wall_time_s",
    "samples_per_s",
    "lag_p50",
    "lag_max",
    "samples_trained",
    "samples_dropped",
    "eval_accuracy_initial",
    "eval_accuracy_final",
    "teacher_accuracy",
    "reward_mean_first",
    "reward_mean_last",
    # the agreement eval of runs on prompts without answers (a real pair): first and last evaluation
    *(f"eval_{k.split('/')[1]}_{w}" for k in N.EVAL_AGREEMENT for w in ("initial", "final")),
)
#: metrics.jsonl keys exported per step unless the caller names others (``active/*`` are added)
DEFAULT_STEP_METRICS = (
    N.EVAL_ACCURACY,
    N.LOSS,
    N.LAG_MEAN,
    N.KL_BEHAVIOR_CURRENT,
    N.ESS_RHO,
    N.GRAD_COS_PREV,
    N.NUMERICS_SKIPPED,
    "est/reward_mean",
    N.KL_TEACHER_REVERSE,
    N.GRADREF_COS,
    N.GRADREF_BIAS_SQ,
    N.GRADREF_REF_SQ,
    N.GRADREF_NOISE_SQ,
    N.GAC_ACTIVE,
    N.GAC_COS_PREV,
)


def format_value(value: Any) -> str:
    """A CSV cell: ``''`` for None/NaN, integers as integers, floats with 10 significant digits."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return f"{value:.10g}"
    return str(value)


def _parse(text: str) -> Any:
    if text == "":
        return math.nan
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def write_csv(path: str | Path, header: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> None:
    """``rows`` as CSV with ``header``'s columns (``format_value``: exact floats, "" for missing);
    the parent folder is created. How every committed evidence table is written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(header)
        for row in rows:
            w.writerow([format_value(row.get(k)) for k in header])


def _last_eval(metrics: Sequence[Mapping[str, Any]]) -> float | None:
    evals = [m[N.EVAL_ACCURACY] for m in metrics if isinstance(m.get(N.EVAL_ACCURACY), int | float)]
    return float(evals[-1]) if evals else None


_FINISHED = (N.STATUS_COMPLETED, N.STATUS_ABORTED)


def _committed(out_dir: Path) -> tuple[dict[str, dict[str, str]], dict[str, list[dict[str, str]]]]:
    """The finished rows (completed, or aborted by the numerics guard) ``out_dir`` already holds, by
    cell, and their steps (as written: strings)."""
    if not (out_dir / RUNS_FILE).exists():
        return {}, {}
    with (out_dir / RUNS_FILE).open(encoding="utf-8", newline="") as fh:
        # finished: a result of its config (a failed or pending cell is missing, and is run again)
        rows = {r["cell"]: r for r in csv.DictReader(fh) if r.get("outcome") in _FINISHED}
    steps: dict[str, list[dict[str, str]]] = {}
    if (out_dir / STEPS_FILE).exists():
        with (out_dir / STEPS_FILE).open(encoding="utf-8", newline="") as fh:
            for r in csv.DictReader(fh):
                steps.setdefault(r["cell"], []).append({k: v for k, v in r.items() if v != ""})
    return rows, steps


def export_sweep(
    sweep_dir: str | Path,
    out_dir: str | Path,
    *,
    metrics: Sequence[str] = DEFAULT_STEP_METRICS,
    keep: bool = True,
) -> tuple[Path, Path, Path]:
    """Export the sweep in ``sweep_dir`` (its ``sweep.json``) to ``out_dir``; returns the three files.

    Every cell of the manifest gets a row, also a pending or failed one (its outcome says so), so a
    reader sees what is missing; ``active/*`` metrics any run logged are exported with ``metrics``.
    ``keep``: a cell whose run directory is not here keeps the finished row and steps ``out_dir``
    already holds, so exporting from a machine that ran part of a sweep (or ran it in another session)
    never drops evidence committed from elsewhere; a run directory that is here always wins."""
    sweep_dir, out_dir = Path(sweep_dir), Path(out_dir)
    doc = json.loads((sweep_dir / "sweep.json").read_text())
    settings = list(dict.fromkeys(k for cell in doc["cells"] for k in cell["settings"]))
    kept_rows, kept_steps = _committed(out_dir) if keep else ({}, {})
    runs, steps, names = [], [], list(metrics)
    histories: dict[str, list[dict[str, Any]]] = {}
    kept_cells: set[str] = set()
    for cell in doc["cells"]:
        run_dir = Path(cell["run_dir"])
        if not run_dir.is_absolute():
            run_dir = sweep_dir / "runs" / cell["key"]
        summary = read_summary(run_dir) if run_dir.exists() else None
        if summary is None and cell["key"] in kept_rows:
            kept_cells.add(cell["key"])
            runs.append(kept_rows[cell["key"]])
            histories[cell["key"]] = kept_steps.get(cell["key"], [])
        else:
            outcome = PENDING if summary is None else str(summary.get("status", N.STATUS_COMPLETED))
            history = read_metrics(run_dir) if summary is not None else []
            histories[cell["key"]] = history
            row = {"cell": cell["key"], **cell["settings"], "seed": cell["seed"], "outcome": outcome}
            row |= {k: (summary or {}).get(k) for k in EXPORTED_SUMMARY}
            row["last_eval_accuracy"] = _last_eval(history)
            runs.append(row)
        active = {k for m in histories[cell["key"]] for k in m if k.startswith(N.ACTIVE_PREFIX)}
        names += sorted(active - set(names))  # kept or run: the same order
    for cell in doc["cells"]:
        kept = cell["key"] in kept_cells
        for m in histories[cell["key"]]:
            # a kept step's values are the committed text; a run's, the numbers it logged
            present = {k: m[k] for k in names if (k in m if kept else isinstance(m.get(k), int | float))}
            if present:
                steps.append(
                    {"cell": cell["key"], N.STEP: m.get(N.STEP), N.TIME_S: m.get(N.TIME_S), **present}
                )
    header = ["cell", *settings, "seed", "outcome", *EXPORTED_SUMMARY, "last_eval_accuracy"]
    write_csv(out_dir / RUNS_FILE, header, runs)
    write_csv(out_dir / STEPS_FILE, ["cell", N.STEP, N.TIME_S, *names], steps)
    meta = {
        "name": doc.get("name", sweep_dir.name),
        "sweep_file": _relative(doc.get("sweep_file", "")),
        "settings": settings,
        "seeds": sorted({int(c["seed"]) for c in doc["cells"]}),
        "cells": len(doc["cells"]),
        "step_metrics": names,
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir / RUNS_FILE, out_dir / STEPS_FILE, out_dir / META_FILE


def _relative(path: str) -> str:
    """A sweep file path from ``examples/`` on (machine-independent), else as given."""
    parts = Path(path).parts
    return str(Path(*parts[parts.index("examples") :])) if "examples" in parts else path


@dataclass
class EvidenceRun:
    """One cell and seed as committed: its settings, seed, outcome, end-point figures and steps."""

    cell: str
    settings: dict[str, Any]
    seed: int
    outcome: str
    figures: dict[str, Any]
    steps: list[dict[str, Any]]

    @property
    def finished(self) -> bool:
        """A result of its config: completed, or aborted by the numerics guard (counts, never dropped)."""
        return self.outcome in (N.STATUS_COMPLETED, N.STATUS_ABORTED)


@dataclass
class Evidence:
    """A sweep's committed evidence (``load_evidence``)."""

    name: str
    meta: dict[str, Any]
    runs: list[EvidenceRun]


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8", newline="") as fh:
        return [{k: _parse(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def load_evidence(directory: str | Path) -> Evidence | None:
    """The evidence under ``directory`` (``export_sweep``'s files), None if there is none."""
    directory = Path(directory)
    if not (directory / RUNS_FILE).exists():
        return None
    meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
    settings = meta["settings"]
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for row in _read_csv(directory / STEPS_FILE):
        cell = row.pop("cell")
        by_cell.setdefault(cell, []).append({k: v for k, v in row.items() if not _nan(v)})
    runs = []
    for row in _read_csv(directory / RUNS_FILE):
        cell = str(row["cell"])
        runs.append(
            EvidenceRun(
                cell=cell,
                settings={k: row[k] for k in settings},
                seed=int(row["seed"]),
                outcome=str(row["outcome"]),
                figures={k: v for k, v in row.items() if k not in (*settings, "cell", "seed", "outcome")},
                steps=by_cell.get(cell, []),
            )
        )
    return Evidence(meta["name"], meta, runs)


def _nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)
