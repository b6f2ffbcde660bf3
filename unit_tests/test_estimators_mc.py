"""Sampled estimators by exact enumeration over a small vocabulary, plus seeded variance checks.

Spec properties (shared/research/opd_estimators.md section 8): T8, T9, T10, T11, T12, T13,
T14, T15. Expectations are exact sums over every m-tuple of draws weighted by its probability;
only the variance checks use random draws (seeded).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from asyncrl import records as R
from asyncrl.estimators import ReverseKLMC
from asyncrl.estimators import functional as F

torch.set_num_threads(1)
f64 = torch.float64
V = 5


def _state(seed: int, stale: float = 0.6):
    """Student z, teacher zt, behavior zb (a perturbed student: the stale policy), each [1, 1, V]."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, 1, V, dtype=f64, generator=g)
    zt = torch.randn(1, 1, V, dtype=f64, generator=g) * 1.5
    zb = z + stale * torch.randn(1, 1, V, dtype=f64, generator=g)
    return z, zt, zb


def _tuples(m: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(V), repeat=m)), dtype=torch.long)  # [V^m, m]


def _expect(loss_fn, z: torch.Tensor, proposal_logits: torch.Tensor, m: int):
    """Exact E[loss] and E[∇_z loss] over m i.i.d. draws from softmax(proposal_logits).

    ``loss_fn(logits [1, N, V], ids [1, N, m]) -> [1, N]``: one enumerated tuple per position.
    """
    ids = _tuples(m).unsqueeze(0)  # [1, N, m]
    N = ids.shape[1]
    lprop = torch.log_softmax(proposal_logits.view(V), -1)
    w = lprop[ids].sum(-1).exp()  # [1, N] tuple probabilities
    assert abs(w.sum().item() - 1) < 1e-12
    zl = z.detach().clone().requires_grad_(True)
    value = (w * loss_fn(zl.expand(1, N, V), ids)).sum()
    (grad,) = torch.autograd.grad(value, zl)
    return value.detach(), grad


def _lp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at ids, broadcasting [1, 1, V] logits over [1, N, m] ids."""
    lp = torch.log_softmax(logits.view(V), -1)
    return lp[ids]


def _dense_grad(fn, z: torch.Tensor, other: torch.Tensor):
    zl = z.detach().clone().requires_grad_(True)
    val = fn(zl, other).sum()
    (g,) = torch.autograd.grad(val, zl)
    return val.detach(), g


def _rkl_mc(z, zt, zb, **kw):
    return lambda logits, ids: F.reverse_kl_mc(logits, ids, _lp(zb, ids), _lp(zt, ids), **kw)


# --- T8: value form ------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_form_is_unbiased_in_value_and_gradient(m: int, seed: int) -> None:
    z, zt, zb = _state(seed)
    value, grad = _expect(_rkl_mc(z, zt, zb, form="value"), z, zb, m)
    rkl, rkl_grad = _dense_grad(F.reverse_kl_dense, z, zt)
    torch.testing.assert_close(value, rkl, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, rkl_grad, atol=1e-12, rtol=0)


# --- T9: pg form, online vs stale ----------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pg_online_gradient_is_unbiased_and_stale_bias_is_minus_grad_kl_to_behavior(
    m: int, seed: int
) -> None:
    z, zt, zb = _state(seed)
    _, g_online = _expect(_rkl_mc(z, zt, zb, advantage="online"), z, zb, m)
    _, g_stale = _expect(_rkl_mc(z, zt, zb, advantage="stale"), z, zb, m)
    _, rkl_grad = _dense_grad(F.reverse_kl_dense, z, zt)
    _, kl_b_grad = _dense_grad(F.reverse_kl_dense, z, zb)  # ∇_θ KL(π_θ‖π_b)
    torch.testing.assert_close(g_online, rkl_grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_stale - g_online, -kl_b_grad, atol=1e-12, rtol=0)
    assert kl_b_grad.abs().max().item() > 1e-3  # the bias is real at this staleness


def test_pg_clipped_is_biased_when_ratios_leave_the_clip_range() -> None:
    z, zt, zb = _state(3, stale=2.0)
    _, g_clip = _expect(_rkl_mc(z, zt, zb, clip_eps=0.2), z, zb, 1)
    _, rkl_grad = _dense_grad(F.reverse_kl_dense, z, zt)
    assert (g_clip - rkl_grad).abs().max().item() > 1e-3


# --- T12: leave-one-out baseline -------------------------------------------------------------------
@pytest.mark.parametrize("advantage", ["online", "stale"])
def test_loo_baseline_keeps_the_expected_gradient(advantage: str) -> None:
    z, zt, zb = _state(4)
    _, g_plain = _expect(_rkl_mc(z, zt, zb, advantage=advantage), z, zb, 2)
    _, g_loo = _expect(_rkl_mc(z, zt, zb, advantage=advantage, loo_baseline=True), z, zb, 2)
    torch.testing.assert_close(g_loo, g_plain, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="m >= 2"):
        _rkl_mc(z, zt, zb, loo_baseline=True)(z, torch.zeros(1, 1, 1, dtype=torch.long))


# --- T13: stratified --------------------------------------------------------------------------------
def _stratified(zt, zb, support):
    lp_s = _lp(zt, support)

    def fn(logits, ids):
        N = ids.shape[1]
        s = support.expand(1, N, support.shape[-1])
        return F.reverse_kl_stratified(logits, s, lp_s.expand_as(s), ids, _lp(zb, ids), _lp(zt, ids))

    return fn


@pytest.mark.parametrize("m", [1, 2])
def test_stratified_is_unbiased(m: int) -> None:
    z, zt, zb = _state(5)
    support = torch.tensor([[[3, 0]]])
    value, grad = _expect(_stratified(zt, zb, support), z, zb, m)
    rkl, rkl_grad = _dense_grad(F.reverse_kl_dense, z, zt)
    torch.testing.assert_close(value, rkl, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, rkl_grad, atol=1e-12, rtol=0)


def _per_trial_grads(loss_fn, z, proposal, m: int, trials: int, seed: int) -> torch.Tensor:
    """Gradients of independent single-position estimates: [trials, V]."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(proposal.view(V), -1)
    ids = torch.multinomial(probs, trials * m, replacement=True, generator=g).view(1, trials, m)
    logits = z.detach().expand(1, trials, V).clone().requires_grad_(True)
    loss_fn(logits, ids).sum().backward()
    return logits.grad[0]


def _total_var(grads: torch.Tensor) -> float:
    return grads.var(0).sum().item()


def test_stratified_variance_below_plain_mc_when_head_is_peaked() -> None:
    g = torch.Generator().manual_seed(6)
    z = torch.tensor([[[4.0, 3.0, 0.0, -0.5, -1.0]]], dtype=f64)  # M_θ({0, 1}) ≈ 0.98
    zt = z + 0.8 * torch.randn(1, 1, V, dtype=f64, generator=g)
    zb = z + 0.3 * torch.randn(1, 1, V, dtype=f64, generator=g)
    support = torch.tensor([[[0, 1]]])
    assert torch.softmax(z.view(V), -1)[:2].sum() >= 0.9
    strat = _total_var(_per_trial_grads(_stratified(zt, zb, support), z, zb, 4, 4000, seed=7))
    plain = _total_var(_per_trial_grads(_rkl_mc(z, zt, zb, form="value"), z, zb, 4, 4000, seed=7))
    assert strat < 0.5 * plain


# --- T11: variance scales as 1/m ----------------------------------------------------------------------
@pytest.mark.parametrize("form", ["pg", "value"])
def test_gradient_variance_scales_as_one_over_m(form: str) -> None:
    z, zt, zb = _state(8, stale=0.4)
    fn = _rkl_mc(z, zt, zb, form=form)
    var1 = _total_var(_per_trial_grads(fn, z, zb, 1, 20_000, seed=9))
    for m in (2, 4):
        var_m = _total_var(_per_trial_grads(fn, z, zb, m, 20_000, seed=10 + m))
        assert 0.9 < m * var_m / var1 < 1.1, (m, m * var_m / var1)


def test_m1_mc_equals_single_token_estimator_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(11)
    B, T = 2, 4
    z = torch.randn(B, T, V, dtype=f64, generator=g)
    zt = torch.randn(B, T, V, dtype=f64, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    lb = torch.log_softmax(z + 0.3, -1).gather(-1, tokens[..., None])[..., 0] - 0.05
    lp = torch.log_softmax(zt, -1).gather(-1, tokens[..., None])[..., 0]
    batch = {
        R.COMPLETION_MASK: torch.ones(B, T, dtype=torch.bool),
        R.COMPLETION_IDS: tokens,
        R.BEHAVIOR_LOGPROBS: lb,
        R.TEACHER_TOKEN_LOGPROBS: lp,
        R.MC_IDS: tokens[..., None],
        R.MC_BEHAVIOR_LOGPROBS: lb[..., None],
        R.TEACHER_MC_LOGPROBS: lp[..., None],
    }
    outs = []
    for source in ("mc", "token"):
        zl = z.clone().requires_grad_(True)
        out = ReverseKLMC(source=source, clip_eps=0.2)(zl, batch)
        out.loss.backward()
        outs.append((out.loss.detach(), zl.grad))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


# --- T10: stationarity at the teacher ---------------------------------------------------------------
def test_every_pg_sample_has_zero_gradient_at_the_teacher() -> None:
    _, zt, zb = _state(12)
    z = zt.clone()
    ids = _tuples(2).unsqueeze(0)
    N = ids.shape[1]
    zl = z.expand(1, N, V).clone().requires_grad_(True)
    for clip in (None, 0.2):
        loss = F.reverse_kl_mc(
            zl, ids, _lp(zb, ids), F.gather_logprobs(zt.expand(1, N, V), ids), clip_eps=clip
        )
        (g,) = torch.autograd.grad(loss.sum(), zl)
        assert torch.count_nonzero(g) == 0  # A = log p − log π_θ = 0 exactly, per sample


def test_expected_gradient_zero_at_the_teacher_for_value_and_stratified() -> None:
    _, zt, zb = _state(13)
    z = zt.clone()
    _, g_val = _expect(_rkl_mc(z, zt, zb, form="value"), z, zb, 2)
    _, g_strat = _expect(_stratified(zt, zb, torch.tensor([[[1, 4]]])), z, zb, 2)
    assert g_val.abs().max().item() < 1e-12
    assert g_strat.abs().max().item() < 1e-12


# --- T14: teacher-sampled forward KL ---------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 2])
def test_teacher_sampled_fkl_is_unbiased(m: int) -> None:
    z, zt, _ = _state(14)
    fn = lambda logits, ids: F.forward_kl_mc(logits, ids, _lp(zt, ids))  # noqa: E731
    value, grad = _expect(fn, z, zt, m)
    fkl, _ = _dense_grad(F.forward_kl_dense, z, zt)
    torch.testing.assert_close(value, fkl, atol=1e-12, rtol=0)
    pi, p = torch.softmax(z, -1), torch.softmax(zt, -1)
    torch.testing.assert_close(grad, pi - p, atol=1e-12, rtol=0)


# --- T15: staleness-0 identities ----------------------------------------------------------------------
def test_staleness_zero_identities() -> None:
    g = torch.Generator().manual_seed(15)
    B, T, m = 2, 3, 4
    z = torch.randn(B, T, 50, generator=g)  # fp32, like an engine
    zt = torch.randn(B, T, 50, generator=g)
    ids = torch.randint(0, 50, (B, T, m), generator=g)
    # behavior log-probs recorded at generation time with the same weights, stored as fp32
    lb = torch.from_numpy(F.gather_logprobs(z, ids).numpy().copy())
    lp = F.gather_logprobs(zt, ids)
    lq = F.gather_logprobs(z, ids)
    assert torch.count_nonzero(F.importance_log_ratio(lq, lb)) == 0  # log ρ exactly 0

    def run(**kw):
        zl = z.clone().requires_grad_(True)
        loss = F.reverse_kl_mc(zl, ids, lb, lp, **kw)
        loss.sum().backward()
        return loss.detach(), zl.grad

    base = run(advantage="online")
    for kw in ({"advantage": "stale"}, {"clip_eps": 0.2}, {"advantage": "stale", "clip_eps": 0.2}):
        other = run(**kw)
        assert torch.equal(base[0], other[0]), kw
        assert torch.equal(base[1], other[1]), kw
    # GRPO core: clipped == unclipped at ρ = 1
    adv = torch.randn(B, generator=g)
    lq_tok = lq[..., 0]
    a = F.policy_gradient_loss(lq_tok, lb[..., 0], adv, clip_eps=0.2)
    b = F.policy_gradient_loss(lq_tok, lb[..., 0], adv, clip_eps=None)
    assert torch.equal(a, b)
