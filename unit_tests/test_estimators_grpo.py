"""GRPO advantages, the PPO-clip core and the GRPO estimator (spec T17, T21)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import records as R
from asyncrl.configurable import ConfigError
from asyncrl.estimators import GRPO, build
from asyncrl.estimators import functional as F

torch.set_num_threads(1)
f64 = torch.float64


# --- T21: group advantages ----------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.floats(-10, 10, allow_nan=False)), min_size=1, max_size=24),
    st.sampled_from(["std", "none"]),
)
def test_advantages_sum_to_zero_per_group(rows, scale) -> None:
    gids = torch.tensor([g for g, _ in rows])
    rewards = torch.tensor([r for _, r in rows], dtype=f64)
    adv = F.grpo_advantages(rewards, gids, scale=scale)
    assert adv.shape == rewards.shape and adv.dtype == f64
    for g in gids.unique():
        sel = gids == g
        assert abs(adv[sel].sum().item()) < 1e-6 * max(1.0, adv[sel].abs().max().item())
        if rewards[sel].max() == rewards[sel].min():
            assert torch.count_nonzero(adv[sel]) == 0  # zero-variance groups (and singletons) get exactly 0


def test_advantages_hand_values() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.3, 0.3, 0.3, 2.0])
    gids = torch.tensor([7, 7, 7, 7, 3, 3, 3, 9])
    adv = F.grpo_advantages(rewards, gids, scale="std", eps=0.0)
    s = math.sqrt(1 / 3)  # Bessel-corrected std of [1, 0, 1, 0]
    expected = torch.tensor([0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s, 0, 0, 0, 0])
    torch.testing.assert_close(adv, expected)
    centred = F.grpo_advantages(rewards, gids, scale="none")
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="scale"):
        F.grpo_advantages(rewards, gids, scale="mad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shape"):
        F.grpo_advantages(rewards, gids[:3])


# --- T17: PPO clip and dual clip ---------------------------------------------------------------------
def test_clip_zeroes_gradient_outside_the_trust_region_in_the_improving_direction() -> None:
    lb = torch.zeros(6, dtype=f64)
    log_ratio = torch.log(torch.tensor([1.5, 1.1, 0.5, 0.9, 1.5, 0.5], dtype=f64))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 1.0], dtype=f64)
    lq = log_ratio.clone().requires_grad_(True)
    loss = F.policy_gradient_loss(lq, lb, adv, clip_eps=0.2)
    loss.sum().backward()
    g = lq.grad
    assert g[0] == 0 and g[2] == 0  # A > 0 above 1+ε; A < 0 below 1−ε: clipped, no gradient
    assert g[1] != 0 and g[3] != 0  # inside the range
    assert g[4] != 0 and g[5] != 0  # outside, but in the worsening direction: still pushed back
    torch.testing.assert_close(loss[0], torch.tensor(-1.2, dtype=f64))


def test_dual_clip_caps_the_loss_for_negative_advantages() -> None:
    lb = torch.zeros(3, dtype=f64)
    lq = torch.log(torch.tensor([10.0, 2.0, 10.0], dtype=f64))
    adv = torch.tensor([-1.0, -1.0, 1.0], dtype=f64)
    loss = F.policy_gradient_loss(lq, lb, adv, clip_eps=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([3.0, 2.0, -1.2], dtype=f64))
    with pytest.raises(ValueError, match="dual_clip"):
        F.policy_gradient_loss(lq, lb, adv, dual_clip=0.5)


def test_unclipped_pg_gradient_is_importance_weighted_score() -> None:
    lb = torch.log(torch.tensor([0.2, 0.5], dtype=f64))
    lq = torch.log(torch.tensor([0.3, 0.25], dtype=f64)).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0], dtype=f64)
    F.policy_gradient_loss(lq, lb, adv, clip_eps=None).sum().backward()
    torch.testing.assert_close(lq.grad, -adv * torch.tensor([1.5, 0.5], dtype=f64))  # −A ρ


# --- the estimator -----------------------------------------------------------------------------------
def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4, 3, 7
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    z = torch.randn(B, T, V, dtype=f64, generator=g)
    lb = torch.log_softmax(z + 0.2 * torch.randn(B, T, V, dtype=f64, generator=g), -1).gather(
        -1, ids[..., None]
    )
    batch = {
        R.COMPLETION_IDS: ids,
        R.COMPLETION_MASK: mask,
        R.BEHAVIOR_LOGPROBS: lb[..., 0],
        R.REWARD: torch.tensor([1.0, 0.0, 0.0, 1.0]),
        R.GROUP_ID: torch.tensor([0, 0, 1, 1]),
    }
    return z, batch


def test_token_mean_vs_seq_mean_match_hand_computation() -> None:
    z, batch = _batch()
    mask = batch[R.COMPLETION_MASK]
    lq = torch.log_softmax(z, -1).gather(-1, batch[R.COMPLETION_IDS][..., None])[..., 0]
    adv = F.grpo_advantages(batch[R.REWARD], batch[R.GROUP_ID]).double()
    per_tok = F.policy_gradient_loss(lq, batch[R.BEHAVIOR_LOGPROBS], adv, clip_eps=0.2)
    lens = mask.sum(-1)
    tok = (per_tok * mask).sum() / lens.sum()
    seq = ((per_tok * mask).sum(-1) / lens).mean()
    out_tok = GRPO(aggregation="token_mean")(z, batch)
    out_seq = GRPO(aggregation="seq_mean")(z, batch)
    torch.testing.assert_close(out_tok.loss, tok)
    torch.testing.assert_close(out_seq.loss, seq)
    assert abs(out_tok.loss.item() - out_seq.loss.item()) > 1e-6  # unequal lengths: they differ
    torch.testing.assert_close(out_tok.per_sample["advantage"], adv)
    torch.testing.assert_close(out_tok.per_sample["loss"], (per_tok * mask).sum(-1) / lens)


def test_grpo_metrics_and_options() -> None:
    z, batch = _batch(1)
    out = GRPO(clip_eps=0.2, dual_clip=3.0)(z.requires_grad_(True), batch)
    out.loss.backward()
    assert torch.isfinite(z.grad).all()
    for key in (
        "est/clip_frac",
        "est/is_ratio_mean",
        "est/is_ratio_max",
        "est/reward_mean",
        "est/zero_adv_frac",
    ):
        assert isinstance(out.metrics[key], float), key
    assert GRPO.cache_kind is None
    with pytest.raises(ConfigError, match="clip_eps_high"):
        build("grpo", {"clip_eps": None, "clip_eps_high": 0.28})
    with pytest.raises(ConfigError, match="scale"):
        build("grpo", {"scale": "mean"})


def test_grpo_kl_penalty_needs_ref_logprobs_and_is_a_policy_gradient_term() -> None:
    z, batch = _batch(2)
    est = GRPO(kl_coef=0.1)
    assert "ref_logprobs" in est.required_columns()
    with pytest.raises(ValueError, match="ref_logprobs"):
        est(z, batch)
    lq = torch.log_softmax(z, -1).gather(-1, batch[R.COMPLETION_IDS][..., None])[..., 0]
    ref = lq - 0.3
    with_kl = est(z, {**batch, "ref_logprobs": ref})
    without = GRPO()(z, batch)
    # per token β·ρ·(log π_θ − log π_ref) with ρ = π_θ/π_b, token mean over valid tokens
    mask = batch[R.COMPLETION_MASK]
    rho = (lq - batch[R.BEHAVIOR_LOGPROBS]).exp()
    expect = 0.1 * (rho * 0.3 * mask).sum() / mask.sum()
    torch.testing.assert_close(with_kl.loss - without.loss, expect)
    assert abs(with_kl.metrics["est/kl_ref"] - (math.exp(-0.3) + 0.3 - 1)) < 1e-9  # k3 value
    with pytest.raises(ValueError, match="ref_logprobs"):
        est(z, {**batch, "ref_logprobs": ref.abs() + 0.5})  # positive log-probs


@pytest.mark.parametrize("stale", [False, True])
def test_grpo_kl_penalty_gradient_is_grad_kl_theta_ref_by_exact_enumeration(stale: bool) -> None:
    """Item 9 of issue 12: the expected gradient of the penalty is ∇KL(π_θ‖π_ref), the direction the
    docstring promises; the k3 pathwise gradient it replaced is ∇KL(π_ref‖π_θ)."""
    V = 7
    g = torch.Generator().manual_seed(3)
    z = torch.randn(V, dtype=f64, generator=g).requires_grad_(True)
    lref = torch.log_softmax(torch.randn(V, dtype=f64, generator=g), -1)
    lq = torch.log_softmax(z, -1)
    lb = torch.log_softmax(z.detach() + (0.8 * torch.randn(V, dtype=f64, generator=g) if stale else 0.0), -1)
    ids = torch.arange(V)
    batch = {  # one row per token y of the vocabulary; the expectation over y ~ π_b by weights
        R.COMPLETION_IDS: ids[:, None],
        R.COMPLETION_MASK: torch.ones(V, 1, dtype=torch.bool),
        R.BEHAVIOR_LOGPROBS: lb[:, None],
        R.REWARD: torch.zeros(V, dtype=f64),  # one zero-variance group: the PG term is exactly 0
        R.GROUP_ID: torch.zeros(V, dtype=torch.long),
        "ref_logprobs": lref[:, None],
    }
    prob = (V * lb.exp())[:, None]  # token_mean / V  ->  Σ_y π_b(y) (...)
    out = GRPO(kl_coef=1.0, clip_eps=None)(z.expand(V, 1, V), batch, token_weights=prob)
    (grad,) = torch.autograd.grad(out.loss, z)
    (want,) = torch.autograd.grad((lq.exp() * (lq - lref)).sum(), z, retain_graph=True)  # ∇KL(π_θ‖π_ref)
    (other,) = torch.autograd.grad((lref.exp() * (lref - lq)).sum(), z, retain_graph=True)  # ∇KL(π_ref‖π_θ)
    assert (grad - want).abs().max() < 1e-14
    assert (want - other).abs().max() > 0.05
    # the old per-token k3 term, on-policy (y ~ π_θ): its expected gradient is the other direction
    from asyncrl.logratio import kl_qp_k3

    (k3_grad,) = torch.autograd.grad((lq.exp().detach() * kl_qp_k3(lq, lref)).sum(), z)
    assert (k3_grad - other).abs().max() < 1e-14
