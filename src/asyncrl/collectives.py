"""Collectives over the learner's data-parallel ranks (``torch.distributed``; no Ray).

Why one small module: batch statistics that drive decisions (ESS, max lag, the token count a
``token_mean`` loss is normalised by) must be identical on every rank, or ranks take different
LR scales and the "global" figures in the log are one rank's view. ``Collectives`` is the one
place that reduces them; ``LOCAL`` is the single-process version users' own loops get.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def _comm_device() -> torch.device:
    """Where collective tensors must live: NCCL reduces only CUDA tensors, gloo CPU ones."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Collectives:
    """Reductions over ``world`` ranks; every method is the identity when ``world == 1``."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> Collectives:
        """The initialised ``torch.distributed`` group (Ray Train sets it up), else ``LOCAL``."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return cls(torch.distributed.get_rank(), torch.distributed.get_world_size())
        return LOCAL

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
        torch.distributed.all_reduce(t)
        return t.tolist()

    def all_cat(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate a 1-D tensor of any length over ranks, in rank order (same on every rank)."""
        if self.world == 1:
            return x
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, x.detach().cpu())
        return torch.cat(out).to(x.device)

    def gather_rows(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per-sample columns of every rank concatenated in rank order (same on every rank)."""
        if self.world == 1:
            return rows
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, rows)
        return {k: np.concatenate([r[k] for r in out]) for k in rows}

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


#: one process, no collectives (users' own loops, unit tests)
LOCAL = Collectives()
