"""Checkpoints without pickle: state round-trips through JSON + safetensors, nothing in a run
directory is ever unpickled (a planted payload is refused and never runs), torn or truncated
checkpoints are never loaded. No Ray: ``checkpoint.save``/``load`` are called directly."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import checkpoint as C
from asyncrl.backends import TorchBackend
from asyncrl.config import TrainConfig
from asyncrl.controllers import build_chain

torch.set_num_threads(1)


# --- the codec ----------------------------------------------------------------------------------------
scalars = st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats(allow_nan=False) | st.text()
keys = st.text() | st.integers(-1000, 1000)
arrays = st.sampled_from([np.float32, np.float64, np.int64, np.uint32, np.uint8, np.bool_]).flatmap(
    lambda dt: st.lists(st.integers(0, 200), max_size=6).map(lambda v: np.asarray(v).astype(dt))
)
tensors = st.lists(st.floats(-1e6, 1e6, width=32), max_size=6).map(
    lambda v: torch.tensor(v, dtype=torch.float32)
)
trees = st.recursive(
    scalars | arrays | tensors,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=12,
)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None)
@given(state=trees)
def test_state_round_trips_exactly(tmp_path_factory, state) -> None:
    d = tmp_path_factory.mktemp("state")
    C.write_state(d, "s", {"root": state})
    assert same(C.read_state(d, "s"), {"root": state})


def test_objects_are_refused_when_written(tmp_path: Path) -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"s\.opt\.scaler.*Opaque.*without pickle"):
        C.write_state(tmp_path, "s", {"opt": {"scaler": Opaque()}})
    with pytest.raises(TypeError, match="object arrays"):
        C.write_state(tmp_path, "s", {"a": np.asarray([{"x": 1}], dtype=object)})


# --- a whole learner checkpoint ----------------------------------------------------------------------
def tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )


def trained_parts(steps: int = 2):
    model = tiny_model()
    backend = TorchBackend(model, TrainConfig(batch_size=2), world=1)
    chain = build_chain([("bounded_staleness", {"max_lag": 1})])
    x = torch.randint(0, 32, (2, 6))
    for step in range(steps):
        backend.backward(model(input_ids=x, labels=x).loss)
        backend.step(step, 1.0)
    return model, backend, chain


def save(path: Path, model, backend, chain, version: int = 2) -> Path:
    C.save(
        path,
        rank=0,
        world=1,
        model=model,
        backend=backend,
        controllers=chain,
        version=version,
        ledger=np.arange(10, dtype=np.int64),
        counters={"trained": 8, "dropped": 2},
        coordinator_state={"version": version, "dispatched": 12, "trained": 8, "dropped": 2},
    )
    return path


def test_save_and_load_restore_optimizer_rng_and_books(tmp_path: Path) -> None:
    model, backend, chain = trained_parts()
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(9)
    save(tmp_path / "step_000002", model, backend, chain)
    want = (torch.rand(3), np.random.rand(3), random.random())
    assert C.problems(tmp_path / "step_000002") == []
    assert C.latest(tmp_path.parent) is None  # looks under RUN/checkpoints only

    fresh = TorchBackend(tiny_model(seed=1), TrainConfig(batch_size=2), world=1)
    restored = C.load(
        tmp_path / "step_000002",
        rank=0,
        backend=fresh,
        controllers=build_chain([("bounded_staleness", {"max_lag": 1})]),
    )
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
    assert restored.version == 2 and restored.counters == {"trained": 8, "dropped": 2}
    assert np.array_equal(restored.ledger, np.arange(10))
    a, b = backend.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for k in a["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a["state"][k][name], b["state"][k][name])
    # nothing in the checkpoint is a pickle
    for f in (tmp_path / "step_000002").rglob("*"):
        if f.is_file():
            assert not f.read_bytes().startswith(b"\x80"), f


# --- planted pickle payloads are refused ---------------------------------------------------------------
class Payload:
    """Unpickling this creates ``marker``: proof that code in the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    model, backend, chain = trained_parts()
    save(tmp_path / "run" / "checkpoints" / "session-a" / "step_000002", model, backend, chain)
    return tmp_path / "run"


def plant(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(Payload(marker)))


@pytest.mark.parametrize(
    "victim",
    ["trainer_state.safetensors", "trainer_state.json", "ledger.npy", "model/model.safetensors"],
)
def test_a_pickle_planted_in_a_checkpoint_is_never_unpickled(
    run_dir: Path, tmp_path: Path, victim: str
) -> None:
    ckpt = C.latest(run_dir)
    marker = tmp_path / "pwned"
    plant(ckpt / victim, marker)
    assert C.latest(run_dir) is None  # its size no longer matches the manifest: not a checkpoint
    with pytest.raises(C.CheckpointError, match=victim.split("/")[-1].replace(".", r"\.")):
        C.load(ckpt, rank=0, backend=trained_parts()[1], controllers=build_chain([]))
    # the readers, called directly on the planted file, refuse it as well
    if victim == "ledger.npy":
        with pytest.raises(C.CheckpointError, match=r"ledger\.npy"):
            C.load_ledger(ckpt)
    elif victim.startswith("trainer_state"):
        with pytest.raises(C.CheckpointError, match="trainer_state"):
            C.read_state(ckpt, "trainer_state")
    else:
        from transformers import AutoModelForCausalLM

        with pytest.raises(Exception):  # noqa: B017 - safetensors' own header error
            AutoModelForCausalLM.from_pretrained(ckpt / "model", use_safetensors=True)
    assert not marker.exists()


def test_a_pickled_numpy_ledger_of_the_right_size_is_refused(run_dir: Path, tmp_path: Path) -> None:
    """Even a payload that matches the manifest's size is only ever read with allow_pickle=False."""
    ckpt = C.latest(run_dir)
    marker = tmp_path / "pwned"
    payload = np.asarray([Payload(marker)], dtype=object)
    np.save(ckpt / "ledger.npy", payload, allow_pickle=True)
    with pytest.raises(C.CheckpointError, match=r"ledger\.npy"):
        C.load_ledger(ckpt)
    assert not marker.exists()


def test_pytorch_bin_weights_planted_in_the_model_dir_are_not_loaded(run_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = C.latest(run_dir)
    marker = tmp_path / "pwned"
    (ckpt / "model" / "model.safetensors").unlink()
    plant(ckpt / "model" / "pytorch_model.bin", marker)
    assert C.latest(run_dir) is None
    with pytest.raises(Exception):  # noqa: B017 - transformers: no safetensors weights found
        AutoModelForCausalLM.from_pretrained(ckpt / "model", use_safetensors=True)
    assert not marker.exists()


def test_an_old_pickle_format_checkpoint_is_not_loaded(run_dir: Path, tmp_path: Path) -> None:
    ckpt = C.latest(run_dir)
    old = run_dir / "checkpoints" / "old" / "step_000009"
    shutil.copytree(ckpt, old)
    plant(old / "trainer_state.pt", tmp_path / "pwned")
    meta = json.loads((old / C.STATE_FILE).read_text())
    del meta["files"]  # what asyncrl <= 0.1 wrote
    (old / C.STATE_FILE).write_text(json.dumps({**meta, "step": 9}))
    assert C.latest(run_dir) == ckpt  # the newer, old-format one is skipped
    step, path, bad = C.scan(run_dir)[0]
    assert step == 9 and path == old and "older asyncrl" in bad[0]
    assert not (tmp_path / "pwned").exists()


# --- torn copies -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", ["model/model.safetensors", "trainer_state.safetensors", "ledger.npy"])
def test_a_truncated_or_missing_file_makes_the_checkpoint_incomplete(run_dir: Path, victim: str) -> None:
    ckpt = C.latest(run_dir)
    newer = run_dir / "checkpoints" / "session-b" / "step_000004"
    shutil.copytree(ckpt, newer)
    meta = json.loads((newer / C.STATE_FILE).read_text())
    (newer / C.STATE_FILE).write_text(json.dumps({**meta, "step": 4}))
    assert C.latest(run_dir) == newer
    f = newer / victim
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert C.latest(run_dir) == ckpt  # the torn newer one is skipped
    assert any(victim in p for p in C.problems(newer))
    f.unlink()
    assert any(victim in p and "missing" in p for p in C.problems(newer))
    (newer / C.STATE_FILE).write_text("{")  # the state file itself torn
    assert C.problems(newer) == [f"{C.STATE_FILE} is not JSON"]
