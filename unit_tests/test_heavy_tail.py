"""``sampling.heavy_tail``: per-completion token budgets from a truncated Pareto law.

- the budgets: within ``[ceil(N / 16), N]``, a function of the seed alone, the tail law
  ``P(L >= x) = (L_0 / x)^alpha`` (checked against its exact values), off by default;
- the HF engine (fast decoder and the model's own forward) stops every row at EOS or its budget,
  and the tokens and behavior log-probs it keeps are exactly those of the same call without the
  option (truncation leaves the per-token distribution alone, so importance ratios stay exact);
- the generation stage refuses an engine that ignores the option, naming it and the setting.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import records as R
from asyncrl import stages
from asyncrl.configurable import ConfigError
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.workloads.tasks import encode_prompts
from asyncrl.workloads.tokenizer import char_tokenizer

torch.set_num_threads(1)
TOK = char_tokenizer()
PROMPTS = ["12+34=", "7+8=", "hello world=", "a", "99+99=", "xyz=", "5+5=", "q"]


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 64),
    cap=st.integers(1, 512),
    alpha=st.floats(0.1, 8.0),
    seed=st.integers(-(2**40), 2**40),
)
def test_budgets_lie_in_their_range_and_depend_on_the_seed_alone(n, cap, alpha, seed) -> None:
    p = SamplingParams(max_new_tokens=cap, heavy_tail=alpha)
    b = p.token_budgets(n, seed)
    assert b is not None and b.shape == (n,) and b.dtype == np.int64
    assert (b >= math.ceil(cap / 16)).all() and (b <= cap).all()
    assert np.array_equal(b, p.token_budgets(n, seed))
    # the first rows of a longer block draw the same budgets (one stream per seed)
    assert np.array_equal(b, p.token_budgets(n + 5, seed)[:n])


def test_budgets_follow_the_truncated_pareto_law() -> None:
    cap, alpha, n = 256, 1.0, 200_000
    b = SamplingParams(max_new_tokens=cap, heavy_tail=alpha).token_budgets(n, seed=7)
    l0 = math.ceil(cap / 16)
    for x in (l0 + 1, 2 * l0, 64, 128, cap):
        want = (l0 / x) ** alpha  # P(L >= x) for integer x: floor(l0 U^-1/a) >= x  <=>  l0 U^-1/a >= x
        got = float((b >= x).mean())
        assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / n) + 1e-9, (x, got, want)
    # a heavier tail (smaller alpha) puts more completions at the cap
    heavier = SamplingParams(max_new_tokens=cap, heavy_tail=0.5).token_budgets(n, seed=7)
    assert (heavier == cap).mean() > (b == cap).mean()


def test_budgets_are_off_by_default_and_bad_values_are_refused() -> None:
    assert SamplingParams(max_new_tokens=8).token_budgets(4, 0) is None
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="heavy_tail"):
            SamplingParams(max_new_tokens=8, heavy_tail=bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(heavy_tail=1.0).token_budgets(4, 0)


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "static"])
@pytest.mark.parametrize("decode", ["fast", "hf"])
def test_hf_engine_stops_each_row_at_its_budget_and_keeps_the_same_tokens(decode: str, compact: bool) -> None:
    """Budgets cut rows and change nothing else: the same draws (one uniform stream for all rows,
    finished rows in the batch or not); with compaction a row's log-probs come from a smaller
    batch's matmuls, equal to float rounding (a draw could flip where rounding moves a CDF
    boundary past its uniform; with this 2-layer model's small vocabulary none does here)."""
    spec = ModelSpec("llama", hidden=32, layers=2, heads=4, intermediate=64, max_positions=128)
    model = build_model(spec, len(TOK), 0).eval()
    engine = HFEngine(model, TOK, decode=decode, compact=compact)
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    plain = SamplingParams(max_new_tokens=48, temperature=1.0, mc_samples=2)
    tail = SamplingParams(max_new_tokens=48, temperature=1.0, mc_samples=2, heavy_tail=1.0)
    full = engine.generate(ids, mask, plain, seed=3)
    cut = engine.generate(ids, mask, tail, seed=3)
    budgets = tail.token_budgets(len(PROMPTS), 3)
    lengths = cut[R.COMPLETION_MASK].sum(1).numpy()
    full_len = full[R.COMPLETION_MASK].sum(1).numpy()
    assert (lengths == np.minimum(full_len, budgets)).all()
    assert (lengths < full_len).any(), "no row was cut: the test would not see a budget"
    T = cut[R.COMPLETION_IDS].shape[1]
    m = cut[R.COMPLETION_MASK]
    for key in (R.COMPLETION_IDS, R.MC_IDS):
        assert torch.equal(cut[key][m], full[key][:, :T][m]), key
    for key in (R.BEHAVIOR_LOGPROBS, R.MC_BEHAVIOR_LOGPROBS):
        if compact:
            torch.testing.assert_close(cut[key][m], full[key][:, :T][m], rtol=0, atol=1e-5)
        else:
            assert torch.equal(cut[key][m], full[key][:, :T][m]), key


@pytest.mark.parametrize("decode", ["fast", "hf"])
def test_finished_rows_leave_the_decode_batch(decode: str, monkeypatch) -> None:
    """With ``compact`` each decode step runs only the rows still generating: the step after token
    t has as many rows as completions longer than t + 1; without it every step runs all B."""
    from asyncrl.engines import hf

    spec = ModelSpec("llama", hidden=32, layers=2, heads=4, intermediate=64, max_positions=128)
    model = build_model(spec, len(TOK), 0).eval()
    ids, mask = encode_prompts(TOK, PROMPTS, 16)
    tail = SamplingParams(max_new_tokens=48, temperature=1.0, heavy_tail=1.0)
    cls = hf.LlamaDecoder if decode == "fast" else hf._ModelDecoder
    real_step = cls.step
    for compact in (True, False):
        rows: list[int] = []

        def step(self, token_ids, t, rows=rows):
            rows.append(int(token_ids.shape[0]))
            return real_step(self, token_ids, t)

        monkeypatch.setattr(cls, "step", step)
        out = HFEngine(model, TOK, decode=decode, compact=compact).generate(ids, mask, tail, seed=3)
        lengths = out[R.COMPLETION_MASK].sum(1)
        if compact:
            assert rows == [int((lengths > t + 1).sum()) for t in range(len(rows))]
            assert rows[-1] < len(PROMPTS), "no row finished early: nothing to compact"
        else:
            assert set(rows) == {len(PROMPTS)}
        assert len(rows) == int(lengths.max()) - 1


class _IgnoresBudgets:
    """An engine that generates to ``max_new_tokens`` whatever ``heavy_tail`` says."""

    version = 0

    def generate(self, prompt_ids, prompt_mask, params, *, seed):
        B, N = prompt_ids.shape[0], params.max_new_tokens
        return {
            R.COMPLETION_IDS: torch.ones((B, N), dtype=torch.int64),
            R.COMPLETION_MASK: torch.ones((B, N), dtype=torch.bool),
            R.BEHAVIOR_LOGPROBS: torch.zeros((B, N)),
            R.TOKEN_VERSIONS: torch.zeros((B, N), dtype=torch.int32),
        }


def test_the_stage_refuses_an_engine_that_ignores_the_budgets() -> None:
    g = stages.Generate.__new__(stages.Generate)
    g.engine = _IgnoresBudgets()
    g.params = SamplingParams(max_new_tokens=64, heavy_tail=1.0)
    mask = g.engine.generate(torch.ones((8, 4)), None, g.params, seed=0)[R.COMPLETION_MASK]
    with pytest.raises(ValueError, match=r"_IgnoresBudgets ignored sampling.heavy_tail.*heavy_tail=0"):
        g._check_budgets(mask, seed=0)
    g.params = SamplingParams(max_new_tokens=64)  # off: nothing to check
    g._check_budgets(mask, seed=0)
    g.params = SamplingParams(max_new_tokens=64, heavy_tail=1.0)
    b = torch.as_tensor(g.params.token_budgets(8, 0))
    g._check_budgets(torch.arange(64)[None, :] < b[:, None], seed=0)  # exactly at the budget: fine
