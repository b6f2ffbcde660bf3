"""Teacher/student checkpoints on disk: plain HF directories, checked complete before use.

A checkpoint is what ``save_pretrained`` writes for a model and its tokenizer, plus (for
pretrained built-ins) ``asyncrl_meta.json`` recording task, preset, accuracy, seed and
library versions. Any ``AutoModelForCausalLM`` + tokenizer directory loads the same way
(``from_pretrained(dir, local_files_only=True)``); the meta file is only required to reuse
a cached pretraining result. Writes go to a temporary sibling directory that is renamed into
place, so an interrupted save never looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

META_FILE = "asyncrl_meta.json"
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class CheckpointError(FileNotFoundError):
    """A checkpoint directory is missing or incomplete; the message says how to make one."""


def missing_parts(path: str | Path, *, require_meta: bool = False) -> list[str]:
    """What a checkpoint directory lacks: a subset of ``config``, ``weights``, ``tokenizer``, ``meta``."""
    p = Path(path)
    if not p.is_dir():
        return ["directory"]
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config")
    if not any((p / f).is_file() for f in _WEIGHT_FILES):
        missing.append("weights")
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        missing.append("tokenizer")
    if require_meta and not (p / META_FILE).is_file():
        missing.append("meta")
    return missing


def check_complete(
    path: str | Path, *, role: str = "model", hint: str = "", require_meta: bool = False
) -> Path:
    """Raise ``CheckpointError`` naming what is missing (and ``hint``, how to make it); return the path."""
    p = Path(path)
    missing = missing_parts(p, require_meta=require_meta)
    if missing:
        what = (
            "does not exist" if missing == ["directory"] else f"is incomplete (missing: {', '.join(missing)})"
        )
        fix = hint or "save a model and its tokenizer there with save_pretrained(dir)"
        raise CheckpointError(f"{role} checkpoint {str(p)!r} {what}; {fix}")
    return p


def save_checkpoint(model: Any, tokenizer: Any, path: str | Path, meta: dict[str, Any]) -> Path:
    """Write model, tokenizer and ``asyncrl_meta.json`` to ``path`` atomically (replacing it)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}.", dir=p.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if p.exists():
            shutil.rmtree(p)
        os.replace(tmp, p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return p


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``asyncrl_meta.json`` of a checkpoint, or ``{}`` when it has none."""
    f = Path(path) / META_FILE
    return json.loads(f.read_text()) if f.is_file() else {}


def load_model(path: str | Path, *, role: str = "model", hint: str = "", dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a complete checkpoint directory, local files only, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = check_complete(path, role=role, hint=hint)
    model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    return model, tokenizer


def load_pair(teacher_dir: str | Path, student_dir: str | Path, *, hint: str = "") -> tuple[Any, Any, Any]:
    """``(teacher, student, tokenizer)`` from two checkpoint dirs that share one tokenizer.

    Raises ``CheckpointError`` when a directory is missing or incomplete and ``ValueError``
    when the two tokenizers' vocabularies differ (distillation compares distributions over
    the same token ids).
    """
    hint = hint or _pretrain_hint(teacher_dir, student_dir)
    teacher, t_tok = load_model(teacher_dir, role="teacher", hint=hint)
    student, s_tok = load_model(student_dir, role="student", hint=hint)
    tv, sv = t_tok.get_vocab(), s_tok.get_vocab()
    if tv != sv:
        only_t = sorted(set(tv) - set(sv))[:5]
        only_s = sorted(set(sv) - set(tv))[:5]
        moved = sorted(k for k in set(tv) & set(sv) if tv[k] != sv[k])[:5]
        raise ValueError(
            f"teacher tokenizer ({teacher_dir}) and student tokenizer ({student_dir}) differ: "
            f"{len(tv)} vs {len(sv)} tokens; only in teacher {only_t}, only in student {only_s}, "
            f"different ids {moved}. Distillation needs one shared vocabulary: "
            f"pretrain both with the same tokenizer"
        )
    t_v = teacher.get_output_embeddings().weight.shape[0]
    s_v = student.get_output_embeddings().weight.shape[0]
    if t_v != s_v:
        raise ValueError(
            f"teacher and student output vocabularies differ ({t_v} vs {s_v} logits); "
            f"resize them to the same vocabulary"
        )
    return teacher, student, s_tok


def _pretrain_hint(*dirs: str | Path) -> str:
    """Suggest the pretrain command when a path looks like ``<cache>/<task>-<preset>-s<seed>/...``."""
    for d in dirs:
        parent = Path(d).parent.name
        parts = parent.rsplit("-s", 1)
        if len(parts) == 2 and parts[1].isdigit() and "-" in parts[0]:
            task, preset = parts[0].split("-", 1)
            return f"run `asyncrl pretrain --task {task} --preset {preset} --seed {parts[1]}`"
    return "run `asyncrl pretrain --task X --preset Y`, or point to a directory written by save_pretrained"
