"""The sweep report: figures against a swept key with error bars over seeds, metric-vs-step curves per
setting group, the tables, and the run panels of ``report`` over the first seed's runs.

Why: a sweep answers "how does y change with x, for each group" (e.g. final accuracy against the
lag, one line per KL direction); a point without its spread over seeds cannot be read as an
effect. Every figure is written as a PNG file and embedded in one self-contained HTML page built
from ``report``'s pieces (page, tables, figure sections, run panels).

Plots: ``y_vs_x`` draws, per group, the mean over seeds at each x with error bars of one sample
standard deviation, and every seed's value as a faint dot; ``curves`` draws one panel per group,
one line per x value: the mean over seeds per step with a band of one standard deviation.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from asyncrl.lab import aggregate as agg
from asyncrl.lab.report import (
    RunRecords,
    color,
    figure_section,
    html_page,
    html_table,
    load_run,
    not_recorded,
    panel_sections,
)
from asyncrl.telemetry import names
from asyncrl.telemetry.sinks import read_metrics

__all__ = [
    "Curves",
    "SweepFigure",
    "SweepOutputs",
    "group_label",
    "plot_curves",
    "plot_y_vs_x",
    "render_sweep_report",
    "write_sweep_report",
]

#: (steps, values) of one metric in one run
Curve = tuple[np.ndarray, np.ndarray]
#: group label -> line label (an x value) -> one curve per seed
Curves = Mapping[str, Mapping[str, Sequence[Curve]]]

_MAX_PANELS = 12  # curve panels per figure
_MAX_RUN_PANELS = 8  # runs overlaid in the run panels (the run report's colours)
#: figure columns shown in the HTML tables (the CSV/Parquet files hold every figure)
SHOWN_FIGURES = (
    "eval_accuracy_initial",
    "eval_accuracy_final",
    "samples_per_s",
    "wall_time_s",
    "lag_p50",
    "lag_max",
    "samples_dropped",
    "reward_mean_first",
    "reward_mean_last",
)


@dataclass(frozen=True)
class SweepFigure:
    """One figure of the sweep report: its file stem, heading, caption and what it needs if empty."""

    stem: str
    title: str
    caption: str
    figure: Figure | None
    missing: str


def group_label(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``variant=forward_kl, train.lr=0.001``; the empty string when there are no keys."""
    return ", ".join(f"{k}={row[k]}" for k in keys)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool | np.bool_)


def _x_positions(values: Sequence[Any]) -> tuple[dict[Any, float], list[str] | None]:
    """Numeric x values map to themselves; anything else to 0, 1, ... in order of first appearance,
    with tick labels."""
    distinct = list(dict.fromkeys(values))
    if all(_is_number(v) for v in distinct):
        return {v: float(v) for v in distinct}, None
    return {v: float(i) for i, v in enumerate(distinct)}, [str(v) for v in distinct]


def plot_y_vs_x(
    seeds: pd.DataFrame,
    cells: pd.DataFrame,
    *,
    x: str,
    y: str,
    group_by: Sequence[str],
    log_x: bool = False,
) -> Figure | None:
    """``y`` against ``x``, one line per ``group_by`` combination: mean over seeds with ±1 std error bars
    (from the seed table's ``y:mean`` / ``y:std``) and each seed's value (from the cell table) as a dot.
    None if no setting has a finite mean."""
    mean_col, std_col = f"{y}:mean", f"{y}:std"
    if mean_col not in seeds or not np.isfinite(pd.to_numeric(seeds[mean_col], errors="coerce")).any():
        return None
    pos, ticks = _x_positions(list(seeds[x]))
    fig = Figure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.subplots()
    groups = seeds.groupby(list(group_by), sort=False, dropna=False) if group_by else [((), seeds)]
    for i, (_, rows) in enumerate(groups):
        rows = rows.sort_values(x, key=lambda col: col.map(pos))
        xs = rows[x].map(pos).to_numpy(float)
        means = pd.to_numeric(rows[mean_col], errors="coerce").to_numpy(float)
        stds = pd.to_numeric(rows[std_col], errors="coerce").to_numpy(float)
        label = group_label(rows.iloc[0], group_by) or y
        ax.errorbar(
            xs,
            means,
            yerr=np.where(np.isfinite(stds), stds, 0.0),
            color=color(i),
            marker="o",
            ms=4,
            capsize=3,
            lw=1.6,
            label=label,
        )
        if y in cells:
            mine = cells
            for k in group_by:
                mine = mine[mine[k].map(str) == str(rows.iloc[0][k])]
            dots = pd.to_numeric(mine[y], errors="coerce").to_numpy(float)
            ax.plot(mine[x].map(pos).to_numpy(float), dots, ".", color=color(i), alpha=0.35, ms=5)
    if ticks is not None:
        ax.set_xticks(range(len(ticks)), ticks, rotation=20 if len(ticks) > 4 else 0)
    else:
        if log_x:
            ax.set_xscale("log")
        values = sorted(set(pos.values()))
        if len(values) <= 12:  # few settings: tick exactly at them (lags 0, 1, 2, 4, 8; learning rates)
            ax.set_xticks(values, [f"{v:g}" for v in values])
            ax.minorticks_off()
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
    if group_by:
        ax.legend(fontsize=7)
    return fig


def plot_curves(curves: Curves, metric: str, *, line_key: str) -> Figure | None:
    """``metric`` against step: one panel per group, one line per ``line_key`` value (mean over seeds,
    band of ±1 std). None if no run recorded the metric."""
    groups = [(g, lines) for g, lines in curves.items() if any(len(s) for c in lines.values() for s, _ in c)]
    if not groups:
        return None
    groups = groups[:_MAX_PANELS]
    cols = min(len(groups), 4)
    rows = math.ceil(len(groups) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (group, lines) in zip(axes, groups):
        drawn = False
        for i, (label, seed_curves) in enumerate(lines.items()):
            steps, mean, std, n = agg.mean_curve(seed_curves)
            if not len(steps):
                continue
            name = f"{line_key}={label}" if line_key else label
            ax.plot(
                steps,
                mean,
                color=color(i),
                lw=1.6,
                label=f"{name} (n={int(n.max())})",
                marker="o" if len(steps) < 4 else None,
                ms=3,
            )
            band = np.isfinite(std)
            if band.any():
                ax.fill_between(
                    steps[band], (mean - std)[band], (mean + std)[band], color=color(i), alpha=0.15
                )
            drawn = True
        if not drawn:
            not_recorded(ax, metric)
            continue
        ax.set_title(group or metric, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    return fig


def _stat(row: Mapping[str, Any], col: str) -> str:
    mean, std, n = row.get(f"{col}:mean"), row.get(f"{col}:std"), row.get(f"{col}:n")
    if mean is None or not math.isfinite(mean):
        return "—"
    spread = f" ± {std:.3g}" if std is not None and math.isfinite(std) else ""
    return f"{mean:.4g}{spread} (n={int(n)})"


def render_sweep_report(
    *,
    title: str,
    intro: Sequence[tuple[str, Any]],
    figures: Sequence[SweepFigure],
    seeds: pd.DataFrame,
    cells: pd.DataFrame,
    settings: Sequence[str],
    shown: Sequence[str],
    runs: Sequence[RunRecords],
    runs_note: str = "",
) -> str:
    """The sweep's HTML page.

    Args:
        intro: (name, value) rows describing the sweep (file, base config, grid, seeds, ...).
        figures: the plots, in order.
        seeds / cells: the seed-aggregated and per-cell tables; ``settings`` are their setting
            columns, ``shown`` the figure columns to show (the files hold every column).
        runs: loaded runs for the run panels (e.g. the first seed of every setting); may be empty.
        runs_note: a line under the run panels' heading (e.g. which runs were left out).
    """
    shown_seeds = [c for c in shown if f"{c}:mean" in seeds]
    body = [
        html_table(["sweep", ""], intro),
        "<h2>Settings over seeds</h2>",
        "<p class='caption'>Mean ± sample standard deviation over seeds (n = seeds that recorded it). "
        "Every figure is in seeds.csv / seeds.parquet.</p>",
        html_table(
            [*settings, *shown_seeds],
            [
                [row[k] for k in settings] + [_stat(row, c) for c in shown_seeds]
                for row in seeds.to_dict("records")
            ],
        ),
        *[figure_section(f.title, f.caption, f.figure, f.missing) for f in figures],
        "<h2>Cells</h2>",
        "<p class='caption'>One row per run (every figure is in cells.csv / cells.parquet).</p>",
    ]
    cell_cols = ["cell", "status", *[c for c in shown if c in cells]]
    body.append(html_table(cell_cols, cells[cell_cols].itertuples(index=False, name=None)))
    if runs:
        listed = ", ".join(f"<b>{html.escape(r.name)}</b> ({html.escape(str(r.path))})" for r in runs)
        body += [
            "<h2>Runs</h2>",
            f"<p class='caption'>{html.escape(runs_note)} Runs: {listed}.</p>",
            *panel_sections(runs),
        ]
    elif runs_note:
        body += ["<h2>Runs</h2>", f"<p class='missing'>{html.escape(runs_note)}</p>"]
    return html_page(title, body)


def save_png(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG (no timestamp metadata: the same data gives the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100, metadata={"Software": None})
    return path


@dataclass(frozen=True)
class SweepOutputs:
    """What ``write_sweep_report`` wrote."""

    cells: Path  # cells.csv (cells.parquet beside it)
    seeds: Path  # seeds.csv (seeds.parquet beside it)
    plots: tuple[Path, ...]
    report: Path
    statuses: dict[str, int]  # cell status -> number of cells


def _stem(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key)


def _metrics_in(columns: Iterable[str]) -> list[str]:
    return [c.partition(":")[2] for c in columns if c.startswith((agg.FINAL, agg.MEAN))]


def write_sweep_report(
    out: Path,
    *,
    title: str,
    intro: Sequence[tuple[str, Any]],
    cells: Sequence[tuple[Mapping[str, Any], Path | None]],
    settings: Sequence[str],
    x: str | None,
    group_by: Sequence[str],
    y: Sequence[str],
    metrics: Sequence[str],
    curves: Sequence[str],
    log_x: bool = False,
) -> SweepOutputs:
    """Write ``out/cells.{csv,parquet}``, ``out/seeds.{csv,parquet}``, ``out/plots/*.png`` and
    ``out/report.html``.

    Args:
        cells: per cell, its identity columns (``cell``, the ``settings``, ``seed``, ``status``, ...)
            and its run directory when it is done (None: listed, but not in the figures).
        settings: the swept columns; a setting = one combination of them (seeds aggregated over).
        x, group_by: the plots' x axis and line groups (every setting column is one of them).
        y: cell-table columns plotted against ``x``.
        metrics: metrics.jsonl keys tabulated as ``final:<key>`` / ``mean:<key>``.
        curves: metrics.jsonl keys plotted against step.
    """
    metrics = list(dict.fromkeys([*metrics, *curves, *_metrics_in(y)]))
    table = agg.cell_table(cells, metrics)
    identity = list(dict.fromkeys(k for ident, _ in cells for k in ident))
    figures = agg.figure_columns(table, identity)
    done_dirs = {ident["cell"]: run_dir for ident, run_dir in cells if run_dir is not None}
    done = table[table["cell"].isin(list(done_dirs))]
    seeds = agg.seed_table(done, list(settings), figures)
    cells_csv, _ = agg.write_table(table, out / "cells")
    seeds_csv, _ = agg.write_table(seeds, out / "seeds")

    plots: list[SweepFigure] = []
    for col in y if x is not None else ():
        plots.append(
            SweepFigure(
                stem=f"{_stem(col)}_vs_{_stem(x)}",
                title=f"{col} against {x}",
                caption="Mean over seeds with ±1 standard deviation; dots are single seeds.",
                figure=plot_y_vs_x(seeds, done, x=x, y=col, group_by=group_by, log_x=log_x),
                missing=f"{col} (no finished cell recorded it)",
            )
        )
    histories = {key: read_metrics(run_dir) for key, run_dir in done_dirs.items()}
    for metric in curves:
        lines: dict[str, dict[str, list[Curve]]] = {}
        for row in done.to_dict("records"):
            line = str(row[x]) if x is not None else "all"
            lines.setdefault(group_label(row, group_by), {}).setdefault(line, []).append(
                agg.metric_series(histories[row["cell"]], metric)
            )
        plots.append(
            SweepFigure(
                stem=f"curve_{_stem(metric)}",
                title=f"{metric} against step",
                caption=f"One panel per group, one line per {x or 'run'}: mean over seeds, ±1 std band.",
                figure=plot_curves(lines, metric, line_key=x or ""),
                missing=f"{metric} (no finished cell recorded it)",
            )
        )
    paths = tuple(save_png(p.figure, out / "plots" / f"{p.stem}.png") for p in plots if p.figure is not None)

    first_seed = done.drop_duplicates(subset=list(settings)) if settings else done.head(1)
    runs: list[RunRecords] = []
    note = ""
    if 0 < len(first_seed) <= _MAX_RUN_PANELS:
        runs = [
            load_run(done_dirs[row["cell"]], group_label(row, settings) or row["cell"])
            for row in first_seed.to_dict("records")
        ]
        note = "The run report's panels over the first seed of every setting, overlaid."
    elif len(first_seed) > _MAX_RUN_PANELS:
        note = f"{len(first_seed)} settings are too many to overlay; compare some: asyncrl report RUN RUN"
    statuses = table["status"].value_counts(sort=False).to_dict() if "status" in table else {}
    page = render_sweep_report(
        title=title,
        intro=intro,
        figures=plots,
        seeds=seeds,
        cells=table,
        settings=list(settings),
        shown=[c for c in dict.fromkeys([*SHOWN_FIGURES, *y]) if c in figures],
        runs=runs,
        runs_note=note,
    )
    report = out / names.REPORT_FILE
    report.write_text(page, encoding="utf-8")
    return SweepOutputs(cells=cells_csv, seeds=seeds_csv, plots=paths, report=report, statuses=statuses)
