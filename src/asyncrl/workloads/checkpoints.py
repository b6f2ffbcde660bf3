"""Teacher/student checkpoints on disk: plain HF directories, checked complete before use.

A checkpoint is what ``save_pretrained`` writes for a model and its tokenizer, plus (for
pretrained built-ins) ``asyncrl_meta.json`` recording task, preset, accuracy, seed and
library versions. Any ``AutoModelForCausalLM`` + tokenizer directory loads the same way
(``from_pretrained(dir, local_files_only=True)``); the meta file is only required to reuse
a cached pretraining result. Writes go to a temporary sibling directory that is renamed into
place, so an interrupted save never looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch itself is imported where a model loads: the CLI checks files first
    import torch

META_FILE = "asyncrl_meta.json"
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin")  # shards
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def run_dir_for(task: str, preset: str, seed: int, cache_dir: str | Path = ".asyncrl_cache") -> Path:
    """``cache_dir/<task>-<preset>-s<seed>``: where ``pretrain`` puts (and looks for) a pair."""
    return Path(cache_dir) / f"{task}-{preset}-s{seed}"


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


#: the generic tokenizer class that ``AutoTokenizer`` returns as named for any model type outside
#: its override lists (transformers 5: what ``save_pretrained`` of a ``tokenizers`` tokenizer writes)
GENERIC_TOKENIZER = "TokenizersBackend"


def load_tokenizer(path: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``, without importing the
    model's modelling code where that cannot change the result.

    Why: ``AutoTokenizer`` always loads the model's config class (``AutoConfig``) to choose the
    tokenizer class, and in transformers 5 that imports the modelling stack (torch.distributed,
    dynamo, scipy): about 1.7 s of CPU in every process that only needs a tokenizer, such as
    the driver and Ray Train's controller, which all start at once on the same cores. When
    ``tokenizer_config.json`` names ``GENERIC_TOKENIZER`` without ``auto_map`` and
    ``config.json``'s model type is on none of ``AutoTokenizer``'s override lists (model types
    with a wrong hub class, Mistral's own backend), ``AutoTokenizer`` returns that class as it
    is, so it is loaded directly. Everything else goes through ``AutoTokenizer``."""
    p = Path(path)
    if _generic_tokenizer(p):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(p), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p), local_files_only=True)


#: ``shared_tokenizer``'s per-process cache: directory signature -> tokenizer
_SHARED_TOKENIZERS: dict[tuple[Any, ...], Any] = {}
_SHARED_LOCK = threading.Lock()


def shared_tokenizer(path: str | Path) -> Any:
    """``load_tokenizer(path)``, loaded once per process and shared by every caller: read-only.

    Why: one process of a run builds several parts that each need a tokenizer of the pair (a
    generator, the reward scorer, the step logger, the pair check, the prompt plan). At a real
    vocabulary every load parses and copies the whole BPE model (Qwen's 151k tokens: 1.2-1.3 s
    per load after the first), so a learner process that loaded it four times spent seconds of
    its start-up on copies of one object.

    Sharing is safe because asyncrl's own code only decodes and encodes without padding or
    truncation: neither changes the Rust backend (``set_truncation_and_padding`` leaves it as
    is when both are off), and the backend's reads take shared borrows, so threads of one
    process (the colocated rollout thread beside the learner) may use it at once. A caller that
    pads, truncates, adds tokens or sets attributes must use ``load_tokenizer`` (a private
    copy). Directories whose tokenizer files are byte-identical share one instance (a teacher
    and a student saved with the same tokenizer) where ``load_tokenizer`` reads nothing else
    (``GENERIC_TOKENIZER``); any other directory is keyed by its path and its files' size, mtime
    and inode. Either way a directory re-saved in place loads afresh."""
    p = Path(path).resolve()
    try:
        key = _tokenizer_key(p)
    except OSError:  # not a readable directory: let load_tokenizer raise its own error
        return load_tokenizer(p)
    with _SHARED_LOCK:  # one load per key even when two threads ask at once
        tok = _SHARED_TOKENIZERS.get(key)
        if tok is None:
            tok = _SHARED_TOKENIZERS[key] = load_tokenizer(p)
    return tok


#: files of a checkpoint directory that ``load_tokenizer``'s ``GENERIC_TOKENIZER`` path does not
#: read (of config.json only the model type, which the key holds)
_NOT_TOKENIZER_FILES = frozenset({"config.json", "generation_config.json", META_FILE})


def _tokenizer_key(p: Path) -> tuple[Any, ...]:
    """``shared_tokenizer``'s cache key for the resolved directory ``p`` (OSError if unreadable)."""
    entries = sorted(
        (e.name, e.stat())
        for e in os.scandir(p)
        if e.is_file() and e.name not in _WEIGHT_FILES and not e.name.endswith(_WEIGHT_SUFFIXES)
    )
    if not _generic_tokenizer(p):  # AutoTokenizer may read anything there (remote code too)
        return ("path", str(p), tuple((n, st.st_size, st.st_mtime_ns, st.st_ino) for n, st in entries))
    digest = hashlib.blake2b(digest_size=16)
    for name, _ in entries:
        if name not in _NOT_TOKENIZER_FILES:
            digest.update(f"{name}\0".encode())
            digest.update((p / name).read_bytes())
            digest.update(b"\0")
    model_cfg = json.loads((p / "config.json").read_text())
    return ("generic", digest.hexdigest(), model_cfg.get("model_type"), model_cfg.get("model_name"))


def _generic_tokenizer(p: Path) -> bool:
    """``load_tokenizer``'s test: would ``AutoTokenizer`` load ``p`` as ``GENERIC_TOKENIZER``?"""
    try:
        tok_cfg = json.loads((p / "tokenizer_config.json").read_text())
        model_cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if tok_cfg.get("tokenizer_class") != GENERIC_TOKENIZER or "auto_map" in tok_cfg:
        return False
    from transformers.models.auto import tokenization_auto as auto

    model_type = model_cfg.get("model_type") or ""
    names = {model_type, model_cfg.get("model_name") or ""}
    overridden = auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    registered = auto.TOKENIZER_MAPPING_NAMES.get(model_type) or ""
    return bool(model_type) and not (names & overridden) and "Mistral" not in registered


def load_model(path: str | Path, *, role: str = "model", hint: str = "", dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` from a complete checkpoint directory, local files only, eval mode;
    ``dtype`` None: float32."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if dtype is None else dtype

    p = check_complete(path, role=role, hint=hint)
    model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, dtype=dtype).eval()
    return model, load_tokenizer(p)


def load_pair(teacher_dir: str | Path, student_dir: str | Path, *, hint: str = "") -> tuple[Any, Any, Any]:
    """``(teacher, student, tokenizer)`` from two checkpoint dirs that share one tokenizer.

    Raises ``CheckpointError`` when a directory is missing or incomplete and ``ValueError``
    when the two tokenizers' vocabularies differ (distillation compares distributions over
    the same token ids).
    """
    hint = hint or _pretrain_hint(teacher_dir, student_dir)
    teacher, t_tok = load_model(teacher_dir, role="teacher", hint=hint)
    student, s_tok = load_model(student_dir, role="student", hint=hint)
    _check_same_vocab(teacher_dir, student_dir, t_tok, s_tok)
    t_v = teacher.get_output_embeddings().weight.shape[0]
    s_v = student.get_output_embeddings().weight.shape[0]
    if t_v != s_v:
        raise ValueError(
            f"teacher and student output vocabularies differ ({t_v} vs {s_v} logits); "
            f"resize them to the same vocabulary"
        )
    return teacher, student, s_tok


def weight_problems(path: str | Path) -> list[str]:
    """Truncated or malformed safetensors weight files in a checkpoint directory (headers only).

    A safetensors file is an 8-byte header length, a JSON header with every tensor's byte range,
    then the data: the file must be exactly as long as the last range ends."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            return [f"{index.name} is not a safetensors index (no weight_map)"]
    elif (p / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        return []  # pytorch_model.bin: transformers reads it with weights_only=True
    out = []
    for name in names:
        f = p / name
        if not f.is_file():
            out.append(f"{name} is missing")
            continue
        size = f.stat().st_size
        try:
            with f.open("rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if size < 8 or n > size - 8:
                    raise ValueError("header length beyond the end of the file")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            out.append(f"{name} is not a safetensors file ({err})")
            continue
        if size != 8 + n + end:
            out.append(f"{name} is truncated ({size} bytes, its header describes {8 + n + end})")
    return out


def model_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory (CheckpointError naming it when it is not JSON)."""
    f = Path(path) / "config.json"
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{f} is not JSON ({err}); re-save the model with save_pretrained") from None


def context_length(path: str | Path) -> int | None:
    """The model's ``max_position_embeddings`` (prompt + completion tokens it can attend), if it says."""
    value = model_config(path).get("max_position_embeddings")
    return int(value) if value else None


def check_pair(teacher_dir: str | Path, student_dir: str | Path, *, hint: str = "") -> Any:
    """``load_pair``'s checks without loading any weights: both directories complete, weight files
    intact, one vocabulary (tokenizers and output sizes). Returns the student's tokenizer.

    What ``asyncrl validate`` and the driver run before any stage or learner process starts."""
    hint = hint or _pretrain_hint(teacher_dir, student_dir)
    toks = {}
    for role, d in (("teacher", teacher_dir), ("student", student_dir)):
        check_complete(d, role=role, hint=hint)
        bad = weight_problems(d)
        if bad:
            raise CheckpointError(f"{role} checkpoint {str(d)!r}: {bad[0]}; re-save it with save_pretrained")
        try:
            toks[role] = shared_tokenizer(d)
        except Exception as err:  # tokenizer files that do not parse: name the directory
            reason = " ".join(str(err).split())[:200]
            raise CheckpointError(
                f"{role} checkpoint {str(d)!r}: its tokenizer does not load ({reason}); "
                f"re-save it with tokenizer.save_pretrained"
            ) from None
    if Path(teacher_dir).resolve() != Path(student_dir).resolve():
        _check_same_vocab(teacher_dir, student_dir, toks["teacher"], toks["student"])
        t_v, s_v = model_config(teacher_dir).get("vocab_size"), model_config(student_dir).get("vocab_size")
        if t_v is not None and s_v is not None and t_v != s_v:
            raise ValueError(
                f"teacher and student output vocabularies differ ({t_v} vs {s_v} logits in config.json); "
                f"resize them to the same vocabulary"
            )
    return toks["student"]


def _check_same_vocab(teacher_dir: Any, student_dir: Any, t_tok: Any, s_tok: Any) -> None:
    tv, sv = t_tok.get_vocab(), s_tok.get_vocab()
    if tv != sv:
        only_t = sorted(set(tv) - set(sv))[:5]
        only_s = sorted(set(sv) - set(tv))[:5]
        moved = sorted(k for k in set(tv) & set(sv) if tv[k] != sv[k])[:5]
        raise ValueError(
            f"teacher tokenizer ({teacher_dir}) and student tokenizer ({student_dir}) differ: "
            f"teacher vocabulary {len(tv)} tokens vs student vocabulary {len(sv)} tokens; only in teacher "
            f"{only_t}, only in student {only_s}, different ids {moved}. Distillation compares "
            f"distributions over one vocabulary: give a teacher and a student saved with the same "
            f"tokenizer (e.g. a student built from the teacher, or pretrain both with one tokenizer)"
        )


def _pretrain_hint(*dirs: str | Path) -> str:
    """Suggest the pretrain command when a path looks like ``<cache>/<task>-<preset>-s<seed>/...``."""
    for d in dirs:
        parent = Path(d).parent.name
        parts = parent.rsplit("-s", 1)
        if len(parts) == 2 and parts[1].isdigit() and "-" in parts[0]:
            task, preset = parts[0].split("-", 1)
            return f"run `asyncrl pretrain --task {task} --preset {preset} --seed {parts[1]}`"
    return "run `asyncrl pretrain --task X --preset Y`, or point to a directory written by save_pretrained"
