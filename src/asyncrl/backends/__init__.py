"""Learner backends behind one seam (``base.LearnerBackend``): DDP (default) or DeepSpeed ZeRO.

``deepspeed`` is an optional extra; only ``make_backend("deepspeed", ...)`` imports it.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.backends.base import LearnerBackend, scheduled_lr
from asyncrl.backends.ddp import TorchBackend
from asyncrl.config import TrainConfig

__all__ = ["LearnerBackend", "TorchBackend", "make_backend", "scheduled_lr"]


def make_backend(name: str, model: torch.nn.Module, tc: TrainConfig, world: int, **options: Any) -> Any:
    if name == "ddp":
        return TorchBackend(model, tc, world)
    if name == "deepspeed":
        from asyncrl.backends.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(model, tc, world, **options)
    raise ValueError(f"unknown learner backend {name!r}; use 'ddp' or 'deepspeed'")
