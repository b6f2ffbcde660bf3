"""The bias instruments (asyncrl.telemetry.gradients) on a tabular model whose bias is known exactly.

The tabular LM (``tabular.py``) has V = 3 tokens and completions of T = 2, so every expectation over
completions (rows) and over Monte Carlo draws is a finite sum. Checked here:

- the probe's cross-product ``B`` on a batch equals the formula over its row groups' error sums;
- ``E[B]`` over random batches is the exact squared bias ``‖E[ĝ] − E[g]‖²`` per token: 0 for the
  online reverse-KL MC estimator on-policy (unclipped), and non-zero (and matched) for the stale
  advantage off-policy and for top-1 reverse KL with the tail dropped;
- the seed-clustered bootstrap gives an upper bound consistent with 0 for the unbiased estimator and
  a lower bound above 0 for the biased ones (the one-sided "unbiased" rule);
- ``frozen_theta`` at fixed states: its bias and variance match exact enumeration over the draws,
  and the variance falls as 1/m.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from tabular import PROMPT_TOKEN, TabularLM, log_policy, n_states, sequences, states_along

from asyncrl import records as R
from asyncrl.estimators import build
from asyncrl.lab.stats import cluster_bootstrap_ratio
from asyncrl.telemetry import gradients as G
from asyncrl.telemetry import names as N

V, T = 3, 2
f64 = torch.float64
torch.set_num_threads(1)


def _tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student, stale behavior and teacher tables [S, V]."""
    g = torch.Generator().manual_seed(seed)
    S = n_states(V, T)
    student = torch.randn(S, V, generator=g, dtype=f64)
    behavior = student + 0.8 * torch.randn(S, V, generator=g, dtype=f64)
    teacher = 1.5 * torch.randn(S, V, generator=g, dtype=f64)
    return student, behavior, teacher


def _batch(
    ys: torch.Tensor, behavior: torch.Tensor, teacher: torch.Tensor, mc_ids: torch.Tensor | None = None
):
    """Record columns for completions ``ys`` [N, T]: one MC column = the generated token (or ``mc_ids``
    [N, T, m]), behavior log-probs under ``behavior``, the teacher's full logits, top-k of the teacher."""
    st = states_along(ys, V)
    lb, lp = log_policy(behavior), log_policy(teacher)
    ids = ys.unsqueeze(-1) if mc_ids is None else mc_ids
    n = len(ys)
    topk = lp[st].topk(1, dim=-1)
    return {
        R.PROMPT_IDS: torch.full((n, 1), PROMPT_TOKEN, dtype=torch.long),
        R.PROMPT_MASK: torch.ones(n, 1, dtype=torch.bool),
        R.COMPLETION_IDS: ys,
        R.COMPLETION_MASK: torch.ones(n, T, dtype=torch.bool),
        R.MC_IDS: ids,
        R.MC_BEHAVIOR_LOGPROBS: lb[st].gather(-1, ids),
        R.TEACHER_MC_LOGPROBS: lp[st].gather(-1, ids),
        R.TEACHER_LOGITS: teacher[st],
        R.TEACHER_TOPK_IDS: topk.indices,
        R.TEACHER_TOPK_LOGPROBS: topk.values,
    }


CASES = {
    # name: (estimator, options, behavior is the student (on-policy), bias is zero)
    "online_mc_on_policy": ("reverse_kl_mc", {"advantage": "online"}, True, True),
    "stale_mc_off_policy": ("reverse_kl_mc", {"advantage": "stale"}, False, False),
    "top1_drop_tail": ("reverse_kl", {"tail": "drop"}, True, False),
}


def _setup(case: str):
    name, options, on_policy, zero = CASES[case]
    student, behavior, teacher = _tables()
    if on_policy:
        behavior = student
    model = TabularLM(student, T)
    probe = G.GradientProbe(model, build(name, options))
    ys = sequences(V, T)
    p_rows = log_policy(behavior)[states_along(ys, V), ys].sum(1).exp()  # P_b(y), sums to 1
    batch = _batch(ys, behavior, teacher)
    # per-row error e(y) = ĝ_y − g_y of the token-mean over its T tokens: exact per row
    rows = [probe._group(batch, np.array([i])) for i in range(len(ys))]
    errors = torch.stack([r.est - r.ref for r in rows])  # [9, P]
    exact_bias = (p_rows[:, None] * errors).sum(0)
    ref_sq = float(((p_rows[:, None] * torch.stack([r.ref for r in rows])).sum(0)).square().sum())
    return probe, batch, ys, p_rows, errors, float(exact_bias.square().sum()), ref_sq, zero


def _simulate_b(errors: torch.Tensor, p_rows: torch.Tensor, *, n: int, groups: int, draws: int, seed: int):
    """``B`` of ``draws`` random batches of ``n`` rows drawn from P_b, from the exact per-row errors
    (the probe's B on a batch is this formula: ``test_probe_b_is_the_cross_product``)."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(p_rows), size=(draws, n), p=p_rows.numpy() / float(p_rows.sum()))
    e = errors.numpy()
    out = np.empty(draws)
    for i, rows in enumerate(idx):
        sums = [torch.from_numpy(T * e[rows[k::groups]].sum(0)) for k in range(groups)]
        counts = [float(T * len(rows[k::groups])) for k in range(groups)]
        out[i] = G.cross_product_sq(sums, counts)
    return out


def test_probe_b_is_the_cross_product_over_row_groups() -> None:
    probe, batch, _ys, _p_rows, errors, *_ = _setup("stale_mc_off_policy")
    rows = np.array([0, 4, 4, 7, 2, 8, 1, 1, 3])  # duplicates allowed: independent draws
    sub = {k: v[torch.as_tensor(rows)] for k, v in batch.items()}
    out = probe(sub)
    sums = [T * errors[rows[k::4]].sum(0) for k in range(4)]
    counts = [float(T * len(rows[k::4])) for k in range(4)]
    b = G.cross_product_sq(sums, counts)
    total = sum(sums) / sum(counts)
    assert out[N.GRADREF_GROUPS] == 4
    assert out[N.GRADREF_BIAS_SQ] == pytest.approx(b, rel=1e-9)
    assert out[N.GRADREF_NOISE_SQ] == pytest.approx(float(total.dot(total)) - b, rel=1e-9, abs=1e-15)
    assert out[N.GRADREF_BIAS_SQ_REL] == pytest.approx(b / out[N.GRADREF_REF_SQ], rel=1e-9)
    # ‖d‖² = B + noise: the decomposition is exact on every probe
    d_sq = (out[N.GRADREF_REL_ERR] ** 2) * out[N.GRADREF_REF_SQ]
    assert out[N.GRADREF_BIAS_SQ] + out[N.GRADREF_NOISE_SQ] == pytest.approx(d_sq, rel=1e-9)


def test_exact_bias_is_zero_only_for_the_online_estimator_on_policy() -> None:
    *_, exact_online, ref_online, _ = _setup("online_mc_on_policy")
    *_, exact_stale, ref_stale, _ = _setup("stale_mc_off_policy")
    *_, exact_topk, ref_topk, _ = _setup("top1_drop_tail")
    assert exact_online < 1e-24 * max(ref_online, 1.0)
    assert exact_stale > 1e-3 * ref_stale and exact_topk > 1e-3 * ref_topk


@pytest.mark.parametrize("case", list(CASES))
def test_b_is_unbiased_for_the_exact_squared_bias(case: str) -> None:
    """Mean of B over 20,000 batches of 16 rows (G = 4) = the exact ‖E[d]‖², within 4 standard errors
    (rows drawn from P_b; the per-token errors of one row are correlated, which B does not mind)."""
    _, _, _, p_rows, errors, exact, ref_sq, zero = _setup(case)
    b = _simulate_b(errors, p_rows, n=16, groups=4, draws=20_000, seed=1)
    se = b.std(ddof=1) / math.sqrt(len(b))
    assert abs(b.mean() - exact) < 4 * se + 1e-12 * ref_sq, (b.mean(), exact, se)
    if not zero:
        assert se < 0.1 * exact  # precise enough that the match above means something


@pytest.mark.parametrize("case", list(CASES))
def test_seed_clustered_upper_bound_decides_unbiased(case: str) -> None:
    """Five seeds of 20 probes each: ratio of sums Σ B / Σ |g|² with a seed-clustered bootstrap. The
    unbiased estimator's one-sided 95% upper bound is above 0 (consistent with 0) and below a
    tolerance; a biased one's lower bound is above 0 and its interval holds the exact ratio."""
    probe, batch, ys, p_rows, _errors, exact, ref_sq, zero = _setup(case)
    rng = np.random.default_rng(7)
    per_seed = []
    for _ in range(5):
        nums, dens = [], []
        for _ in range(20):
            rows = rng.choice(len(ys), size=16, p=p_rows.numpy() / float(p_rows.sum()))
            out = probe({k: v[torch.as_tensor(rows)] for k, v in batch.items()})
            nums.append(out[N.GRADREF_BIAS_SQ])
            dens.append(out[N.GRADREF_REF_SQ])
        per_seed.append((nums, dens))
    est, lo, hi, n, _ = cluster_bootstrap_ratio(per_seed, level=0.95, one_sided=True, seed=0)
    assert n == 5
    assert lo <= est <= hi
    if zero:
        assert lo < 0 < hi, (lo, hi)
        assert hi < 0.05  # "unbiased": the upper bound is below the tolerance
    else:
        assert lo > 0, (lo, hi)
        # the exact ratio uses ‖E g‖²; Σ‖g‖² over batches also holds the state noise of g (a little larger)
        assert lo * 0.5 < exact / ref_sq < hi * 1.5


# --- frozen θ ----------------------------------------------------------------------------------------------
def _frozen_setup(advantage: str):
    student, behavior, teacher = _tables(3)
    if advantage == "online":
        behavior = student
    model = TabularLM(student, T)
    ys = torch.tensor([[0, 2], [1, 1]])  # two fixed states (rows), T = 2: four positions
    states = _batch(ys, behavior, teacher)
    proposal = log_policy(behavior)[states_along(ys, V)]  # [2, T, V] log π_b at the fixed states
    est = build("reverse_kl_mc", {"advantage": advantage})
    return model, est, ys, states, proposal, behavior, teacher


def _exact_over_draws(model, est, ys, behavior, teacher, proposal):
    """E_draws[d] and trace Var_draws(d) for m = 1 by enumerating the 3^4 draws at the 4 positions."""
    ds, ps = [], []
    probe = G.GradientProbe(model, est)
    for assign in itertools.product(range(V), repeat=ys.numel()):
        ids = torch.tensor(assign).reshape(ys.shape).unsqueeze(-1)
        b = _batch(ys, behavior, teacher, mc_ids=ids)
        g = probe._group(b, np.arange(len(ys)))
        ds.append(g.est - g.ref)
        ps.append(float(proposal.gather(-1, ids).sum().exp()))
    d, p = torch.stack(ds), torch.tensor(ps, dtype=f64)
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-12)
    mean = (p[:, None] * d).sum(0)
    var = float((p * (d - mean).square().sum(1)).sum())
    return float(mean.square().sum()), var


@pytest.mark.parametrize("advantage", ["online", "stale"])
def test_frozen_theta_matches_exact_enumeration_over_draws(advantage: str) -> None:
    model, est, ys, states, proposal, behavior, teacher = _frozen_setup(advantage)
    bias_exact, var_exact = _exact_over_draws(model, est, ys, behavior, teacher, proposal)
    runs = [
        G.frozen_theta(
            model, est, states, G.mc_redraw(proposal, states[R.TEACHER_LOGITS], 1, seed=s), redraws=8
        )
        for s in range(150)
    ]
    bias = np.array([r.bias_sq for r in runs])
    var = np.array([r.var for r in runs])
    se_b, se_v = bias.std(ddof=1) / math.sqrt(len(runs)), var.std(ddof=1) / math.sqrt(len(runs))
    assert abs(bias.mean() - bias_exact) < 4 * se_b + 1e-15, (bias.mean(), bias_exact, se_b)
    assert abs(var.mean() - var_exact) < 4 * se_v, (var.mean(), var_exact, se_v)
    if advantage == "online":
        assert bias_exact < 1e-25
    else:
        assert bias_exact > 10 * se_b  # the stale advantage's bias is resolved at fixed states


def test_frozen_theta_variance_falls_as_one_over_m_at_equal_bias() -> None:
    model, est, _ys, states, proposal, *_ = _frozen_setup("stale")
    teacher_logits = states[R.TEACHER_LOGITS]
    out = {}
    for m in (1, 4):
        runs = [
            G.frozen_theta(model, est, states, G.mc_redraw(proposal, teacher_logits, m, seed=s), redraws=8)
            for s in range(100)
        ]
        out[m] = (np.mean([r.var for r in runs]), np.mean([r.bias_sq for r in runs]))
    assert out[1][0] / out[4][0] == pytest.approx(4.0, rel=0.25)
    assert out[1][1] == pytest.approx(out[4][1], rel=0.25)  # same θ, same states: the same bias


def test_frozen_theta_without_redraws_is_the_deterministic_error() -> None:
    student, _, teacher = _tables(3)
    model = TabularLM(student, T)
    states = _batch(torch.tensor([[0, 2], [1, 1]]), student, teacher)
    probe = G.GradientProbe(model, build("reverse_kl", {"tail": "drop"}))
    g = probe._group(states, np.arange(2))
    out = G.frozen_theta(model, build("reverse_kl", {"tail": "drop"}), states)
    assert out.bias_sq == pytest.approx(float((g.est - g.ref).square().sum()), rel=1e-12)
    assert out.var == 0.0 and out.redraws == 1 and out.ref_sq == pytest.approx(float(g.ref.square().sum()))
    with pytest.raises(ValueError, match="redraws"):
        G.frozen_theta(model, build("reverse_kl", {"tail": "drop"}), states, redraws=3)


def test_cross_product_and_ratio_of_sums_edge_cases() -> None:
    a = [torch.tensor([1.0, 0.0], dtype=f64), torch.tensor([1.0, 0.0], dtype=f64)]
    assert G.cross_product_sq(a, [1.0, 1.0]) == pytest.approx(1.0)  # 2 a·b / (4 − 2)
    with pytest.raises(ValueError, match=">= 2 groups"):
        G.cross_product_sq(a[:1], [1.0])
    assert G.ratio_of_sums([1.0, -0.5, math.nan], [2.0, 2.0, 1.0]) == pytest.approx(0.125)
    assert math.isnan(G.ratio_of_sums([], []))
