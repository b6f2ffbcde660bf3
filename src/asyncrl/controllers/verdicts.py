"""Group-atomic keep/drop verdicts and drop accounting by reason.

GRPO groups are admitted and dropped whole (DESIGN.md section 2): a verdict computed per
sample is widened to its group with ``group_all`` (a group is kept only if every member
passes), and a per-sample statistic such as lag is lifted to the group with ``group_max``
(the lag of a group is the max over its members). ``DropCounter`` counts every drop with a
reason so that nothing is ever dropped silently.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _group_index(group_ids: np.ndarray, n: int) -> np.ndarray:
    group_ids = np.asarray(group_ids)
    if group_ids.shape != (n,):
        raise ValueError(f"group_id has shape {group_ids.shape}, expected ({n},): one group id per sample")
    return np.unique(group_ids, return_inverse=True)[1].reshape(-1)


def group_max(values: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """[N] -> [N]: each sample gets the max of ``values`` over the members of its group."""
    values = np.asarray(values)
    if values.size == 0:
        return values.copy()
    inv = _group_index(group_ids, len(values))
    out = np.full(inv.max() + 1, -np.inf if values.dtype.kind == "f" else np.iinfo(np.int64).min)
    np.maximum.at(out, inv, values)
    return out[inv].astype(values.dtype)


def group_all(keep: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """[N] bool -> [N] bool: a sample is kept only if every member of its group is kept."""
    keep = np.asarray(keep, dtype=bool)
    if keep.size == 0:
        return keep.copy()
    inv = _group_index(group_ids, len(keep))
    bad = np.zeros(inv.max() + 1, dtype=bool)
    np.logical_or.at(bad, inv, ~keep)
    return ~bad[inv]


class DropCounter:
    """Counts drops by reason: a per-step window (reset with ``reset_window``) and run totals.

    ``window`` feeds the per-step metrics (``<prefix>/dropped``, ``<prefix>/dropped/<reason>``),
    ``totals`` the cumulative ones; totals are part of ``state_dict``.
    """

    def __init__(self) -> None:
        self.window: dict[str, int] = {}
        self.totals: dict[str, int] = {}

    def add(self, reason: str, n: int) -> None:
        n = int(n)
        if n < 0:
            raise ValueError(f"drop count for {reason!r} must be >= 0, got {n}")
        if n:
            self.window[reason] = self.window.get(reason, 0) + n
            self.totals[reason] = self.totals.get(reason, 0) + n

    def reset_window(self) -> None:
        self.window = {}

    @property
    def window_total(self) -> int:
        return sum(self.window.values())

    @property
    def total(self) -> int:
        return sum(self.totals.values())

    def metrics(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}/dropped": float(self.window_total), f"{prefix}/dropped_total": float(self.total)}
        out.update({f"{prefix}/dropped/{r}": float(n) for r, n in sorted(self.window.items())})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals = {str(k): int(v) for k, v in state.get("totals", {}).items()}
        self.window = {}
