"""VLLMEngine without vllm: the import guard, and the engine logic against a stand-in ``vllm.LLM``.

The stand-in (``FakeLLM``) speaks the slice of vLLM's API the engine uses (``generate`` with
token-id prompts and per-request ``SamplingParams``, ``FlatLogprobs``-shaped or list-of-dict
log-probs, ``collective_rpc``, ``reset_prefix_cache``) over a bigram "model" whose exact
distribution is known, so output packing, MC draws, seeds, weight reload and timeouts are
checked here; the real vLLM is exercised by ``integration_tests/test_engine_contract.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import engines as asyncrl_engines
from asyncrl import records
from asyncrl.engines import ENGINES, EngineDeadError, SamplingParams
from asyncrl.engines.vllm import INSTALL_HINT, VLLMEngine, pack_completions, request_seeds
from asyncrl.engines.vllm_worker import (
    RELOAD_METHOD,
    WeightSyncExtension,
    deserialize_state_dict,
    serialize_state_dict,
)

torch.set_num_threads(1)
V, EOS, PAD = 12, 2, 0


# --- the import guard -------------------------------------------------------------------------
def test_import_does_not_need_vllm():
    """In a fresh interpreter where ``import vllm`` fails, the module, the registry entry and the
    error of ``from_pretrained`` all behave."""
    code = """
import json, sys, tempfile, pathlib
sys.modules["vllm"] = None  # make `import vllm` raise ImportError, even where vllm is installed
import asyncrl.engines as engines
from asyncrl.engines.vllm import VLLMEngine
assert engines.ENGINES.get("vllm") is VLLMEngine
d = pathlib.Path(tempfile.mkdtemp()); (d / "config.json").write_text("{}")
try:
    VLLMEngine.from_pretrained(str(d))
except ImportError as err:
    print(json.dumps({"msg": str(err)}))
else:
    raise SystemExit("from_pretrained did not raise ImportError")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    msg = json.loads(res.stdout.strip().splitlines()[-1])["msg"]
    assert INSTALL_HINT in msg and "pip install vllm" in msg and "scripts/vllm_cpu_env.sh" in msg


def test_from_pretrained_raises_clear_import_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ImportError, match=r"install vLLM \(on GPU: `pip install vllm`"):
        VLLMEngine.from_pretrained(str(tmp_path))


def test_from_pretrained_checks_the_directory_first(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        VLLMEngine.from_pretrained(str(tmp_path / "nope"))


def test_registered_as_vllm():
    assert ENGINES.get("vllm") is VLLMEngine
    assert VLLMEngine.name == "vllm"


# --- a stand-in for vllm.LLM ----------------------------------------------------------------
class FakeLLM:
    """Bigram LM: ``z(next | prev) = table[prev]``; samples with each request's own seed."""

    def __init__(self, table: torch.Tensor, flat: bool = True) -> None:
        self.table, self.flat = table, flat
        self.calls: list[tuple[list[dict], list]] = []
        self.rpc_delay = 0.0
        self.resets = 0
        self.reset_ok = True
        self.worker = FakeWorker()

    def generate(self, prompts, sampling_params, use_tqdm=False):
        self.calls.append((prompts, sampling_params))
        return [self._one(p["prompt_token_ids"], sp) for p, sp in zip(prompts, sampling_params)]

    def _one(self, prompt: list[int], sp) -> SimpleNamespace:
        gen = torch.Generator().manual_seed(sp.seed)
        prev, ids, flat = (
            prompt[-1],
            [],
            SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[]),
        )
        dicts = []
        for _ in range(sp.max_tokens):
            z = self.table[prev]
            if sp.temperature == 0:
                tok = int(z.argmax())
            else:
                lp = torch.log_softmax(z / sp.temperature, -1)
                tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
                # vLLM: the sampled token first, then the top `logprobs` (-1: all V)
                pairs = [(tok, float(lp[tok]))]
                if sp.logprobs == -1:
                    pairs += [(v, float(lp[v])) for v in torch.argsort(lp, descending=True).tolist()]
                flat.start_indices.append(len(flat.token_ids))
                flat.token_ids += [p[0] for p in pairs]
                flat.logprobs += [p[1] for p in pairs]
                flat.end_indices.append(len(flat.token_ids))
                dicts.append({t: SimpleNamespace(logprob=v) for t, v in pairs})
            ids.append(tok)
            prev = tok
            if tok in sp.stop_token_ids:
                break
        lps = None if sp.logprobs is None else (flat if self.flat else dicts)
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lps)])

    def collective_rpc(self, method, args=()):
        time.sleep(self.rpc_delay)
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self):
        self.resets += 1
        return self.reset_ok


class FakeWorker(WeightSyncExtension):
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator):
        self.loaded = dict(weights_iterator)


def make_engine(flat: bool = True, **kw) -> tuple[VLLMEngine, FakeLLM]:
    torch.manual_seed(0)
    table = torch.randn(V, V) * 2
    table[:, EOS] += 0.5  # rows stop at EOS now and then
    llm = FakeLLM(table, flat=flat)
    opts = dict(eos_ids=[EOS], pad_id=PAD, vocab_size=V, max_model_len=64, version=3)
    opts.update(kw)
    return VLLMEngine(llm, sampling_params_factory=lambda **k: SimpleNamespace(**k), **opts), llm


def prompts(B: int = 6, P: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P), generator=gen)
    lengths = torch.randint(1, P + 1, (B,), generator=gen)
    mask = torch.arange(P)[None, :] >= (P - lengths)[:, None]  # left padding
    return torch.where(mask, ids, PAD), mask


def bigram_logprobs(table: torch.Tensor, pids, pmask, out, tau: float) -> torch.Tensor:
    """log softmax(z / tau) [B, T, V] of the bigram model along each completion."""
    prev = torch.cat([pids[:, -1:], out[records.COMPLETION_IDS][:, :-1]], dim=1)
    return torch.log_softmax(table[prev] / tau, -1)


# --- generate ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flat", [True, False], ids=["flat_logprobs", "dict_logprobs"])
@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_generate_packs_exact_behavior_logprobs(flat, tau):
    eng, llm = make_engine(flat=flat)
    pids, pmask = prompts()
    out = eng.generate(pids, pmask, SamplingParams(max_new_tokens=10, temperature=tau), seed=7)
    cols = [
        records.COMPLETION_IDS,
        records.COMPLETION_MASK,
        records.BEHAVIOR_LOGPROBS,
        records.TOKEN_VERSIONS,
    ]
    assert set(out) == set(cols)
    records.validate_batch(out, cols, vocab_size=V)
    mask = out[records.COMPLETION_MASK]
    ref = bigram_logprobs(llm.table, pids, pmask, out, tau).gather(-1, out[records.COMPLETION_IDS][..., None])
    torch.testing.assert_close(out[records.BEHAVIOR_LOGPROBS][mask], ref.squeeze(-1)[mask])
    assert (out[records.BEHAVIOR_LOGPROBS][~mask] == 0).all()
    assert (out[records.COMPLETION_IDS][~mask] == PAD).all()
    assert (out[records.TOKEN_VERSIONS] == 3).all() and out[records.TOKEN_VERSIONS].dtype == torch.int32
    # the requests vLLM saw: valid prompt tokens only, untruncated sampling, sampled-token log-probs
    sent, sps = llm.calls[-1]
    assert [p["prompt_token_ids"] for p in sent] == [r[m].tolist() for r, m in zip(pids, pmask)]
    for sp in sps:
        assert (sp.top_k, sp.top_p, sp.min_p, sp.temperature) == (0, 1.0, 0.0, tau)
        assert sp.logprobs == 0 and sp.stop_token_ids == [EOS] and sp.max_tokens == 10
    assert len({sp.seed for sp in sps}) == len(sps), "rows must not share a vLLM seed"


def test_heavy_tail_gives_each_request_its_own_budget():
    eng, llm = make_engine()
    pids, pmask = prompts()
    params = SamplingParams(max_new_tokens=32, temperature=1.0, heavy_tail=0.8)
    out = eng.generate(pids, pmask, params, seed=7)
    budgets = params.token_budgets(len(pids), 7).tolist()
    assert [sp.max_tokens for sp in llm.calls[-1][1]] == budgets
    assert (out[records.COMPLETION_MASK].sum(1) <= torch.tensor(budgets)).all()
    assert len(set(budgets)) > 1


def test_generate_greedy_has_point_mass_logprobs():
    eng, llm = make_engine()
    pids, pmask = prompts()
    out = eng.generate(pids, pmask, SamplingParams(max_new_tokens=6, temperature=0.0, mc_samples=3), seed=0)
    assert all(sp.logprobs is None for sp in llm.calls[-1][1])
    assert (out[records.BEHAVIOR_LOGPROBS] == 0).all() and (out[records.MC_BEHAVIOR_LOGPROBS] == 0).all()
    mask = out[records.COMPLETION_MASK]
    assert (out[records.MC_IDS][mask] == out[records.COMPLETION_IDS][mask][:, None]).all()


def test_generate_is_deterministic_given_seed():
    eng, _ = make_engine()
    pids, pmask = prompts(B=8)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, mc_samples=3)
    a, b = eng.generate(pids, pmask, params, seed=1), eng.generate(pids, pmask, params, seed=1)
    c = eng.generate(pids, pmask, params, seed=2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[records.MC_IDS], c[records.MC_IDS])


def test_generate_mc_draws_come_from_full_vocab_distribution():
    eng, llm = make_engine()
    pids, pmask = prompts()
    m, tau = 5, 0.8
    out = eng.generate(pids, pmask, SamplingParams(max_new_tokens=10, temperature=tau, mc_samples=m), seed=4)
    assert all(sp.logprobs == -1 for sp in llm.calls[-1][1]), "MC needs the full processed distribution"
    records.validate_batch(out, [records.MC_IDS, records.MC_BEHAVIOR_LOGPROBS], vocab_size=V)
    mask = out[records.COMPLETION_MASK]
    assert torch.equal(out[records.MC_IDS][..., 0][mask], out[records.COMPLETION_IDS][mask])
    ref = bigram_logprobs(llm.table, pids, pmask, out, tau).gather(-1, out[records.MC_IDS])
    torch.testing.assert_close(out[records.MC_BEHAVIOR_LOGPROBS][mask], ref[mask])
    assert torch.equal(out[records.MC_BEHAVIOR_LOGPROBS][..., 0], out[records.BEHAVIOR_LOGPROBS])


def test_mc_refused_for_large_vocab():
    eng, _ = make_engine(mc_max_vocab=V - 1)
    assert eng.supports_mc is False
    pids, pmask = prompts()
    with pytest.raises(ValueError, match=r"mc_samples=2 .*mc_max_vocab"):
        eng.generate(pids, pmask, SamplingParams(max_new_tokens=4, temperature=1.0, mc_samples=2), seed=0)
    out = eng.generate(pids, pmask, SamplingParams(max_new_tokens=4, temperature=1.0), seed=0)
    assert records.MC_IDS not in out


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda i, m: (i, m.flip(1)), "left-padded"),
        (lambda i, m: (i.clamp_max(0) + V, m), "vocab_size"),
        (lambda i, m: (i, torch.zeros_like(m)), "no valid token"),
        (lambda i, m: (i.float(), m), "integer token ids"),
        (lambda i, m: (i[:, :-1], m), r"\[B, P\]"),
    ],
)
def test_generate_rejects_bad_prompts(mutate, match):
    eng, _ = make_engine()
    pids, pmask = prompts()
    pmask[0] = True  # row 0 unpadded, so flipping the mask makes it right-padded elsewhere
    bad_ids, bad_mask = mutate(pids, pmask)
    with pytest.raises(ValueError, match=match):
        eng.generate(bad_ids, bad_mask, SamplingParams(max_new_tokens=4), seed=0)


def test_generate_rejects_sub_threshold_temperature_and_overlong_requests():
    eng, _ = make_engine()
    pids, pmask = prompts()
    with pytest.raises(ValueError, match="greedy threshold"):
        eng.generate(pids, pmask, SamplingParams(max_new_tokens=4, temperature=1e-7), seed=0)
    with pytest.raises(ValueError, match="max_model_len=64"):
        eng.generate(pids, pmask, SamplingParams(max_new_tokens=64), seed=0)
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.generate(pids, pmask, {"max_new_tokens": 4}, seed=0)  # type: ignore[arg-type]


# --- load_weights -----------------------------------------------------------------------------
def test_load_weights_round_trips_through_the_worker_extension():
    eng, llm = make_engine()
    sd = {"module.layer.weight": torch.randn(3, 4), "layer.bias": torch.arange(3.0)}
    eng.load_weights(sd, version=9)
    assert eng.version == 9 and llm.resets == 1
    assert set(llm.worker.loaded) == {"layer.weight", "layer.bias"}, "DDP 'module.' prefix is stripped"
    assert torch.equal(llm.worker.loaded["layer.weight"], sd["module.layer.weight"])
    pids, pmask = prompts()
    assert (
        eng.generate(pids, pmask, SamplingParams(max_new_tokens=3), seed=0)[records.TOKEN_VERSIONS] == 9
    ).all()


def test_load_weights_times_out_and_disables_the_engine():
    eng, llm = make_engine(reload_timeout_s=0.2)
    llm.rpc_delay = 1.0
    t0 = time.perf_counter()
    with pytest.raises(EngineDeadError, match=r"reload_timeout_s=0.2s.*from_pretrained"):
        eng.load_weights({"w": torch.ones(2)}, version=4)
    assert time.perf_counter() - t0 < 0.9, "the deadline must not wait for the stuck reload"
    assert eng.version == 3
    pids, pmask = prompts()
    with pytest.raises(RuntimeError, match="unusable"):
        eng.generate(pids, pmask, SamplingParams(max_new_tokens=3), seed=0)
    with pytest.raises(RuntimeError, match="unusable"):
        eng.load_weights({"w": torch.ones(2)}, version=5)
    time.sleep(max(0.0, 1.1 - (time.perf_counter() - t0)))  # let the stuck reload thread finish
    assert not [t for t in threading.enumerate() if t.name.startswith("vllm-reload") and t.is_alive()]


def test_load_weights_fails_if_prefix_cache_cannot_be_reset():
    eng, llm = make_engine()
    llm.reset_ok = False
    with pytest.raises(RuntimeError, match="prefix cache"):
        eng.load_weights({"w": torch.ones(2)}, version=4)
    assert eng.version == 3


@pytest.mark.parametrize("bad", [{}, {"w": [1.0, 2.0]}])
def test_load_weights_rejects_non_tensor_state_dicts(bad):
    eng, _ = make_engine()
    with pytest.raises(ValueError, match="name -> Tensor"):
        eng.load_weights(bad, version=4)  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [-1, True, 1.5])
def test_versions_must_be_non_negative_ints(version):
    eng, _ = make_engine()
    with pytest.raises(ValueError, match="version must be an int"):
        eng.load_weights({"w": torch.ones(1)}, version=version)  # type: ignore[arg-type]


def test_worker_payload_refuses_anything_but_a_flat_tensor_dict():
    import io

    buf = io.BytesIO()
    torch.save({"w": {"nested": torch.ones(1)}}, buf)
    with pytest.raises(TypeError, match="flat dict"):
        deserialize_state_dict(buf.getvalue())
    assert WeightSyncExtension.asyncrl_reload_weights.__name__ == RELOAD_METHOD


# --- pure helpers (property tests) -------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**40), n=st.integers(1, 64))
def test_request_seeds_are_deterministic_and_distinct(seed, n):
    a = request_seeds(seed, n)
    assert a == request_seeds(seed, n) and len(a) == n
    assert len(set(a)) == n  # 64 draws from 2^31: a collision would be a bug in practice
    assert all(0 <= s < 2**31 for s in a)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 7), min_size=1, max_size=5),
    m=st.integers(0, 4),
    greedy=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_pack_completions_layout(lengths, m, greedy, seed):
    gen = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, V, (n,), generator=gen).tolist() for n in lengths]
    dists = [torch.log_softmax(torch.randn(n, V, generator=gen), -1) for n in lengths]
    lps = [
        torch.zeros(len(t)) if greedy else d.gather(1, torch.tensor(t)[:, None]).squeeze(1)
        for t, d in zip(toks, dists)
    ]
    out = pack_completions(
        toks, lps, pad_id=PAD, version=5, mc_samples=m, dists=None if greedy else dists, mc_seed=1
    )
    B, T = len(lengths), max(lengths)
    assert out[records.COMPLETION_IDS].shape == (B, T)
    assert out[records.COMPLETION_MASK].sum(1).tolist() == lengths
    assert rows_of(out) == toks
    assert (out[records.COMPLETION_IDS][~out[records.COMPLETION_MASK]] == PAD).all()
    if m == 0:
        assert records.MC_IDS not in out
        return
    mc, mlp, mask = out[records.MC_IDS], out[records.MC_BEHAVIOR_LOGPROBS], out[records.COMPLETION_MASK]
    assert mc.shape == (B, T, m) and (mc[~mask] == PAD).all() and (mlp[~mask] == 0).all()
    assert torch.equal(mc[..., 0][mask], out[records.COMPLETION_IDS][mask])
    for b, d in enumerate(dists):
        n = lengths[b]
        expect = torch.zeros(n, m) if greedy else d.gather(1, mc[b, :n])
        torch.testing.assert_close(mlp[b, :n], expect)


def rows_of(out):
    return [ids[m].tolist() for ids, m in zip(out[records.COMPLETION_IDS], out[records.COMPLETION_MASK])]


def test_pack_completions_mc_draws_follow_the_distribution():
    """Extra MC columns are i.i.d. from exp(dist): empirical frequencies match within 5 sigma."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
    n, m = 400, 26
    dist = p.log().expand(n, -1)
    out = pack_completions(
        [[0] * n], [dist[:, 0]], pad_id=PAD, version=0, mc_samples=m, dists=[dist], mc_seed=3
    )
    draws = out[records.MC_IDS][0, :, 1:].flatten()
    freq = torch.bincount(draws, minlength=len(p)).float() / draws.numel()
    sigma = (p * (1 - p) / draws.numel()).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-9).all(), (freq, p)
    assert freq[4:].sum() == 0, "zero-probability tokens are never drawn"


def test_pack_completions_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="row 0"):
        pack_completions([[1, 2]], [torch.zeros(3)], pad_id=PAD, version=0)
    with pytest.raises(ValueError, match="empty completion"):
        pack_completions([[]], [torch.zeros(0)], pad_id=PAD, version=0)


def test_serialize_round_trip():
    sd = {"a": torch.randn(2, 3), "b": torch.arange(4, dtype=torch.int64)}
    back = deserialize_state_dict(serialize_state_dict(sd))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_vllm_engine_core_death_becomes_engine_dead_error():
    """vLLM raises its own ``EngineDeadError`` when the engine-core process dies; the engine turns
    it into ``asyncrl.engines.EngineDeadError`` (what the generation stage restarts on) and refuses
    further calls. Any other error passes through unchanged."""

    class EngineDeadError(Exception):  # the name is what vLLM's exception is recognised by
        pass

    eng, llm = make_engine()
    pids, pmask = prompts()
    params = SamplingParams(max_new_tokens=3)

    def boom(*args, **kwargs):
        raise ValueError("a request error")

    llm.generate = boom
    with pytest.raises(ValueError, match="a request error"):
        eng.generate(pids, pmask, params, seed=0)

    def dead(*args, **kwargs):
        raise EngineDeadError("EngineCore encountered an issue")

    llm.generate = dead
    with pytest.raises(asyncrl_engines.EngineDeadError, match="engine core died during generate"):
        eng.generate(pids, pmask, params, seed=0)
    with pytest.raises(asyncrl_engines.EngineDeadError, match="unusable"):
        eng.load_weights({"w": torch.ones(2)}, version=5)
