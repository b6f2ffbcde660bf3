"""In-flight weight updates (``pipeline.inflight_updates``): an engine that loads newer weights
between decode steps and continues its unfinished rows with them.

- the HF engine (fast ``LlamaDecoder`` and the model's own forward, KV cache recomputed or kept)
  stamps each token with the version that produced it, and its behavior log-probs after a switch
  are the new weights' (recompute) or the exact mixed distribution it sampled from (keep);
- polling that never finds newer weights changes nothing (same draws as no polling);
- an engine that keeps stale derived state (the fast decoder's fused weight copies) after an
  in-flight load reports a fingerprint matching no published version: the learner's check fails;
- the staleness bound holds per token: a fake engine switching at random steps, the consumption
  gate, and every kept token's lag <= S (hypothesis);
- samples.parquet's token-lag columns, the config / engine refusals.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import records as R
from asyncrl import stages
from asyncrl.configurable import ConfigError
from asyncrl.controllers.bounded import BoundedStaleness
from asyncrl.engines.base import EngineDeadError, SamplingParams, pack_rollout, supports_inflight
from asyncrl.engines.hf import HFEngine
from asyncrl.engines.llama_decode import LlamaDecoder
from asyncrl.engines.vllm import VLLMEngine
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.lora import policy_state
from asyncrl.provenance import ProvenanceCheck, ProvenanceError, weights_fingerprint
from asyncrl.step import sample_info
from asyncrl.telemetry.staleness import LAG_BUCKETS, token_lag_columns, token_lag_histogram
from asyncrl.workloads.tasks import encode_prompts
from asyncrl.workloads.tokenizer import char_tokenizer

torch.set_num_threads(1)
TOK = char_tokenizer()
PROMPTS = ["12+34=", "7+8=", "hello world=", "a", "99+99=", "xyz="]
PARAMS = SamplingParams(max_new_tokens=16, temperature=1.0)


def _model(seed: int = 0, arch: str = "llama") -> torch.nn.Module:
    spec = ModelSpec(arch, hidden=32, layers=2, heads=4, intermediate=64, max_positions=64)
    return build_model(spec, len(TOK), seed).eval()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _switch_at(step: int, version: int, state: dict[str, torch.Tensor]):
    """A ``WeightsPoll`` that hands out ``(version, state)`` at its ``step``-th call, once."""
    calls = []

    def poll():
        calls.append(1)
        return (version, state) if len(calls) == step else None

    return poll


def _teacher_forced(model, ids, mask, out) -> torch.Tensor:
    """log pi(y_t | prefix) of every completion token under ``model``, teacher-forced [B, T]."""
    with torch.no_grad():
        z = R.completion_logits(model, ids, mask, out[R.COMPLETION_IDS], out[R.COMPLETION_MASK])
    return torch.log_softmax(z.float(), -1).gather(-1, out[R.COMPLETION_IDS][..., None])[..., 0]


@pytest.mark.parametrize("decode", ["fast", "hf"])
@pytest.mark.parametrize("kv", ["recompute", "keep"])
@pytest.mark.parametrize("tail", [0.0, 1.0], ids=["full", "heavy_tail"])
def test_mid_sequence_switch_stamps_versions_and_logprobs(decode: str, kv: str, tail: float) -> None:
    """heavy_tail: rows end at their budgets, some before the switch, so the switch (and the
    recompute) happens on a compacted decode batch (``HFEngine(compact=True)``)."""
    old, new = _model(0), _model(1)
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    engine = HFEngine(copy.deepcopy(old), TOK, decode=decode, inflight_kv=kv, version=3)
    switch = 5  # after token 4 is drawn: tokens 0..4 from v3, tokens 5.. from v7
    params = dataclasses.replace(PARAMS, heavy_tail=tail, max_new_tokens=40 if tail else 16)
    seed = 2 if tail else 0  # budgets 3 3 27 7 8 40: rows end before and after the switch
    out = engine.generate(ids, mask, params, seed=seed, poll_weights=_switch_at(switch, 7, _state(new)))
    if tail:
        lengths = out[R.COMPLETION_MASK].sum(1)
        assert (lengths < switch).any() and (lengths > switch + 1).any(), lengths
    valid, tv = out[R.COMPLETION_MASK], out[R.TOKEN_VERSIONS]
    assert tv.dtype == torch.int32 and engine.version == 7
    assert (tv[:, :switch] == 3).all() and (tv[:, switch:] == 7).all()
    assert out[R.COMPLETION_IDS].shape[1] > switch + 2, "every row finished before the switch"
    before = _teacher_forced(old, ids, mask, out)
    after = _teacher_forced(new, ids, mask, out)
    lb = out[R.BEHAVIOR_LOGPROBS]
    # tokens before the switch: the old weights' exact sampling distribution
    assert (before - lb)[:, :switch][valid[:, :switch]].abs().max() < 1e-5
    late = valid.clone()
    late[:, :switch] = False
    if kv == "recompute":  # pi_new(y_t | prefix) exactly: the prefix's K/V was rebuilt
        assert (after - lb)[late].abs().max() < 1e-5
    else:  # new weights on the old prefix K/V: neither version's distribution
        assert (after - lb)[late].abs().max() > 1e-3
    assert engine.fingerprints[7] == weights_fingerprint(policy_state(new))


@pytest.mark.parametrize("decode", ["fast", "hf"])
def test_polling_without_newer_weights_changes_nothing(decode: str) -> None:
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    engine = HFEngine(_model(0), TOK, decode=decode)
    plain = engine.generate(ids, mask, PARAMS, seed=4)
    polled = engine.generate(ids, mask, PARAMS, seed=4, poll_weights=lambda: None, poll_every=2)
    for key in plain:
        assert torch.equal(plain[key], polled[key]), key


def test_poll_every_k_steps_and_a_callback_that_claims_a_version() -> None:
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    engine = HFEngine(_model(0), TOK)
    calls: list[int] = []

    def poll():  # like the stage under skip_weight_load: the version moves, no state is handed over
        calls.append(1)
        if len(calls) == 2:
            engine.weights_updated(1)
        return None

    out = engine.generate(ids, mask, PARAMS, seed=0, poll_weights=poll, poll_every=3)
    tv = out[R.TOKEN_VERSIONS]
    assert (tv[:, :6] == 0).all() and (tv[:, 6:] == 1).all()  # checks after tokens 2 and 5
    with pytest.raises(ValueError, match="poll_every"):
        engine.generate(ids, mask, PARAMS, seed=0, poll_weights=poll, poll_every=0)


class StaleCacheEngine(HFEngine):
    """An engine whose fast decoder keeps its fused q/k/v and MLP copies across an in-flight load:
    the weights-derived state outlives the update (as a KV / prefix cache not flushed would)."""

    def _reload_decoder(self, dec: LlamaDecoder) -> None:
        pass


def _inflight_block(engine: HFEngine, poll) -> dict[str, np.ndarray]:
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    out = engine.generate(ids, mask, PARAMS, seed=0, poll_weights=poll)
    vfirst = torch.where(out[R.COMPLETION_MASK], out[R.TOKEN_VERSIONS], 2**30).min(1).values.long()
    n = ids.shape[0]
    return {
        R.SAMPLE_ID: np.arange(n),
        R.BLOCK_INDEX: np.zeros(n, dtype=np.int64),
        R.TOKEN_VERSIONS: out[R.TOKEN_VERSIONS].numpy(),
        R.COMPLETION_MASK: out[R.COMPLETION_MASK].numpy(),
        R.VERSION_FIRST: vfirst.numpy(),
        R.WEIGHTS_FINGERPRINT: stages.sample_fingerprints(
            engine, out[R.TOKEN_VERSIONS], out[R.COMPLETION_MASK], vfirst
        ),
        R.GEN_ENGINE: np.full(n, "hf (actor stale, pid 2)", dtype=object),
    }


def test_a_stale_decoder_cache_after_an_inflight_load_fails_the_provenance_check() -> None:
    learner, new = _model(0), _model(1)
    check = ProvenanceCheck("strict")
    check.record(0, policy_state(learner))
    check.record(1, policy_state(new))
    # the engine that rebuilds its derived state passes, its samples spanning v0 and v1
    good = HFEngine(copy.deepcopy(learner), TOK, decode="fast")
    metrics = check.check(_inflight_block(good, _switch_at(3, 1, _state(new))))
    assert metrics["provenance/checked"] == len(PROMPTS) and metrics["provenance/mismatches"] == 0
    # the one that keeps its old fused copies: its parameters hold v1, what it samples with does not
    stale = StaleCacheEngine(copy.deepcopy(learner), TOK, decode="fast")
    block = _inflight_block(stale, _switch_at(3, 1, _state(new)))
    assert weights_fingerprint(policy_state(stale.model)) == weights_fingerprint(policy_state(new))
    with pytest.raises(ProvenanceError, match=r"hf \(actor stale, pid 2\).*versions v0, v1"):
        check.check(block)


# --- the per-token staleness bound ------------------------------------------------------------
class SwitchingEngine:
    """A fake engine (no model): row tokens are stamped with the version it holds when each is
    drawn, and it loads every newer version the poll offers, at any step."""

    def __init__(self, version: int) -> None:
        self.version = version

    def generate(self, n_rows: int, length: int, lengths: np.ndarray, poll) -> dict[str, np.ndarray]:
        tv = np.empty((n_rows, length), dtype=np.int32)
        for t in range(length):
            tv[:, t] = self.version
            got = poll()
            if got is not None:
                self.version = got
        mask = np.arange(length)[None, :] < lengths[:, None]
        return {R.TOKEN_VERSIONS: tv, R.COMPLETION_MASK: mask}


@settings(max_examples=60, deadline=None)
@given(
    S=st.integers(0, 3),
    publish=st.lists(st.integers(0, 40), min_size=0, max_size=6),  # decode steps at which v moves
    extra=st.integers(0, 4),  # learner steps between generation start and consumption
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6),
)
def test_every_kept_token_lag_is_within_the_bound(S, publish, extra, lengths) -> None:
    v0 = 5
    engine = SwitchingEngine(v0)
    steps = iter(range(10_000))
    publish_at = sorted(publish)
    versions = {p: v0 + i + 1 for i, p in enumerate(publish_at)}

    def poll():
        return versions.get(next(steps))

    lengths_np = np.asarray(lengths)
    out = engine.generate(len(lengths), 12, lengths_np, poll)
    valid = out[R.COMPLETION_MASK]
    big = np.iinfo(np.int64).max
    vfirst = np.where(valid.any(1), np.where(valid, out[R.TOKEN_VERSIONS], big).min(1), v0)
    vlast = np.where(valid.any(1), np.where(valid, out[R.TOKEN_VERSIONS], -1).max(1), v0)
    learner = max(engine.version, v0) + extra
    batch = {
        R.SAMPLE_ID: np.arange(len(lengths)),
        R.GROUP_ID: np.arange(len(lengths)),
        R.VERSION_FIRST: vfirst,
        R.VERSION_LAST: vlast,
        **out,
    }
    keep = BoundedStaleness(max_lag=S).keep(sample_info(batch), learner)
    token_lag = learner - out[R.TOKEN_VERSIONS]
    assert (token_lag[keep][valid[keep]] <= S).all()
    # and nothing is dropped that satisfies the bound on every token
    ok = np.where(valid, token_lag <= S, True).all(1) & (learner - vfirst <= S)
    assert (keep == ok).all()


def test_the_gate_bounds_the_oldest_token_even_if_version_first_is_wrong() -> None:
    """``sample_info`` takes the oldest valid token's version: a sample whose column claims a
    newer first version than its tokens carry is dropped by its oldest token."""
    tv = np.array([[2, 2, 4, 4], [4, 4, 4, 0]], dtype=np.int32)
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=bool)  # row 1's version-0 slot is padding
    batch = {
        R.SAMPLE_ID: np.arange(2),
        R.GROUP_ID: np.arange(2),
        R.VERSION_FIRST: np.array([4, 4]),  # row 0 claims v4, its first tokens are v2
        R.VERSION_LAST: np.array([4, 4]),
        R.TOKEN_VERSIONS: tv,
        R.COMPLETION_MASK: mask,
    }
    info = sample_info(batch)
    assert info.version_first.tolist() == [2, 4]
    assert BoundedStaleness(max_lag=1).keep(info, 4).tolist() == [False, True]


def test_token_lag_columns_and_histogram() -> None:
    tv = np.array([[3, 3, 5, 6], [6, 6, 6, -1], [0, 0, 0, 0]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=bool)
    cols = token_lag_columns(tv, mask, 6)
    assert cols["token_lag_min"].tolist() == [0, 0, -1] and cols["token_lag_max"].tolist() == [3, 0, -1]
    assert cols["token_lag_mean"][0] == pytest.approx((3 + 3 + 1 + 0) / 4)
    assert np.isnan(cols["token_lag_mean"][2])
    assert cols["token_lag_counts"][0].tolist() == [1, 1, 0, 2, 0, 0, 0]  # lags 0, 1, 3, 3
    hist = token_lag_histogram(cols["token_lag_counts"])
    assert hist["staleness/token_lag_hist/0"] == 4 and hist["staleness/token_lag_hist/3-4"] == 2
    assert len(hist) == len(LAG_BUCKETS)
    with pytest.raises(ValueError, match="above the learner version"):
        token_lag_columns(tv, mask, 5)


def test_pack_rollout_takes_per_token_versions() -> None:
    draws = torch.zeros((2, 3, 1), dtype=torch.int64)
    versions = torch.tensor([[0, 1, 1], [0, 0, 2]])
    mask = torch.ones((2, 3), dtype=torch.bool)
    out = pack_rollout(draws, torch.zeros((2, 3, 1)), mask, version=versions, mc_samples=0)
    assert out[R.TOKEN_VERSIONS].dtype == torch.int32 and out[R.TOKEN_VERSIONS].tolist() == versions.tolist()


# --- the generation stage's poll and its faults ------------------------------------------------
class Watch:
    """Stand-in for ``VersionWatch``: newer weights at the given check numbers."""

    def __init__(self, offers: dict[int, tuple[int, dict]]) -> None:
        self.offers, self.n = offers, 0

    def poll(self):
        self.n += 1
        return self.offers.get(self.n)


def _stage(engine, faults=stages.NO_FAULTS) -> stages.Generate:
    g = stages.Generate.__new__(stages.Generate)
    g.engine, g.faults, g.loads, g.have_version = engine, faults, 0, engine.version
    g.inflight_updates, g.inflight_polls, g.inflight_loads, g.inflight_poll_steps = True, 0, 0, 1
    g.store = None
    return g


def test_stage_poll_loads_through_the_stage_and_skips_pinned_blocks(monkeypatch) -> None:
    new = _model(1)
    engine = HFEngine(_model(0), TOK)
    g = _stage(engine)
    monkeypatch.setattr(stages, "VersionWatch", lambda store, have: Watch({2: (4, _state(new))}))
    assert g._poll_weights({"behavior_version": 2}) is None  # a pinned version is used throughout
    poll = g._poll_weights({"behavior_version": None})
    assert poll() is None and poll() is None  # the stage loads the weights itself
    assert engine.version == 4 and g.have_version == 4 and g.loads == 1 and g.inflight_loads == 1
    g.inflight_updates = False
    assert g._poll_weights({"behavior_version": None}) is None


def test_engine_dies_mid_sequence_fault_raises_engine_dead(tmp_path, monkeypatch) -> None:
    from asyncrl.faults import FaultConfig, Faults

    engine = HFEngine(_model(0), TOK)
    g = _stage(engine, Faults(FaultConfig(engine_dies_mid_sequence=3), str(tmp_path)))
    monkeypatch.setattr(stages, "VersionWatch", lambda store, have: Watch({}))
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    with pytest.raises(EngineDeadError, match="engine_dies_mid_sequence"):
        engine.generate(ids, mask, PARAMS, seed=0, poll_weights=g._poll_weights({"behavior_version": None}))
    assert g.inflight_polls == 3 and (tmp_path / "engine_dies_mid_sequence").exists()


# --- build-time refusals ------------------------------------------------------------------------
def test_config_refuses_colocate_and_fixed_lag_with_inflight_updates() -> None:
    from asyncrl.config import PipelineConfig

    assert PipelineConfig(inflight_updates=True).inflight_updates
    with pytest.raises(ConfigError, match="colocate"):
        PipelineConfig(inflight_updates=True, colocate=True)
    with pytest.raises(ConfigError, match="lag_mode=fixed"):
        PipelineConfig(inflight_updates=True, lag_mode="fixed")
    with pytest.raises(ConfigError, match="inflight_poll_steps"):
        PipelineConfig(inflight_poll_steps=0)


def test_engines_state_whether_they_update_in_flight() -> None:
    assert supports_inflight(HFEngine) and not supports_inflight(VLLMEngine)
    with pytest.raises(ValueError, match=r"inflight_updates is not supported by pipeline\.engine=vllm"):
        VLLMEngine.check_supported(None, PARAMS, inflight_updates=True)
    with pytest.raises(ValueError, match="inflight_kv"):
        HFEngine.check_supported(None, PARAMS, inflight_kv="flush")


def test_the_plan_refuses_inflight_updates_for_an_engine_that_cannot_poll() -> None:
    from pathlib import Path

    from asyncrl.config import load_config
    from asyncrl.plan import check_components

    repo = Path(__file__).resolve().parents[1]

    def config(*overrides: str):
        return load_config(repo / "examples" / "configs" / "opd_tiny.yaml", list(overrides))

    check_components(config("pipeline.inflight_updates=true"), None)  # hf: polls between steps
    user = "pipeline.engine=test_engine_dotted:FakeEngine"  # generate(..., *, seed) only
    check_components(config(user), None)
    with pytest.raises(ConfigError, match=r"takes no generate\(\.\.\., poll_weights=\.\.\.\)"):
        check_components(config(user, "pipeline.inflight_updates=true"), None)
    with pytest.raises(ConfigError, match="colocate"):
        config("pipeline.inflight_updates=true", "pipeline.colocate=true")
