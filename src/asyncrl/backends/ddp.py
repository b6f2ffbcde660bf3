"""Plain PyTorch / DDP learner backend (gloo on CPU, NCCL on GPU): the default."""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.backends.base import scheduled_lr
from asyncrl.config import TrainConfig
from asyncrl.controllers.base import scaled_lr


class TorchBackend:
    """AdamW on the plain model (one worker) or a DDP wrapper (several; gloo on CPU)."""

    name = "ddp"
    supports_gradient_transform = True

    def __init__(self, model: torch.nn.Module, tc: TrainConfig, world: int) -> None:
        self.tc = tc
        self.module = model
        if world > 1:
            import ray.train.torch

            self.model = ray.train.torch.prepare_model(model, move_to_device=False)
        else:
            self.model = model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # the fused kernel: one pass over all parameters (the `small` student's step: 1.8 ms
        # against 5.4 ms for the per-tensor loop, CPU; parameters equal to 1e-8 after 10 steps)
        fused = all(p.device.type in ("cpu", "cuda") for p in self.params)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=tc.lr, weight_decay=tc.weight_decay, fused=fused or None
        )

    def base_lr(self, step: int) -> float:
        return scheduled_lr(self.tc, step)

    def backward(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def clip_and_norm(self, max_norm: float) -> float:
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in self.gradients()])))

    def step(self, step: int, scale: float) -> float:
        for g in self.optimizer.param_groups:
            g["lr"] = self.base_lr(step)
        with scaled_lr(self.optimizer, scale) as applied:
            self.optimizer.step()
        return applied[0]

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
