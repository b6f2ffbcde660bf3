"""Continuous batching across rollouts (``asyncrl.engines.continuous.ContinuousBatcher``,
``pipeline.continuous_batching``): several blocks' rows decoded in shared steps.

- ``step_together`` gives each decoder the logits of its own ``step`` (float rounding);
- a rollout decoded beside others (joined mid-flight, at a known step) samples the same tokens
  with the same log-probs as alone, and its behavior log-probs are the model's teacher-forced ones;
- a block admitted with newer weights switches the rollouts already decoding (in-flight update):
  their later tokens carry the new version and, with the prefix recomputed, its exact log-probs;
- a bad request fails alone; a dead engine (its poll raising) fails every request, now and later;
- an engine without the fast decode path is refused, naming the fix;
- a step floor (``HFEngine(step_latency_s=...)``) paces own and fused steps and changes no draw.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import records as R
from asyncrl.engines.base import EngineDeadError, SamplingParams
from asyncrl.engines.continuous import ContinuousBatcher
from asyncrl.engines.hf import HFEngine
from asyncrl.engines.llama_decode import LlamaDecoder, step_together
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.workloads.tasks import encode_prompts
from asyncrl.workloads.tokenizer import char_tokenizer

torch.set_num_threads(1)
TOK = char_tokenizer()
PROMPTS_A = ["12+34=", "7+8=", "hello world=", "a"]
PROMPTS_B = ["99+99=", "xyz=", "5+5=", "abc+def="]
# heavy tails: rows end at their own budgets, so rollouts overlap with few live rows each
PARAMS = SamplingParams(max_new_tokens=40, temperature=1.0, heavy_tail=1.0)


def _model(seed: int = 0, arch: str = "llama") -> torch.nn.Module:
    spec = ModelSpec(arch, hidden=32, layers=2, heads=4, intermediate=64, max_positions=96)
    return build_model(spec, len(TOK), seed).eval()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _teacher_forced(model, ids, mask, out) -> torch.Tensor:
    with torch.no_grad():
        z = R.completion_logits(model, ids, mask, out[R.COMPLETION_IDS], out[R.COMPLETION_MASK])
    return torch.log_softmax(z.float(), -1).gather(-1, out[R.COMPLETION_IDS][..., None])[..., 0]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert torch.equal(a[R.COMPLETION_IDS], b[R.COMPLETION_IDS])
    assert torch.equal(a[R.COMPLETION_MASK], b[R.COMPLETION_MASK])
    assert torch.allclose(a[R.BEHAVIOR_LOGPROBS], b[R.BEHAVIOR_LOGPROBS], atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_step_together_equals_each_decoders_own_step(arch: str) -> None:
    model = _model(0, arch)
    a_ids, a_mask = encode_prompts(TOK, PROMPTS_A, 16)
    b_ids, b_mask = encode_prompts(TOK, PROMPTS_B[:3], 12)  # other width, other batch
    with torch.inference_mode():
        alone, fused = [], []
        for dec_list in (alone, fused):
            for ids, mask in ((a_ids, a_mask), (b_ids, b_mask)):
                dec = LlamaDecoder(model)
                dec.start(ids, mask, R.position_ids(mask), 8)
                dec_list.append(dec)
        fused[1].adopt_weights(fused[0])
        toks = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])]
        for t in range(3):  # b is one token behind a: its own slot
            ts = [t + 1, t]
            want = [d.step(tok, tt) for d, tok, tt in zip(alone, toks, ts)]
            got = step_together(fused, toks, ts)
            for w, g in zip(want, got):
                assert torch.allclose(w, g, atol=1e-5), (w - g).abs().max()
    with pytest.raises(ValueError, match="adopt_weights"):
        step_together([alone[0], alone[1]], toks, [0, 0])


def test_a_rollout_joined_mid_flight_samples_what_it_samples_alone() -> None:
    model = _model(0)
    engine = HFEngine(copy.deepcopy(model), TOK)
    a_ids, a_mask = encode_prompts(TOK, PROMPTS_A, 16)
    b_ids, b_mask = encode_prompts(TOK, PROMPTS_B, 16)
    alone_a = engine.generate(a_ids, a_mask, PARAMS, seed=1)  # lengths 5 6 3 40
    alone_b = engine.generate(b_ids, b_mask, PARAMS, seed=5)
    assert alone_a[R.COMPLETION_MASK].sum(1).max() > 8, "rollout A must outlive the join"

    futures = {}
    polls = []

    def poll():  # runs in the batcher's thread between steps: B joins at A's 4th step
        polls.append(1)
        if len(polls) == 4:
            futures["b"] = batcher.submit(b_ids, b_mask, PARAMS, seed=5)
        return None

    batcher = ContinuousBatcher(engine, poll=poll)
    try:
        futures["a"] = batcher.submit(a_ids, a_mask, PARAMS, seed=1)
        done_a, done_b = futures["a"].result(timeout=60), futures["b"].result(timeout=60)
        got_a, got_b = done_a.columns, done_b.columns
    finally:
        batcher.close()
    _assert_same(got_a, alone_a)
    _assert_same(got_b, alone_b)
    assert batcher.most_rollouts == 2, batcher.stats()
    # the steps they shared count for both; A's first steps (before B joined) it took alone
    assert done_a.shared_steps == done_b.shared_steps > 0
    assert done_a.shared_steps <= done_a.steps - 4 and 0 < done_a.shared_frac < 1
    for ids, mask, out in ((a_ids, a_mask, got_a), (b_ids, b_mask, got_b)):
        valid = out[R.COMPLETION_MASK]
        diff = (_teacher_forced(model, ids, mask, out) - out[R.BEHAVIOR_LOGPROBS])[valid]
        assert diff.abs().max() < 1e-5
        assert (out[R.TOKEN_VERSIONS] == 0).all()


def test_concurrent_submits_from_threads_all_finish_exactly() -> None:
    """Ray Data's threads (``max_concurrent_calls_per_actor``) submit at any time."""
    engine = HFEngine(_model(0), TOK)
    blocks = [encode_prompts(TOK, PROMPTS_A if i % 2 else PROMPTS_B, 16) for i in range(6)]
    alone = [engine.generate(ids, mask, PARAMS, seed=10 + i) for i, (ids, mask) in enumerate(blocks)]
    batcher = ContinuousBatcher(engine)
    results: dict[int, dict] = {}

    def call(i: int) -> None:
        results[i] = batcher.submit(*blocks[i], PARAMS, seed=10 + i).result(timeout=120).columns

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(blocks))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    batcher.close()
    assert sorted(results) == list(range(len(blocks)))
    for i, out in enumerate(alone):
        _assert_same(results[i], out)


def test_a_step_floor_paces_every_decode_step_and_changes_no_draw() -> None:
    """``step_latency_s`` (a study tool emulating an accelerator's flat step cost): every decode
    step lasts at least the floor, a rollout's own and a fused one alike (one floor per fused
    step, however many rollouts share it), and the tokens are those drawn without it."""
    a_ids, a_mask = encode_prompts(TOK, PROMPTS_A, 16)
    b_ids, b_mask = encode_prompts(TOK, PROMPTS_B, 16)
    free = HFEngine(_model(0), TOK)
    alone_a = free.generate(a_ids, a_mask, PARAMS, seed=1)
    alone_b = free.generate(b_ids, b_mask, PARAMS, seed=5)
    floor = 0.01
    paced = HFEngine(_model(0), TOK, step_latency_s=floor)
    t0 = time.perf_counter()
    got = paced.generate(a_ids, a_mask, PARAMS, seed=1)
    took = time.perf_counter() - t0
    _assert_same(got, alone_a)
    steps = int(got[R.COMPLETION_MASK].sum(1).max()) - 1  # the first token comes from the prefill
    assert steps > 8 and took >= steps * floor, (steps, took)

    batcher = ContinuousBatcher(paced)
    try:
        t0 = time.perf_counter()
        futures = [
            batcher.submit(a_ids, a_mask, PARAMS, seed=1),
            batcher.submit(b_ids, b_mask, PARAMS, seed=5),
        ]
        done = [f.result(timeout=60) for f in futures]
        took = time.perf_counter() - t0
    finally:
        batcher.close()
    _assert_same(done[0].columns, alone_a)
    _assert_same(done[1].columns, alone_b)
    assert done[0].shared_steps > 0 and took >= batcher.steps * floor, (batcher.steps, took)
    for bad in (-0.1, "fast", True):
        with pytest.raises(ValueError, match="step_latency_s"):
            HFEngine(_model(0), TOK, step_latency_s=bad)


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_a_block_with_newer_weights_switches_the_rollouts_decoding(kv: str) -> None:
    old, new = _model(0), _model(1)
    engine = HFEngine(copy.deepcopy(old), TOK, inflight_kv=kv, version=3)
    a_ids, a_mask = encode_prompts(TOK, PROMPTS_A, 16)
    b_ids, b_mask = encode_prompts(TOK, PROMPTS_B, 16)
    params = dataclasses.replace(PARAMS, heavy_tail=0.0, max_new_tokens=16)  # every row outlives the join
    futures, polls = {}, []

    def poll():  # B is submitted at the check after A's token 4, admitted with version 7
        polls.append(1)
        if len(polls) == 5:
            futures["b"] = batcher.submit(b_ids, b_mask, params, seed=1, weights=(7, _state(new)))
        return None

    batcher = ContinuousBatcher(engine, poll=poll)
    try:
        futures["a"] = batcher.submit(a_ids, a_mask, params, seed=0)
        out_a, out_b = futures["a"].result(timeout=60).columns, futures["b"].result(timeout=60).columns
    finally:
        batcher.close()
    switch = 6  # B joins the round after (token 5 drawn): A's tokens 0..5 under v3, 6.. under v7
    tv = out_a[R.TOKEN_VERSIONS]
    assert (tv[:, :switch] == 3).all() and (tv[:, switch:] == 7).all()
    assert (out_b[R.TOKEN_VERSIONS] == 7).all() and engine.version == 7
    valid, lb = out_a[R.COMPLETION_MASK], out_a[R.BEHAVIOR_LOGPROBS]
    before, after = _teacher_forced(old, a_ids, a_mask, out_a), _teacher_forced(new, a_ids, a_mask, out_a)
    assert (before - lb)[:, :switch][valid[:, :switch]].abs().max() < 1e-5
    late = valid.clone()
    late[:, :switch] = False
    if kv == "recompute":
        assert (after - lb)[late].abs().max() < 1e-5
    else:  # new weights over the old prefix K/V
        assert (after - lb)[late].abs().max() > 1e-3
    b_valid = out_b[R.COMPLETION_MASK]
    assert (_teacher_forced(new, b_ids, b_mask, out_b) - out_b[R.BEHAVIOR_LOGPROBS])[
        b_valid
    ].abs().max() < 1e-5


def test_a_bad_request_fails_alone_and_a_dead_engine_fails_everything() -> None:
    engine = HFEngine(_model(0), TOK)
    ids, mask = encode_prompts(TOK, PROMPTS_A, 16)
    batcher = ContinuousBatcher(engine)
    bad = batcher.submit(ids, mask[:, :3], PARAMS, seed=0)  # mask of another shape
    good = batcher.submit(ids, mask, PARAMS, seed=0)
    with pytest.raises(ValueError):
        bad.result(timeout=60)
    assert good.result(timeout=60).columns[R.COMPLETION_IDS].shape[0] == len(PROMPTS_A)
    batcher.close()

    polls = []

    def dying_poll():
        polls.append(1)
        if len(polls) == 3:
            raise EngineDeadError("fault injected: the engine died mid-rollout")
        return None

    params = dataclasses.replace(PARAMS, heavy_tail=0.0)
    batcher = ContinuousBatcher(engine, poll=dying_poll)
    first = batcher.submit(ids, mask, params, seed=0)
    with pytest.raises(EngineDeadError):
        first.result(timeout=60)
    with pytest.raises(EngineDeadError):
        batcher.submit(ids, mask, params, seed=1).result(timeout=5)


def test_an_engine_without_the_fast_path_is_refused() -> None:
    with pytest.raises(ValueError, match="continuous_batching=false"):
        ContinuousBatcher(HFEngine(_model(0), TOK, decode="hf"))


# --- the generation stage with continuous batching (no Ray: a stand-in store) ---------------------
class Store:
    def __init__(self, pin: int | None = None) -> None:
        self.pin = pin

    def acquire(self, n, block_index, timeout_s, stream=None, have=None):
        admitted = {"ticket": block_index, "version": 0, "expected_version": 1, "behavior_version": self.pin}
        return {**admitted, "weights": None}


def _continuous_stage(engine: HFEngine, store: Store):
    from asyncrl import stages

    g = stages.Generate.__new__(stages.Generate)
    g.engine, g.store, g.seed, g.admit_timeout_s = engine, store, 0, 1.0
    g.params = PARAMS
    g.have_version, g.admissions, g.max_engine_restarts, g.loads = engine.version, 0, 0, 0
    g.stream, g.faults, g.identity = None, stages.NO_FAULTS, "hf (test)"
    g.inflight_updates, g.inflight_polls, g.inflight_loads = True, 0, 0
    g.batcher = ContinuousBatcher(engine, load=g._load)
    return g


def _block(index: int, prompts: list[str]) -> dict:
    import numpy as np

    ids, mask = encode_prompts(TOK, prompts, 16)
    n = len(prompts)
    return {
        R.SAMPLE_ID: np.arange(index * n, (index + 1) * n),
        R.BLOCK_INDEX: np.full(n, index),
        R.PROMPT_IDS: ids.numpy(),
        R.PROMPT_MASK: mask.numpy(),
    }


def test_the_stage_runs_two_blocks_at_once_each_as_generated_alone() -> None:
    from asyncrl import stages

    engine = HFEngine(_model(0), TOK)
    blocks = [_block(i, PROMPTS_A if i % 2 else PROMPTS_B) for i in range(4)]
    g = _continuous_stage(engine, Store())
    out: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, g(blocks[i]))) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    g.batcher.close()
    assert sorted(out) == [0, 1, 2, 3]
    for i, b in enumerate(blocks):
        seed = stages.batch_seed(0, b[R.SAMPLE_ID])
        alone = engine.generate(
            torch.as_tensor(b[R.PROMPT_IDS]), torch.as_tensor(b[R.PROMPT_MASK]), PARAMS, seed=seed
        )
        width = alone[R.COMPLETION_IDS].shape[1]
        assert (out[i][R.COMPLETION_IDS][:, :width] == alone[R.COMPLETION_IDS].numpy()).all()
        assert (out[i][R.SAMPLE_ID] == b[R.SAMPLE_ID]).all()
        assert (out[i][R.VERSION_FIRST] == 0).all() and (out[i][R.VERSION_LAST] == 0).all()


def test_the_stage_refuses_a_pinned_behavior_version() -> None:
    g = _continuous_stage(HFEngine(_model(0), TOK), Store(pin=0))
    try:
        with pytest.raises(ValueError, match="lag_mode=bound"):
            g(_block(0, PROMPTS_A))
    finally:
        g.batcher.close()


def test_config_and_plan_checks_name_the_fix() -> None:
    from asyncrl.config import PipelineConfig
    from asyncrl.configurable import ConfigError

    assert PipelineConfig(continuous_batching=True, inflight_updates=True).continuous_batching
    with pytest.raises(ConfigError, match="inflight_updates=true"):
        PipelineConfig(continuous_batching=True)
    with pytest.raises(ConfigError, match="continuous_blocks"):
        PipelineConfig(continuous_batching=True, inflight_updates=True, continuous_blocks=1)
    with pytest.raises(ValueError, match="decode='hf'"):
        HFEngine.check_supported(None, PARAMS, continuous_batching=True, decode="hf")
    with pytest.raises(ValueError, match="lora_merge=false"):
        HFEngine.check_supported(None, PARAMS, continuous_batching=True, lora={"rank": 4}, lora_merge=False)


def test_an_engine_death_under_two_blocks_exits_once_and_counts_once(tmp_path, monkeypatch) -> None:
    """``engine_dies_mid_sequence`` in the batcher's check: both blocks' calls see the death; the
    first reports it and exits the process (Ray restarts the actor, both blocks are retried under
    their admissions), the other waits behind it and never reports it a second time."""
    from asyncrl import stages
    from asyncrl.faults import FaultConfig, Faults

    class DyingStore(Store):
        deaths = 0

        def engine_died(self) -> int:
            self.deaths += 1
            return self.deaths

    class NoNews:
        have = 0

        def poll(self):
            return None

    exited, release = threading.Event(), threading.Event()

    def fake_exit(code: int) -> None:  # os._exit never returns: hold this thread, as the process would end
        exited.set()
        release.wait(60)
        raise SystemExit(code)

    monkeypatch.setattr(stages, "_exit_process", fake_exit)
    monkeypatch.setattr(stages, "_DYING", threading.Lock())  # this test's own
    store = DyingStore()
    engine = HFEngine(_model(0), TOK)
    g = _continuous_stage(engine, store)
    g.batcher.close()
    g.faults = Faults(FaultConfig(engine_dies_mid_sequence=12), str(tmp_path))
    g.max_engine_restarts = 3
    g._watch = NoNews()
    g.batcher = ContinuousBatcher(engine, load=g._load, poll=g._batcher_poll)
    params = dataclasses.replace(PARAMS, heavy_tail=0.0)  # both blocks still decoding at the 12th check
    g.params = params

    def call(block: dict) -> None:
        with pytest.raises(SystemExit):  # the fake exit, once released
            g(block)

    threads = [threading.Thread(target=call, args=(_block(i, PROMPTS_A),), daemon=True) for i in range(2)]
    for th in threads:
        th.start()
    assert exited.wait(60), "no thread exited the process"
    for th in threads:
        th.join(2)
    # both blocks saw the death: one thread is in the exit, the other waits behind it, uncounted
    assert all(th.is_alive() for th in threads) and store.deaths == 1 and g.inflight_polls == 12
    release.set()  # end the test's threads
    for th in threads:
        th.join(10)


class PollingEngine(HFEngine):
    """An engine that updates in flight but cannot step several rollouts together."""

    supports_continuous_batching = False


def test_the_plan_refuses_continuous_batching_for_an_engine_that_cannot_share_steps() -> None:
    from pathlib import Path

    from asyncrl.config import load_config
    from asyncrl.configurable import ConfigError
    from asyncrl.plan import check_components

    repo = Path(__file__).resolve().parents[1]

    def config(*overrides: str):
        on = ("pipeline.inflight_updates=true", "pipeline.continuous_batching=true")
        return load_config(repo / "examples" / "configs" / "opd_tiny.yaml", [*on, *overrides])

    check_components(config(), None)  # hf
    with pytest.raises(ConfigError, match="cannot decode several blocks in shared steps"):
        check_components(config("pipeline.engine=test_continuous_batching:PollingEngine"), None)


_HYP_MODEL = _model(3)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(1, 4), st.integers(2, 10), st.integers(0, 4)), min_size=1, max_size=3
    ),
    seed=st.integers(0, 2**16),
)
def test_step_together_matches_own_steps_for_any_mix_of_rollouts(shapes, seed) -> None:
    """Any number of decoders, each with its own batch, prompt width and position in its rollout:
    the fused step's logits are each decoder's own step's, to float rounding."""
    g = torch.Generator().manual_seed(seed)
    alone, fused, toks, ts = [], [], [], []
    with torch.inference_mode():
        for rows, width, t in shapes:
            ids = torch.randint(1, len(TOK), (rows, width), generator=g)
            mask = torch.ones(rows, width, dtype=torch.bool)
            mask[0, : width // 2] = False  # one left-padded row
            history = torch.randint(1, len(TOK), (rows, t + 1), generator=g)
            pair = []
            for _ in range(2):
                dec = LlamaDecoder(_HYP_MODEL)
                dec.start(ids, mask, R.position_ids(mask), t + 2)
                for j in range(t):  # walk to token t
                    dec.step(history[:, j], j)
                pair.append(dec)
            alone.append(pair[0])
            fused.append(pair[1])
            toks.append(history[:, t])
            ts.append(t)
        for dec in fused[1:]:
            dec.adopt_weights(fused[0])
        got = step_together(fused, toks, ts)
        for dec, tok, t, logits in zip(alone, toks, ts, got):
            assert torch.allclose(dec.step(tok, t), logits, atol=1e-5)
