"""The learner-backend seam: how a Train worker wraps the model, steps the optimizer and checkpoints.

The learner loop calls only this seam, so the same loop runs plain PyTorch / DDP (gloo on
CPU, NCCL on GPU) or DeepSpeed ZeRO. The learning rate follows one schedule for every
backend (linear warmup, then constant); controllers scale it for one step at a time and the
scheduled value is restored afterwards.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from asyncrl.config import TrainConfig


def scheduled_lr(tc: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_steps`` (from lr/warmup to lr), then constant ``lr``."""
    if tc.warmup_steps <= 0:
        return tc.lr
    return tc.lr * min(1.0, (step + 1) / tc.warmup_steps)


class LearnerBackend(Protocol):
    """What ``asyncrl.step.loss_step`` drives: backward, gradients, clipping, the optimizer step and
    its learning rate, and the state a checkpoint holds. ``TorchBackend`` (DDP) and
    ``DeepSpeedBackend`` (ZeRO-1/2) implement it."""

    name: str
    #: False when gradients are partitioned (ZeRO-2): gradient-transform controllers are refused
    supports_gradient_transform: bool
    #: the unwrapped model (full weights on every rank): publishing, eval, save_pretrained
    module: torch.nn.Module
    #: what the forward pass calls (DDP / DeepSpeed engine)
    model: torch.nn.Module

    def base_lr(self, step: int) -> float:
        """The scheduled learning rate at optimizer step ``step`` (``scheduled_lr``)."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (gradients averaged over data-parallel ranks)."""
        ...

    def gradients(self) -> list[torch.Tensor]:
        """The full gradients, one per parameter (what gradient-transform controllers change)."""
        ...

    def clip_and_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm``; returns the norm before clipping."""
        ...

    def step(self, step: int, scale: float) -> float:
        """One optimizer step at the scheduled LR times ``scale`` (restored after); returns the LR used."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (and engine) state for a checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state ``state_dict`` returned."""
        ...
