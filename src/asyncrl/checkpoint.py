"""Learner checkpoints: what a run directory must hold to resume exactly, stored without pickle.

A checkpoint directory (``RUN/checkpoints/<session>/step_<v>/``) holds the model (``model/``,
``save_pretrained`` safetensors), the backend's optimizer state, the controllers' state, RNG
states, the sample ledger (ids of every sample consumed so far: a resumed run never trains one
twice) and counters, plus the coordinator's admission books. Ray Train copies the directory
each rank reports into the same folder, which is how sharded (ZeRO) backends add one
``backend_rank<r>`` state per rank.

**No pickle.** Loading a run directory someone else wrote must not run their code, so nested
state (optimizer state dicts, controller state, RNG states) is written as a pair of files:
``<name>.json`` holds the structure (dicts, lists, tuples, numbers, strings) and
``<name>.safetensors`` the tensors it refers to (``write_state`` / ``read_state``); numpy arrays
are stored as tensors with their dtype; anything else is refused when the checkpoint is
*written*. The ledger is a ``.npy`` read with ``allow_pickle=False``; the model is read with
``use_safetensors=True``. A file that is not what its name says fails with a one-line
``CheckpointError`` naming it; nothing in a checkpoint is ever unpickled.

**Complete or ignored.** Ray Train copies a reported directory file by file, so a process that
dies mid-copy leaves a partial one. ``asyncrl_state.json`` lists every file rank 0 wrote with its
size (and whether per-rank shards exist); each state pair records its tensor file's size.
``latest`` returns the newest checkpoint that passes these checks (``problems``), so a torn
copy is never loaded.

**The learner's checkpoints.** ``Checkpointer`` says when one is due (``train.checkpoint_every``
and the last step) and saves it through Ray Train's ``report``, every rank its part; when the
numerics guard stops a run, its checkpoint is followed by ``RUN/abort.json`` (``write_abort``), which
the driver turns into the run's error.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from asyncrl.collectives import Collectives
    from asyncrl.step import NumericsGuard, StepParts

STATE_FILE = "asyncrl_state.json"
TRAINER_STATE = "trainer_state"  # + .json / .safetensors
LEDGER_FILE = "ledger.npy"
COORDINATOR_FILE = "coordinator.json"
MODEL_DIR = "model"
FORMAT = "asyncrl-state/1"


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or not in asyncrl's format; the message names it."""


SHARD_PREFIX = "backend_rank"


def backend_shard_name(rank: int) -> str:
    """Per-rank backend state of sharded backends (ZeRO partitions optimizer state by rank)."""
    return f"{SHARD_PREFIX}{rank}"


# --- nested state as JSON + safetensors ------------------------------------------------------------
_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__items__")


def _encode(x: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(x, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = x.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            raise TypeError(f"{where}: numpy object arrays cannot be stored without pickle")
        key = f"t{len(tensors)}"
        # safetensors/torch lack wide unsigned types: store them widened, restore the dtype on read
        stored = x.astype(np.int64) if x.dtype.kind == "u" and x.dtype.itemsize > 1 else x
        tensors[key] = torch.from_numpy(np.ascontiguousarray(stored)).clone()
        return {"__ndarray__": key, "dtype": x.dtype.str}
    if isinstance(x, np.generic):
        return _encode(x.item(), tensors, where)
    if x is None or isinstance(x, bool | int | float | str):
        return x
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in x):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in x.items()}
        items = [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in x.items()]
        return {"__items__": items}
    raise TypeError(
        f"{where}: a {type(x).__module__}.{type(x).__qualname__} cannot be stored in a checkpoint without "
        f"pickle; return tensors, numpy arrays, numbers, strings, lists, tuples or dicts from state_dict()"
    )


def _decode(x: Any, tensors: dict[str, torch.Tensor], where: Path) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensors, where) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tensor__" in x or "__ndarray__" in x:
        key = x.get("__tensor__", x.get("__ndarray__"))
        if key not in tensors:
            raise CheckpointError(f"{where} refers to tensor {key!r} that its .safetensors file lacks")
        if "__tensor__" in x:
            return tensors[key]
        return tensors[key].numpy().astype(np.dtype(x["dtype"]))
    if "__tuple__" in x:
        return tuple(_decode(v, tensors, where) for v in x["__tuple__"])
    if "__items__" in x:
        return {_hashable(_decode(k, tensors, where)): _decode(v, tensors, where) for k, v in x["__items__"]}
    return {k: _decode(v, tensors, where) for k, v in x.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list | tuple) else key


def write_state(directory: str | Path, name: str, state: Any) -> list[Path]:
    """Write ``state`` as ``<name>.json`` + ``<name>.safetensors`` in ``directory``; returns both paths.

    Raises ``TypeError`` naming the entry for anything but tensors, numpy arrays, numbers,
    strings, None, lists, tuples and dicts (keys: anything of those that is hashable)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, name)
    tensor_path = directory / f"{name}.safetensors"
    save_file(tensors, str(tensor_path))
    doc = {"format": FORMAT, "tensors_bytes": tensor_path.stat().st_size, "state": tree}
    json_path = directory / f"{name}.json"
    json_path.write_text(json.dumps(doc))
    return [json_path, tensor_path]


def state_problems(directory: str | Path, name: str) -> list[str]:
    """Why the ``name`` state pair in ``directory`` cannot be read (empty if it can)."""
    json_path, tensor_path = Path(directory, f"{name}.json"), Path(directory, f"{name}.safetensors")
    if not json_path.is_file():
        return [f"{json_path.name} is missing"]
    try:
        doc = json.loads(json_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return [f"{json_path.name} is not JSON (truncated, or not written by asyncrl)"]
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return [f"{json_path.name} is not an {FORMAT} file"]
    if not tensor_path.is_file():
        return [f"{tensor_path.name} is missing"]
    if tensor_path.stat().st_size != doc.get("tensors_bytes"):
        return [
            f"{tensor_path.name} has {tensor_path.stat().st_size} bytes, "
            f"{doc.get('tensors_bytes')} were written"
        ]
    return []


def read_state(directory: str | Path, name: str) -> Any:
    """Read a pair written by ``write_state``; ``CheckpointError`` names the bad file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    problems = state_problems(directory, name)
    if problems:
        raise CheckpointError(f"checkpoint state {Path(directory, name)}: {problems[0]}")
    json_path, tensor_path = Path(directory, f"{name}.json"), Path(directory, f"{name}.safetensors")
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{tensor_path} is not a readable safetensors file ({err})") from None
    return _decode(json.loads(json_path.read_text(encoding="utf-8"))["state"], tensors, json_path)


# --- one checkpoint --------------------------------------------------------------------------------
@dataclass
class Restored:
    """What ``load`` gives back besides the state it loads into the parts in place."""

    version: int
    counters: dict[str, int]
    ledger: np.ndarray


def seed_rngs(seed: int) -> None:
    """Seed the learner process's RNGs, the ones ``rng_state`` checkpoints."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict[str, Any]:
    """The learner process's RNG states (torch CPU, numpy's global, Python's)."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def save(
    path: Path,
    *,
    rank: int,
    world: int,
    model: torch.nn.Module,
    backend: Any,
    controllers: Any,
    version: int,
    ledger: np.ndarray,
    counters: dict[str, int],
    coordinator_state: dict[str, Any] | None,
    tokenizer: Any = None,
) -> None:
    """Write this rank's part of a checkpoint into ``path`` (rank 0 writes everything shared, and
    ``STATE_FILE`` with the manifest last). ``tokenizer`` is saved beside the model, so that
    ``MODEL_DIR`` is a complete checkpoint of its own (``from_pretrained``, ``asyncrl eval --model``)."""
    path.mkdir(parents=True, exist_ok=True)
    sharded = bool(getattr(backend, "sharded_state", False))
    if sharded:
        write_state(path, backend_shard_name(rank), backend.state_dict())
    if rank != 0:
        return
    model.save_pretrained(path / MODEL_DIR, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path / MODEL_DIR)
    write_state(
        path,
        TRAINER_STATE,
        {
            "backend": None if sharded else backend.state_dict(),
            "controllers": controllers.state_dict(),
            "rng": rng_state(),
        },
    )
    np.save(path / LEDGER_FILE, np.asarray(ledger, dtype=np.int64))
    if coordinator_state is not None:
        (path / COORDINATOR_FILE).write_text(json.dumps(coordinator_state, default=str))
    files = {
        p.relative_to(path).as_posix(): p.stat().st_size
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.name.startswith(SHARD_PREFIX)  # shards are checked by their own pairs
    }
    meta = {"step": version, "counters": counters, "world": world, "sharded": sharded, "files": files}
    (path / STATE_FILE).write_text(json.dumps(meta))


def problems(path: str | Path) -> list[str]:
    """Why the checkpoint at ``path`` is incomplete or unreadable (empty when it is complete)."""
    path = Path(path)
    try:
        meta = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"{STATE_FILE} is missing"]
    except (UnicodeDecodeError, json.JSONDecodeError):
        return [f"{STATE_FILE} is not JSON"]
    if not isinstance(meta, dict) or "files" not in meta:
        return [f"{STATE_FILE} has no file manifest: written by an older asyncrl (pickle format), not loaded"]
    out = []
    for name, size in meta["files"].items():
        f = path / name
        if not f.is_file():
            out.append(f"{name} is missing")
        elif f.stat().st_size != size:
            out.append(f"{name} has {f.stat().st_size} bytes, {size} were written")
    out += state_problems(path, TRAINER_STATE)
    if meta.get("sharded"):
        for r in range(int(meta.get("world", 1))):
            out += state_problems(path, backend_shard_name(r))
    return out


def load(path: str | Path, *, rank: int, backend: Any, controllers: Any) -> Restored:
    """Restore the backend, controllers and RNG from ``path`` in place; return version, counters, ledger."""
    path = Path(path)
    bad = problems(path)
    if bad:
        raise CheckpointError(f"checkpoint {path} is incomplete: {'; '.join(bad[:3])}")
    meta = json.loads((path / STATE_FILE).read_text())
    state = read_state(path, TRAINER_STATE)
    if meta.get("sharded"):
        if not Path(path, f"{backend_shard_name(rank)}.json").is_file():
            raise CheckpointError(
                f"checkpoint {path} has no {backend_shard_name(rank)} state: it was written with "
                f"{meta.get('world')} learner workers; resume with the same pipeline.learner_workers/backend"
            )
        backend.load_state_dict(read_state(path, backend_shard_name(rank)))
    else:
        backend.load_state_dict(state["backend"])
    controllers.load_state_dict(state["controllers"])
    set_rng_state(state["rng"])
    return Restored(version=int(meta["step"]), counters=dict(meta["counters"]), ledger=load_ledger(path))


def load_ledger(path: str | Path) -> np.ndarray:
    """Ids of every sample consumed up to the checkpoint (never unpickled)."""
    f = Path(path) / LEDGER_FILE
    try:
        ledger = np.load(f, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{f} is not an int64 .npy array of sample ids ({err})") from None
    if ledger.dtype.kind not in "iu" or ledger.ndim != 1:
        raise CheckpointError(f"{f} holds {ledger.dtype} {ledger.shape}, not a 1-D array of sample ids")
    return ledger.astype(np.int64)


def step_of(path: str | Path) -> int:
    return int(json.loads(Path(path, STATE_FILE).read_text())["step"])


def scan(run_dir: str | Path) -> list[tuple[int, Path, list[str]]]:
    """Every checkpoint under ``RUN/checkpoints`` as (step, path, problems), newest first."""
    found = []
    for state in Path(run_dir, "checkpoints").glob(f"**/{STATE_FILE}"):
        try:
            step = int(json.loads(state.read_text())["step"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            step = -1
        found.append((step, state.parent, problems(state.parent)))
    # ties (a step checkpointed by two sessions): the later session wins
    return sorted(found, key=lambda t: (t[0], t[1].parent.name, t[1].name), reverse=True)


def latest(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under RUN/checkpoints, or None."""
    for _, path, bad in scan(run_dir):
        if not bad:
            return path
    return None


# --- the learner's checkpoints ----------------------------------------------------------------------
#: why the learners stopped the run on purpose (``kind``: ``numerics``, the numerics guard, written by
#: rank 0; ``stream``, a stage of the rollout stream raised); the driver turns it into the run's error
ABORT_FILE = "abort.json"


class Checkpointer:
    """When a learner checkpoints (every ``every`` steps, 0 = never, and at the last step) and how:
    every rank writes its part (``save``) and reports it to Ray Train, which copies the parts into
    one ``step_<v>`` folder of the run's checkpoints. Every rank calls ``save``."""

    def __init__(
        self, comm: Collectives, *, every: int, steps: int, version: int, tokenizer: Any = None
    ) -> None:
        self.comm = comm
        self.tokenizer = tokenizer  # saved with the model (rank 0)
        self.every = every
        self.steps = steps
        self.last = version  # version of the latest checkpoint (the one resumed from, at start)

    def due(self, version: int) -> bool:
        if version >= self.steps:
            return True
        return self.every > 0 and version // self.every > self.last // self.every

    def save(
        self,
        version: int,
        parts: StepParts,
        ledger: list[np.ndarray],
        counters: dict[str, int],
        coordinator_state: dict[str, Any] | None,
        *,
        aborted: bool = False,
    ) -> None:
        """Checkpoint ``parts`` and the books at ``version``; rank 0 passes the
        coordinator's. ``aborted``: the numerics guard's, whose skipped samples enter the ledger as
        dropped; at the version of the latest checkpoint it goes to ``step_<v>_aborted`` beside it."""
        import tempfile

        import ray.train
        from ray.train import Checkpoint

        suffix = "_aborted" if aborted and self.last >= version else ""
        with tempfile.TemporaryDirectory() as tmp:
            save(
                Path(tmp),
                rank=self.comm.rank,
                world=self.comm.world,
                model=parts.backend.module,
                backend=parts.backend,
                controllers=parts.controllers,
                version=version,
                ledger=np.concatenate(ledger) if ledger else np.zeros(0, dtype=np.int64),
                counters=counters,
                coordinator_state=coordinator_state,
                tokenizer=self.tokenizer,
            )
            wrote = any(Path(tmp).iterdir())  # ranks > 0 write only a sharded backend's state
            ray.train.report(
                {"step": version},
                checkpoint=Checkpoint.from_directory(tmp) if wrote else None,
                checkpoint_dir_name=f"step_{version:06d}{suffix}",
            )
        self.comm.barrier()  # every shard is on storage before any rank moves on (and might fail)
        self.last = version


def write_abort(run_dir: str | Path, guard: NumericsGuard) -> None:
    """Leave why the numerics guard (a tripped ``asyncrl.step.NumericsGuard``) stopped the run, and
    where its checkpoint is, for the driver (``RUN/abort.json``); call it once the checkpoint is saved."""
    message = guard.message(latest(run_dir))
    note = {"kind": "numerics", "step": guard.first_bad_step, "message": message}
    Path(run_dir, ABORT_FILE).write_text(json.dumps(note))


def write_stream_failure(run_dir: str | Path, cause: str) -> None:
    """Leave why the rollout stream failed (``cause``: a stage's exception, ``asyncrl.rollouts.StreamFailed``)
    for the restarted learners, which then stop at once, and for the driver, which raises it.

    Why not let Ray Train restart the learners (``pipeline.max_learner_failures``) as for a dead
    worker: a stage raises only for what a restart cannot fix (transient faults exit the actor's
    process and Ray Data restarts it), and a restarted stream replays the same blocks from the
    checkpoint, so each restart would start the run again and fail the same way. Any rank may
    write it (the same note); written whole (rename), so a reader never sees half of it."""
    ckpt = latest(run_dir)
    where = f"from the checkpoint {ckpt}" if ckpt is not None else "from the start (no checkpoint yet)"
    message = (
        f"the rollout stream failed: {cause}. The learners were not restarted (the same blocks would "
        f"fail the same way); fix the cause and rerun the same command, which resumes {where}"
    )
    tmp = Path(run_dir, f".{ABORT_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"kind": "stream", "message": message}))
    os.replace(tmp, Path(run_dir, ABORT_FILE))


def read_abort(run_dir: str | Path) -> dict[str, Any] | None:
    """The note ``write_abort`` / ``write_stream_failure`` left in ``run_dir``, or None."""
    path = Path(run_dir, ABORT_FILE)
    if not path.is_file():
        return None
    note = json.loads(path.read_text())
    note.setdefault("kind", "numerics")
    return note
