"""GGUF files as checkpoints: a ``.gguf`` file converted once to a safetensors directory.

A GGUF file (llama.cpp's format: weights, often quantised, plus the config and the tokenizer as
metadata) is read with transformers' GGUF reader (``from_pretrained(dir, gguf_file=name)``, the
``gguf`` package) and dequantised to float32. A GGUF-loaded model refuses ``save_pretrained``,
so its state dict is copied (strictly, every key) into a fresh model of its config, which is
saved with the tokenizer the file describes, chat template included, as a checkpoint directory
(``checkpoints.save_checkpoint``: atomic; ``asyncrl_meta.json`` records the source file, its
size and mtime, and the library versions). The rest of asyncrl only ever sees that directory.

* ``gguf_to_checkpoint(gguf_file, out_dir)``: convert one file to ``out_dir``.
* ``materialize(path, cache_dir)``: what ``workload.teacher_path`` / ``workload.student_path``
  go through (``asyncrl.plan.resolve_models``, in the driver before any stage or learner
  process starts): a directory is returned as it is; a GGUF file is converted once into
  ``<cache_dir>/gguf/<stem>-<hash>``, keyed by its resolved path, size and mtime, and the
  converted directory is reused while the file is unchanged (a changed file converts afresh;
  an interrupted conversion never looks complete). Errors are one line naming the field, the
  file and the fix: a missing file, a file that is not GGUF, an architecture transformers'
  GGUF reader cannot build.

Architectures: those transformers 5.24's GGUF reader builds as a causal LM (``architectures()``:
llama, mistral, qwen2, qwen2moe, qwen3, qwen3moe, phi3, gpt2, gemma2/3/4, falcon, bloom,
stablelm, starcoder2, nemotron, mamba, deci, gpt-oss, minimax-m2, lfm2, qwen35, qwen35moe).
Tested here (unit_tests/test_workloads_gguf.py, logits and token ids against the original
model): **llama, qwen2, qwen3 and gpt2**, F32 and Q8_0 tensors; SmolLM2-135M-Instruct (llama,
Q4_1) by hand. Three config fields the reader drops are restored from the file's metadata
(``_restore_config``): Qwen3's ``head_dim`` (``attention.key_length``; the reader leaves
``Qwen3Config``'s default of 128), GPT-2's ``n_positions`` and ``n_inner``. The converted
directory loads like any other checkpoint: the learner's ``checkpoints.load_model`` and the HF
engine (its fast ``LlamaDecoder`` for llama and qwen3, transformers' forward for the others).

The tokenizer is what transformers builds from the file's vocabulary and merges
(``tokenizer.ggml.*``); a pre-tokenizer transformers has no entry for (``tokenizer.ggml.pre``,
e.g. SmolLM2's ``smollm``) falls back to the byte-level default of its tokenizer type.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import platform
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from asyncrl.configurable import ConfigError

GGUF_MAGIC = b"GGUF"
#: ``materialize``'s cache, under ``cache_dir``
CACHE_SUBDIR = "gguf"
#: GGUF architecture names whose transformers name differs (transformers' own aliases)
_ALIASES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}
#: architectures transformers' reader knows that are not causal LMs (encoder-decoders)
_NOT_CAUSAL = {"t5", "t5encoder", "umt5"}


def architectures() -> list[str]:
    """GGUF ``general.architecture`` values that transformers' reader builds as a causal LM."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_CONFIG_ARCHS)
    names |= {k for k, v in _ALIASES.items() if v in names}
    return sorted(names - {"general", "tokenizer"} - _NOT_CAUSAL)


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _fail(field: str | None, path: Path, fix: str) -> Exception:
    """The one-line error: a ``ConfigError`` naming ``field`` when the path came from a config."""
    return ConfigError(field, str(path), fix) if field else ValueError(f"GGUF file {str(path)!r}: {fix}")


def read_metadata(gguf_file: str | Path, *, field: str | None = None) -> dict[str, Any]:
    """The file's metadata (arrays as their lengths), after checking that it exists, is GGUF and
    has an architecture transformers can build; one-line errors naming ``field`` and the fix."""
    p = Path(gguf_file)
    if not p.is_file():
        raise _fail(
            field,
            p,
            "the GGUF file does not exist; give the path of a .gguf file, or a checkpoint directory "
            "written by save_pretrained",
        )
    if not is_gguf(p):
        raise _fail(
            field,
            p,
            "not a GGUF file (it does not start with the GGUF magic bytes); give a .gguf file (llama.cpp's "
            "format) or a checkpoint directory written by save_pretrained",
        )
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        metadata, _ = read_gguf_metadata(str(p))
    except Exception as err:  # truncated or a GGUF version the reader does not handle
        raise _fail(
            field, p, f"its GGUF header does not read ({_one_line(err)}); download or convert the file again"
        ) from None
    arch = metadata.get("general.architecture")
    supported = architectures()
    if arch not in supported:
        raise _fail(
            field,
            p,
            f"architecture {arch!r} is not one transformers' GGUF reader builds as a causal LM "
            f"(supported: {', '.join(supported)}); convert the model to a safetensors checkpoint directory "
            f"(save_pretrained) and give that directory",
        )
    return metadata


def gguf_to_checkpoint(gguf_file: str | Path, out_dir: str | Path, *, field: str | None = None) -> Path:
    """Convert ``gguf_file`` to a float32 safetensors checkpoint directory at ``out_dir`` (replaced
    atomically); returns ``out_dir``. See the module docstring. ``field``: the config field the
    path came from, named by the one-line errors (``ConfigError``; else ``ValueError``)."""
    src = Path(gguf_file).resolve()
    metadata = read_metadata(src, field=field)
    t0 = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from asyncrl.workloads.checkpoints import save_checkpoint

    stat = src.stat()
    kw: dict[str, Any] = {"gguf_file": src.name, "local_files_only": True}
    try:
        config = _restore_config(AutoConfig.from_pretrained(str(src.parent), **kw), metadata)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(src.parent),
            config=config,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),  # never packed GGUF blocks
            **kw,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kw)
    except Exception as err:
        raise _fail(
            field,
            src,
            f"transformers could not load it ({type(err).__name__}: {_one_line(err)}); convert the model "
            f"to a safetensors checkpoint directory (save_pretrained) and give that directory",
        ) from None
    # A GGUF-loaded model refuses save_pretrained: copy its weights into a plain model of its config.
    clean = copy.deepcopy(loaded.config)
    if hasattr(clean, "quantization_config"):  # else config.json would ask for the GGUF loader again
        del clean.quantization_config
    clean.name_or_path = ""
    with _no_init():  # every parameter is overwritten next: skip the random init (seconds at 135M)
        model = AutoModelForCausalLM.from_config(clean, dtype=torch.float32)
    model.tie_weights()  # no_init_weights skips the tying too
    state = loaded.state_dict()
    model.load_state_dict(state, strict=True)  # every key, every shape; tied embeddings stay tied
    bad = [
        k for k, v in model.state_dict().items() if v.dtype != torch.float32 or not torch.equal(v, state[k])
    ]
    if bad:
        raise RuntimeError(f"GGUF conversion of {src}: weights {bad[:3]} did not copy as float32")
    if loaded.generation_config is not None:
        model.generation_config = copy.deepcopy(loaded.generation_config)
    del loaded, state
    template = metadata.get("tokenizer.chat_template")
    meta = {
        "source": {
            "format": "gguf",
            "file": str(src),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "architecture": metadata.get("general.architecture"),
            "name": metadata.get("general.name"),
            "file_type": metadata.get("general.file_type"),
        },
        "model_type": model.config.model_type,
        "dtype": "float32",
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "chat_template": bool(template),
        "convert_s": round(time.perf_counter() - t0, 2),
        "versions": _versions(torch, transformers),
    }
    pre = metadata.get("tokenizer.ggml.pre")
    return save_checkpoint(model, _CheckedTokenizer(tokenizer, template, pre, src), out_dir, meta)


def _restore_config(config: Any, metadata: dict[str, Any]) -> Any:
    """Put back the config fields transformers' GGUF reader drops, from the file's metadata."""
    arch = metadata.get("general.architecture")

    def key(name: str) -> Any:
        return metadata.get(f"{arch}.{name}")

    if config.model_type == "qwen3" and key("attention.key_length"):
        config.head_dim = int(key("attention.key_length"))
    if config.model_type == "gpt2":
        if key("context_length"):
            config.n_positions = int(key("context_length"))
        if key("feed_forward_length"):
            config.n_inner = int(key("feed_forward_length"))
    return config


#: text the saved tokenizer must encode as the one built from the file does
_PROBE = ["Hello, world! 12 + 345 = 357\n\tcafé 東京 🙂  two  spaces", "<|im_start|>user\nhi<|im_end|>"]


class _CheckedTokenizer:
    """``save_checkpoint``'s tokenizer: saved under transformers' generic class
    (``checkpoints.GENERIC_TOKENIZER``), then loaded back from the directory (not renamed into
    place yet: a failed check leaves no checkpoint) and checked against the file.

    Why generic: the directory's ``tokenizer.json`` is the tokenizer transformers built from the
    file, and the generic class loads it as it is; saved under a model-specific class (e.g.
    ``GPT2Tokenizer``) it would be rebuilt on load from the vocabulary and merges alone, with that
    class's own pre-tokenizer. For the model types ``AutoTokenizer`` overrides whatever the
    directory says (qwen2 and qwen3 among them) it is rebuilt so anyway: when that encodes
    differently from the file's own (``tokenizer.ggml.pre``), a warning says so. The chat
    template the file carries must survive (an error if not)."""

    def __init__(self, tokenizer: Any, template: str | None, pre: str | None, src: Path) -> None:
        self.tokenizer, self.template, self.pre, self.src = tokenizer, template, pre, src

    def save_pretrained(self, path: str | Path) -> Any:
        from asyncrl.workloads.checkpoints import GENERIC_TOKENIZER, load_tokenizer

        files = self.tokenizer.save_pretrained(path)
        f = Path(path) / "tokenizer_config.json"
        config = json.loads(f.read_text(encoding="utf-8"))
        config["tokenizer_class"] = GENERIC_TOKENIZER
        for key in ("is_local", "local_files_only"):  # how it was loaded, not what it is
            config.pop(key, None)
        f.write_text(
            json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        saved = load_tokenizer(path)  # as every process of a run will load it
        if self.template and saved.chat_template != self.template:
            raise RuntimeError(
                f"GGUF conversion of {self.src}: the saved tokenizer lost the file's chat template"
            )
        if saved(_PROBE)["input_ids"] != self.tokenizer(_PROBE)["input_ids"]:
            warnings.warn(
                f"GGUF conversion of {self.src}: transformers loads the converted checkpoint's tokenizer "
                f"as {type(saved).__name__}, whose own pre-tokenizer encodes text differently from the "
                f"tokenizer the file describes (tokenizer.ggml.pre={self.pre!r}); runs use "
                f"{type(saved).__name__}'s encoding",
                stacklevel=4,
            )
        return files


def cached_dir(gguf_file: str | Path, cache_dir: str | Path) -> Path:
    """``<cache_dir>/gguf/<stem>-<hash>``: where ``materialize`` keeps the file's conversion
    (hash of the resolved path, size and mtime: a changed file gets a new directory)."""
    src = Path(gguf_file).resolve()
    st = src.stat()
    key = f"{src}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return Path(cache_dir) / CACHE_SUBDIR / f"{src.stem}-{hashlib.blake2b(key, digest_size=6).hexdigest()}"


def materialize(path: str | Path, cache_dir: str | Path, *, field: str = "model path") -> str:
    """A checkpoint directory for ``path``: a directory (or a path that does not exist and is not
    a ``.gguf``, for ``checkpoints.check_complete`` to name) is returned as it is; a GGUF file is
    converted once (``gguf_to_checkpoint``) into ``cached_dir`` and that directory returned, reused
    while the file keeps its path, size and mtime. Any other file is a one-line ``ConfigError``
    naming ``field``."""
    p = Path(path).expanduser()
    if p.is_dir() or (not p.exists() and p.suffix.lower() != ".gguf"):
        return str(path)
    if not p.is_file() or not is_gguf(p):
        read_metadata(p, field=field)  # raises: missing, or not a GGUF file
    from asyncrl.workloads.checkpoints import missing_parts, read_meta

    target = cached_dir(p, cache_dir)

    def done() -> bool:
        return (
            not missing_parts(target, require_meta=True)
            and read_meta(target).get("source", {}).get("mtime_ns") == p.resolve().stat().st_mtime_ns
        )

    if not done():
        with _lock(target):  # one conversion when several drivers ask at once
            if not done():
                gguf_to_checkpoint(p, target, field=field)
    return str(target)


def _no_init() -> Any:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # another transformers layout: initialise, only slower
        return nullcontext()
    return no_init_weights()


@contextmanager
def _lock(target: Path):
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _versions(torch: Any, transformers: Any) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        gguf_version = version("gguf")
    except PackageNotFoundError:
        gguf_version = "unknown"
    return {
        "asyncrl": version("asyncrl"),  # asyncrl.__version__, without importing the package's API
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": gguf_version,
        "python": platform.python_version(),
    }


def _one_line(err: BaseException | str, limit: int = 200) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = [
    "CACHE_SUBDIR",
    "architectures",
    "cached_dir",
    "gguf_to_checkpoint",
    "is_gguf",
    "materialize",
    "read_metadata",
]
