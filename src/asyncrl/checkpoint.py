"""Learner checkpoints: what a run directory must hold to resume exactly (no Ray here).

A checkpoint directory (``RUN/checkpoints/.../step_<v>/``) holds the model
(``model/``, ``save_pretrained``), the backend's optimizer state, the controllers' state, RNG
states, the sample ledger (ids of every sample consumed so far: a resumed run never trains one
twice) and counters, plus the coordinator's admission state. Ray Train copies the directory
each rank reports into the same folder, which is how sharded (ZeRO) backends add one
``backend_rank<r>.pt`` per rank.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "asyncrl_state.json"
TRAINER_STATE = "trainer_state.pt"
LEDGER_FILE = "ledger.npy"
COORDINATOR_FILE = "coordinator.json"
MODEL_DIR = "model"


def backend_shard_name(rank: int) -> str:
    """Per-rank backend state file of sharded backends (ZeRO partitions optimizer state by rank)."""
    return f"backend_rank{rank}.pt"


@dataclass
class Restored:
    """What ``load`` gives back besides the state it loads into the parts in place."""

    version: int
    counters: dict[str, int]
    ledger: np.ndarray


def save(
    path: Path,
    *,
    rank: int,
    model: torch.nn.Module,
    backend: Any,
    controllers: Any,
    version: int,
    ledger: np.ndarray,
    counters: dict[str, int],
    coordinator_state: dict[str, Any] | None,
) -> None:
    """Write this rank's part of a checkpoint into ``path`` (rank 0 writes everything shared)."""
    path.mkdir(parents=True, exist_ok=True)
    sharded = getattr(backend, "sharded_state", False)
    if sharded:
        torch.save(backend.state_dict(), path / backend_shard_name(rank))
    if rank != 0:
        return
    model.save_pretrained(path / MODEL_DIR, safe_serialization=True)
    torch.save(
        {
            "backend": None if sharded else backend.state_dict(),
            "controllers": controllers.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        },
        path / TRAINER_STATE,
    )
    np.save(path / LEDGER_FILE, ledger)
    if coordinator_state is not None:
        (path / COORDINATOR_FILE).write_text(json.dumps(coordinator_state, default=str))
    (path / STATE_FILE).write_text(json.dumps({"step": version, "counters": counters}))


def load(path: str | Path, *, rank: int, backend: Any, controllers: Any) -> Restored:
    """Restore the backend, controllers and RNG from ``path`` in place; return version, counters, ledger."""
    path = Path(path)
    state = torch.load(path / TRAINER_STATE, weights_only=False)
    if getattr(backend, "sharded_state", False):
        shard = path / backend_shard_name(rank)
        if not shard.is_file():
            raise FileNotFoundError(
                f"checkpoint {path} has no {shard.name}: it was written with fewer learner workers or a "
                f"different backend; resume with the same pipeline.learner_workers/backend"
            )
        backend.load_state_dict(torch.load(shard, weights_only=False))
    else:
        backend.load_state_dict(state["backend"])
    controllers.load_state_dict(state["controllers"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    meta = json.loads((path / STATE_FILE).read_text())
    return Restored(version=int(meta["step"]), counters=dict(meta["counters"]), ledger=load_ledger(path))


def load_ledger(path: str | Path) -> np.ndarray:
    """Ids of every sample consumed up to the checkpoint."""
    return np.load(Path(path) / LEDGER_FILE)


def latest(run_dir: str | Path) -> Path | None:
    """The checkpoint directory with the highest step under RUN/checkpoints, or None."""
    best, best_step = None, -1
    for state in Path(run_dir, "checkpoints").glob(f"**/{STATE_FILE}"):
        step = json.loads(state.read_text())["step"]
        if step > best_step:
            best, best_step = state.parent, step
    return best
