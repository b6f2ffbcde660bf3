"""DeepSpeed ZeRO-1/2 learner backend (the ``pipeline.backend=deepspeed`` side of the seam).

Why a separate module: ``deepspeed`` is an optional extra (``pip install 'asyncrl[deepspeed]'``,
built with ``DS_BUILD_OPS=0``); importing this module is what imports it.

What differs from :class:`asyncrl.backends.ddp.TorchBackend`, and why:

* **Wrapping.** ``deepspeed.initialize`` wraps the model in its engine; Ray Train's
  ``prepare_model`` must not also wrap it. Ray Train's ``TorchConfig`` has already created the
  process group, so ``deepspeed.init_distributed`` only adopts it.
* **Optimizer.** torch ``AdamW`` is the client optimizer (``zero_allow_untested_optimizer``), the
  same update rule as the DDP backend, and it needs no JIT-built ``fused_adam``/``cpu_adam``.
  ZeRO-1 partitions its state (``m``, ``v``, fp32 master weights) over ranks; ZeRO-2 also
  partitions the reduced gradients. Every rank still holds the full weights, so ``module``
  (``engine.module``) serves publishing, evaluation and ``save_pretrained`` as with DDP.
* **Clipping.** ``gradient_clipping = train.grad_clip`` in the DeepSpeed config: the engine
  clips inside ``step`` with the same rule as ``torch.nn.utils.clip_grad_norm_``,
  ``g <- g * min(1, c / (||g||_2 + 1e-6))``. The learner asks for the norm *before* ``step``,
  when the engine's ``get_global_grad_norm()`` still holds the previous step's value, so
  :meth:`DeepSpeedBackend.clip_and_norm` computes the pre-clip global norm of this step's
  partitioned gradients directly (one extra scalar all-reduce); the unit tests check it equals
  what the engine reports after ``step``.
* **Gradients** are partitioned, so gradient-transform controllers are refused at build time
  (``supports_gradient_transform = False``; see ``pipeline.check_build``).
* **Checkpoints** are per rank (``sharded_state = True``): each rank's :meth:`state_dict` is its
  own ZeRO partition and must be restored on the same rank with the same world size and stage.

The loss is not rescaled: ``engine.backward`` divides by ``gradient_accumulation_steps``, which
is 1 here, and the reduce-scatter averages over ranks as DDP's all-reduce does, so losses and
updates match the DDP backend (checked by the max_lag 0 parity test).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch

from asyncrl.backends.base import scheduled_lr
from asyncrl.config import TrainConfig
from asyncrl.controllers.base import scaled_lr

#: keys of :meth:`DeepSpeedBackend.state_dict` besides the ZeRO optimizer state
_LAYOUT_KEYS = ("rank", "world", "zero_stage")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _single_process_env() -> None:
    """Rendezvous variables for a one-process group when no launcher (Ray Train, torchrun) set any."""
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def deepspeed_config(tc: TrainConfig, world: int, zero_stage: int) -> dict[str, Any]:
    """The DeepSpeed config dict: one micro-batch per step (the learner's local batch ``B / world``)."""
    if zero_stage not in (1, 2):
        raise ValueError(f"pipeline.zero_stage={zero_stage} is not supported; use 1 or 2")
    if world < 1 or tc.batch_size % world:
        raise ValueError(
            f"train.batch_size={tc.batch_size} must divide evenly over {world} learner workers "
            f"(pipeline.learner_workers)"
        )
    local = tc.batch_size // world
    return {
        "train_batch_size": local * world,
        "train_micro_batch_size_per_gpu": local,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": float(tc.grad_clip) if tc.grad_clip > 0 else 0.0,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


#: DeepSpeed's CPU shared-memory all-reduce op (``deepspeed.ops.op_builder.cpu.comm.ShareMemCommBuilder``)
SHM_COMM_OP = "deepspeed_shm_comm"


def _skip_inference_comm_op() -> None:
    """Do not JIT-build DeepSpeed's shared-memory all-reduce op on CPU.

    DeepSpeed's torch comm backend builds it (C++, 25-70 s on 2 cores, and a compiler is needed)
    whenever it initializes on CPU, but only ``inference_all_reduce`` (DeepSpeed inference) calls
    it; ZeRO training reduces through the process group (gloo here), and DeepSpeed falls back to
    exactly that where the op is not compatible. So the op is marked incompatible, as on a machine
    that cannot build it. A DeepSpeed without the name builds it as before (slower, not wrong)."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    if SHM_COMM_OP in compatible:
        compatible[SHM_COMM_OP] = False


class DeepSpeedBackend:
    """ZeRO stage 1 or 2 over the Train workers' process group (gloo on CPU, NCCL on CUDA).

    Options (``make_backend(..., **options)``): ``zero_stage`` (1 or 2); ``extensions_dir``, where
    DeepSpeed JIT-builds its C++ ops (on CPU: the shared-memory comm op, about 25 s once; keep
    it in a persistent cache, default ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``).

    Device: DeepSpeed's accelerator decides (``DS_ACCELERATOR``, ``cpu`` in the pipeline's Ray
    env). On ``cuda`` the engine moves the model to this rank's GPU and the process group should
    be NCCL; the caller must then move batches to ``self.device``.
    """

    name = "deepspeed"
    supports_gradient_transform = False
    #: each rank saves and restores its own state (ZeRO partitions the optimizer over ranks)
    sharded_state = True

    def __init__(
        self,
        model: torch.nn.Module,
        tc: TrainConfig,
        world: int,
        *,
        zero_stage: int = 2,
        extensions_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        config = deepspeed_config(tc, world, zero_stage)
        if extensions_dir is not None:
            Path(extensions_dir).mkdir(parents=True, exist_ok=True)
            os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir)
        if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"
        try:
            import deepspeed
            from deepspeed.accelerator import get_accelerator
        except ImportError as err:
            raise ImportError(
                "pipeline.backend=deepspeed needs the deepspeed extra: "
                "DS_BUILD_OPS=0 pip install 'asyncrl[deepspeed]'"
            ) from err

        on_cuda = get_accelerator().device_name() == "cuda"
        if not on_cuda:
            _skip_inference_comm_op()
        if not torch.distributed.is_initialized():
            if world != 1:
                raise RuntimeError(
                    f"DeepSpeedBackend(world={world}) needs an initialized process group "
                    f"(Ray Train's TorchConfig or torchrun); none exists in this process"
                )
            _single_process_env()
        # adopts an existing process group (Ray Train / torchrun); else creates a 1-rank one
        deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo")
        got = torch.distributed.get_world_size()
        if got != world:
            raise RuntimeError(f"process group has {got} ranks but the learner was told world={world}")

        self.tc = tc
        self.world = world
        self.zero_stage = zero_stage
        self.rank = torch.distributed.get_rank()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.engine = engine
        #: what the forward pass calls; accepts the HF model's keyword arguments
        self.model: torch.nn.Module = engine
        #: the unwrapped HF model (full weights on every rank)
        self.module: torch.nn.Module = engine.module
        self.device = engine.device

    # --- the LearnerBackend protocol ---------------------------------------------------------
    def base_lr(self, step: int) -> float:
        return scheduled_lr(self.tc, step)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward plus ZeRO's gradient reduce(-scatter); gradients were zeroed by the last step."""
        self.engine.backward(loss)

    def gradients(self) -> list[torch.Tensor]:
        raise RuntimeError(
            "DeepSpeed ZeRO partitions gradients over ranks, so no rank holds the full gradients; "
            "gradient-transform controllers need pipeline.backend=ddp"
        )

    def clip_and_norm(self, max_norm: float) -> float:
        """Global L2 norm of this step's gradients before clipping; the clip happens in :meth:`step`.

        ``max_norm`` must equal ``train.grad_clip`` (it is baked into the DeepSpeed config).
        """
        configured = self.engine.gradient_clipping()
        if abs(float(max_norm) - float(configured)) > 1e-12 and not (max_norm <= 0 and configured == 0):
            raise ValueError(
                f"DeepSpeed clips at gradient_clipping={configured} (train.grad_clip at build); "
                f"got max_norm={max_norm}"
            )
        optimizer = self.engine.optimizer
        norm = optimizer.scaled_global_norm() / optimizer.loss_scale
        return float(norm)

    def step(self, step: int, scale: float) -> float:
        """One ZeRO step at ``base_lr(step) * scale``; the scheduled LR is restored afterwards."""
        optimizer = self.engine.optimizer
        for group in optimizer.param_groups:
            group["lr"] = self.base_lr(step)
        with scaled_lr(optimizer, scale) as applied:
            self.engine.step()
        return applied[0]

    def state_dict(self) -> dict[str, Any]:
        """This rank's ZeRO partition (AdamW moments, fp32 master slice) and the layout it needs,
        as plain data (checkpoints store no pickled objects): ZeRO's loss scaler object becomes its
        scale, its stage enum an int, and its parameter-slice map (not read by a same-world restore)
        is left out."""
        zero = dict(self.engine.optimizer.state_dict())
        scaler = zero.pop("loss_scaler", None)
        zero.pop("param_slice_mappings", None)
        if "zero_stage" in zero:
            zero["zero_stage"] = int(zero["zero_stage"])
        return {
            "zero_optimizer": zero,
            "loss_scale": float(scaler.cur_scale) if scaler is not None else None,
            "global_steps": int(self.engine.global_steps),
            "global_samples": int(self.engine.global_samples),
            "rank": self.rank,
            "world": self.world,
            "zero_stage": self.zero_stage,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's partition; the model weights must already be the checkpoint's."""
        have = {"rank": self.rank, "world": self.world, "zero_stage": self.zero_stage}
        saved = {k: state.get(k) for k in _LAYOUT_KEYS}
        if saved != have:
            raise ValueError(
                f"this DeepSpeed checkpoint shard was written with {saved} but is being loaded with "
                f"{have}; resume with the same pipeline.learner_workers and pipeline.zero_stage, "
                f"each rank loading its own backend_rank<r> state"
            )
        # DeepSpeed takes every rank's state; a rigid (same-world) restore reads only its own entry.
        shards: list[Any] = [None] * self.world
        shards[self.rank] = state["zero_optimizer"]
        optimizer = self.engine.optimizer
        optimizer.load_state_dict(shards, load_optimizer_states=True, load_from_fp32_weights=True)
        if state.get("loss_scale") is not None:
            optimizer.loss_scaler.cur_scale = float(state["loss_scale"])
        self.engine.global_steps = int(state["global_steps"])
        self.engine.global_samples = int(state["global_samples"])
