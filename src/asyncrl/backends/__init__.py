"""Learner backends behind one seam (``base.LearnerBackend``): DDP (default) or DeepSpeed ZeRO.

``deepspeed`` is an optional extra; only ``make_backend("deepspeed", ...)`` imports it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from asyncrl.backends.base import LearnerBackend, scheduled_lr
from asyncrl.backends.ddp import TorchBackend
from asyncrl.config import RunConfig, TrainConfig

__all__ = ["LearnerBackend", "TorchBackend", "learner_backend", "make_backend", "scheduled_lr"]


def make_backend(name: str, model: torch.nn.Module, tc: TrainConfig, world: int, **options: Any) -> Any:
    """The ``LearnerBackend`` ``name`` (``ddp`` or ``deepspeed``) around ``model`` for ``world`` ranks."""
    if name == "ddp":
        return TorchBackend(model, tc, world)
    if name == "deepspeed":
        from asyncrl.backends.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(model, tc, world, **options)
    raise ValueError(f"unknown learner backend {name!r}; use 'ddp' or 'deepspeed'")


def learner_backend(
    cfg: RunConfig,
    model_dir: str | Path,
    world: int,
    *,
    checkpointed: bool,
    base_dir: str | Path | None = None,
) -> Any:
    """A learner worker's student: the model at ``model_dir`` on this worker's device, in eval mode,
    behind ``pipeline.backend``. ``checkpointed``: ``model_dir`` is in a run directory, whose
    weights are read as safetensors only (never unpickled).

    With ``train.lora`` the model is the student checkpoint ``base_dir`` (default ``model_dir``)
    wrapped in peft's LoRA (``asyncrl.lora.apply_lora``, adapters seeded by the run seed), and a
    checkpointed ``model_dir`` holds the adapters to restore (what peft's ``save_pretrained`` wrote)."""
    from transformers import AutoModelForCausalLM

    pc = cfg.pipeline
    lora = cfg.train.lora
    safe = {"use_safetensors": True} if checkpointed and lora is None else {}
    model = AutoModelForCausalLM.from_pretrained(
        base_dir if lora is not None and base_dir is not None else model_dir,
        local_files_only=True,
        dtype=torch.float32,
        **safe,
    )
    if lora is not None:
        from asyncrl.lora import apply_lora, load_adapter_state, read_adapter

        model = apply_lora(model, lora, seed=cfg.seed)
        if checkpointed:
            load_adapter_state(model, read_adapter(model_dir))
    if pc.device == "cuda":  # this worker's GPU (Ray Train sets CUDA_VISIBLE_DEVICES and the index)
        import ray.train.torch

        device = ray.train.torch.get_device()
    else:
        device = torch.device("cpu")
    if pc.backend == "deepspeed":  # DeepSpeed picks its accelerator (and NCCL/gloo) from it
        os.environ["DS_ACCELERATOR"] = pc.device
    # eval mode: the engines sample without dropout, so pi_theta must be computed without it too,
    # or lag-0 importance ratios are not 1 (gradients flow in eval mode all the same)
    model.to(device).eval()
    if lora is not None and lora.dropout > 0:
        from asyncrl.lora import train_dropout

        train_dropout(model)
    return make_backend(
        pc.backend,
        model,
        cfg.train,
        world,
        zero_stage=pc.zero_stage,
        # DeepSpeed's JIT-op build cache goes with the model cache (absolute path), else its default
        extensions_dir=str(Path(cfg.workload.cache_dir, "torch_extensions")),
    )
