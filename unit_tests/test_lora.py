"""LoRA students (``asyncrl.lora``, ``train.lora``): adapters only are trained, published, loaded,
checkpointed and resumed; the HF engine applies them merged (fast decode path) or unmerged."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncrl import checkpoint
from asyncrl.backends import learner_backend
from asyncrl.config import parse_config
from asyncrl.controllers import build_chain
from asyncrl.coordinator import pack_weights, publishable_state, unpack_weights
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.engines.llama_decode import unsupported_reason
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.lora import LoRAConfig, adapter_state, apply_lora, policy_state, state_bytes
from asyncrl.provenance import weights_fingerprint
from asyncrl.records import completion_logits
from asyncrl.workloads.tasks import encode_prompts
from asyncrl.workloads.tokenizer import char_tokenizer

torch.set_num_threads(1)
TOK = char_tokenizer()
LORA = LoRAConfig(r=4, alpha=8.0)


def _base(seed: int = 0) -> torch.nn.Module:
    spec = ModelSpec("llama", hidden=32, layers=2, heads=4, intermediate=64, max_positions=64)
    return build_model(spec, len(TOK), seed).eval()


def _trained_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """Adapters as after some training (B != 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def _loss(model: torch.nn.Module) -> torch.Tensor:
    ids, mask = encode_prompts(TOK, ["12+34=", "7+8="], 12)
    comp = torch.tensor([[5, 6, 7], [8, 9, 10]])
    logits = completion_logits(model, ids, mask, comp, torch.ones_like(comp, dtype=torch.bool))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), comp.reshape(-1))


def test_publication_is_the_adapters_only_and_round_trips_bit_exactly():
    learner = apply_lora(_base(), LORA, seed=3)
    _trained_adapters(learner)
    published = publishable_state(learner)
    assert published and all(".lora_A." in k or ".lora_B." in k for k in published)
    full = _base().state_dict()
    assert state_bytes(published) < 0.5 * state_bytes(full)
    wire = unpack_weights(pack_weights(published))  # the PolicyStore's wire format
    engine = HFEngine(_base(), TOK, lora=LORA)
    engine.load_weights(wire, 4)
    held = adapter_state(engine.model)
    assert held.keys() == published.keys()
    assert all(torch.equal(held[k], published[k]) for k in held)
    assert engine.fingerprints[4] == weights_fingerprint(policy_state(learner))
    with pytest.raises(ValueError, match="does not match the engine's LoRA adapters"):
        engine.load_weights(full, 5)  # full weights to a LoRA engine


def test_adapter_state_is_peft_s_adapter_state_dict():
    from peft import get_peft_model_state_dict

    model = apply_lora(_base(), LoRAConfig(r=2, target_modules=("q_proj", "down_proj")), seed=0)
    _trained_adapters(model)
    ours, peft_s = adapter_state(model), get_peft_model_state_dict(model)
    assert list(ours) == list(peft_s) and all(torch.equal(ours[k], peft_s[k]) for k in ours)
    assert len(ours) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)


def test_merged_and_unmerged_engines_agree_to_float_error():
    learner = apply_lora(_base(), LORA, seed=3)
    _trained_adapters(learner)
    ids, mask = encode_prompts(TOK, ["12+34=", "7+8=", "hello="], 16)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, mc_samples=2)
    outs = {}
    for merge in (True, False):
        engine = HFEngine(_base(), TOK, lora=LORA, lora_merge=merge)
        assert engine.decode_path == ("fast" if merge else "hf")
        for v in (1, 2):  # a second version: the merge is rebuilt from the base, not stacked
            if v == 2:
                _trained_adapters(learner, seed=9)
            engine.load_weights(publishable_state(learner), v)
        outs[merge] = engine.generate(ids, mask, params, seed=7)
    assert torch.equal(outs[True]["completion_ids"], outs[False]["completion_ids"])
    diff = (outs[True]["behavior_logprobs"] - outs[False]["behavior_logprobs"]).abs().max()
    assert diff < 1e-5
    # and both equal the learner's own (peft) teacher-forced log-probs
    with torch.no_grad():
        z = completion_logits(
            learner, ids, mask, outs[False]["completion_ids"], outs[False]["completion_mask"]
        )
    lp = torch.log_softmax(z, -1).gather(-1, outs[False]["completion_ids"][..., None])[..., 0]
    m = outs[False]["completion_mask"]
    assert (lp[m] - outs[True]["behavior_logprobs"][m]).abs().max() < 1e-5


def test_the_fast_decoder_refuses_unmerged_adapters():
    model = apply_lora(_base(), LORA, seed=0)
    assert "unmerged LoRA adapters" in unsupported_reason(model.get_base_model())
    with pytest.raises(ValueError, match="unmerged"):
        HFEngine(_base(), TOK, lora=LORA, lora_merge=False, decode="fast")


def _cfg(student_dir, **train):
    overrides = [f"train.{k}={v}" for k, v in train.items()]
    return parse_config(None, ["train.lora={r: 4, alpha: 8.0}", "train.warmup_steps=0", *overrides])


def test_learner_gradient_and_updates_only_on_adapters(tmp_path):
    _base().save_pretrained(tmp_path / "student")
    cfg = _cfg(tmp_path / "student")
    backend = learner_backend(cfg, tmp_path / "student", 1, checkpointed=False)
    model = backend.module
    names = {id(p): n for n, p in model.named_parameters()}
    assert backend.params and all("lora_" in names[id(p)] for p in backend.params)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    backend.backward(_loss(backend.model))
    for n, p in model.named_parameters():
        assert (p.grad is not None) == ("lora_" in n), n
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    backend.clip_and_norm(1.0)
    backend.step(0, 1.0)
    for _ in range(2):  # at B = 0 only B's gradient is non-zero: A moves from the second step on
        backend.backward(_loss(backend.model))
        backend.clip_and_norm(1.0)
        backend.step(1, 1.0)
    for n, p in model.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == ("lora_B" in n or "lora_A" in n), n


def test_resume_is_bit_identical(tmp_path):
    _base().save_pretrained(tmp_path / "student")
    cfg = _cfg(tmp_path / "student", lr=0.01)
    controllers = build_chain([])

    def train(backend, steps, start):
        for s in range(start, start + steps):
            backend.backward(_loss(backend.model))
            backend.clip_and_norm(1.0)
            backend.step(s, 1.0)

    straight = learner_backend(cfg, tmp_path / "student", 1, checkpointed=False)
    train(straight, 6, 0)
    first = learner_backend(cfg, tmp_path / "student", 1, checkpointed=False)
    train(first, 3, 0)
    ckpt = tmp_path / "ckpt"
    checkpoint.save(
        ckpt,
        rank=0,
        world=1,
        model=first.module,
        backend=first,
        controllers=controllers,
        version=3,
        ledger=np.zeros(0, dtype=np.int64),
        counters={"trained": 0, "dropped": 0},
        coordinator_state=None,
    )
    assert (ckpt / checkpoint.MODEL_DIR / "adapter_model.safetensors").is_file()
    assert not checkpoint.problems(ckpt)
    resumed = learner_backend(
        cfg, ckpt / checkpoint.MODEL_DIR, 1, checkpointed=True, base_dir=tmp_path / "student"
    )
    checkpoint.load(ckpt, rank=0, backend=resumed, controllers=controllers)
    a0, r0 = adapter_state(first.module), adapter_state(resumed.module)
    assert all(torch.equal(a0[k], r0[k]) for k in a0)
    train(resumed, 3, 3)
    a, b = adapter_state(straight.module), adapter_state(resumed.module)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = _base().state_dict()  # the base never moved
    got = resumed.module.get_base_model().state_dict()
    assert all(torch.equal(base[k.replace(".base_layer", "")], got[k]) for k in got if "lora_" not in k)


def test_engine_refuses_a_second_set_of_adapters_and_vllm_refuses_lora():
    from asyncrl.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match="has them already"):
        HFEngine(apply_lora(_base(), LORA, seed=0), TOK, lora=LORA)
    with pytest.raises(ValueError, match=r"train\.lora is not supported by pipeline\.engine=vllm"):
        VLLMEngine.check_supported(None, SamplingParams(), lora=LORA.options())


def test_dropout_trains_only_the_adapter_dropout(tmp_path):
    _base().save_pretrained(tmp_path / "student")
    cfg = parse_config(None, ["train.lora={r: 4, dropout: 0.1}"])
    model = learner_backend(cfg, tmp_path / "student", 1, checkpointed=False).module
    training = {n for n, m in model.named_modules() if m.training}
    assert training and all("lora_dropout" in n for n in training)
    off = learner_backend(_cfg(tmp_path / "student"), tmp_path / "student", 1, checkpointed=False).module
    assert not any(m.training for m in off.modules())


def test_adapter_init_is_seeded_and_leaves_the_rng_alone():
    rng = torch.get_rng_state()
    a = adapter_state(apply_lora(_base(), LORA, seed=5))
    assert torch.equal(rng, torch.get_rng_state())
    b = adapter_state(apply_lora(copy.deepcopy(_base()), LORA, seed=5))
    c = adapter_state(apply_lora(_base(), LORA, seed=6))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "lora_A" in k)
    assert all(not v.any() for k, v in a.items() if "lora_B" in k)  # v0 is the base model
