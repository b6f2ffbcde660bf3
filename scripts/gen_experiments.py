"""Regenerate EXPERIMENTS.md and its plots (docs/experiments/*.png) from the committed evidence.

    asyncrl pretrain --preset small
    for s in kl_direction_x_lag cache_finiteness async_grpo recompute_vs_stabilisers s_eta_opd \
             s_eta_grpo accuracy_vs_wall_time real_pair real_pair_healed; do
        asyncrl sweep examples/sweeps/$s.yaml                 # resumable: finished cells are not rerun
    done
    python scripts/gen_experiments.py --export-from runs/sweeps   # runs/sweeps/<s> -> experiments/data/<s>
    python scripts/frozen_theta.py ...                        # cache finiteness at frozen θ (its docstring)
    python scripts/probe_null.py ...                          # the probe at zero lag (its docstring)
    python scripts/gen_experiments.py                         # EXPERIMENTS.md + plots, from experiments/data
    python scripts/gen_experiments.py --check                 # regenerate elsewhere, compare byte for byte

The document is a function of ``experiments/data/`` alone (tracked; ``asyncrl.lab.evidence``
writes it from the sweeps' run directories, which are not): nothing is rerun to regenerate it, and
``--check`` proves the committed document and plots are what the committed data gives. An export
keeps the committed rows of cells whose run directories are not on this machine
(``export_sweep(keep=True)``), so evidence committed from another session or machine is never
dropped by a later export. To fill in part of a sweep (one lag, more seeds), run only those cells
with ``asyncrl sweep examples/sweeps/<s>.yaml --only pipeline.max_lag=2,4``: the sweep's manifest still
lists every cell, so the export that follows covers the whole experiment.

Every experiment tests one published claim and ends in a one-line verdict, *reproduced*, *not
reproduced* or *inconclusive at this scale*, decided by the rule printed beside it (fixed before the
numbers were read; ``Verdict`` below). Tables give the mean and the standard error over seeds
(``se = s / sqrt(n)``); a difference counts only beyond two standard errors of the difference.
Round-2 experiments (``ROUND2``) decide from seed-paired differences with 95% t intervals
(``asyncrl.lab.stats``): a straddling interval is "inconclusive", never "no effect" (``RULES``).
A final accuracy of 0.0 is a value; a run the numerics guard aborted counts with accuracy 0.0 (its
last logged evaluation is kept in the data); only a run that failed (raised) or never ran is missing.
"""

from __future__ import annotations

import argparse
import csv
import filecmp
import itertools
import math
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from asyncrl.lab.evidence import export_sweep, load_evidence
from asyncrl.lab.stats import INCONCLUSIVE as CI_STRADDLES
from asyncrl.lab.stats import (
    Interval,
    cluster_bootstrap_ratio,
    decide,
    paired_difference,
)
from asyncrl.telemetry import names as N

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "experiments" / "data"
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive at this scale"
NOT_RUN = "not run yet"  # no evidence committed: no verdict at all (not "inconclusive")
#: a round-1 design a later experiment replaced: not run, on purpose, and said why (no verdict either)
SUPERSEDED = "superseded"
#: round 1's document (split-half bias, 3 seeds, endpoints): kept as it was, its runs were not committed
ROUND1 = "experiments/round1/EXPERIMENTS.md"
DPI = 80


# --- reading a sweep ----------------------------------------------------------------------------------
@dataclass
class Run:
    settings: dict[str, Any]
    seed: int
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    outcome: str = N.STATUS_COMPLETED

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        pts = [
            (m[N.STEP], m[key])
            for m in self.metrics
            if isinstance(m.get(key), int | float) and math.isfinite(m[key])
        ]
        return (np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float))

    def mean(self, key: str, *, last: int | None = None) -> float:
        _, v = self.series(key)
        v = v[-last:] if last else v
        return float(v.mean()) if len(v) else math.nan


@dataclass
class Sweep:
    name: str
    path: Path
    runs: list[Run]
    pending: int
    cpu_s: float  # sum of the finished cells' wall time (start-up included)

    def select(self, **settings: Any) -> list[Run]:
        return [r for r in self.runs if all(_same(r.settings.get(k), v) for k, v in settings.items())]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def load_data(data: Path, name: str) -> Sweep | None:
    """The committed evidence of sweep ``name`` under ``data`` (None if it never ran): finished cells
    (completed, or aborted by the numerics guard: both count) as runs; failed and pending ones counted."""
    ev = load_evidence(data / name)
    if ev is None:
        return None
    runs, pending, cpu = [], 0, 0.0
    for r in ev.runs:
        if not r.finished:
            pending += 1
            continue
        summary = {**r.figures, "status": r.outcome}
        runs.append(Run({k: _number(v) for k, v in r.settings.items()}, r.seed, summary, r.steps, r.outcome))
        wall = r.figures.get("wall_time_s")
        cpu += float(wall) if isinstance(wall, int | float) and math.isfinite(wall) else 0.0
    return Sweep(name, data / name, runs, pending, cpu)


def load_sweep(root: Path, name: str, data: Path | None = None) -> Sweep | None:
    """Export the sweep ``root/name`` (a sweep's output directory) to ``data/name`` (default: beside it,
    ``root/name/evidence``) and read it back: what ``--export-from`` does, one sweep at a time."""
    if not (root / name / "sweep.json").exists():
        return None
    out = (data / name) if data is not None else (root / name / "evidence")
    export_sweep(root / name, out)
    return load_data(out.parent, out.name) if data is None else load_data(data, name)


def _number(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


# --- statistics ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stat:
    mean: float
    se: float
    n: int

    def __str__(self) -> str:
        if self.n == 0 or not math.isfinite(self.mean):
            return "—"
        return f"{self.mean:.3f} ± {self.se:.3f}" if self.n > 1 else f"{self.mean:.3f}"

    def below(self, other: Stat) -> bool:
        """Significantly below ``other``: the gap exceeds two standard errors of the difference."""
        return other.mean - self.mean > 2 * math.hypot(self.se, other.se)


def probe_ratio(runs: Sequence[Run], key: str, *, one_sided: bool = False) -> Interval:
    """Σ ``key`` / Σ ``gradref/ref_sq`` over every probe of every run, with a bootstrap over seeds."""
    clusters = [
        ([m[key] for m in r.metrics if key in m and N.GRADREF_REF_SQ in m],
         [m[N.GRADREF_REF_SQ] for m in r.metrics if key in m and N.GRADREF_REF_SQ in m])
        for r in runs
    ]  # fmt: skip
    return cluster_bootstrap_ratio(clusters, level=LEVEL, one_sided=one_sided)


def as_stat(iv: Interval) -> Stat:
    """An interval drawn as an error bar: the estimate ± half the interval's width / 1.96."""
    half = (iv.hi - iv.lo) / 2 if math.isfinite(iv.hi - iv.lo) else math.nan
    return Stat(iv.estimate, half / 1.96, iv.n)


def stat(values: Iterable[float]) -> Stat:
    v = np.array([x for x in values if x is not None and math.isfinite(x)], float)
    if not len(v):
        return Stat(math.nan, math.nan, 0)
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0
    return Stat(float(v.mean()), se, len(v))


def figure(r: Run, key: str) -> float:
    """A summary figure as a float: 0.0 is a value; only an absent figure is NaN."""
    value = r.summary.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


def acc_final(r: Run) -> float:
    """Final exact match; a run the numerics guard aborted has no usable policy at its budget: 0.0."""
    return 0.0 if r.outcome == N.STATUS_ABORTED else figure(r, "eval_accuracy_final")


def acc_gain(r: Run) -> float:
    return acc_final(r) - acc_initial(r)


def acc_initial(r: Run) -> float:
    return figure(r, "eval_accuracy_initial")


# --- the document ---------------------------------------------------------------------------------------
@dataclass
class Section:
    title: str
    claim: str
    sweep_file: str
    verdict: str
    why: str
    rule: str
    body: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    cpu_s: float = 0.0
    cells: str = ""
    tally: str = ""  # how many of the rule's parts hold, e.g. "3 of 4 parts hold"
    source: str = ""  # where the claim comes from (CONTEXT)
    changes: str = ""  # what evidence would change the verdict (CONTEXT)


ASYNC_OPD = 'AsyncOPD (Kang et al., "How Stale Can On-Policy Distillation Be?", arXiv 2606.24143)'
SCALING = "Staleness-learning rate scaling laws for asynchronous RLHF (Song et al., arXiv 2607.01083)"
#: per experiment (sweep name): the claim's source, and what evidence would change its verdict. Written
#: once, independent of the data: the verdict and the figures come from the evidence alone.
CONTEXT: dict[str, tuple[str, str]] = {
    "kl_direction_x_lag": (
        f"{ASYNC_OPD}, abstract claims 1 and 2.",
        "A stale reverse-KL arm that does not lose accuracy at the largest lag would leave nothing to "
        "recover (the claim is then untested here, not refuted); a forward-KL arm whose seed-paired loss "
        "at the largest lag excludes 0 would refute robustness at this scale.",
    ),
    "cache_finiteness": (
        f"{ASYNC_OPD}, abstract claim 3; sampled sparse KD is unbiased (RS-KD, arXiv 2503.16870).",
        "A bias² interval of an MC cache lying above the tolerance, or a top-k cache whose bias does not "
        "fall with k; intervals that straddle the tolerance narrow with more seeds or probes.",
    ),
    "async_grpo": (
        f"{SCALING}; VCPO (arXiv 2602.17616); GAC (arXiv 2603.01501).",
        "A controller that acts on a meaningful fraction of steps (its acting fraction is reported) and "
        "still does not beat the fixed-LR baseline at the largest lag; a controller that never acted is "
        "no evidence either way.",
    ),
    "lr_x_lag": (
        f"{SCALING}, result 2 (the stable learning rate shrinks with the lag).",
        "Divergence or damage that does not grow with S at a fixed learning rate; more seeds where the "
        "intervals straddle.",
    ),
    "recompute_vs_stabilisers": (
        f"{ASYNC_OPD}, abstract claim 2 (RL stabilisers do not beat recomputing the reverse-KL signal).",
        "A stabiliser whose seed-paired gain over online is above the margin at the largest lag would "
        "refute the claim; the precondition (stale reverse KL loses accuracy with lag) must hold for the "
        "comparison to say anything; lags 2 and 4 fill the curve, not the rule.",
    ),
    "s_eta_opd": (
        f"{SCALING}, result 1 (the stale-gradient bias is O(S·η)), applied to OPD's reverse KL.",
        "Matched-S·η pairs whose damage differs beyond their interval (the product would not be what "
        "matters), or a forward-KL control that is damaged as much as reverse KL.",
    ),
    "s_eta_grpo": (
        f"{SCALING}, result 1, on GRPO.",
        "Matched-S·η pairs whose damage differs beyond their interval; more seeds where they straddle.",
    ),
    "accuracy_vs_wall_time": (
        f"{ASYNC_OPD}, abstract claim 4 (1.6-3.8x sync's throughput at comparable accuracy); asynchronous "
        "RLHF (Noukhovitch et al., arXiv 2410.18252).",
        "An estimator whose async − sync interval at the wall-time budget straddles 0 is decided by more "
        "seeds or a larger budget; on a machine where generation and learning do not share two cores "
        "the async speed-up, and with it the gap at equal time, is expected to grow.",
    ),
    "real_pair": (
        f"{ASYNC_OPD}, abstract claims 1 and 2, taken from the paper's scale to a real 135M-parameter "
        "teacher and its pruned student.",
        "A seed-paired KL increase at the largest lag whose interval lies above 0 refutes robustness for "
        "that estimator; with three seeds an interval straddling the margin is decided by more seeds or "
        "steps. While the students degenerate (one token repeated) no agreement figure decides it: a "
        "student that answers is needed first (healed by offline distillation, or deeper than 24 of the "
        "teacher's 30 layers).",
    ),
    "real_pair_healed": (
        f"{ASYNC_OPD}, abstract claims 1 and 2, on the real pair of experiment 10 with its pruned student "
        "healed first by offline distillation on the teacher's sampled responses (preset smollm2-healed).",
        "As in experiment 10: a seed-paired KL increase whose interval lies above 0 refutes robustness for "
        "that estimator, an interval straddling the margin is decided by more seeds or steps, and while an "
        "estimator's students degenerate its figures decide nothing (a longer heal, or a deeper student).",
    ),
    "probe_null": (
        "this study's squared-bias instrument (asyncrl.telemetry.gradients: the row-group cross-product is "
        "unbiased for ‖b‖² when the groups are independent); experiment 6's S = 0 rows, where the bias is 0, "
        "read below 0 (its bias table).",
        "An interval that excludes 0 at any θ (the groups would not be independent, or the on-policy "
        "estimator not unbiased, and every bias² figure in this document would carry that offset); an "
        "interval wider than the tolerance narrows with more batches.",
    ),
    "cache_finiteness_frozen": (
        f"{ASYNC_OPD}, abstract claim 3 (multi-sample MC stays correctable with less variance than one "
        "sample); sampled sparse KD is unbiased (RS-KD, arXiv 2503.16870).",
        "An MC interval lying above the 0.01 tolerance (biased) or a variance slope outside [−1.25, −0.75]; "
        "an interval straddling the tolerance narrows with more seeds or redraws.",
    ),
}


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def save(fig: Figure, out_dir: Path, stem: str) -> str:
    """Write ``stem.png`` without metadata that varies (no software version, no date): the same data
    gives the same bytes. The returned link is relative to the repository (``docs/experiments/...``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return f"docs/experiments/{stem}.png"


def errorbar_panel(ax: Any, xs: Sequence[float], stats: Sequence[Stat], label: str, **kw: Any) -> None:
    m = np.array([s.mean for s in stats])
    e = np.array([s.se if math.isfinite(s.se) else 0.0 for s in stats])
    ax.errorbar(xs, m, yerr=e, marker="o", ms=4, capsize=3, label=label, **kw)


def missing(title: str, sweep_file: str, claim: str, sweep: Sweep | None) -> Section:
    ran = "no finished cells" if sweep is None or not sweep.runs else f"{len(sweep.runs)} finished cells"
    return Section(
        title,
        claim,
        sweep_file,
        NOT_RUN,
        f"no evidence in experiments/data ({ran})",
        "—",
        cpu_s=sweep.cpu_s if sweep else 0,
    )


EXPERIMENTS: list[tuple[str, Callable[[Sweep | None, Path], Section]]] = []


def experiment(sweep_name: str) -> Callable:
    def register(fn: Callable[[Sweep | None, Path], Section]) -> Callable:
        EXPERIMENTS.append((sweep_name, fn))
        return fn

    return register


def _verdict(parts: dict[str, bool | None]) -> str:
    """All parts hold: reproduced; one fails: not reproduced; otherwise (a part untestable, or its interval
    straddles its threshold): inconclusive.

    A part may be a numpy bool (a comparison of numpy figures): ``np.True_ is True`` is false, so every part
    is made a Python bool first."""
    parts = {k: None if v is None else bool(v) for k, v in parts.items()}
    if any(v is False for v in parts.values()):
        return NOT_REPRODUCED
    return REPRODUCED if parts and all(v is True for v in parts.values()) else INCONCLUSIVE


def _tally(parts: dict[str, bool | None]) -> str:
    """How many of the rule's parts hold, and how many are untestable: one failed part makes the verdict
    "not reproduced", so the summary also says how much of the claim did hold."""
    held = sum(v is not None and bool(v) for v in parts.values())
    undecided = sum(v is None for v in parts.values())
    return f"{held} of {len(parts)} parts hold" + (f", {undecided} inconclusive" if undecided else "")


def _says(parts: dict[str, bool | None]) -> str:
    word = {True: "holds", False: "fails", None: "inconclusive"}
    return "; ".join(f"{k}: {word[v]}" for k, v in parts.items())


# --- 1. KL direction x staleness ----------------------------------------------------------------------------
KL_VARIANTS = {
    "forward_kl_topk": "forward KL, top-16 + tail bucket",
    "reverse_kl_mc_stale": "reverse KL, MC m=8, stale advantage",
    "reverse_kl_mc_online": "reverse KL, MC m=8, online advantage (recompute)",
    "reverse_kl_topk": "reverse KL, top-16 + tail bucket",
}


@experiment("kl_direction_x_lag")
def kl_direction(sweep: Sweep | None, plots: Path) -> Section:
    title = "1. KL direction × staleness"
    claim = (
        "Forward KL on the teacher's top-k is robust to staleness; reverse KL by Monte Carlo with the stale "
        "advantage (log p − log π_b) degrades as the lag grows; recomputing the advantage under the current "
        "student (online) recovers near-sync quality."
    )
    file = "examples/sweeps/kl_direction_x_lag.yaml"
    if sweep is None or not sweep.runs:
        return missing(title, file, claim, sweep)
    lags = sorted({r.settings["pipeline.max_lag"] for r in sweep.runs})
    gain = {
        (v, s): stat(acc_gain(r) for r in sweep.select(variant=v, **{"pipeline.max_lag": s}))
        for v in KL_VARIANTS
        for s in lags
    }
    rkl = {
        (v, s): stat(
            r.mean(N.KL_TEACHER_REVERSE, last=3) for r in sweep.select(variant=v, **{"pipeline.max_lag": s})
        )
        for v in KL_VARIANTS
        for s in lags
    }
    cos = {
        (v, s): stat(r.mean(N.GRADREF_COS) for r in sweep.select(variant=v, **{"pipeline.max_lag": s}))
        for v in KL_VARIANTS
        for s in lags
    }
    lo, hi = min(lags), max(lags)
    learns = {
        v: gain[(v, lo)].mean > 2 * gain[(v, lo)].se and gain[(v, lo)].n > 1
        for v in ("reverse_kl_mc_stale", "reverse_kl_mc_online")
    }
    parts: dict[str, bool | None] = {
        f"forward KL at S={hi} not below S={lo}": not gain[("forward_kl_topk", hi)].below(
            gain[("forward_kl_topk", lo)]
        ),
    }
    if all(learns.values()):
        parts[f"stale reverse KL at S={hi} below S={lo}"] = gain[("reverse_kl_mc_stale", hi)].below(
            gain[("reverse_kl_mc_stale", lo)]
        )
        parts[f"online above stale at S={hi}, not below its S={lo}"] = gain[
            ("reverse_kl_mc_stale", hi)
        ].below(gain[("reverse_kl_mc_online", hi)]) and not gain[("reverse_kl_mc_online", hi)].below(
            gain[("reverse_kl_mc_online", lo)]
        )
    else:
        parts["reverse-KL MC learns at S=0 (precondition)"] = None
    verdict = _verdict(parts)
    body = ["Accuracy gain (final − initial exact match) per fixed lag S:", ""]
    body += md_table(
        ["estimator", *[f"S={s}" for s in lags]],
        [[KL_VARIANTS[v], *[str(gain[(v, s)]) for s in lags]] for v in KL_VARIANTS],
    )
    body += [
        "",
        "Exact KL(π_θ‖p) per token to the teacher on the student's own samples, mean of the last "
        "three probes (`kl/teacher_reverse`, lower is better), and the cosine of the estimator's gradient "
        "to the exact gradient of its KL on the same batch (`gradref/cos`, mean over probes):",
        "",
    ]
    body += md_table(
        ["estimator", *[f"S={s}" for s in lags]],
        [
            [KL_VARIANTS[v], *[f"{rkl[(v, s)].mean:.3f} / {cos[(v, s)].mean:.2f}" for s in lags]]
            for v in KL_VARIANTS
        ],
    )
    fig = Figure(figsize=(10, 3.4), layout="constrained")
    a1, a2, a3 = fig.subplots(1, 3)
    for v, label in KL_VARIANTS.items():
        errorbar_panel(a1, lags, [gain[(v, s)] for s in lags], label)
        errorbar_panel(a2, lags, [rkl[(v, s)] for s in lags], label)
        errorbar_panel(a3, lags, [cos[(v, s)] for s in lags], label)
    for ax, y in (
        (a1, "accuracy gain"),
        (a2, "KL(student || teacher) / token"),
        (a3, "cos(estimator, exact)"),
    ):
        ax.set_xlabel("fixed lag S")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=7)
    return Section(
        title,
        claim,
        file,
        verdict,
        _says(parts),
        "precondition: each reverse-KL MC variant raises accuracy at S=0 (gain > 2 se), else inconclusive; "
        f"then forward KL's gain at S={hi} is not significantly below S={lo}, the stale variant's gain at "
        f"S={hi} is significantly below its S={lo}, and the online variant's gain at S={hi} is significantly "
        f"above the stale one's and not significantly below its own S={lo}.",
        body,
        [save(fig, plots, "kl_direction_x_lag")],
        sweep.cpu_s,
        cells_line(sweep),
        tally=_tally(parts),
    )


# --- 2. cache finiteness --------------------------------------------------------------------------------
CACHE_FAMILIES = {
    "forward_topk_k": "forward KL, top-k",
    "reverse_topk_k": "reverse KL, top-k",
    "reverse_mc_m": "reverse KL, m behavior draws",
    "forward_mc_m": "forward KL, m teacher draws",
}


def _family(variant: str) -> tuple[str, int] | None:
    for fam in CACHE_FAMILIES:
        if variant.startswith(fam) and variant[len(fam) :].isdigit():
            return fam, int(variant[len(fam) :])
    return None


@experiment("cache_finiteness")
def cache_finiteness(sweep: Sweep | None, plots: Path) -> Section:
    title = "2. Cache finiteness: bias and variance against dense"
    claim = (
        "Sparse top-k estimators are biased (less as k grows); Monte Carlo estimators are unbiased, with a "
        "gradient variance that falls as 1/m."
    )
    file = "examples/sweeps/cache_finiteness.yaml"
    if sweep is None or not sweep.runs:
        return missing(title, file, claim, sweep)
    rows: dict[tuple[str, int], dict[str, Stat]] = {}
    for variant in dict.fromkeys(r.settings["variant"] for r in sweep.runs):
        fam = _family(variant)
        if fam is None:
            continue
        runs = sweep.select(variant=variant)
        bias = probe_ratio(runs, N.GRADREF_BIAS_SQ)
        rows[fam] = {
            "bias": as_stat(bias),
            "bias_ci": bias,
            "bias_upper": probe_ratio(runs, N.GRADREF_BIAS_SQ, one_sided=True),
            "noise": as_stat(probe_ratio(runs, N.GRADREF_NOISE_SQ)),
            "cos": stat(r.mean(N.GRADREF_COS) for r in runs),
            "acc": stat(acc_final(r) for r in runs),
        }
    parts: dict[str, bool | None] = {}
    for fam in ("forward_topk_k", "reverse_topk_k"):
        ks = sorted(k for f, k in rows if f == fam)
        if len(ks) < 2:
            parts[f"{CACHE_FAMILIES[fam]} biased"] = None
            continue
        small, large = rows[(fam, ks[0])], rows[(fam, ks[-1])]
        parts[f"{CACHE_FAMILIES[fam]}: biased at k={ks[0]}, less at k={ks[-1]}"] = biased_and_falls(
            small["bias_upper"], small["bias_ci"], large["bias_ci"]
        )
    for fam in ("reverse_mc_m", "forward_mc_m"):
        ms = sorted(m for f, m in rows if f == fam)
        if len(ms) < 2:
            parts[f"{CACHE_FAMILIES[fam]} unbiased, variance ~ 1/m"] = None
            continue
        unbiased = all_of([unbiased_within(rows[(fam, m)]["bias_upper"], BIAS_TOL) for m in ms])
        slope = float(np.polyfit(np.log(ms), np.log([rows[(fam, m)]["noise"].mean for m in ms]), 1)[0])
        parts[f"{CACHE_FAMILIES[fam]}: unbiased"] = unbiased
        parts[f"{CACHE_FAMILIES[fam]}: noise ~ m^{slope:.2f} (1/m: slope in [-1.25, -0.75])"] = (
            -1.25 <= slope <= -0.75
        )
    verdict = _verdict(parts)
    body = [
        "Per estimator and cache size: squared bias and noise variance of the gradient relative to "
        "|g|² (ratios of sums over the probes of every seed, ± the seed-bootstrap interval's half-width / "
        "1.96), cosine to the exact dense-KL gradient (mean over probes), and the final exact match:",
        "",
    ]
    body += md_table(
        ["estimator", "k or m", f"bias² / |g|² [{LEVEL:.0%} CI]", "noise / |g|²", "cos", "final accuracy"],
        [
            [CACHE_FAMILIES[f], n, str(v["bias_ci"]), str(v["noise"]), str(v["cos"]), str(v["acc"])]
            for (f, n), v in sorted(
                rows.items(), key=lambda kv: (list(CACHE_FAMILIES).index(kv[0][0]), kv[0][1])
            )
        ],
    )
    body += ["", FIVE_SEED_BIAS]
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    for fam in CACHE_FAMILIES:
        sizes = sorted(n for f, n in rows if f == fam)
        if not sizes:
            continue
        errorbar_panel(a1, sizes, [rows[(fam, n)]["bias"] for n in sizes], CACHE_FAMILIES[fam])
        errorbar_panel(a2, sizes, [rows[(fam, n)]["noise"] for n in sizes], CACHE_FAMILIES[fam])
    ms = sorted({n for f, n in rows if f.endswith("_mc_m")})
    if ms:
        ref = rows.get(("reverse_mc_m", ms[0]), {}).get("noise")
        if ref is not None and math.isfinite(ref.mean):
            a2.plot(ms, [ref.mean * ms[0] / m for m in ms], "k:", label="1/m")
    a1.set_ylabel("bias² / |g|²")
    a2.set_ylabel("noise variance / |g|²")
    a2.set_yscale("log")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (top-k) or m (draws)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return Section(
        title,
        claim,
        file,
        verdict,
        _says(parts),
        "squared bias and noise are ratios of sums over every probe of every seed (Σ B / Σ |g|², B the "
        "row-group cross-product), with seed-clustered bootstrap intervals; each top-k family's one-sided "
        f"{LEVEL:.0%} lower bound is above 0 at the smallest k and its interval at the largest k lies below "
        f"the smallest k's; each MC family is unbiased at every m (one-sided {LEVEL:.0%} upper bound below "
        f"{BIAS_TOL} of |g|²; biased where the lower bound is above it; inconclusive between) and the "
        "least-squares slope of log noise against log m lies in [−1.25, −0.75].",
        body,
        [save(fig, plots, "cache_finiteness")],
        sweep.cpu_s,
        cells_line(sweep),
        tally=_tally(parts),
    )


# --- 3. async GRPO ----------------------------------------------------------------------------------------
GRPO_VARIANTS = ("none", "truncated_is", "ess_lr", "gradient_alignment", "staleness_lr_law")
#: GAC on the update at three τ (added after the defaults acted on 6 % of the steps at S = 8); the arm
#: read at the largest S is the τ with the highest batch reward at S = 0 (tuned at S = 0 only)
GRPO_GAC = ("gac_t0.1", "gac_t0.3", "gac_t0.5")
REWARD = "est/reward_mean"
WINDOW = 10


def seed_mean(
    curves: Sequence[tuple[np.ndarray, np.ndarray]], *, smooth: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Mean over seeds of per-step curves (cut to the shortest); ``smooth``: the trailing ``WINDOW``-step
    mean, plotted from step ``WINDOW`` on (a centred or zero-padded window would bend both ends)."""
    n = min(len(c[0]) for c in curves)
    steps, mean = curves[0][0][:n], np.mean([c[1][:n] for c in curves], axis=0)
    if smooth and n >= WINDOW:
        return steps[WINDOW - 1 :], np.convolve(mean, np.ones(WINDOW) / WINDOW, mode="valid")
    return steps, mean


def collapse_step(r: Run) -> int | None:
    """First step where the 10-step rolling batch reward falls below half its first-10-step mean (or a
    step is skipped for non-finite numbers): a collapse event; None if there is none."""
    steps, reward = r.series(REWARD)
    for m in r.metrics:
        if m.get(N.NUMERICS_SKIPPED):
            return int(m[N.STEP])
    if len(reward) < 2 * WINDOW:
        return None
    roll = np.convolve(reward, np.ones(WINDOW) / WINDOW, mode="valid")
    base = roll[0]
    if base <= 0:
        return None
    below = np.nonzero(roll[1:] < 0.5 * base)[0]
    return int(steps[below[0] + WINDOW]) if len(below) else None


def ess_lead(r: Run, at: int) -> bool | None:
    """An ESS drop precedes the collapse at step ``at``: the lowest ess/rho_seq of the 10 steps before it is
    below the run's median ess/rho_seq over the steps before those."""
    steps, ess = r.series(N.ESS_RHO)
    before = ess[(steps < at) & (steps >= at - WINDOW)]
    earlier = ess[steps < at - WINDOW]
    if not len(before) or not len(earlier):
        return None
    return bool(before.min() < np.median(earlier))


@experiment("async_grpo")
def async_grpo(sweep: Sweep | None, plots: Path) -> Section:
    title = "3. Async GRPO: staleness controllers"
    claim = (
        "ESS drops precede instability; ESS-scaled LR and gradient-alignment control stabilise high lag; "
        "the cosine between consecutive gradients is higher async than sync."
    )
    file = "examples/sweeps/async_grpo.yaml"
    if sweep is None or not sweep.runs:
        return missing(title, file, claim, sweep)
    lags = sorted({r.settings["pipeline.max_lag"] for r in sweep.runs})
    lo, hi = min(lags), max(lags)
    variants = [*GRPO_VARIANTS, *(v for v in GRPO_GAC if sweep.select(variant=v))]
    cell = {(v, s): sweep.select(variant=v, **{"pipeline.max_lag": s}) for v in variants for s in lags}
    reward = {k: stat(r.mean(REWARD, last=WINDOW) for r in runs) for k, runs in cell.items()}
    acc = {k: stat(acc_final(r) for r in runs) for k, runs in cell.items()}
    ess = {k: stat(r.mean(N.ESS_RHO) for r in runs) for k, runs in cell.items()}
    cos = {k: stat(r.mean(N.GRAD_COS_PREV) for r in runs) for k, runs in cell.items()}
    collapses = {
        k: [c for c in (collapse_step(r) for r in runs) if c is not None] for k, runs in cell.items()
    }
    leads = [ess_lead(r, c) for runs in cell.values() for r in runs if (c := collapse_step(r)) is not None]
    leads = [x for x in leads if x is not None]
    parts: dict[str, bool | None] = {}
    parts["ESS drops precede collapses"] = (sum(leads) > len(leads) / 2) if leads else None
    unstable = bool(collapses[("none", hi)]) or reward[("none", hi)].below(reward[("none", lo)])
    if unstable:
        for v in ("ess_lr", "gradient_alignment"):
            parts[f"{v} at S={hi} above none at S={hi}, no collapse"] = (
                reward[("none", hi)].below(reward[(v, hi)]) and not collapses[(v, hi)]
            )
    else:
        parts[f"ess_lr / gradient_alignment stabilise S={hi} (no instability without them)"] = None
    tuned = max(
        (
            (reward[(v, lo)].mean, -i, v)
            for i, v in enumerate(GRPO_GAC)
            if cell.get((v, lo)) and math.isfinite(reward[(v, lo)].mean)
        ),
        default=None,
    )
    if tuned is None or not cell.get((tuned[2], hi)):
        parts[f"gradient_alignment on the update, τ tuned at S={lo}: not run at S={lo} and S={hi}"] = None
    else:
        v = tuned[2]
        parts[
            f"gradient_alignment on the update (τ {v.removeprefix('gac_t')}, tuned at S={lo}) at S={hi} "
            f"above none at S={hi}, no collapse"
        ] = (reward[("none", hi)].below(reward[(v, hi)]) and not collapses[(v, hi)]) if unstable else None
    parts[f"grad cosine higher at S={hi} than S={lo} (no controller)"] = cos[("none", lo)].below(
        cos[("none", hi)]
    )
    verdict = _verdict(parts)
    header = ["controller", *[f"S={s}" for s in lags]]
    body = [
        "Batch reward (exact match of the samples, mean of the last 10 steps) per controller and fixed lag "
        "S:",
        "",
    ]
    body += md_table(
        [*header, f"acting fraction at S={hi}"],
        [[v, *[str(reward[(v, s)]) for s in lags], acting(cell[(v, hi)])] for v in variants],
    )
    body += [
        "",
        "Collapse events (cells whose 10-step rolling reward fell below half its start), mean ESS "
        "fraction of the sequence IS weights (`ess/rho_seq`) and mean cosine of consecutive applied "
        "gradients (`grad/cos_prev`):",
        "",
    ]
    body += md_table(
        header,
        [
            [
                v,
                *[
                    f"{len(collapses[(v, s)])} / {ess[(v, s)].mean:.3f} / {cos[(v, s)].mean:.3f}"
                    for s in lags
                ],
            ]
            for v in variants
        ],
    )
    body += ["", "Final greedy exact match:", ""]
    body += md_table(header, [[v, *[str(acc[(v, s)]) for s in lags]] for v in variants])
    fig = Figure(figsize=(12, 3.4), layout="constrained")
    axes = fig.subplots(1, 3)
    for i, v in enumerate(GRPO_VARIANTS):
        for ax, key in zip(axes, (REWARD, N.ESS_RHO, N.GRAD_COS_PREV)):
            runs = cell[(v, hi)]
            curves = [r.series(key) for r in runs]
            curves = [c for c in curves if len(c[0])]
            if not curves:
                continue
            xs, mean = seed_mean(curves, smooth=key == REWARD)
            ax.plot(xs, mean, label=f"{v} (S={hi})", color=f"C{i}")
    for i, key in enumerate((REWARD, N.ESS_RHO, N.GRAD_COS_PREV)):
        runs = cell[("none", lo)]
        curves = [c for c in (r.series(key) for r in runs) if len(c[0])]
        if curves:
            xs, mean = seed_mean(curves, smooth=key == REWARD)
            axes[i].plot(xs, mean, "k--", label=f"none (S={lo})")
    for ax, y in zip(axes, ("batch reward (10-step mean)", "ESS fraction", "cos(g_t, g_t-1)")):
        ax.set_xlabel("step")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return Section(
        title,
        claim,
        file,
        verdict,
        _says(parts),
        "a collapse event is a 10-step rolling batch reward below half its first 10 steps (or a skipped "
        "non-finite step); ESS drops precede collapses when, for most events, the lowest ESS in the 10 steps "
        "before is below the run's earlier median; stabilisation is testable only if the uncontrolled run at "
        f"S={hi} collapses or ends significantly below S={lo}, and then holds if ess_lr and "
        "gradient_alignment "
        "end significantly above it without collapses; the same for gradient alignment applied to the update "
        f"at the τ (of 0.1, 0.3, 0.5) with the highest batch reward at S={lo}; the cosine claim holds if the "
        f"uncontrolled run's mean grad/cos_prev at S={hi} is significantly above S={lo}.",
        body,
        [save(fig, plots, "async_grpo")],
        sweep.cpu_s,
        cells_line(sweep),
        tally=_tally(parts),
    )


# --- 4. LR x staleness ------------------------------------------------------------------------------------
def divergence_step(r: Run) -> int | None:
    """First step where the 10-step rolling loss exceeds its first 10 steps' mean by 25% (or a step is
    skipped for non-finite numbers); None if the run never diverges."""
    for m in r.metrics:
        if m.get(N.NUMERICS_SKIPPED):
            return int(m[N.STEP])
    steps, loss = r.series(N.LOSS)
    if len(loss) < 2 * WINDOW:
        return None
    roll = np.convolve(loss, np.ones(WINDOW) / WINDOW, mode="valid")
    above = np.nonzero(roll[1:] > 1.25 * roll[0])[0]
    return int(steps[above[0] + WINDOW]) if len(above) else None


@experiment("lr_x_lag")
def lr_x_lag(sweep: Sweep | None, plots: Path) -> Section:
    title = "4. Learning rate × staleness"
    claim = "The bias of a stale gradient grows like S·η, so the largest stable learning rate falls like 1/S."
    file = "examples/sweeps/lr_x_lag.yaml"
    if sweep is None or not sweep.runs:
        return replace(
            missing(title, file, claim, sweep),
            verdict=SUPERSEDED,
            why="Replaced by experiments 6 and 7, which test the same claim on objectives that are "
            "sensitive to lag and read damage from seed-paired accuracy. This round-1 design cannot decide "
            "it: it trains forward KL, which experiment 1 finds insensitive to lag, and calls a run diverged "
            "when its rolling loss rises 25 %, which also flags dips that recover (every η ≥ 1e-3 "
            "'diverged' at S = 0 in round 1). Its sweep stays runnable as an example.",
        )
    lrs = sorted({float(r.settings["train.lr"]) for r in sweep.runs})
    lags = sorted({r.settings["pipeline.max_lag"] for r in sweep.runs})
    cell = {(lr, s): sweep.select(**{"train.lr": lr, "pipeline.max_lag": s}) for lr in lrs for s in lags}
    acc = {k: stat(acc_final(r) for r in runs) for k, runs in cell.items()}
    div = {k: [divergence_step(r) for r in runs] for k, runs in cell.items()}
    drift = {k: stat(r.mean(N.KL_BEHAVIOR_CURRENT) for r in runs) for k, runs in cell.items()}

    def stable(k: tuple[float, int]) -> bool:
        return bool(div[k]) and all(d is None for d in div[k])

    largest = {s: max((lr for lr in lrs if stable((lr, s))), default=None) for s in lags}
    parts: dict[str, bool | None] = {}
    known = [largest[s] for s in lags]
    if any(x is None for x in known) or (len(set(known)) == 1 and all(stable((lrs[-1], s)) for s in lags)):
        parts["largest stable LR falls with S (needs divergence inside the LR grid)"] = None
    else:
        vals = [x or 0.0 for x in known]
        parts["largest stable LR non-increasing in S and lower at the largest S"] = (
            all(a >= b for a, b in itertools.pairwise(vals)) and vals[-1] < vals[0]
        )
    pts = [
        (s, lr, drift[(lr, s)].mean)
        for lr in lrs
        for s in lags
        if s > 0 and math.isfinite(drift[(lr, s)].mean) and drift[(lr, s)].mean > 0
    ]
    if len(pts) >= 4:
        X = np.column_stack([np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), np.ones(len(pts))])
        a, b, _ = np.linalg.lstsq(X, np.log([p[2] for p in pts]), rcond=None)[0]
        parts[f"drift KL(π_b‖π_θ) ~ S^{a:.2f} η^{b:.2f}: a function of S·η (|a − b| < 0.5, both > 0)"] = (
            abs(a - b) < 0.5 and a > 0 and b > 0
        )
    verdict = _verdict(parts)
    header = ["learning rate", *[f"S={s}" for s in lags]]
    initial = stat(acc_initial(r) for r in sweep.runs)
    body = [f"Final exact match per learning rate and fixed lag S (initial {initial.mean:.3f}):", ""]
    body += md_table(header, [[f"{lr:g}", *[str(acc[(lr, s)]) for s in lags]] for lr in lrs])

    def fmt_div(d: list[int | None]) -> str:
        hit = [x for x in d if x is not None]
        return f"{len(hit)}/{len(d)}" + (f" (step {int(np.median(hit))})" if hit else "")

    body += [
        "",
        "Diverged seeds (median step of divergence), and the policy drift a batch carries, mean "
        "KL(π_b‖π_θ) per token (`kl/behavior_current`):",
        "",
    ]
    body += md_table(
        header,
        [[f"{lr:g}", *[f"{fmt_div(div[(lr, s)])} / {drift[(lr, s)].mean:.2g}" for s in lags]] for lr in lrs],
    )
    body += [
        "",
        "Largest learning rate of the grid with no diverged seed, per S: "
        + ", ".join(f"S={s}: {largest[s]:g}" if largest[s] else f"S={s}: none" for s in lags)
        + ".",
    ]
    fig = Figure(figsize=(10, 3.4), layout="constrained")
    a1, a2, a3 = fig.subplots(1, 3)
    for lr in lrs:
        errorbar_panel(a1, lags, [acc[(lr, s)] for s in lags], f"lr {lr:g}")
        xs = [s * lr for s in lags if s > 0]
        a2.plot(xs, [drift[(lr, s)].mean for s in lags if s > 0], "o-", label=f"lr {lr:g}")
    for i, s in enumerate(lags):
        runs = cell[(lrs[-1], s)]
        curves = [c for c in (r.series(N.LOSS) for r in runs) if len(c[0])]
        if curves:
            n = min(len(c[0]) for c in curves)
            a3.plot(
                curves[0][0][:n], np.mean([c[1][:n] for c in curves], axis=0), label=f"S={s}", color=f"C{i}"
            )
    a1.set_xlabel("fixed lag S")
    a1.set_ylabel("final accuracy")
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.set_xlabel("S · lr")
    a2.set_ylabel("KL(behavior || current) / token")
    a3.set_xlabel("step")
    a3.set_ylabel(f"loss at lr {lrs[-1]:g}")
    for ax in (a1, a2, a3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return Section(
        title,
        claim,
        file,
        verdict,
        _says(parts),
        "a run diverges at the first step where its 10-step rolling loss exceeds its first 10 steps by 25% "
        "(or a non-finite step is skipped); a learning rate is stable at S when no seed diverges; the claim "
        "holds if the largest stable learning rate of the grid is non-increasing in S and lower at the "
        "largest "
        "S than at S=0 (untestable if nothing diverges), and if the drift KL(π_b‖π_θ) regressed on log S and "
        "log η has exponents within 0.5 of each other (a function of S·η).",
        body,
        [save(fig, plots, "lr_x_lag")],
        sweep.cpu_s,
        cells_line(sweep),
        tally=_tally(parts),
    )


# --- round 2: pre-registered rules (written and committed before any of these sweeps ran) -----------------
#: accuracy margin of "does not improve on": the upper end of the 95% interval of the seed-paired
#: difference must lie below it (exact match; about one eval prompt in 50 at eval_size 256 x 5 seeds)
MARGIN = 0.02
#: |difference| a matched-S·η pair may show and still be "the same damage" (both interval ends inside)
SETA_MARGIN = 0.03
#: "unbiased" at frozen θ: the one-sided 95% upper bound of Σ bias² / Σ |g|² is below this
BIAS_TOL = 0.01
#: what a five-seed interval of a squared bias can and cannot say (sections 2 and 9; section 12 measured it)
FIVE_SEED_BIAS = (
    "The intervals bootstrap over five seeds, which covers less than its nominal level, so an MC cache's "
    "interval that excludes 0 is not by itself evidence of a bias (one below 0, impossible for a squared "
    "bias, can only be that noise); the rule's one-sided bound against the tolerance decides. Section 12 "
    "measures the same instrument on thousands of independent batches."
)
LEVEL = 0.95
SEEDS = 5

RULES = [
    "## Decision rules (round 2, fixed before the runs)",
    "",
    f"- Replication: {SEEDS} seeds per cell (the real pair: 3); every comparison is between cells that "
    f"share seeds, and is read from the seed-paired differences: their mean with a {LEVEL:.0%} Student-t "
    "interval over the seeds both cells finished.",
    "- An interval that excludes 0 decides the direction; one that straddles 0 makes that part "
    '*inconclusive* (never "no effect"). A claim of the form "X does not improve on Y" holds when the '
    f"upper end of X − Y's interval is below {MARGIN} exact match, fails when its lower end is above 0, "
    "and is inconclusive otherwise.",
    "- A run's final accuracy of 0.0 is a result; a run stopped by the numerics guard counts, with final "
    "accuracy 0.0 (its last logged evaluation is in the data); a run that raised or never ran is missing "
    "and is listed as such.",
    "- Squared gradient bias is the cross-product estimate over row groups, summed over probes and divided "
    'by the summed |g|² (a ratio of sums), with a bootstrap over seeds; "unbiased" is one-sided: it holds '
    f"when the upper {LEVEL:.0%} bound is below {BIAS_TOL} of |g|², fails when the lower {LEVEL:.0%} bound "
    f"is above {BIAS_TOL}, and is inconclusive when the interval straddles {BIAS_TOL}.",
    "- Verdict: every part holds: *reproduced*; a part fails: *not reproduced*; otherwise *inconclusive*. "
    "Controllers' acting fractions (`active/<controller>`, mean over steps) are reported beside every "
    "controller result: a controller that did not act is not evidence about it.",
]


def per_seed(runs: Sequence[Run], fn: Callable[[Run], float]) -> dict[int, float]:
    return {r.seed: fn(r) for r in runs}


def paired(a: Sequence[Run], b: Sequence[Run], fn: Callable[[Run], float] = acc_final) -> Interval:
    """``fn(a) − fn(b)`` paired by seed, with its t interval."""
    return paired_difference(per_seed(a, fn), per_seed(b, fn), level=LEVEL)


def direction(iv: Interval) -> bool | None:
    """True above 0, False below, None when the interval straddles 0."""
    d = decide(iv)
    return None if d == CI_STRADDLES else d == "greater"


def not_better(iv: Interval, margin: float = MARGIN) -> bool | None:
    """ "X does not improve on Y" from X − Y: True if hi < margin, False if lo > 0, else None."""
    if iv.hi < margin:
        return True
    if iv.lo > 0:
        return False
    return None


def equivalent(iv: Interval, margin: float) -> bool | None:
    """Both ends within ±margin: True; the interval excludes 0: False; else None."""
    if -margin < iv.lo and iv.hi < margin:
        return True
    return False if decide(iv) != CI_STRADDLES else None


def acting(runs: Sequence[Run]) -> str:
    """Mean acting fraction per controller over the runs' steps, e.g. ``gradient_alignment 0.12``."""
    keys = sorted({k for r in runs for m in r.metrics for k in m if k.startswith(N.ACTIVE_PREFIX)})
    parts = []
    for k in keys:
        v = stat(r.mean(k) for r in runs)
        if v.n:
            parts.append(f"{k.removeprefix(N.ACTIVE_PREFIX)} {v.mean:.2f}")
    return ", ".join(parts) or "—"


def unbiased_within(iv: Interval, tol: float) -> bool | None:
    """ "Unbiased" decided from a one-sided interval (each bound one-sided at its level) of bias² / |g|²:
    holds when the upper bound is below ``tol``, fails when the lower bound is above it (a bias
    significantly larger than the tolerance), and is None (inconclusive) when the interval straddles
    ``tol`` or has no bounds (fewer than 2 seeds): too little power is not evidence of a bias."""
    if not (math.isfinite(iv.lo) and math.isfinite(iv.hi)):
        return None
    if iv.hi < tol:
        return True
    return False if iv.lo > tol else None


def biased_and_falls(small_one_sided: Interval, small: Interval, large: Interval) -> bool | None:
    """Biased at the smallest size (one-sided lower bound above 0) and less at the largest (its interval
    below the smallest's); None when an interval is unbounded (fewer than 2 seeds)."""
    if not all(math.isfinite(x) for iv in (small_one_sided, small, large) for x in (iv.lo, iv.hi)):
        return None
    return small_one_sided.lo > 0 and large.hi < small.lo


def all_of(values: Sequence[bool | None]) -> bool | None:
    if any(v is False for v in values):
        return False
    return True if values and all(v is True for v in values) else None


def finish(
    title: str, claim: str, file: str, sweep: Sweep, parts: dict[str, bool | None], rule: str,
    body: list[str], plots: list[str],
) -> Section:  # fmt: skip
    return Section(
        title, claim, file, _verdict(parts), _says(parts), rule, body, plots, sweep.cpu_s,
        cells_line(sweep),
        tally=_tally(parts),
    )  # fmt: skip


# --- 5. recompute vs RL stabilisers in OPD ----------------------------------------------------------------
STABILISERS = {
    "stale_tis": "truncated_is (token, proximal anchor)",
    "stale_ess_lr": "ess_lr",
    "stale_gac": "gradient_alignment (apply_to update, τ tuned at S=0)",
}
GAC_TAUS = ("stale_gac_t0.1", "stale_gac_t0.3", "stale_gac_t0.5")
RECOMPUTE_VARIANTS = ("stale", "stale_tis", "stale_ess_lr", *GAC_TAUS, "online", "online_ess_lr", "rkl_topk")


def gac_tau(sweep: Sweep, lo: float) -> str | None:
    """τ tuned at S=0 only: the GAC variant with the highest mean final accuracy at S=lo (ties: smaller τ)."""
    scores = [(stat(acc_final(r) for r in _cell(sweep, v, lo)).mean, -i, v) for i, v in enumerate(GAC_TAUS)]
    scores = [x for x in scores if math.isfinite(x[0])]
    return max(scores)[2] if scores else None


def _cell(sweep: Sweep, variant: str, lag: float) -> list[Run]:
    return sweep.select(variant=variant, **{"pipeline.max_lag": lag})


@experiment("recompute_vs_stabilisers")
def recompute_vs_stabilisers(sweep: Sweep | None, plots: Path) -> Section:
    title = "5. Recompute vs RL stabilisers in OPD"
    claim = (
        "In on-policy distillation with stale rollouts, recomputing the reverse-KL signal under the current "
        "student recovers the loss of quality, and RL stabilisers (truncated importance sampling, ESS-scaled "
        "learning rate, gradient-alignment control) applied to the stale signal do not improve on it."
    )
    file = "examples/sweeps/recompute_vs_stabilisers.yaml"
    if sweep is None or not sweep.runs:
        return missing(title, file, claim, sweep)
    lags = sorted({r.settings["pipeline.max_lag"] for r in sweep.runs})
    lo, hi = min(lags), max(lags)
    tau = gac_tau(sweep, lo)
    arm = {"stale_gac": tau, **{v: v for v in STABILISERS if v != "stale_gac"}}
    parts: dict[str, bool | None] = {}
    damage = paired(_cell(sweep, "stale", hi), _cell(sweep, "stale", lo))
    if direction(damage) is not False:
        parts[f"stale reverse KL loses accuracy from S={lo} to S={hi} (precondition)"] = None
    recompute = paired(_cell(sweep, "online", hi), _cell(sweep, "stale", hi))
    parts[f"online above stale at S={hi}: {recompute}"] = direction(recompute)
    for key, label in STABILISERS.items():
        variant = arm[key]
        if variant is None:
            parts[f"{label} does not improve on online at S={hi}"] = None
            continue
        iv = paired(_cell(sweep, variant, hi), _cell(sweep, "online", hi))
        parts[f"{label} − online at S={hi}: {iv}, does not improve (hi < {MARGIN})"] = not_better(iv)
    header = ["variant", *[f"S={s}" for s in lags], f"acting fraction at S={hi}"]
    body = ["Final exact match per variant and fixed lag S (mean ± se over seeds):", ""]
    body += md_table(
        header,
        [
            [
                v,
                *[str(stat(acc_final(r) for r in _cell(sweep, v, s))) for s in lags],
                acting(_cell(sweep, v, hi)),
            ]
            for v in RECOMPUTE_VARIANTS
        ],
    )
    body += ["", f"GAC τ chosen at S={lo}: `{tau}`.", "", f"Seed-paired differences at S={hi}:", ""]
    rows = [["online − stale", str(recompute)], [f"stale S={hi} − stale S={lo}", str(damage)]]
    rows += [
        [f"{v} − online", str(paired(_cell(sweep, v, hi), _cell(sweep, "online", hi)))]
        for v in (*[arm[k] for k in STABILISERS if arm[k]], "online_ess_lr", "rkl_topk")
    ]
    body += md_table(["difference", f"mean [{LEVEL:.0%} CI] (n)"], rows)
    fig = Figure(figsize=(6.5, 3.6), layout="constrained")
    ax = fig.subplots()
    for v in RECOMPUTE_VARIANTS:
        errorbar_panel(ax, lags, [stat(acc_final(r) for r in _cell(sweep, v, s)) for s in lags], v)
    ax.set_xlabel("fixed lag S")
    ax.set_ylabel("final exact match")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    rule = (
        f"precondition: stale reverse KL's accuracy at S={hi} is below its S={lo} (seed-paired interval "
        f"below 0), else inconclusive; online − stale at S={hi} above 0; for each stabiliser X on the stale "
        f"signal, X − online at S={hi} does not improve (upper end below {MARGIN}; fails if the lower end is "
        f"above 0). GAC's τ is the one of {{0.1, 0.3, 0.5}} with the best mean accuracy at S={lo} "
        "(min_lag 0, so it acts there)."
    )
    return finish(
        title, claim, file, sweep, parts, rule, body, [save(fig, plots, "recompute_vs_stabilisers")]
    )


# --- 6. S·η on staleness-sensitive objectives ------------------------------------------------------------
def damage(sweep: Sweep, variant: str | None, lr: float, lag: float) -> dict[int, float]:
    """Per seed: final accuracy at (lr, S) minus at (lr, 0)."""
    sel = {"train.lr": lr} | ({"variant": variant} if variant else {})
    at = per_seed(sweep.select(**sel, **{"pipeline.max_lag": lag}), acc_final)
    base = per_seed(sweep.select(**sel, **{"pipeline.max_lag": 0}), acc_final)
    return {s: at[s] - base[s] for s in at if s in base}


def s_eta_points(sweep: Sweep) -> list[tuple[float, float]]:
    """The sweep's (η, S) settings with S > 0 (S = 0 is each η's reference)."""
    lrs = sorted({float(r.settings["train.lr"]) for r in sweep.runs})
    lags = sorted(s for s in {r.settings["pipeline.max_lag"] for r in sweep.runs} if s > 0)
    return [(lr, s) for lr in lrs for s in lags]


def damage_rows(sweep: Sweep, variant: str | None, label: str) -> list[list[str]]:
    """Per (η, S > 0): final exact match at (η, 0) and at (η, S), and the seed-paired damage."""
    sel = {"variant": variant} if variant else {}
    rows = []
    for lr, s in s_eta_points(sweep):
        d = damage(sweep, variant, lr, s)
        at = [sweep.select(**sel, **{"train.lr": lr, "pipeline.max_lag": x}) for x in (0, s)]
        rows.append([
            label, f"{lr:g}", f"{s:g}", f"{lr * s:g}", *(str(stat(acc_final(r) for r in a)) for a in at),
            str(paired_difference(d, {k: 0.0 for k in d}, level=LEVEL)),
        ])  # fmt: skip
    return rows


DAMAGE_HEAD = ["objective", "η", "S", "S·η", "exact match at S=0", "at S",
               f"damage, mean [{LEVEL:.0%} CI] (n)"]  # fmt: skip


def s_eta_parts(sweep: Sweep, variant: str | None, label: str, *, control: bool) -> tuple[dict, list]:
    points = s_eta_points(sweep)
    top = max(points, key=lambda p: (p[0] * p[1], p[1]))
    d_top = paired_difference(damage(sweep, variant, *top), {k: 0.0 for k in damage(sweep, variant, *top)})
    parts: dict[str, bool | None] = {}
    rows = []
    if control:
        parts[f"{label} (control) not hurt at S·η={top[0] * top[1]:g}: {d_top}"] = (
            direction(d_top) is not False
        )
        return parts, rows
    parts[f"{label} hurt at the largest S·η={top[0] * top[1]:g}: {d_top}"] = (
        None if direction(d_top) is None else direction(d_top) is False
    )
    groups: dict[float, list[tuple[float, float]]] = {}
    for lr, s in points:
        groups.setdefault(round(lr * s, 12), []).append((lr, s))
    verdicts = []
    for prod, members in sorted(groups.items()):
        for a, b in itertools.combinations(members, 2):
            iv = paired_difference(damage(sweep, variant, *a), damage(sweep, variant, *b), level=LEVEL)
            verdicts.append(equivalent(iv, SETA_MARGIN))
            rows.append([label, f"{prod:g}", f"(η {a[0]:g}, S {a[1]:g}) − (η {b[0]:g}, S {b[1]:g})", str(iv)])
    parts[f"{label}: equal S·η, equal damage (every matched pair within ±{SETA_MARGIN})"] = all_of(verdicts)
    return parts, rows


def bias_vs_s_eta(sweep: Sweep, variant: str) -> list[list[str]]:
    """Per (η, S): Σ bias² / Σ |g|² over the probes of every seed, with its seed-clustered interval."""
    out = []
    for r_lr in sorted({float(r.settings["train.lr"]) for r in sweep.runs}):
        for s in sorted({r.settings["pipeline.max_lag"] for r in sweep.runs}):
            runs = sweep.select(variant=variant, **{"train.lr": r_lr, "pipeline.max_lag": s})
            clusters = [(r.series(N.GRADREF_BIAS_SQ)[1], r.series(N.GRADREF_REF_SQ)[1]) for r in runs]
            iv = cluster_bootstrap_ratio(clusters, level=LEVEL)
            out.append([variant, f"{r_lr:g}", f"{s:g}", f"{r_lr * s:g}", str(iv)])
    return out


@experiment("s_eta_opd")
def s_eta_opd(sweep: Sweep | None, plots: Path) -> Section:
    title = "6. S·η on staleness-sensitive objectives (OPD)"
    claim = (
        "The damage a stale gradient does grows with the product of the lag S and the learning rate η: "
        "settings with equal S·η lose equal accuracy, for an objective whose gradient is sensitive to "
        "staleness (reverse KL with the stale advantage); forward KL, insensitive to lag, is the negative "
        "control; the squared gradient bias grows with S·η."
    )
    file = "examples/sweeps/s_eta_opd.yaml"
    if sweep is None or not sweep.runs:
        return missing(title, file, claim, sweep)
    parts, rows = s_eta_parts(sweep, "rkl_mc_stale", "stale reverse KL", control=False)
    control, _ = s_eta_parts(sweep, "forward_kl", "forward KL", control=True)
    parts |= control
    body = ["Final exact match and its damage (accuracy at (η, S) minus at (η, 0), paired by seed) per "
            "setting:", ""]  # fmt: skip
    body += md_table(DAMAGE_HEAD, damage_rows(sweep, "rkl_mc_stale", "stale reverse KL")
                     + damage_rows(sweep, "forward_kl", "forward KL"))  # fmt: skip
    body += ["", "Seed-paired differences of the damage between settings of equal S·η:", ""]
    body += md_table(["objective", "S·η", "pair", f"mean [{LEVEL:.0%} CI] (n)"], rows)
    body += ["", "Squared gradient bias over |g|² (ratio of sums over probes, bootstrap over seeds):", ""]
    body += md_table(["objective", "η", "S", "S·η", "bias² / |g|²"], bias_vs_s_eta(sweep, "rkl_mc_stale"))
    body += ["", "At S = 0 the bias is 0, so the S = 0 rows show the instrument's noise, which a bootstrap "
             "over five seeds can understate; section 12 measures it on thousands of independent "
             "batches."]  # fmt: skip
    rule = (
        "damage = final accuracy at (η, S) minus at (η, 0), paired by seed; the sensitive objective is hurt "
        "at the largest S·η (interval below 0; straddling: inconclusive); every pair of settings with equal "
        f"S·η has a damage difference whose interval lies within ±{SETA_MARGIN} (fails if it excludes 0); "
        "the "
        "control (forward KL) is not hurt at the largest S·η (fails if its interval is below 0)."
    )
    return finish(title, claim, file, sweep, parts, rule, body, [])


@experiment("s_eta_grpo")
def s_eta_grpo(sweep: Sweep | None, plots: Path) -> Section:
    title = "7. S·η on staleness-sensitive objectives (GRPO)"
    claim = "As in 6, for GRPO: equal S·η, equal damage; damage at the largest S·η."
    file = "examples/sweeps/s_eta_grpo.yaml"
    if sweep is None or not sweep.runs:
        return missing(title, file, claim, sweep)
    parts, rows = s_eta_parts(sweep, None, "GRPO", control=False)
    body = ["Final exact match and its damage (accuracy at (η, S) minus at (η, 0), paired by seed) per "
            "setting:", ""]  # fmt: skip
    body += md_table(DAMAGE_HEAD, damage_rows(sweep, None, "GRPO"))
    body += ["", "Seed-paired differences of the damage between settings of equal S·η:", ""]
    body += md_table(["objective", "S·η", "pair", f"mean [{LEVEL:.0%} CI] (n)"], rows)
    rule = (
        "as in 6, on the final exact match of GRPO runs (no dense gradient reference: RL has no KL estimand)."
    )
    return finish(title, claim, file, sweep, parts, rule, body, [])


# --- 8. accuracy against wall time, sync vs async ----------------------------------------------------------
def eval_points(r: Run) -> list[tuple[float, float]]:
    """(wall time s, exact match) of every evaluation the run logged."""
    return [(m[N.TIME_S], m[N.EVAL_ACCURACY]) for m in r.metrics if N.EVAL_ACCURACY in m and N.TIME_S in m]


def last_eval_time(r: Run) -> float:
    return max((t for t, _ in eval_points(r)), default=0.0)


def accuracy_at(r: Run, t: float) -> float:
    """The last evaluation logged at or before wall time ``t`` (s since the run started); NaN if none."""
    before = [a for when, a in eval_points(r) if when <= t]
    return float(before[-1]) if before else math.nan


@experiment("accuracy_vs_wall_time")
def accuracy_vs_wall_time(sweep: Sweep | None, plots: Path) -> Section:
    title = "8. Accuracy against wall time: sync vs async"
    claim = (
        "At equal wall time, asynchronous training reaches a higher accuracy than synchronous training, for "
        "forward KL and for online (recomputed) reverse KL."
    )
    file = "examples/sweeps/accuracy_vs_wall_time.yaml"
    if sweep is None or not sweep.runs:
        return missing(title, file, claim, sweep)
    lags = sorted({r.settings["pipeline.max_lag"] for r in sweep.runs})
    ends = []
    for v in ("forward_kl", "rkl_online"):
        for s in lags:
            times = [last_eval_time(r) for r in _cell(sweep, v, s)]
            if times:
                ends.append(float(np.median(times)))
    budget = min(ends) if ends else math.nan
    parts: dict[str, bool | None] = {}
    rows = []
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, v in zip(axes, ("forward_kl", "rkl_online")):
        sync, asyn = _cell(sweep, v, min(lags)), _cell(sweep, v, max(lags))
        iv = paired(asyn, sync, lambda r: accuracy_at(r, budget))
        parts[f"{v}: async − sync at {budget:.0f} s: {iv}"] = direction(iv)
        rows.append([v, f"{budget:.0f}", str(iv)])
        for i, s in enumerate(lags):
            for r in _cell(sweep, v, s):
                pts = [
                    (m[N.TIME_S], m[N.EVAL_ACCURACY])
                    for m in r.metrics
                    if N.EVAL_ACCURACY in m and N.TIME_S in m
                ]
                if pts:
                    ax.plot(
                        *zip(*pts),
                        color=f"C{i}",
                        alpha=0.5,
                        label=f"S={s:g}" if r is _cell(sweep, v, s)[0] else None,
                    )
        ax.axvline(budget, color="k", ls=":")
        ax.set_title(v, fontsize=9)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("exact match")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    body = ["Accuracy at equal wall time (the shortest median run time of all cells), seed-paired:", ""]
    body += md_table(["estimator", "wall time (s)", f"async − sync, mean [{LEVEL:.0%} CI] (n)"], rows)
    body += ["", "Each cell at equal steps (mean ± se over seeds): the run's time to its last evaluation, "
             "its throughput, realised median lag and final exact match:", ""]  # fmt: skip
    body += md_table(
        ["estimator", "S", "time to last eval (s)", "samples/s", "lag p50", "final exact match"],
        [
            [v, f"{s:g}", str(stat(last_eval_time(r) for r in _cell(sweep, v, s))),
             str(stat(figure(r, "samples_per_s") for r in _cell(sweep, v, s))),
             str(stat(figure(r, "lag_p50") for r in _cell(sweep, v, s))),
             str(stat(acc_final(r) for r in _cell(sweep, v, s)))]
            for v in ("forward_kl", "rkl_online") for s in lags
        ],
    )  # fmt: skip
    rule = (
        "the wall-time budget is the shortest median (over seeds) time of the last evaluation among all "
        "cells; each run's accuracy at the budget is its last evaluation at or before it; async − sync, "
        "paired by seed, "
        "above 0 holds, below 0 fails, straddling is inconclusive."
    )
    return finish(title, claim, file, sweep, parts, rule, body, [save(fig, plots, "accuracy_vs_wall_time")])


# --- 10. the real pair --------------------------------------------------------------------------------
#: "does not get worse" on the held-out KL(student || teacher), in nats: the upper end of the seed-paired
#: interval of (KL at the largest S) − (KL at S = 0) must lie below it (written before the runs)
KL_MARGIN = 0.1
REAL_VARIANTS = ("forward_kl", "rkl_online")
#: the final checkpoints re-evaluated with the reference instruments (scripts/reference_eval.py)
REFERENCE_FILE = "reference.csv"
CELL_KEYS = ("variant", "pipeline.max_lag", "seed")
#: a cell's students are degenerate when the distinct-2 of their greedy responses is below this fraction
#: of the teacher's own (written before the re-evaluation)
DEGENERATE_FRACTION = 0.5


def load_reference(sweep: Sweep) -> dict[tuple[str, float, int], dict[str, float]]:
    """``reference.csv`` beside the sweep's evidence: (variant, lag, seed) -> metrics of its final
    checkpoint; the teacher's own row under ("teacher", nan, seed) and the starting student's under
    ("initial", nan, seed). Empty when the re-evaluation has not run."""
    path = sweep.path / REFERENCE_FILE
    if not path.exists():
        return {}
    out = {}
    with path.open(encoding="utf-8", newline="") as fh:
        for row in csv.DictReader(fh):
            lag = float(row["pipeline.max_lag"]) if row["pipeline.max_lag"] else math.nan
            key = (row["variant"], lag, int(row["seed"]))
            out[key] = {k: float(v) for k, v in row.items() if k not in CELL_KEYS}
    return out


def ref_of(ref: dict[tuple[str, float, int], dict[str, float]], key: str) -> Callable[[Run], float]:
    """A run's re-evaluated final figure ``key``; a run that was not re-evaluated gives the figure it
    logged itself at its last eval (``eval_<key>_final``: runs since the reference instruments exist log
    them), NaN when it has neither."""

    def fn(r: Run) -> float:
        row = ref.get((str(r.settings["variant"]), float(r.settings["pipeline.max_lag"]), int(r.seed)))
        return row[key] if row is not None else figure(r, f"eval_{key}_final")

    return fn


def kl_final(r: Run) -> float:
    """Held-out KL(student || teacher) after the last step; a run the numerics guard aborted has no usable
    policy: +inf would poison means, so it is missing from the KL figures and listed by its outcome."""
    return math.nan if r.outcome == N.STATUS_ABORTED else figure(r, "eval_kl_reverse_final")


REAL_PAIR_CLAIM = (
    "On a real pretrained teacher and student with chat prompts, teacher-weighted forward KL is robust "
    "to stale rollouts, and reverse KL is too once its signal is recomputed under the current student: "
    "training at a fixed lag leaves the held-out agreement with the teacher where training at lag 0 does."
)


@experiment("real_pair")
def real_pair(sweep: Sweep | None, plots: Path) -> Section:
    return _real_pair(
        sweep, plots, "10. The real pair: forward KL and online reverse KL under lag", "real_pair"
    )


@experiment("real_pair_healed")
def real_pair_healed(sweep: Sweep | None, plots: Path) -> Section:
    """Experiment 10 again, from the student healed by offline distillation (preset ``smollm2-healed``):
    the same claim, cells, prompts and rule, from a student that answers before on-policy training."""
    return _real_pair(
        sweep, plots, "11. The real pair with a healed student: forward KL and online reverse KL under lag",
        "real_pair_healed",
    )  # fmt: skip


def _real_pair(sweep: Sweep | None, plots: Path, title: str, name: str) -> Section:
    claim = REAL_PAIR_CLAIM
    file = f"examples/sweeps/{name}.yaml"
    if sweep is None or not sweep.runs:
        return missing(title, file, claim, sweep)
    lags = sorted({r.settings["pipeline.max_lag"] for r in sweep.runs})
    lo, hi = min(lags), max(lags)
    parts: dict[str, bool | None] = {}
    rows = []
    for v in REAL_VARIANTS:
        iv = paired(_cell(sweep, v, hi), _cell(sweep, v, lo), kl_final)
        parts[f"{v}: KL(S={hi:g}) − KL(S={lo:g}) = {iv}, no worse (hi < {KL_MARGIN})"] = not_better(
            iv, KL_MARGIN
        )
        rows.append([v, f"S={hi:g} − S={lo:g}", str(iv)])
    body = [
        "Held-out KL(student‖teacher) and top-1 agreement after the last step (mean ± se over seeds):",
        "",
    ]
    body += md_table(
        ["estimator", *[f"KL at S={s:g}" for s in lags], *[f"top-1 at S={s:g}" for s in lags]],
        [
            [v, *[str(stat(kl_final(r) for r in _cell(sweep, v, s))) for s in lags],
             *[str(stat(figure(r, "eval_top1_agree_final") for r in _cell(sweep, v, s))) for s in lags]]
            for v in REAL_VARIANTS
        ],
    )  # fmt: skip
    start = stat(figure(r, "eval_kl_reverse_initial") for r in sweep.runs)
    body += ["", f"Before training: KL(student‖teacher) {start}.", "", "Seed-paired differences:", ""]
    body += md_table(["estimator", "difference", f"mean [{LEVEL:.0%} CI] (n)"], rows)
    ref = load_reference(sweep)
    if ref:
        teacher_d2 = stat(row["distinct_2"] for (v, _, _), row in ref.items() if v == "teacher")
        floor = DEGENERATE_FRACTION * teacher_d2.mean if teacher_d2.n else math.inf
        ref_rows = []
        for v in REAL_VARIANTS:
            iv = paired(_cell(sweep, v, hi), _cell(sweep, v, lo), ref_of(ref, "kl_forward_ref"))
            parts[f"{v}: KL_ref(S={hi:g}) − KL_ref(S={lo:g}) = {iv}, no worse (hi < {KL_MARGIN})"] = (
                not_better(iv, KL_MARGIN)
            )
            d2 = {s: stat(ref_of(ref, "distinct_2")(r) for r in _cell(sweep, v, s)) for s in lags}
            if all(d.n and d.mean < floor for d in d2.values()):
                # degenerate at every lag: the estimator's agreement figures decide nothing either way
                parts = {k: (None if k.startswith(f"{v}: ") else x) for k, x in parts.items()}
                parts[
                    f"{v}: students still answer (distinct-2 at or above {DEGENERATE_FRACTION:g} of the "
                    f"teacher's {teacher_d2.mean:.3f} at some lag; precondition of the agreement figures)"
                ] = None
            ref_rows.append([v, f"S={hi:g} − S={lo:g}", str(iv)])
        body += [
            "",
            (
                "The final checkpoints re-evaluated"
                if any(k[0] in REAL_VARIANTS for k in ref)
                else "The final students as the runs logged them"
            )
            + " on the same prompts with the reference instruments: "
            "KL(teacher‖student) and top-1 agreement teacher-forced on the teacher's own greedy responses "
            "(`kl_forward_ref`, `top1_agree_ref`), and the distinct-2 of the student's greedy responses "
            "(mean ± se over seeds):",
            "",
        ]
        body += md_table(
            ["estimator", *[f"KL_ref at S={s:g}" for s in lags], *[f"top-1_ref at S={s:g}" for s in lags],
             *[f"distinct-2 at S={s:g}" for s in lags]],
            [
                [v, *[str(stat(ref_of(ref, "kl_forward_ref")(r) for r in _cell(sweep, v, s))) for s in lags],
                 *[str(stat(ref_of(ref, "top1_agree_ref")(r) for r in _cell(sweep, v, s))) for s in lags],
                 *[str(stat(ref_of(ref, "distinct_2")(r) for r in _cell(sweep, v, s))) for s in lags]]
                for v in REAL_VARIANTS
            ],
        )  # fmt: skip
        init = [row for (v, _, _), row in ref.items() if v == "initial"] or [
            {k: figure(r, f"eval_{k}_initial") for k in ("kl_forward_ref", "top1_agree_ref", "distinct_2")}
            for r in sweep.runs
        ]  # not re-evaluated: the runs' own first evals (step 0, the same student in every cell)
        body += [
            "",
            f"Before training: KL_ref {stat(r['kl_forward_ref'] for r in init)}, top-1_ref "
            f"{stat(r['top1_agree_ref'] for r in init)}, distinct-2 {stat(r['distinct_2'] for r in init)}; "
            f"the teacher's own greedy responses: distinct-2 {teacher_d2}.",
            "",
            "Seed-paired differences of KL_ref:",
            "",
        ]
        body += md_table(["estimator", "difference", f"mean [{LEVEL:.0%} CI] (n)"], ref_rows)
    # on-sample KL; beside it, once measured, KL on the teacher's responses with its value before training
    fig = Figure(figsize=(10.0 if ref else 6.0, 3.4), layout="constrained")
    axes = fig.subplots(1, 2 if ref else 1, squeeze=False)[0]
    panels = [(kl_final, "held-out KL(student‖teacher)", start)]
    if ref:
        start_ref = stat(r["kl_forward_ref"] for r in init)
        panels.append((ref_of(ref, "kl_forward_ref"), "KL_ref (teacher's responses)", start_ref))
    for ax, (fn, label, before) in zip(axes, panels):
        for v in REAL_VARIANTS:
            errorbar_panel(ax, lags, [stat(fn(r) for r in _cell(sweep, v, s)) for s in lags], v)
        if math.isfinite(before.mean):
            ax.axhline(before.mean, color="grey", ls="--", lw=1, label="before training")
        ax.set_xlabel("fixed lag S")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    rule = (
        "the held-out KL(student‖teacher) after the last step (exact, full vocabulary, on the student's own "
        f"samples of the held-out prompts); per estimator, KL at the largest lag minus KL at S={lo:g}, "
        f"paired by seed: no worse (holds) when the interval's upper end is below {KL_MARGIN} nats, worse "
        "(fails) when its lower end is above 0, inconclusive otherwise. Round 3 (written before the "
        "final checkpoints were re-evaluated, once the students' greedy responses were seen to repeat one "
        "token): the same test on KL(teacher‖student) teacher-forced on the teacher's own greedy responses "
        "(`kl_forward_ref`), which a student cannot lower by moving to states the teacher finds easy; and an "
        "estimator whose students' distinct-2 is below "
        f"{DEGENERATE_FRACTION:g} of the teacher's at every lag is undecided (its agreement figures measure "
        "a degenerate student)."
    )
    return finish(title, claim, file, sweep, parts, rule, body, [save(fig, plots, name)])


# --- 9. cache finiteness at frozen θ ----------------------------------------------------------------------
FROZEN = "cache_finiteness_frozen"
FROZEN_FILE = "frozen.csv"  # scripts/frozen_theta.py
FROZEN_MC = ("reverse_mc_m", "forward_mc_m")  # its Monte Carlo families (redrawn; the rest are top-k)


def read_table(path: Path, *text: str) -> list[dict[str, Any]] | None:
    """A measurement script's CSV: the ``text`` columns as written, every other one a float ("" is
    NaN); None if the file does not exist (not measured yet)."""
    if not path.exists():
        return None
    with path.open(encoding="utf-8", newline="") as fh:
        return [
            {k: (v if k in text else float(v) if v else math.nan) for k, v in row.items()}
            for row in csv.DictReader(fh)
        ]


def load_frozen(data: Path) -> list[dict[str, Any]] | None:
    """The rows of ``data/cache_finiteness_frozen/frozen.csv`` (None if not measured yet)."""
    return read_table(data / FROZEN / FROZEN_FILE, "family")


def frozen_ratio(rows: Sequence[dict[str, Any]], key: str, *, one_sided: bool = False) -> Interval:
    """Σ ``key`` / Σ ``ref_sq`` over every checkpoint of every seed, with a bootstrap over seeds."""
    seeds = sorted({r["seed"] for r in rows})
    clusters = [
        ([r[key] for r in rows if r["seed"] == s], [r["ref_sq"] for r in rows if r["seed"] == s])
        for s in seeds
    ]
    return cluster_bootstrap_ratio(clusters, level=LEVEL, one_sided=one_sided)


def cache_frozen(rows: list[dict[str, Any]] | None, plots: Path) -> Section:
    title = "9. Cache finiteness at frozen θ"
    claim = (
        "At equal parameters and states, sparse top-k caches are biased (less as k grows) and Monte Carlo "
        "caches are unbiased with a variance that falls as 1/m; at equal bytes per token there is a cache "
        "size where the Monte Carlo cache's error (bias² + variance) falls below the top-k cache's."
    )
    file = "examples/sweeps/cache_finiteness_frozen.yaml + scripts/frozen_theta.py"
    if not rows:
        return missing(title, file, claim, None)
    cells = {}
    for fam in dict.fromkeys(r["family"] for r in rows):
        for size in sorted({r["size"] for r in rows if r["family"] == fam}):
            sel = [r for r in rows if r["family"] == fam and r["size"] == size]
            cells[(fam, int(size))] = {
                "bias": frozen_ratio(sel, "bias_sq"),
                "bias_upper": frozen_ratio(sel, "bias_sq", one_sided=True),
                "var": frozen_ratio(sel, "var"),
                "bytes": float(np.median([r["bytes_per_token"] for r in sel])),
            }
    parts: dict[str, bool | None] = {}
    for fam in ("forward_topk_k", "reverse_topk_k"):
        ks = sorted(k for f, k in cells if f == fam)
        if len(ks) < 2:
            parts[f"{CACHE_FAMILIES[fam]} biased"] = None
            continue
        small, large = cells[(fam, ks[0])], cells[(fam, ks[-1])]
        parts[f"{CACHE_FAMILIES[fam]}: biased at k={ks[0]}, less at k={ks[-1]}"] = biased_and_falls(
            small["bias_upper"], small["bias"], large["bias"]
        )
    for fam in FROZEN_MC:
        ms = sorted(m for f, m in cells if f == fam)
        if len(ms) < 2:
            parts[f"{CACHE_FAMILIES[fam]} unbiased, variance ~ 1/m"] = None
            continue
        worst = max(ms, key=lambda m: cells[(fam, m)]["bias_upper"].hi)  # the bound nearest the tolerance
        hi = cells[(fam, worst)]["bias_upper"].hi
        says = f"unbiased at every m (upper bound < {BIAS_TOL}; the largest, at m={worst}, is {hi:.3g})"
        parts[f"{CACHE_FAMILIES[fam]}: {says}"] = all_of(
            [unbiased_within(cells[(fam, m)]["bias_upper"], BIAS_TOL) for m in ms]
        )
        var = [cells[(fam, m)]["var"].estimate for m in ms]
        if all(v > 0 for v in var):
            slope = float(np.polyfit(np.log(ms), np.log(var), 1)[0])
            parts[f"{CACHE_FAMILIES[fam]}: variance ~ m^{slope:.2f} (slope in [-1.25, -0.75])"] = (
                -1.25 <= slope <= -0.75
            )
        else:
            parts[f"{CACHE_FAMILIES[fam]}: variance ~ 1/m"] = None
    crossover = []
    for topk, mc in (("reverse_topk_k", "reverse_mc_m"), ("forward_topk_k", "forward_mc_m")):
        err = {
            f: {c["bytes"]: c["bias"].estimate + c["var"].estimate for (ff, _), c in cells.items() if ff == f}
            for f in (topk, mc)
        }
        cheaper = [
            b for b in sorted(err[mc]) if any(bt <= b and err[mc][b] <= e for bt, e in err[topk].items())
        ]
        crossover.append(f"{CACHE_FAMILIES[mc]} vs {CACHE_FAMILIES[topk]}: " + (
            f"{cheaper[0]:g} bytes/token" if cheaper else "none in the grid"))  # fmt: skip
    body = ["Squared bias and variance over |g|² at frozen θ (ratios of sums over checkpoints and seeds, "
            f"{LEVEL:.0%} seed-bootstrap intervals), and bytes per token:", ""]  # fmt: skip
    body += md_table(
        ["cache", "k or m", "bytes/token", "bias² / |g|²", "variance / |g|²"],
        [[CACHE_FAMILIES.get(f, f), n, f"{c['bytes']:g}", str(c["bias"]), str(c["var"])]
         for (f, n), c in sorted(cells.items())],
    )  # fmt: skip
    body += ["", "Byte-matched crossover (smallest MC size whose bias² + variance is at most a top-k cache's "
             "of no more bytes): " + "; ".join(crossover) + "."]  # fmt: skip
    body += ["", FIVE_SEED_BIAS]
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    for fam in dict.fromkeys(f for f, _ in cells):
        sizes = sorted(n for f, n in cells if f == fam)
        bytes_ = [cells[(fam, n)]["bytes"] for n in sizes]
        errorbar_panel(
            a1, bytes_, [as_stat(cells[(fam, n)]["bias"]) for n in sizes], CACHE_FAMILIES.get(fam, fam)
        )
        a2.plot(bytes_, [cells[(fam, n)]["bias"].estimate + cells[(fam, n)]["var"].estimate for n in sizes],
                "o-", label=CACHE_FAMILIES.get(fam, fam))  # fmt: skip
    for ax, y in ((a1, "bias² / |g|²"), (a2, "(bias² + variance) / |g|²")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per token")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    rule = (
        "at every checkpoint (and the starting student) of every seed, fixed states; top-k once, MC over "
        "redraws of its columns (asyncrl.telemetry.gradients.frozen_theta); ratios of sums with a bootstrap "
        f"over seeds; a top-k family is biased if its one-sided {LEVEL:.0%} lower bound at the smallest k is "
        "above 0 and its interval at the largest k lies below the smallest k's; an MC family is unbiased "
        f"if its one-sided upper bound is below {BIAS_TOL} at every m (biased where a lower bound is above "
        "it, inconclusive where the interval straddles it), and its variance falls as 1/m if the "
        "slope of log variance on log m lies in [−1.25, −0.75]. The crossover is reported, not tested."
    )
    n = len({r["seed"] for r in rows})
    redraws = sorted({int(r["redraws"]) for r in rows if r["family"] in FROZEN_MC})
    drawn = f", {'/'.join(map(str, redraws))} redraws per MC measurement" if redraws else ""
    return Section(
        title, claim, file, _verdict(parts), _says(parts), rule, body, [save(fig, plots, FROZEN)],
        0.0, f"{n} seed(s), {len(rows)} measurements{drawn}", tally=_tally(parts),
    )  # fmt: skip


# --- 12. the gradient probe at zero lag ------------------------------------------------------------------
PROBE_NULL = "probe_null"
PROBE_NULL_FILE = "probe_null.csv"  # scripts/probe_null.py
#: the half-width (of |g|²) an interval around 0 must be inside to say "reads 0": a quarter of
#: experiment 6's S = 0 offset, so an offset of that size could not hide in it
NULL_TOL = 0.005
#: probes behind one cell of experiment 6 (a probe every 20 of 200 steps, 5 seeds): the noise-only
#: half-width the table reports is for a cell of this many
CELL_PROBES = 10 * 5


def load_probe_null(data: Path) -> list[dict[str, Any]] | None:
    """The rows of ``data/probe_null/probe_null.csv`` (None if not measured yet)."""
    return read_table(data / PROBE_NULL / PROBE_NULL_FILE, "estimator", "theta")


def batch_ratio(rows: Sequence[dict[str, Any]], key: str) -> Interval:
    """Σ ``key`` / Σ ``ref_sq`` with a bootstrap over batches (each batch is an independent cluster)."""
    return cluster_bootstrap_ratio([([r[key]], [r["ref_sq"]]) for r in rows], level=LEVEL)


def reads_zero(iv: Interval, tol: float = NULL_TOL) -> bool | None:
    """Holds: the interval contains 0 and lies within ±tol; fails: it excludes 0; else inconclusive."""
    if not (iv.lo <= 0.0 <= iv.hi):
        return False
    return True if -tol <= iv.lo and iv.hi <= tol else None


#: the estimators section 12 probes: experiment 6's, and the one sections 2 and 9 read small negative
#: squared biases for (forward KL by one teacher draw per token)
NULL_ESTIMATORS = {
    "reverse_kl_mc": "reverse KL by behavior draws",
    "forward_kl_mc": "forward KL by teacher draws",
}


def probe_null(rows: list[dict[str, Any]] | None, plots: Path) -> Section:
    title = "12. The gradient probe at zero lag"
    claim = (
        "The squared-bias instrument (the row-group cross-product B, summed over probes and divided by the "
        "summed |g|²) reads 0 where the gradient's bias is 0: on-policy batches (lag 0) of an unbiased "
        "Monte Carlo estimator, probed as the learner probes them."
    )
    file = "scripts/probe_null.py"
    rule = (
        "at each θ (the starting student; a checkpoint trained by experiment 6's recipe at S = 0), i.i.d. "
        "batches generated by the engine at that θ and probed with each estimator: experiment 6's (reverse "
        "KL by Monte Carlo, stale advantage, leave-one-out baseline, m = 8) and forward KL by one teacher "
        "draw per token (m = 1, unbiased at any lag; sections 2 and 9 read small negative squared biases "
        f"for it); Σ B / Σ |g|² over the batches with a {LEVEL:.0%} bootstrap over batches; an (estimator, "
        f"θ) part holds when the interval contains 0 and lies within ±{NULL_TOL} of |g|², fails when it "
        "excludes 0, and is inconclusive otherwise; an estimator not measured yet is a part not run."
    )
    if not rows:
        return replace(missing(title, file, claim, None), rule=rule)
    parts: dict[str, bool | None] = {}
    table = []
    fig = Figure(figsize=(4.5 * len(NULL_ESTIMATORS), 3.2), layout="constrained")
    axes = fig.subplots(1, len(NULL_ESTIMATORS), squeeze=False)[0]
    for ax, (est, base) in zip(axes, NULL_ESTIMATORS.items()):
        mine = [r for r in rows if r["estimator"] == est]
        ax.set_title(base, fontsize=8)
        if not mine:
            parts[f"{base}: not measured yet"] = None
            continue
        every = np.array([r["bias_sq"] / r["ref_sq"] for r in mine])
        bins = np.linspace(float(every.min()), float(every.max()), 61)  # one set of bins for every θ
        for m, theta in dict.fromkeys((int(r["m"]), r["theta"]) for r in mine):
            name = f"{base} (m = {m})"  # the draws the probed batches held, not a typed figure
            sel = [r for r in mine if int(r["m"]) == m and r["theta"] == theta]
            iv = batch_ratio(sel, "bias_sq")
            label = "the starting student" if theta == "start" else f"step {theta}"
            says = f"{name}, {label}: Σ B / Σ |g|² = {iv}, within ±{NULL_TOL} and containing 0"
            parts[says] = reads_zero(iv)
            per = np.array([r["bias_sq"] / r["ref_sq"] for r in sel])
            # the half-width of a cell of experiment 6 from the batches' noise alone
            spread = float(np.std(per, ddof=1) / math.sqrt(CELL_PROBES))
            table.append([
                name, label, len(sel), f"{np.mean([r['tokens'] for r in sel]):.0f}", str(iv),
                str(batch_ratio(sel, "noise_sq")), f"{np.std(per, ddof=1):.3f}", f"±{1.96 * spread:.3f}",
            ])  # fmt: skip
            ax.hist(per, bins=bins, alpha=0.5, label=label)
        ax.axvline(0.0, color="k", lw=0.8)
        ax.set_xlabel("B / |g|² of one batch")
        ax.set_ylabel("batches")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    body = [
        "Per estimator and θ: batches, valid tokens per batch, the squared bias and the noise variance over "
        f"|g|² (ratios of sums, {LEVEL:.0%} bootstrap over batches), the spread of one batch's B / |g|², and "
        f"the half-width that spread alone gives a cell of {CELL_PROBES} probes (experiment 6: 10 probes "
        "per run, 5 seeds):",
        "",
        *md_table(
            [
                "estimator",
                "θ",
                "batches",
                "tokens/batch",
                "bias² / |g|²",
                "noise / |g|²",
                "SD of one batch",
                f"{CELL_PROBES} probes",
            ],
            table,
        ),
    ]
    n = len(rows)
    return Section(
        title, claim, file, _verdict(parts), _says(parts), rule, body, [save(fig, plots, PROBE_NULL)],
        0.0, f"{n} batches", tally=_tally(parts),
    )  # fmt: skip


def models_line(sweeps: Sequence[Sweep | None]) -> str:
    """The student's and teacher's exact match as the runs measured them (``summary.json``), not typed."""
    runs = [r for sw in sweeps if sw is not None for r in sw.runs if r.summary.get("algo") == "opd"]
    if not runs:
        return "no OPD cell has finished yet"
    student = stat(acc_initial(r) for r in runs)
    teacher = stat(figure(r, "teacher_accuracy") for r in runs)
    return f"student exact match {student.mean:.3f}, teacher {teacher.mean:.3f} on the runs' eval prompts"


def cells_line(sweep: Sweep) -> str:
    """How many of the sweep's cells have a result: "90 cells", or "90 of 180 cells finished"."""
    n = len(sweep.runs)
    return f"{n} of {n + sweep.pending} cells finished" if sweep.pending else f"{n} cells"


def wall_time(s: Section) -> str:
    """The summed wall time of the section's runs, or "" where the evidence records none."""
    return f"{s.cpu_s / 60:.0f} min of summed cell wall time on 2 cores" if s.cpu_s > 0 else ""


def render(sections: Sequence[Section], root: Path, models: str = "") -> str:
    lines = [
        "# Experiments: does asyncrl reproduce the published staleness findings?",
        "",
        "<!-- Generated by `python scripts/gen_experiments.py` from the committed evidence in "
        "experiments/data: do not edit. -->",
        "",
        "Each experiment is one example sweep (`examples/sweeps/`), run with `asyncrl sweep` on the built-in",
        "addition task at the `small` preset with `pipeline.lag_mode: fixed` (every batch after the first S",
        "steps is trained at exactly lag S; the wall-time experiment runs as deployed, `lag_mode: bound`;",
        "the real-pair experiment uses SmolLM2-135M-Instruct and its pruned student on chat prompts),",
        "a fixed number of learner steps and five seeds per setting, on",
        f"a 2-core CPU machine. Models: {models}. Every figure below is computed from the committed",
        "per-cell, per-seed evidence in `experiments/data/`; an experiment without evidence there has no",
        "verdict. The first round's document (three seeds, endpoint means, a split-half bias estimate that",
        f"could read negative; its runs were not kept) is preserved unchanged in [{ROUND1}]({ROUND1}).",
        "Intervals and decisions follow the decision rules below. The verdict rule of each experiment is",
        "stated beside it and is applied by the script, not by hand. Regenerate with the commands in",
        "`scripts/gen_experiments.py`.",
        "",
        *RULES,
        "",
        "| experiment | verdict | rule parts | cells | summed cell wall time |",
        "|---|---|---|---|---|",
    ]
    for s in sections:
        anchor = s.title.lower().replace(" ", "-").replace(".", "").replace("×", "").replace(":", "")
        cols = [
            f"[{s.title}](#{anchor})",
            f"**{s.verdict}**",
            s.tally or "—",
            s.cells,
            wall_time(s).removesuffix(" of summed cell wall time on 2 cores") or "—",
        ]
        lines.append("| " + " | ".join(cols) + " |")
    lines.append("")
    for s in sections:
        lines += [
            f"## {s.title}",
            "",
            f"**Claim.** {s.claim}",
            "",
            f"*Source:* {s.source}",
            "",
            f"**Verdict: {s.verdict}** ({s.tally}). {s.why}"
            if s.tally
            else f"**Verdict: {s.verdict}.** {s.why}",
            "",
            f"*Rule:* {s.rule}",
            "",
            f"*What would change it:* {s.changes}",
            "",
            f"Sweep: `{s.sweep_file}` ({', '.join(x for x in (s.cells, wall_time(s)) if x) or 'no runs'}).",
            "",
            *s.body,
            "",
        ]
        for p in s.plots:
            lines += [f"![{s.title}]({p})", ""]
    return "\n".join(lines).rstrip() + "\n"


def with_context(section: Section, name: str) -> Section:
    source, changes = CONTEXT[name]
    return replace(section, source=source, changes=changes)


def generate(data: Path, out: Path, plots: Path) -> list[Section]:
    """EXPERIMENTS.md at ``out`` and its plots in ``plots`` from the evidence under ``data`` alone."""
    sweeps = {name: load_data(data, name) for name, _ in EXPERIMENTS}
    sections = [with_context(fn(sweeps[name], plots), name) for name, fn in EXPERIMENTS]
    sections.append(with_context(cache_frozen(load_frozen(data), plots), FROZEN))
    sections.append(with_context(probe_null(load_probe_null(data), plots), PROBE_NULL))
    sections.sort(key=lambda s: int(s.title.split(".")[0]))  # by number (9 and 12 are not sweeps')
    out.write_text(render(sections, data, models_line(list(sweeps.values()))), encoding="utf-8")
    return sections


def export_all(sweeps_root: Path, data: Path) -> list[str]:
    """``export_sweep`` every experiment's sweep found under ``sweeps_root`` into ``data/<name>``."""
    done = []
    for name in dict.fromkeys(n for n, _ in EXPERIMENTS):
        if (sweeps_root / name / "sweep.json").exists():
            export_sweep(sweeps_root / name, data / name)
            done.append(name)
    return done


def check(data: Path, out: Path, plots: Path) -> list[str]:
    """Regenerate into a temporary directory; the committed files that differ (empty: byte-identical)."""
    with tempfile.TemporaryDirectory() as tmp:
        t_out, t_plots = Path(tmp) / out.name, Path(tmp) / "plots"
        generate(data, t_out, t_plots)
        differ = [] if out.exists() and filecmp.cmp(out, t_out, shallow=False) else [str(out)]
        for png in sorted(t_plots.glob("*.png")):
            mine = plots / png.name
            if not (mine.exists() and filecmp.cmp(mine, png, shallow=False)):
                differ.append(str(mine))
    return differ


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA), help="the committed evidence (experiments/data)")
    ap.add_argument("--export-from", default=None, help="first export the sweeps under this directory")
    ap.add_argument("--sweeps-root", default=None, help="read sweep outputs directly (exported beside them)")
    ap.add_argument("--out", default=str(REPO / "EXPERIMENTS.md"))
    ap.add_argument("--plots", default=str(REPO / "docs" / "experiments"))
    ap.add_argument(
        "--check", action="store_true", help="compare a regeneration with the files; rc 1 if any differ"
    )
    args = ap.parse_args(argv)
    data, out, plots = Path(args.data), Path(args.out), Path(args.plots)
    if args.sweeps_root is not None:  # a scratch export beside the sweeps, for a look before committing
        data = Path(args.sweeps_root) / "_evidence"
        export_all(Path(args.sweeps_root), data)
    if args.export_from is not None:
        print("exported:", ", ".join(export_all(Path(args.export_from), data)) or "nothing")
    if args.check:
        differ = check(data, out, plots)
        for path in differ:
            print(f"differs from its regeneration: {path}")
        return 1 if differ else 0
    for s in generate(data, out, plots):
        print(f"{s.title}: {s.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
