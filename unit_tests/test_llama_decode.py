"""LlamaDecoder (HFEngine's fast decode path) against transformers' own Llama forward.

The fast path must be the same distribution, not an approximation: the staleness math reads
the engine's behavior log-probabilities as log pi_b, and the learner recomputes them with
transformers' forward. So for every supported shape (grouped-query attention, biases, tied
embeddings, explicit head_dim, scaled RoPE, left padding, EOS, MC draws) the same seed must give
the same tokens and log-probabilities equal to float error, under both decode paths.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import records
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.engines.llama_decode import LlamaDecoder, unsupported_reason
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.workloads.tasks import encode_prompts
from asyncrl.workloads.tokenizer import EOS_ID, PAD_ID, char_tokenizer

torch.set_num_threads(1)

TOK = char_tokenizer()
PROMPTS = ["12+34=", "7+8=", "hello world=", "a", "99+99=", "xyz=", "3=", "reverse me="]
IDS = {"pad_id": PAD_ID, "eos_id": EOS_ID}


def _llama(seed: int = 0, *, family: str = "llama", **overrides) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kw = {
        "vocab_size": len(TOK),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 96,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        **overrides,
    }
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**kw)).eval()
        with torch.no_grad():  # the per-head q/k norms start at 1: make them matter
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    if kw.get("attention_bias") or kw.get("mlp_bias"):  # zero-initialised biases test nothing
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    return model


SHAPES = {
    "mha": {},
    "gqa": {"num_key_value_heads": 2},
    "mqa_3_layers": {"num_key_value_heads": 1, "num_hidden_layers": 3},
    "biases": {"attention_bias": True, "mlp_bias": True},
    "tied": {"tie_word_embeddings": True},
    "head_dim_16": {"head_dim": 16},
    "rope_linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
    "rope_llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0,
        }
    },
}


def _both(model: torch.nn.Module, ids, mask, params: SamplingParams, seed: int) -> tuple[dict, dict]:
    fast = HFEngine(model, IDS, decode="fast")
    ref = HFEngine(model, IDS, decode="hf")
    assert fast.decode_path == "fast" and ref.decode_path == "hf"
    return fast.generate(ids, mask, params, seed=seed), ref.generate(ids, mask, params, seed=seed)


def _assert_same_rollout(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for key in ref:
        if ref[key].is_floating_point():
            torch.testing.assert_close(got[key], ref[key], atol=2e-5, rtol=1e-5, msg=key)
        else:
            assert torch.equal(got[key], ref[key]), key


# qwen3 adds per-head q/k norms to the same block; its RoPE tables are the same code as llama's
CASES = [("llama", s) for s in sorted(SHAPES)] + [("qwen3", s) for s in ("mha", "gqa", "tied", "head_dim_16")]


@pytest.mark.parametrize(("family", "shape"), CASES)
def test_fast_path_is_transformers_rollout(family: str, shape: str) -> None:
    model = _llama(seed=1, family=family, **SHAPES[shape])
    assert unsupported_reason(model) is None
    ids, mask = encode_prompts(TOK, PROMPTS, 16)  # left padding in 7 of 8 rows
    params = SamplingParams(max_new_tokens=40, temperature=1.0, mc_samples=2)
    got, ref = _both(model, ids, mask, params, seed=3)
    assert got["completion_ids"].shape[1] > 20  # the comparison covers many decode steps
    _assert_same_rollout(got, ref)


def test_fast_path_logits_equal_teacher_forced_forward() -> None:
    """Every step's logits, not only the sampled tokens: the decoder's next-token logits at each
    generated position equal one full teacher-forced forward over prompt + completion."""
    model = _llama(seed=2, num_key_value_heads=2)
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    pos = records.position_ids(mask)
    dec = LlamaDecoder(model)
    with torch.inference_mode():
        steps = [dec.start(ids, mask, pos, 12)]
        gen = torch.randint(3, len(TOK), (len(PROMPTS), 12))
        for t in range(11):
            steps.append(dec.step(gen[:, t], t))
        full = records.completion_logits(model, ids, mask, gen, torch.ones_like(gen, dtype=torch.bool))
    torch.testing.assert_close(torch.stack(steps, 1), full.float(), atol=2e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=6),
    tau=st.sampled_from([1.0, 0.6, 0.0]),
    seed=st.integers(0, 2**16),
)
def test_fast_path_matches_for_any_left_padding(lengths: list[int], tau: float, seed: int) -> None:
    model = _llama(seed=5, num_key_value_heads=2)
    prompts = ["".join("0123456789+="[(seed + i * j) % 12] for j in range(n)) for i, n in enumerate(lengths)]
    ids, mask = encode_prompts(TOK, prompts, 16)
    got, ref = _both(model, ids, mask, SamplingParams(max_new_tokens=10, temperature=tau), seed=seed)
    _assert_same_rollout(got, ref)


def test_weights_changed_in_place_are_used() -> None:
    """The decoder reads the model's parameters per rollout: a step of training in place (the
    plain-loop examples share one model) and ``load_weights`` both show in the next rollout."""
    model = _llama(seed=0)
    eng = HFEngine(model, IDS)
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    before = eng.generate(ids, mask, params, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    after = eng.generate(ids, mask, params, seed=0)
    _assert_same_rollout(after, HFEngine(model, IDS, decode="hf").generate(ids, mask, params, seed=0))
    assert not torch.allclose(before["behavior_logprobs"], after["behavior_logprobs"])
    other = _llama(seed=9)
    eng.load_weights(other.state_dict(), version=4)
    _assert_same_rollout(
        {k: v for k, v in eng.generate(ids, mask, params, seed=0).items() if k != "token_versions"},
        {
            k: v
            for k, v in HFEngine(other, IDS, decode="hf").generate(ids, mask, params, seed=0).items()
            if k != "token_versions"
        },
    )


def test_bfloat16_close_to_transformers() -> None:
    """bf16 follows transformers' casts (float32 norm statistics and RoPE tables, cast back)."""
    model = _llama(seed=3, num_key_value_heads=2).to(torch.bfloat16)
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    pos = records.position_ids(mask)
    with torch.inference_mode():
        got = LlamaDecoder(model).start(ids, mask, pos, 4)
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=2e-2)


def test_default_is_fast_for_the_built_in_llama_presets() -> None:
    model = build_model(ModelSpec("llama", hidden=32, layers=2, heads=1, intermediate=64), len(TOK), 0)
    assert HFEngine(model, TOK).decode_path == "fast"


def test_default_is_fast_for_the_built_in_qwen3_preset_shape() -> None:
    model = build_model(ModelSpec("qwen3", hidden=32, layers=1, heads=2, intermediate=64), len(TOK), 0)
    assert HFEngine(model, TOK).decode_path == "fast"


@pytest.mark.parametrize("arch", ["gpt2"])
def test_unsupported_models_use_transformers_forward_or_fail_loudly(arch: str) -> None:
    model = build_model(ModelSpec(arch, hidden=32, layers=1, heads=2, intermediate=64), len(TOK), 0)
    reason = unsupported_reason(model)
    assert reason is not None and arch in reason
    eng = HFEngine(model, TOK)
    assert eng.decode_path == "hf" and eng.decode_reason == reason
    with pytest.raises(ValueError, match="decode='fast' cannot run this model: model_type"):
        HFEngine(model, TOK, decode="fast")
    with pytest.raises(ValueError, match="LlamaDecoder cannot run"):
        LlamaDecoder(model)


def test_unsupported_llama_variants_are_named() -> None:
    assert "rope_type 'dynamic'" in str(
        unsupported_reason(
            _llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
        )
    )
    assert "hidden_act 'gelu'" in str(unsupported_reason(_llama(hidden_act="gelu")))
    legacy = _llama()  # a transformers 4.x config: rope_scaling with "type", no rope_parameters
    legacy.config.rope_parameters = None
    with warnings.catch_warnings():  # transformers 5 deprecates setting rope_scaling
        warnings.simplefilter("ignore", FutureWarning)
        legacy.config.rope_scaling = {"type": "dynamic", "factor": 2.0}
    assert "rope_type 'dynamic'" in str(unsupported_reason(legacy))
    assert "attention_dropout" in str(unsupported_reason(_llama(attention_dropout=0.1)))
    sliding = _llama(family="qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding-window" in str(unsupported_reason(sliding))
    with pytest.raises(ValueError, match="use 'auto', 'fast' or 'hf'"):
        HFEngine(_llama(), IDS, decode="vllm")  # type: ignore[arg-type]


def test_check_supported_refuses_decode_fast_in_the_driver(tmp_path) -> None:
    """``pipeline.engine_options.decode`` is checked before any actor starts (config only)."""
    llama, gpt2 = tmp_path / "llama", tmp_path / "gpt2"
    _llama().save_pretrained(llama)
    build_model(
        ModelSpec("gpt2", hidden=32, layers=1, heads=2, intermediate=64), len(TOK), 0
    ).save_pretrained(gpt2)
    params = SamplingParams(max_new_tokens=4)
    for decode in ("auto", "fast", "hf"):
        HFEngine.check_supported(str(llama), params, decode=decode)
    HFEngine.check_supported(str(gpt2), params, decode="auto")
    with pytest.raises(ValueError, match=r"engine_options.decode='fast' cannot run .*model_type 'gpt2'"):
        HFEngine.check_supported(str(gpt2), params, decode="fast")
    with pytest.raises(ValueError, match=r"engine_options.decode='vllm': use 'auto', 'fast' or 'hf'"):
        HFEngine.check_supported(str(llama), params, decode="vllm")
