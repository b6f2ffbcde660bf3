"""Inference over seeds for the study's verdicts: seed-paired differences, seed-clustered bootstraps.

Why: a verdict compares settings that share seeds (the same seed gives the same prompts and the same
initial state in every cell), so the unit of replication is the seed, and a difference is read from
the seed-paired differences, not from two independent means. Three pieces, each a pure function of
numbers (no files, no plotting):

- ``paired_difference``: the mean of ``a_s − b_s`` over the seeds both cells finished, with the
  Student-t interval ``mean ± t_{n−1} s / sqrt(n)``;
- ``cluster_bootstrap_ratio``: a ratio of sums ``Σ num / Σ den`` over all probes of all seeds (e.g.
  squared bias over ``‖g‖²``), with a percentile interval from resampling whole seeds (probes of one
  seed share its trajectory, so they are not independent);
- ``decide``: "greater" / "less" when the interval excludes 0, else "inconclusive" (a straddling
  interval is reported as such, never as "no effect"). One-sided bounds (``Interval.hi`` of a
  one-sided interval) decide "at most a tolerance" claims, e.g. "unbiased": upper bound < tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import numpy as np

__all__ = [
    "GREATER",
    "INCONCLUSIVE",
    "LESS",
    "Interval",
    "cluster_bootstrap_ratio",
    "decide",
    "paired_difference",
    "t_quantile",
]

GREATER, LESS, INCONCLUSIVE = "greater", "less", "inconclusive"
Direction = Literal["greater", "less", "inconclusive"]


class Interval(NamedTuple):
    """An estimate with its interval at ``level`` (two-sided unless built one-sided), from ``n`` seeds."""

    estimate: float
    lo: float
    hi: float
    n: int = 0
    level: float = 0.95

    def __str__(self) -> str:
        if not math.isfinite(self.estimate):
            return "—"
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            return f"{self.estimate:+.3f} (n={self.n})"
        return f"{self.estimate:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}] (n={self.n})"


def _t_cdf(x: float, df: int) -> float:
    """Student-t CDF by Simpson's rule on its density over [0, |x|] (smooth; 4,000 panels)."""
    if x == 0:
        return 0.5
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    grid = np.linspace(0.0, abs(x), 4001)
    dens = c * (1 + grid**2 / df) ** (-(df + 1) / 2)
    h = grid[1] - grid[0]
    area = h / 3 * (dens[0] + dens[-1] + 4 * dens[1:-1:2].sum() + 2 * dens[2:-1:2].sum())
    return 0.5 + math.copysign(float(area), x)


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on ``_t_cdf``)."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1; got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def paired_difference(
    a: Mapping[int, float], b: Mapping[int, float], *, level: float = 0.95, one_sided: bool = False
) -> Interval:
    """Mean over the seeds both ``a`` and ``b`` have a finite value for of ``a[s] − b[s]``, with the
    t interval at ``level`` (two-sided; ``one_sided``: ``lo`` and ``hi`` are each a one-sided bound at
    ``level``). Fewer than 2 shared seeds: an infinite interval (undecidable)."""
    seeds = sorted(s for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s]))
    d = np.array([a[s] - b[s] for s in seeds], float)
    n = len(d)
    if n == 0:
        return Interval(math.nan, -math.inf, math.inf, 0, level)
    mean = float(d.mean())
    if n < 2:
        return Interval(mean, -math.inf, math.inf, n, level)
    q = t_quantile(level if one_sided else (1 + level) / 2, n - 1)
    half = q * float(d.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, level)


def cluster_bootstrap_ratio(
    clusters: Sequence[tuple[Sequence[float], Sequence[float]]],
    *,
    level: float = 0.95,
    one_sided: bool = False,
    n_boot: int = 4000,
    seed: int = 0,
) -> Interval:
    """``Σ num / Σ den`` over every (num, den) pair of every cluster (seed), with a percentile interval
    from ``n_boot`` resamples of whole clusters with replacement (two-sided at ``level``, or each bound
    one-sided at ``level``). Non-finite pairs are left out; fewer than 2 clusters: infinite interval."""
    sums = []
    for nums, dens in clusters:
        pairs = [(float(x), float(y)) for x, y in zip(nums, dens) if math.isfinite(x) and math.isfinite(y)]
        if pairs:
            sums.append((sum(x for x, _ in pairs), sum(y for _, y in pairs)))
    if not sums:
        return Interval(math.nan, -math.inf, math.inf, 0, level)
    num, den = np.array(sums).T
    estimate = float(num.sum() / den.sum()) if den.sum() > 0 else math.nan
    k = len(sums)
    if k < 2:
        return Interval(estimate, -math.inf, math.inf, k, level)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, k, size=(n_boot, k))
    ratios = num[pick].sum(1) / np.maximum(den[pick].sum(1), 1e-300)
    tail = 1 - level if one_sided else (1 - level) / 2
    lo, hi = np.quantile(ratios, [tail, 1 - tail])
    return Interval(estimate, float(lo), float(hi), k, level)


def decide(interval: Interval) -> Direction:
    """``greater`` if the interval lies above 0, ``less`` if below, ``inconclusive`` if it straddles 0
    (or is undefined)."""
    if not (math.isfinite(interval.lo) or math.isfinite(interval.hi)):
        return INCONCLUSIVE
    if interval.lo > 0:
        return GREATER
    if interval.hi < 0:
        return LESS
    return INCONCLUSIVE
