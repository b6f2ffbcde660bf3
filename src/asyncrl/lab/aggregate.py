"""Tables over many run directories: one row per run, and the same figures aggregated over seeds.

Why: a study (e.g. accuracy against staleness) compares settings, and one seed per setting says
nothing about noise. ``cell_table`` reads each run's ``summary.json`` and ``metrics.jsonl`` into one
row; ``seed_table`` groups the rows by setting and reports, per figure, the mean over seeds, the
sample standard deviation ``s = sqrt(sum (x_i - mean)^2 / (n - 1))`` (NaN for n < 2) and the number
``n`` of seeds that recorded it. ``mean_curve`` does the same per step for metric-vs-step curves.

Pure pandas over run-directory files; no Ray, no plotting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from asyncrl.telemetry import names
from asyncrl.telemetry.sinks import read_metrics, read_summary

__all__ = [
    "FINAL",
    "MEAN",
    "STAT_SUFFIXES",
    "cell_table",
    "figure_columns",
    "mean_curve",
    "metric_figures",
    "metric_series",
    "seed_table",
    "summary_figures",
    "write_table",
]

#: column-name prefixes of the per-run figures taken from metrics.jsonl: ``final:loss``, ``mean:ess/rho_seq``
FINAL = "final:"
MEAN = "mean:"
#: suffixes of the per-setting columns of ``seed_table``: ``eval_accuracy_final:mean`` etc.
STAT_SUFFIXES = (":mean", ":std", ":n")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def summary_figures(summary: Mapping[str, Any]) -> dict[str, float | int | None]:
    """The numeric figures of a ``summary.json`` (``names.SUMMARY_KEYS`` order first, then the rest
    sorted); settings and paths (algo, estimator, run_dir) are left out."""
    ordered = [k for k in names.SUMMARY_KEYS if k in summary]
    ordered += sorted(k for k in summary if k not in names.SUMMARY_KEYS)
    return {k: summary[k] for k in ordered if summary[k] is None or _is_number(summary[k])}


def metric_series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of metric ``key`` over the rows of a metrics.jsonl where it is finite."""
    steps, values = [], []
    for row in rows:
        value, step = row.get(key), row.get(names.STEP)
        if _is_number(value) and _is_number(step) and math.isfinite(value):
            steps.append(float(step))
            values.append(float(value))
    return np.asarray(steps), np.asarray(values)


def metric_figures(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, float | None]:
    """Per metric: its value at the last step that recorded it (``final:<key>``) and its mean over the
    steps that recorded it (``mean:<key>``); None if never recorded."""
    out: dict[str, float | None] = {}
    for key in metrics:
        _, values = metric_series(rows, key)
        out[FINAL + key] = float(values[-1]) if len(values) else None
        out[MEAN + key] = float(values.mean()) if len(values) else None
    return out


def cell_table(
    cells: Sequence[tuple[Mapping[str, Any], Path | None]], metrics: Sequence[str]
) -> pd.DataFrame:
    """One row per run: its identity columns (settings, seed, status, ...) and, for a finished run
    (``run_dir`` given), the numeric ``summary.json`` figures and the ``metric_figures`` of ``metrics``.

    Args:
        cells: (identity columns, run directory or None for a run that has no results to read).
        metrics: metrics.jsonl keys to tabulate as ``final:<key>`` and ``mean:<key>``.
    """
    rows = []
    for identity, run_dir in cells:
        row: dict[str, Any] = dict(identity)
        if run_dir is not None:
            row |= summary_figures(read_summary(run_dir) or {})
            row |= metric_figures(read_metrics(run_dir), metrics)
        rows.append(row)
    table = pd.DataFrame(rows)
    for key in metrics:  # every requested column exists, even if no run finished yet
        for col in (FINAL + key, MEAN + key):
            if col not in table:
                table[col] = np.nan
    return table


def figure_columns(table: pd.DataFrame, exclude: Sequence[str]) -> list[str]:
    """The numeric figure columns of a cell table: numeric (not boolean) columns not in ``exclude``."""
    return [
        col
        for col in table.columns
        if col not in exclude
        and pd.api.types.is_numeric_dtype(table[col])
        and not pd.api.types.is_bool_dtype(table[col])
    ]


def seed_table(table: pd.DataFrame, settings: Sequence[str], figures: Sequence[str]) -> pd.DataFrame:
    """Per setting (a distinct combination of the ``settings`` columns, in order of first appearance):
    ``<figure>:mean``, ``<figure>:std`` (sample std, ddof = 1; NaN for n < 2) and ``<figure>:n`` (rows
    with a finite value) for every column in ``figures``."""
    rows = []
    keys = list(settings)
    groups = table.groupby(keys, sort=False, dropna=False) if keys else [((), table)]
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        row: dict[str, Any] = dict(zip(keys, key))
        for col in figures:
            values = pd.to_numeric(group[col], errors="coerce").to_numpy(float)
            values = values[np.isfinite(values)]
            n = len(values)
            row[col + ":mean"] = float(values.mean()) if n else np.nan
            row[col + ":std"] = float(values.std(ddof=1)) if n >= 2 else np.nan
            row[col + ":n"] = n
        rows.append(row)
    return pd.DataFrame(rows, columns=[*keys, *[c + s for c in figures for s in STAT_SUFFIXES]])


def mean_curve(
    curves: Sequence[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds of metric-vs-step curves: (steps, mean, std, n) at every step any seed recorded;
    ``std`` is the sample std (NaN where n < 2), ``n`` the seeds that recorded that step."""
    # one column per seed, indexed by step (a step logged twice within one curve counts once, its mean)
    frames = [pd.Series(v, index=s).groupby(level=0).mean() for s, v in curves if len(s)]
    if not frames:
        empty = np.zeros(0)
        return empty, empty, empty, empty
    values = pd.concat(frames, axis=1).sort_index()
    steps, values = values.index.to_numpy(float), values.to_numpy(float)  # [steps, seeds], NaN = not recorded
    n = np.isfinite(values).sum(axis=1)  # >= 1: every step comes from some seed's finite value
    mean = np.nansum(values, axis=1) / n
    squares = np.nansum((values - mean[:, None]) ** 2, axis=1)
    std = np.where(n >= 2, np.sqrt(squares / np.maximum(n - 1, 1)), np.nan)
    return steps, mean, std, n.astype(float)


def _arrow_safe(table: pd.DataFrame) -> pd.DataFrame:
    """Columns mixing types (e.g. a swept key with numbers and strings) become strings for Parquet."""
    out = table.copy()
    for col in out.columns:
        if out[col].dtype == object:
            kinds = {
                type(v) for v in out[col] if v is not None and not (isinstance(v, float) and math.isnan(v))
            }
            if len(kinds) > 1:
                out[col] = out[col].map(lambda v: None if v is None else str(v))
    return out


def write_table(table: pd.DataFrame, stem: Path) -> tuple[Path, Path]:
    """Write ``stem.csv`` and ``stem.parquet``; returns both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv, parquet = stem.with_suffix(".csv"), stem.with_suffix(".parquet")
    table.to_csv(csv, index=False)
    _arrow_safe(table).to_parquet(parquet, index=False)
    return csv, parquet
