"""LoRA students: the learner trains low-rank adapters only, and only the adapters travel.

``train.lora: {r, alpha, dropout, target_modules}`` (None: full fine-tuning) wraps the student
in ``peft``'s LoRA (no hand-written LoRA layers): every targeted linear layer ``W`` becomes
``W x + (alpha / r) B A x`` with ``A`` [r, d_in] (Kaiming-uniform init, seeded by the run seed) and
``B`` [d_out, r] (zeros, so version 0 is the base model exactly). The base weights are frozen, so
the optimizer, the gradient and the backend see the adapters only; ``asyncrl.step.loss_step``
is unchanged (it sees a model).

Publication ships the adapter tensors only (``adapter_state``: peft's adapter state dict, the
keys without the adapter name): the PolicyStore holds one adapter per version, and an engine
holds the base weights once (read from the same student checkpoint) and applies each adapter
version (``asyncrl.engines.hf``: merged into its base weights for the fast decode path, or as
unmerged adapters). Checkpoints hold the adapters (peft's ``save_pretrained``); a resume reads
the base from the student checkpoint and the adapters from the checkpoint.

Importing this module never imports peft; the functions that build or read adapters do.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.configurable import check, field

if TYPE_CHECKING:  # config.py imports this module and must not import torch (asyncrl.config)
    import torch

#: peft's adapter name for the one adapter a student carries
ADAPTER = "default"
#: the file peft's ``save_pretrained`` writes the adapter tensors to
ADAPTER_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRAConfig:
    r: int = field(8, help="adapter rank r (A is [r, d_in], B is [d_out, r])")
    alpha: float = field(16.0, help="scale numerator: the update is (alpha / r) B A")
    dropout: float = field(
        0.0,
        help="dropout on the adapters' input in the learner's forward; > 0 makes pi_theta differ from the "
        "engines' pi_b (which sample without dropout) even at lag 0",
    )
    target_modules: tuple[str, ...] = field(
        ("all-linear",),
        help="module names to adapt (e.g. [q_proj, v_proj]); ['all-linear']: every linear layer but the "
        "LM head",
    )

    def __post_init__(self) -> None:
        check(self.r >= 1, "r", self.r, "use a rank >= 1")
        check(self.alpha > 0, "alpha", self.alpha, "use a positive scale numerator, e.g. 2 * r")
        check(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "use a probability in [0, 1)")
        check(
            len(self.target_modules) >= 1, "target_modules", self.target_modules, "name at least one module"
        )

    def peft_config(self) -> Any:
        """The ``peft.LoraConfig`` of this config."""
        from peft import LoraConfig

        targets: Any = self.target_modules
        targets = "all-linear" if tuple(targets) == ("all-linear",) else list(targets)
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )

    def options(self) -> dict[str, Any]:
        """This config as engine options (``pipeline.engine_options`` of the generators)."""
        return {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": list(self.target_modules),
        }


def as_config(lora: LoRAConfig | Mapping[str, Any]) -> LoRAConfig:
    """A ``LoRAConfig`` from itself or its ``options()`` (how engines receive it)."""
    if isinstance(lora, LoRAConfig):
        return lora
    from asyncrl.configurable import from_dict

    return from_dict(LoRAConfig, dict(lora))


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (its publishable weights are its adapters)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def apply_lora(model: torch.nn.Module, lora: LoRAConfig | Mapping[str, Any], *, seed: int) -> torch.nn.Module:
    """``model`` wrapped in peft's LoRA: base weights frozen, adapters trainable, ``A`` drawn from a
    generator seeded with ``seed`` (the process's RNG is left as it was), ``B = 0``."""
    import torch
    from peft import get_peft_model

    cfg = as_config(lora)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft 0.21 asks transformers 5.24 for `is_gradient_checkpointing`, which warns that it is
        # deprecated: a note between the two libraries, printed by every process that wraps a model
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, cfg.peft_config())
    return peft_model


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of a peft ``model`` (no copy): what a LoRA run publishes and fingerprints."""
    return {key: p for key, p in _adapter_params(model)}


def _adapter_params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(key, parameter)`` of every adapter tensor, keyed as peft's ``get_peft_model_state_dict``
    keys them (the parameter name without the adapter name; checked equal by a unit test). Found
    once per model: peft's function walks the whole state dict (base weights too) on every call,
    which made a publication of the ``small`` student's adapters cost 3x the full weights' copy."""
    cached = getattr(model, "_asyncrl_adapter_params", None)
    if cached is None:
        cached = [
            (name.replace(f".{ADAPTER}.", "."), p)
            for name, p in model.named_parameters()
            if ".lora_A." in name or ".lora_B." in name
        ]
        model._asyncrl_adapter_params = cached  # type: ignore[assignment]
    return cached


def policy_state(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """The tensors that define a model's policy, uncopied: ``model.state_dict()``, or a LoRA
    student's adapters. What the learner publishes (``asyncrl.coordinator.publishable_state``) and
    what the provenance fingerprint is taken over, in the learner and in every engine."""
    return adapter_state(model) if is_lora(model) else model.state_dict()


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter tensors (``adapter_state`` of a model with the same LoRA config) into ``model``;
    every adapter tensor of ``model`` must be given, and nothing else."""
    import torch

    state = {(k[7:] if k.startswith("module.") else k): v for k, v in state.items()}
    params = _adapter_params(model)
    have = {key for key, _ in params}
    missing, unexpected = sorted(have - set(state)), sorted(set(state) - have)
    if missing or unexpected:
        raise ValueError(
            f"adapter state does not match the engine's LoRA adapters: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}; the learner and the engines must use the same train.lora and student"
        )
    with torch.no_grad():  # what peft's set_peft_model_state_dict does for LoRA, without its state-dict walk
        for key, p in params:
            if state[key].shape != p.shape:
                raise ValueError(
                    f"adapter {key!r} has shape {tuple(state[key].shape)}, expected {tuple(p.shape)}"
                )
            p.copy_(state[key])


def read_adapter(directory: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors peft's ``save_pretrained`` wrote to ``directory`` (safetensors; no pickle)."""
    from safetensors.torch import load_file

    path = Path(directory, ADAPTER_FILE)
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is missing: a LoRA run's checkpoint holds its adapters there "
            f"(peft save_pretrained)"
        )
    return load_file(str(path))


def lora_modules(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(name, layer)`` of every peft LoRA layer in ``model``."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def train_dropout(model: torch.nn.Module) -> None:
    """Put the adapters' dropout modules in train mode (the rest of the learner stays in eval mode)."""
    for _, layer in lora_modules(model):
        for drop in layer.lora_dropout.values():
            drop.train()


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a weight publication (tied keys counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in state.values():
        key = (t.data_ptr(), t.numel())
        if key in seen and t.numel():
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


__all__ = [
    "LoRAConfig",
    "adapter_state",
    "apply_lora",
    "as_config",
    "is_lora",
    "load_adapter_state",
    "lora_modules",
    "policy_state",
    "read_adapter",
    "state_bytes",
    "train_dropout",
]
