"""The staleness report: one self-contained HTML page over one or several run directories.

Why: asynchrony trades freshness for throughput, and whether the trade paid off is only
visible side by side: lag distribution, how far the behavior policy drifted
(KL(pi_b || pi_theta) per lag bucket), whether ESS collapsed and the LR controllers reacted,
gradient alignment, and finally loss/accuracy against *wall time* as well as steps. Several
runs (e.g. sync ``max_lag=0`` vs async) are overlaid, one colour per run, legend = run name.

The page embeds every plot as a base64 PNG (matplotlib Agg, no pyplot state) and needs no
network. A panel whose metrics no run recorded says "not recorded" instead of failing. An
inline script marks ``document.body.dataset.imagesOk`` once every image has decoded, which the
tests check in headless Chromium.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from asyncrl.telemetry import names
from asyncrl.telemetry.sinks import read_metrics, read_samples, read_summary
from asyncrl.telemetry.staleness import BUCKET_LOWER, LAG_BUCKETS, TOKEN_LAG_COUNTS, lag_bucket

__all__ = [
    "ReportError",
    "RunRecords",
    "color",
    "default_report_path",
    "figure_section",
    "html_page",
    "html_table",
    "load_run",
    "load_runs",
    "not_recorded",
    "panel_sections",
    "png_data_uri",
    "render_report",
    "write_report",
]


class ReportError(FileNotFoundError):
    """A run directory cannot be reported on; the message names the directory and the missing file."""


@dataclass
class RunRecords:
    """Everything the report reads from one run directory."""

    name: str
    path: Path
    config: dict[str, Any]
    metrics: pd.DataFrame  # one row per step, columns = metric keys (NaN where not logged)
    samples: pd.DataFrame | None  # one row per consumed sample, or None if not recorded
    summary: dict[str, Any] | None  # None if the run has not finished

    def series(self, key: str, x: str = names.STEP) -> tuple[np.ndarray, np.ndarray] | None:
        """(x, y) of metric ``key`` over the steps where it is finite; None if never recorded."""
        if key not in self.metrics or x not in self.metrics:
            return None
        xs = pd.to_numeric(self.metrics[x], errors="coerce").to_numpy(float)
        ys = pd.to_numeric(self.metrics[key], errors="coerce").to_numpy(float)
        ok = np.isfinite(xs) & np.isfinite(ys)
        return (xs[ok], ys[ok]) if ok.any() else None

    @property
    def max_lag(self) -> int | None:
        value = self.config.get("pipeline", {}).get("max_lag")
        return int(value) if isinstance(value, int | float) else None


# --- loading --------------------------------------------------------------------------------
def load_run(path: str | Path, name: str | None = None) -> RunRecords:
    """Read a run directory; a missing ``config.yaml`` or ``metrics.jsonl`` raises ``ReportError``."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"run directory {str(path)!r} does not exist")
    for required, why in (
        (names.CONFIG_FILE, "written when the run starts"),
        (names.METRICS_FILE, "written by the learner from its first step; did the run start?"),
    ):
        if not (path / required).exists():
            raise ReportError(f"run directory {str(path)!r} is incomplete: missing {required} ({why})")
    config = yaml.safe_load((path / names.CONFIG_FILE).read_text(encoding="utf-8")) or {}
    if not isinstance(config, dict):
        raise ReportError(f"{path / names.CONFIG_FILE} is not a YAML mapping")
    try:
        rows = read_metrics(path)
    except ValueError as err:
        raise ReportError(str(err)) from None
    if not rows:
        raise ReportError(f"{path / names.METRICS_FILE} has no steps yet; report once the run has trained")
    table = read_samples(path)
    # the agreement evals (RUN/evals.jsonl) as rows of their own, by the version they measured: a
    # step record carries only the newest one that had finished by then
    from asyncrl.telemetry.summary import read_evals

    evals = read_evals(path)
    if evals:
        agreement = {*names.EVAL_AGREEMENT, names.EVAL_STEP}
        rows = [{k: v for k, v in r.items() if k not in agreement} for r in rows]
    for ev in evals:
        rows.append(
            {names.STEP: ev["step"], names.EVAL_STEP: ev["step"]}
            | {f"eval/{k}": v for k, v in ev["metrics"].items()}
        )
    return RunRecords(
        name=name or path.resolve().name,
        path=path,
        config=config,
        metrics=pd.DataFrame(rows).sort_values(names.STEP, kind="stable").reset_index(drop=True),
        samples=None if table is None else table.to_pandas(),
        summary=read_summary(path),
    )


def _unique_names(paths: Sequence[Path]) -> list[str]:
    """Directory names, extended by parent directories until they are distinct."""
    resolved = [p.resolve() for p in paths]
    for depth in range(1, max(len(p.parts) for p in resolved) + 1):
        labels = ["/".join(p.parts[-depth:]) for p in resolved]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{p.name} ({i})" for i, p in enumerate(resolved)]


# --- plotting helpers --------------------------------------------------------------------------
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
NOT_RECORDED = "not recorded"


def color(i: int) -> str:
    return _COLORS[i % len(_COLORS)]


def _width(i: int) -> float:
    """Earlier runs draw wider, so a later run on the same values does not hide them."""
    return max(1.0, 2.6 - 0.6 * i)


def not_recorded(ax: Axes, what: str) -> None:
    ax.text(
        0.5, 0.5, f"{NOT_RECORDED}: {what}", ha="center", va="center", transform=ax.transAxes, color="0.4"
    )
    ax.set_xticks([])
    ax.set_yticks([])


def _lines(
    ax: Axes, runs: Sequence[RunRecords], key: str, *, x: str = names.STEP, style: str = "-", suffix: str = ""
) -> bool:
    """Plot ``key`` against ``x`` for every run that recorded it; True if anything was drawn."""
    drawn = False
    for i, run in enumerate(runs):
        s = run.series(key, x)
        if s is None:
            continue
        marker = "o" if len(s[0]) < 3 else None
        ax.plot(
            s[0], s[1], style, color=color(i), lw=_width(i), label=f"{run.name}{suffix}", marker=marker, ms=3
        )
        drawn = True
    return drawn


def _finish(ax: Axes, drawn: bool, key: str, xlabel: str, ylabel: str) -> bool:
    if not drawn:
        not_recorded(ax, key)
        return False
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if xlabel == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return True


def _line_panel(runs: Sequence[RunRecords], specs: Sequence[tuple[str, str, str]]) -> Figure | None:
    """One subplot per (metric key, x key, y label); None if no run recorded any of them."""
    fig = Figure(figsize=(4.2 * len(specs), 3.2), layout="constrained")
    axes = fig.subplots(1, len(specs), squeeze=False)[0]
    any_drawn = False
    for ax, (key, x, ylabel) in zip(axes, specs):
        xlabel = "wall time (s)" if x == names.TIME_S else "step"
        any_drawn |= _finish(ax, _lines(ax, runs, key, x=x), key, xlabel, ylabel)
    return fig if any_drawn else None


def _bucket_sort_key(label: str) -> tuple[float, str]:
    m = re.match(r"\d+", label)
    return (float(m.group()) if m else math.inf, label)


# --- panels ------------------------------------------------------------------------------------
def _panel_lag_hist(runs: Sequence[RunRecords]) -> Figure | None:
    present = [(i, r) for i, r in enumerate(runs) if r.samples is not None and "lag" in r.samples]
    if not present:
        return None
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    hi = max(int(np.nanmax(r.samples["lag"].to_numpy(float), initial=0)) for _, r in present)
    bins = np.arange(-0.5, hi + 1.5)
    for i, run in present:
        lags = run.samples["lag"].to_numpy(float)
        ax.hist(lags[np.isfinite(lags)], bins=bins, histtype="step", lw=2, color=color(i), label=run.name)
        if run.max_lag is not None:
            ax.axvline(run.max_lag + 0.5, color=color(i), ls=":", lw=1, label=f"{run.name} max_lag")
    ax.set_xlabel("lag at consumption (learner version - first-token version)")
    ax.set_ylabel("samples")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _panel_token_lag(runs: Sequence[RunRecords]) -> Figure | None:
    """Trained tokens per lag bucket (samples.parquet ``token_lag_counts`` of kept samples): with
    in-flight updates a sample's tokens come from several versions, each lag <= the head lag."""
    present = [(i, r) for i, r in enumerate(runs) if r.samples is not None and TOKEN_LAG_COUNTS in r.samples]
    if not present:
        return None
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(LAG_BUCKETS))
    width = 0.8 / len(present)
    for j, (i, run) in enumerate(present):
        s = run.samples
        kept = s["kept"].to_numpy(bool) if "kept" in s else np.ones(len(s), bool)
        rows = [np.asarray(c, dtype=np.int64) for c in s[TOKEN_LAG_COUNTS][kept]]
        counts = np.sum(rows, axis=0) if rows else np.zeros(len(LAG_BUCKETS))
        ax.bar(x + j * width, counts, width, color=color(i), label=run.name)
        if run.max_lag is not None:
            bound = int(np.searchsorted(np.asarray(BUCKET_LOWER), run.max_lag, side="right")) - 1
            ax.axvline(bound + 0.5 + j * width, color=color(i), ls=":", lw=1, label=f"{run.name} max_lag")
    ax.set_xticks(x + 0.4 - width / 2, LAG_BUCKETS)
    ax.set_xlabel("token lag (learner version - version that produced the token)")
    ax.set_ylabel("trained tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _panel_lag_time(runs: Sequence[RunRecords]) -> Figure | None:
    fig = Figure(figsize=(8.4, 3.2), layout="constrained")
    ax_lag, ax_drop = fig.subplots(1, 2)
    drawn = _lines(ax_lag, runs, names.LAG_MEAN, suffix=" mean")
    drawn |= _lines(ax_lag, runs, names.LAG_MAX, style="--", suffix=" max")
    any_drawn = _finish(ax_lag, drawn, f"{names.LAG_MEAN}, {names.LAG_MAX}", "step", "lag (steps)")
    dropped = False
    for i, run in enumerate(runs):
        s = run.series(names.DROPPED)
        if s is not None:
            ax_drop.plot(s[0], np.cumsum(s[1]), color=color(i), lw=_width(i), label=run.name)
            dropped = True
    any_drawn |= _finish(ax_drop, dropped, names.DROPPED, "step", "dropped samples (cumulative)")
    return fig if any_drawn else None


def _panel_lr(runs: Sequence[RunRecords]) -> Figure | None:
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    drawn = _lines(ax, runs, names.LR_APPLIED, suffix=" applied")
    drawn |= _lines(ax, runs, names.LR_SCHEDULED, style="--", suffix=" scheduled")
    return (
        fig
        if _finish(ax, drawn, f"{names.LR_APPLIED}, {names.LR_SCHEDULED}", "step", "learning rate")
        else None
    )


def _kl_per_bucket(run: RunRecords) -> dict[str, float]:
    """Mean KL(pi_b || pi_theta) (k3) per lag bucket: from samples.parquet, else the mean over steps of
    the ``bucket/<label>/kl_behavior_current`` (or ``.../kl_k3``) metrics."""
    s = run.samples
    if s is not None and {"lag", "kl_behavior_current"} <= set(s.columns):
        frame = pd.DataFrame(
            {
                "bucket": [lag_bucket(int(lag)) for lag in s["lag"].to_numpy()],
                "kl": pd.to_numeric(s["kl_behavior_current"], errors="coerce"),
            }
        ).dropna()
        if len(frame):
            return {str(k): float(v) for k, v in frame.groupby("bucket")["kl"].mean().items()}
    out = {}
    for key in run.metrics.columns:
        parsed = names.parse_bucket_key(key)
        if parsed and parsed[1] in ("kl_behavior_current", names.KL_BEHAVIOR_CURRENT, "kl_k3"):
            values = pd.to_numeric(run.metrics[key], errors="coerce").dropna()
            if len(values):
                out[parsed[0]] = float(values.mean())
    return out


def _panel_kl_buckets(runs: Sequence[RunRecords]) -> Figure | None:
    per_run = [_kl_per_bucket(r) for r in runs]
    labels = sorted({b for d in per_run for b in d}, key=_bucket_sort_key)
    if not labels:
        return None
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(runs)
    xs = np.arange(len(labels))
    for i, (run, kl) in enumerate(zip(runs, per_run)):
        heights = [kl.get(b, np.nan) for b in labels]
        ax.bar(xs + (i - (len(runs) - 1) / 2) * width, heights, width, color=color(i), label=run.name)
    ax.set_xticks(xs, labels)
    ax.set_xlabel("lag bucket")
    ax.set_ylabel("KL(behavior || current) per token")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return fig


def _with_teacher(runs: Sequence[RunRecords], fig: Figure | None) -> Figure | None:
    """A dotted line at the teacher's accuracy (from the runs' summaries) on the accuracy subplots."""
    teacher = [r.summary.get("teacher_accuracy") for r in runs if r.summary]
    teacher = [t for t in teacher if isinstance(t, int | float)]
    if fig is None or not teacher:
        return fig
    for ax in fig.axes:
        if ax.get_ylabel() == "eval accuracy" and ax.lines:
            ax.axhline(max(teacher), color="0.3", ls=":", lw=1.2, label="teacher")
            ax.legend(fontsize=7)
    return fig


@dataclass(frozen=True)
class _Panel:
    title: str
    caption: str
    keys: str  # what is missing when the whole panel is "not recorded"
    render: Callable[[Sequence[RunRecords]], Figure | None]


_PANELS = (
    _Panel(
        "Lag histogram",
        "Lag of every consumed sample (kept and dropped); dotted lines mark each run's max_lag bound.",
        "samples.parquet column 'lag'",
        _panel_lag_hist,
    ),
    _Panel(
        "Token lag distribution",
        "Trained tokens per lag bucket: with in-flight updates (pipeline.inflight_updates) a sample's "
        "later tokens come from newer versions, so token lags sit at or below the sample's lag; the "
        "bound max_lag holds for every token.",
        "samples.parquet column 'token_lag_counts'",
        _panel_token_lag,
    ),
    _Panel(
        "Lag over time",
        "Batch mean (solid) and max (dashed) lag per step, and samples dropped for exceeding max_lag.",
        f"{names.LAG_MEAN}, {names.LAG_MAX}, {names.DROPPED}",
        _panel_lag_time,
    ),
    _Panel(
        "Effective sample size",
        "ESS fraction rho = (sum w)^2 / (N sum w^2) of the importance weights pi_theta/pi_b; 1 = on-policy.",
        names.ESS_RHO,
        lambda runs: _line_panel(runs, [(names.ESS_RHO, names.STEP, "ESS fraction rho")]),
    ),
    _Panel(
        "Learning rate",
        "Applied LR (after controller scales, solid) against the scheduled LR (dashed).",
        f"{names.LR_APPLIED}, {names.LR_SCHEDULED}",
        _panel_lr,
    ),
    _Panel(
        "KL(behavior || current) per lag bucket",
        "How far the policy moved since each sample was generated: mean per-token KL by lag bucket.",
        "samples.parquet 'kl_behavior_current' or bucket/*/kl_behavior_current",
        _panel_kl_buckets,
    ),
    _Panel(
        "Gradient norm and alignment",
        "Global gradient norm before clipping; the cosine to the previous step's gradient as the GAC "
        "controller sees it, and of the applied gradients (telemetry.grad_cos_prev).",
        f"{names.GRAD_NORM}, {names.GAC_COS_PREV}, {names.GRAD_COS_PREV}",
        lambda runs: _line_panel(
            runs,
            [
                (names.GRAD_NORM, names.STEP, "grad norm"),
                (names.GAC_COS_PREV, names.STEP, "GAC cos(g_t, g_t-1)"),
                (names.GRAD_COS_PREV, names.STEP, "applied cos(g_t, g_t-1)"),
            ],
        ),
    ),
    _Panel(
        "Gradient against the exact dense KL",
        "telemetry.grad_reference=dense: cosine of the estimator's gradient to the exact KL gradient on "
        "the same batch, and its squared bias and noise variance relative to |g|^2 (row-group "
        "cross-product; one probe's bias can read below 0, sum several to read it).",
        f"{names.GRADREF_COS}, {names.GRADREF_BIAS_SQ_REL}, {names.GRADREF_NOISE_REL}",
        lambda runs: _line_panel(
            runs,
            [
                (names.GRADREF_COS, names.STEP, "cos(estimator, dense)"),
                (names.GRADREF_BIAS_SQ_REL, names.STEP, "bias^2 / |g|^2"),
                (names.GRADREF_NOISE_REL, names.STEP, "noise variance / |g|^2"),
            ],
        ),
    ),
    _Panel(
        "Loss and accuracy",
        "Against optimizer steps and against wall time: asynchrony pays off only if it wins on wall time. "
        "The dotted line is the teacher's accuracy (OPD), the level the student can approach.",
        f"{names.LOSS}, {names.EVAL_ACCURACY}",
        lambda runs: _with_teacher(
            runs,
            _line_panel(
                runs,
                [
                    (names.LOSS, names.STEP, "loss"),
                    (names.LOSS, names.TIME_S, "loss"),
                    (names.EVAL_ACCURACY, names.STEP, "eval accuracy"),
                    (names.EVAL_ACCURACY, names.TIME_S, "eval accuracy"),
                ],
            ),
        ),
    ),
    _Panel(
        "Agreement with the teacher (held-out prompts)",
        "Evaluation without a verifier, by the version it measured: per-token KL(student || teacher) and "
        "KL(teacher || student) on the student's own samples (exact, full vocabulary), top-1 agreement, and "
        "ROUGE-L of the student's greedy responses against the teacher's. Lower KL and higher agreement "
        "mean the student got closer to its teacher.",
        f"{names.EVAL_KL_REVERSE}, {names.EVAL_KL_FORWARD}, {names.EVAL_TOP1_AGREE}, {names.EVAL_ROUGE_L}",
        lambda runs: _line_panel(
            runs,
            [
                (names.EVAL_KL_REVERSE, names.EVAL_STEP, "KL(student||teacher) / token"),
                (names.EVAL_KL_FORWARD, names.EVAL_STEP, "KL(teacher||student) / token"),
                (names.EVAL_TOP1_AGREE, names.EVAL_STEP, "top-1 agreement"),
                (names.EVAL_ROUGE_L, names.EVAL_STEP, "ROUGE-L vs teacher"),
            ],
        ),
    ),
    _Panel(
        "Throughput",
        "Samples trained per second, and the fraction of time the learner waited for data.",
        f"{names.SAMPLES_PER_S}, {names.LEARNER_IDLE_FRAC}",
        lambda runs: _line_panel(
            runs,
            [
                (names.SAMPLES_PER_S, names.STEP, "samples/s"),
                (names.LEARNER_IDLE_FRAC, names.STEP, "learner idle fraction"),
            ],
        ),
    ),
    _Panel(
        "Teacher mass captured by the cache",
        "Teacher probability mass the cache keeps per position (e.g. top-k mass); 1 = lossless.",
        names.TEACHER_MASS,
        lambda runs: _line_panel(runs, [(names.TEACHER_MASS, names.STEP, "teacher mass")]),
    ),
)


def png_data_uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


# --- tables ------------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def html_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _summary_of(run: RunRecords) -> dict[str, Any]:
    """summary.json, or what the metrics say for an unfinished run."""
    if run.summary is not None:
        return run.summary
    last = run.metrics.iloc[-1]
    acc = run.series(names.EVAL_ACCURACY)
    return {
        "steps": int(last[names.STEP]),
        "wall_time_s": float(last[names.TIME_S]) if names.TIME_S in last else None,
        "eval_accuracy_final": float(acc[1][-1]) if acc is not None else None,
        "status": "unfinished (no summary.json)",
    }


def _summary_table(runs: Sequence[RunRecords]) -> str:
    summaries = [_summary_of(r) for r in runs]
    keys = [k for k in names.SUMMARY_KEYS if k != "run_dir" and any(k in s for s in summaries)]
    keys += sorted({k for s in summaries for k in s} - set(names.SUMMARY_KEYS))
    return html_table(["", *[r.name for r in runs]], [[k, *[s.get(k) for s in summaries]] for k in keys])


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: yaml.safe_dump(d, default_flow_style=True).strip() if isinstance(d, list) else d}


_KEY_SETTINGS = (
    "algo",
    "estimator.name",
    "pipeline.max_lag",
    "train.steps",
    "train.batch_size",
    "train.group_size",
    "train.lr",
    "workload.task",
    "workload.preset",
    "cache.kind",
)


def _config_table(runs: Sequence[RunRecords]) -> str:
    flat = [_flatten(r.config) for r in runs]
    all_keys = sorted({k for f in flat for k in f})
    differing = [k for k in all_keys if k != "run_dir" and len({repr(f.get(k)) for f in flat}) > 1]
    keys = [k for k in _KEY_SETTINGS if any(k in f for f in flat)]
    keys += [k for k in differing if k not in keys]
    return html_table(["setting", *[r.name for r in runs]], [[k, *[f.get(k) for f in flat]] for k in keys])


# --- page --------------------------------------------------------------------------------------
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.caption { color: #555; font-size: 0.9em; margin: 0.2em 0 0.5em; }
.missing { color: #777; font-style: italic; border: 1px dashed #bbb; padding: 1em; }
img { max-width: 100%; }
#images-warning { display: none; background: #fee; border: 1px solid #c00; padding: 0.5em; }
"""

# Marks the page so a headless browser (the tests) can tell that every embedded image decoded.
_SCRIPT = """
window.addEventListener("load", function () {
  var imgs = document.images, ok = 0;
  for (var i = 0; i < imgs.length; i++) {
    if (imgs[i].complete && imgs[i].naturalWidth > 0) ok++;
  }
  document.body.dataset.imagesLoaded = ok + "/" + imgs.length;
  document.body.dataset.imagesOk = String(ok === imgs.length);
  if (ok !== imgs.length) document.getElementById("images-warning").style.display = "block";
});
"""


def html_page(title: str, body: Sequence[str]) -> str:
    """A self-contained page: ``title``, the ``body`` HTML fragments, the shared style and the script
    that marks whether every embedded image decoded."""
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        '<p id="images-warning">Some plots failed to load.</p>',
        *body,
        f"<script>{_SCRIPT}</script></body></html>",
    ]
    return "\n".join(parts) + "\n"


def figure_section(title: str, caption: str, fig: Figure | None, missing: str) -> str:
    """One ``<section>``: heading, caption, and the figure as an embedded PNG (or "not recorded: ...")."""
    parts = [f"<section><h2>{html.escape(title)}</h2>", f"<p class='caption'>{html.escape(caption)}</p>"]
    if fig is None:
        parts.append(f"<p class='missing'>{NOT_RECORDED}: {html.escape(missing)}</p>")
    else:
        parts.append(f'<img alt="{html.escape(title)}" src="{png_data_uri(fig)}">')
    parts.append("</section>")
    return "\n".join(parts)


def panel_sections(records: Sequence[RunRecords]) -> list[str]:
    """The run panels (lag histogram, lag over time, ESS, LR, KL per bucket, ...), runs overlaid."""
    return [figure_section(p.title, p.caption, p.render(records), p.keys) for p in _PANELS]


def load_runs(runs: Sequence[str | Path | RunRecords]) -> list[RunRecords]:
    """``RunRecords`` for run directories (or records already loaded), named by distinct directory names."""
    paths = [r.path if isinstance(r, RunRecords) else Path(r) for r in runs]
    labels = _unique_names(paths)
    return [r if isinstance(r, RunRecords) else load_run(p, name) for r, p, name in zip(runs, paths, labels)]


def render_report(runs: Sequence[str | Path | RunRecords], *, title: str | None = None) -> str:
    """The HTML page (a string) over ``runs`` (run directories or loaded ``RunRecords``), overlaid."""
    if not runs:
        raise ValueError("render_report needs at least one run directory")
    records = load_runs(runs)
    title = title or "asyncrl report: " + " vs ".join(r.name for r in records)
    body = [
        "<p class='caption'>Runs: "
        + ", ".join(f"<b>{html.escape(r.name)}</b> ({html.escape(str(r.path))})" for r in records)
        + f". asyncrl {html.escape(dist_version('asyncrl'))}.</p>",
        "<h2>Summary</h2>",
        _summary_table(records),
        "<h2>Settings</h2>",
        "<p class='caption'>Key settings, and every setting that differs between runs.</p>",
        _config_table(records),
        *panel_sections(records),
    ]
    return html_page(title, body)


def default_report_path(run_dirs: Sequence[str | Path]) -> Path:
    """``RUN/report.html`` for one run; ``<common parent>/report.html`` for several."""
    paths = [Path(p).resolve() for p in run_dirs]
    if len(paths) == 1:
        return paths[0] / names.REPORT_FILE
    return Path(os.path.commonpath(paths)) / names.REPORT_FILE


def write_report(
    run_dirs: Sequence[str | Path], out: str | Path | None = None, *, title: str | None = None
) -> Path:
    """Render the report over ``run_dirs`` and write it to ``out`` (default ``default_report_path``)."""
    target = Path(out) if out is not None else default_report_path(run_dirs)
    page = render_report(run_dirs, title=title)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    return target
