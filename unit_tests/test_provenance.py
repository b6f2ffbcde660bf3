"""Version provenance (``asyncrl.provenance``): the engines' weight fingerprints and the learner's
check. An engine that skips one weight load, loads part of one, or holds another engine's weights
is caught, named with both versions; normal loads (fp32 or bf16 engines) pass."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncrl import records as R
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.lora import policy_state
from asyncrl.provenance import (
    NO_FINGERPRINT,
    ProvenanceCheck,
    ProvenanceError,
    combine,
    fingerprint,
    sample_weights,
    weights_fingerprint,
)
from asyncrl.stages import sample_fingerprints
from asyncrl.workloads.tasks import encode_prompts
from asyncrl.workloads.tokenizer import char_tokenizer

torch.set_num_threads(1)
TOK = char_tokenizer()


def _model(seed: int = 0) -> torch.nn.Module:
    spec = ModelSpec("llama", hidden=32, layers=2, heads=4, intermediate=64, max_positions=64)
    return build_model(spec, len(TOK), seed).eval()


def _step(model: torch.nn.Module, seed: int) -> None:
    """An optimizer step's worth of change: every floating parameter moves a little."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=gen))


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy_state(model).items()}


def _block(engine: HFEngine, block_index: int = 0) -> dict[str, np.ndarray]:
    """One rollout block as the generation stage writes it (the provenance columns included)."""
    ids, mask = encode_prompts(TOK, ["12+34=", "7+8=", "5+5="], 16)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=4), seed=block_index)
    n = ids.shape[0]
    vfirst = torch.full((n,), engine.version, dtype=torch.int64)
    return {
        R.SAMPLE_ID: np.arange(n) + 10 * block_index,
        R.BLOCK_INDEX: np.full(n, block_index),
        R.TOKEN_VERSIONS: out[R.TOKEN_VERSIONS].numpy(),
        R.COMPLETION_MASK: out[R.COMPLETION_MASK].numpy(),
        R.VERSION_FIRST: vfirst.numpy(),
        R.WEIGHTS_FINGERPRINT: sample_fingerprints(
            engine, out[R.TOKEN_VERSIONS], out[R.COMPLETION_MASK], vfirst
        ),
        R.GEN_ENGINE: np.full(n, "hf (actor abc, pid 1)", dtype=object),
    }


def _run(versions: int, *, skip: int | None = None, mode: str = "strict", engine_dtype=torch.float32):
    """A learner publishing ``versions`` steps and an engine loading each (but the ``skip``-th);
    every block checked as the learner does. Returns the metrics of every check."""
    learner = _model()
    check = ProvenanceCheck(mode, keep=4)
    engine = HFEngine(copy.deepcopy(learner).to(engine_dtype), TOK)
    check.record(0, policy_state(learner))
    metrics = [check.check(_block(engine, 0))]
    for v in range(1, versions + 1):
        _step(learner, v)
        check.record(v, policy_state(learner))
        if v == skip:  # the update never arrives, the engine claims it anyway
            engine.weights_updated(v)
        else:
            engine.load_weights(_snapshot(learner), v)
        metrics.append(check.check(_block(engine, v)))
    return metrics


def test_every_normal_load_passes_fp32_and_bf16_engines():
    for dtype in (torch.float32, torch.bfloat16):
        metrics = _run(4, engine_dtype=dtype)
        assert all(m["provenance/mismatches"] == 0 and m["provenance/checked"] == 3 for m in metrics)


def test_a_skipped_weight_load_fails_loudly_naming_engine_and_both_versions():
    with pytest.raises(ProvenanceError) as err:
        _run(4, skip=3)
    text = str(err.value)
    assert "hf (actor abc, pid 1)" in text  # the engine
    assert "stamped v3" in text and "the weights of v2" in text  # claimed and held versions
    assert "block(s) [3]" in text


def test_warn_counts_and_off_checks_nothing(capsys):
    metrics = _run(3, skip=2, mode="warn")
    assert [m["provenance/mismatches"] for m in metrics] == [0, 0, 3, 0]  # the next load is whole again
    assert "provenance mismatch" in capsys.readouterr().err
    assert _run(3, skip=2, mode="off") == [{}] * 4


def test_partial_load_and_foreign_weights_are_caught():
    learner = _model()
    check = ProvenanceCheck("strict")
    check.record(0, policy_state(learner))
    old = _snapshot(learner)
    _step(learner, 1)
    check.record(1, policy_state(learner))
    engine = HFEngine(copy.deepcopy(_model()), TOK)
    partial = _snapshot(learner)
    partial["model.layers.1.mlp.down_proj.weight"] = old["model.layers.1.mlp.down_proj.weight"]
    engine.load_weights(partial, 1)  # one tensor of the update did not arrive
    with pytest.raises(ProvenanceError, match="matching no version the learner published"):
        check.check(_block(engine, 1))
    # a tensor that arrived in part: its first half new, the rest old
    t = partial["model.layers.1.mlp.down_proj.weight"].clone().reshape(-1)
    new = _snapshot(learner)["model.layers.1.mlp.down_proj.weight"].reshape(-1)
    t[: t.numel() // 2] = new[: t.numel() // 2]
    partial["model.layers.1.mlp.down_proj.weight"] = t.reshape(
        old["model.layers.1.mlp.down_proj.weight"].shape
    )
    engine.load_weights(partial, 1)
    with pytest.raises(ProvenanceError):
        check.check(_block(engine, 1))
    other = HFEngine(_model(seed=7), TOK, version=1)  # another model's weights, stamped v1
    with pytest.raises(ProvenanceError, match="matching no version"):
        check.check(_block(other, 1))
    with pytest.raises(ProvenanceError, match="never published"):
        engine.weights_updated(5)
        check.check(_block(engine, 5))


def test_fingerprint_is_deterministic_bit_exact_and_leaves_the_rng_alone():
    model = _model()
    rng = torch.get_rng_state()
    a = weights_fingerprint(model.state_dict())
    assert torch.equal(rng, torch.get_rng_state())
    assert a == weights_fingerprint(copy.deepcopy(model).state_dict()) != NO_FINGERPRINT
    samples = sample_weights(model.state_dict())
    assert all(v.numel() <= 256 for v in samples.values())
    with torch.no_grad():  # the smallest change of one sampled element changes it
        key = "model.layers.0.self_attn.q_proj.weight"
        flat = model.state_dict()[key].reshape(-1)
        idx = next(i for i in range(flat.numel()) if flat[i] in samples[key])
        flat[idx] = torch.nextafter(flat[idx], torch.tensor(1.0))
    assert weights_fingerprint(model.state_dict()) != a
    assert fingerprint(samples, torch.bfloat16) != fingerprint(samples)
    assert combine([a]) == a and combine([a, 5]) != combine([5, a])


def test_a_block_spanning_versions_combines_their_fingerprints():
    learner = _model()
    check = ProvenanceCheck("strict")
    fps = {}
    for v in (0, 1):
        if v:
            _step(learner, v)
        check.record(v, policy_state(learner))
        fps[v] = weights_fingerprint(policy_state(learner))

    class TwoVersions:  # an engine that loaded v1 mid-sequence (in-flight updates)
        fingerprints = fps

    versions = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.int32)
    mask = torch.ones(2, 4, dtype=torch.bool)
    first = torch.zeros(2, dtype=torch.int64)
    block = {
        R.SAMPLE_ID: np.arange(2),
        R.TOKEN_VERSIONS: versions.numpy(),
        R.COMPLETION_MASK: mask.numpy(),
        R.VERSION_FIRST: first.numpy(),
        R.WEIGHTS_FINGERPRINT: sample_fingerprints(TwoVersions(), versions, mask, first),
    }
    assert check.check(block)["provenance/checked"] == 2
    fps[1] = fps[0]  # v1 never arrived mid-sequence
    block[R.WEIGHTS_FINGERPRINT] = sample_fingerprints(TwoVersions(), versions, mask, first)
    with pytest.raises(ProvenanceError, match="versions v0, v1"):
        check.check(block)
