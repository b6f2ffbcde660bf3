"""TruncatedIS and truncated_is_weights (spec 7.2 a-g)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.configurable import ConfigError
from asyncrl.controllers import StepContext, TruncatedIS, build
from asyncrl.controllers.functional import truncated_is_weights
from asyncrl.logratio import LOG_RATIO_CLAMP

torch.set_num_threads(1)
SETTINGS = settings(max_examples=40, deadline=None)


def random_batch(seed: int, b: int = 4, t: int = 7, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    behavior = logp - scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return logp, behavior, mask


def test_identical_policies_are_a_no_op():  # 7.2 a
    logp, _, mask = random_batch(0)
    for level in ("token", "sequence", "geometric"):
        ctrl = TruncatedIS(level=level)
        w = ctrl.token_weights(
            StepContext.local(
                step=0, base_lr=1.0, mask=mask, logprobs=logp, behavior_logprobs=logp, lags=[0] * 4
            )
        )
        assert torch.equal(w, torch.ones_like(w))
        m = ctrl.metrics()
        assert m["is/frac_masked"] == 0 and m["is/frac_truncated"] == 0
        assert m["is/ess_tok_frac"] == 1.0
        assert m["is/kl_k1"] == 0.0 and m["is/kl_k3"] == 0.0
        # the weighted loss is bitwise the plain loss
        per_tok = torch.randn(4, 7, dtype=torch.float64)
        assert torch.equal(per_tok * w, per_tok)


@SETTINGS
@given(
    st.integers(0, 10_000),
    st.sampled_from(["token", "sequence", "geometric"]),
    st.floats(0.0, 0.9),
    st.floats(1.0, 10.0),
    st.floats(0.1, 30.0),
)
def test_weight_bounds(seed, level, lower, upper, scale):  # 7.2 b
    logp, behavior, mask = random_batch(seed, scale=scale)
    lr = torch.where(mask, logp - behavior, 0.0)
    tr = truncated_is_weights(lr, mask, level=level, action="truncate", upper=upper, lower=lower)
    w = tr.weights[mask]
    assert (w <= upper).all() and (w >= lower).all() and torch.isfinite(w).all()
    mk = truncated_is_weights(lr, mask, level=level, action="mask", upper=upper, lower=lower)
    w = mk.weights[mask]
    assert (((w >= lower) & (w <= upper)) | (w == 0)).all()
    assert torch.equal(mk.masked[mask], w == 0)


def test_weights_are_detached_gradient_is_sum_w_a_grad_logp():  # 7.2 c
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 6, (3, 5))
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)  # with grad
    behavior = logp.detach() + 0.4 * torch.randn(3, 5, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)[:, None]
    ctx = StepContext(  # logprobs deliberately NOT detached: the controller must detach
        step=1,
        base_lr=1.0,
        mask=mask,
        logprobs=logp,
        behavior_logprobs=behavior,
        token_versions=torch.zeros(3, 5, dtype=torch.long),
        lags=torch.ones(3, dtype=torch.long),
        group_ids=torch.arange(3),
        seq_log_ratio=(logp - behavior).detach().sum(-1),
        lags_global=torch.ones(3),
    )
    for level in ("token", "sequence", "geometric"):
        w = TruncatedIS(level=level, upper=math.inf).token_weights(ctx)
        assert not w.requires_grad
        (grad,) = torch.autograd.grad(-(w * adv * logp).sum(), logits, retain_graph=True)
        w_const = torch.exp(
            torch.clamp(
                {
                    "token": logp - behavior,
                    "sequence": (logp - behavior).sum(-1, keepdim=True).expand(3, 5),
                    "geometric": (logp - behavior).mean(-1, keepdim=True).expand(3, 5),
                }[level].detach(),
                -20,
                20,
            )
        )
        (expected,) = torch.autograd.grad(-(w_const * adv * logp).sum(), logits, retain_graph=True)
        assert torch.allclose(grad, expected, rtol=1e-12, atol=1e-12)


def test_long_sequences_never_overflow_and_match_fp64():  # 7.2 d
    t = 65_536
    g = torch.Generator().manual_seed(1)
    rows = torch.stack(
        [
            torch.rand(t, generator=g) * 2 - 1,  # |L| large: clamped
            torch.full((t,), 1.0),  # L = +65536
            torch.full((t,), -1.0),  # L = -65536
            (torch.rand(t, generator=g) * 2 - 1) * 1e-4,  # |L| small: exact
        ]
    ).float()
    mask = torch.ones_like(rows, dtype=torch.bool)
    out = truncated_is_weights(rows, mask, level="sequence", action="truncate", upper=math.inf)
    assert torch.isfinite(out.weights).all()
    ref_L = rows.double().numpy().sum(-1)
    ref = np.exp(np.clip(ref_L, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    np.testing.assert_allclose(out.weights[:, 0].double().numpy(), ref, rtol=1e-5)
    small = abs(ref_L) < LOG_RATIO_CLAMP
    np.testing.assert_allclose(out.weights[small, 0].double().numpy(), np.exp(ref_L[small]), rtol=1e-5)


@SETTINGS
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=20), st.integers(2, 5))
def test_geometric_invariant_to_repetition(lr, k):  # 7.2 e
    one = torch.tensor([lr], dtype=torch.float64)
    rep = one.repeat(1, k)
    w1 = truncated_is_weights(one, torch.ones_like(one, dtype=torch.bool), level="geometric", upper=math.inf)
    wk = truncated_is_weights(rep, torch.ones_like(rep, dtype=torch.bool), level="geometric", upper=math.inf)
    assert float(w1.weights[0, 0]) == pytest.approx(float(wk.weights[0, 0]), rel=1e-9)


def test_unbiased_on_bandit_with_infinite_cap():  # 7.2 f
    torch.manual_seed(0)
    k, n = 6, 20_000
    theta = torch.randn(k, dtype=torch.float64, requires_grad=True)
    reward = torch.linspace(-1, 1, k, dtype=torch.float64)
    pi_b = torch.softmax(torch.randn(k, dtype=torch.float64), 0)
    # exact on-policy gradient of E_theta[R]
    (exact,) = torch.autograd.grad((torch.softmax(theta, 0) * reward).sum(), theta)
    actions = torch.multinomial(pi_b, n, replacement=True)
    logp_all = torch.log_softmax(theta, 0)
    logp = logp_all[actions]
    lr = (logp.detach() - pi_b.log()[actions])[:, None]
    w = truncated_is_weights(lr, torch.ones_like(lr, dtype=torch.bool), upper=math.inf).weights[:, 0]
    # per-sample gradient contributions w_i R_i grad log pi(a_i) = w_i R_i (e_{a_i} - pi)
    pi = torch.softmax(theta.detach(), 0)
    contrib = (w * reward[actions])[:, None] * (torch.nn.functional.one_hot(actions, k).double() - pi)
    mean, se = contrib.mean(0), contrib.std(0) / math.sqrt(n)
    assert ((mean - exact).abs() <= 3 * se + 1e-12).all()


def test_mask_does_not_inflate_survivors():  # 7.2 g
    logp, behavior, mask = random_batch(3, scale=2.0)
    lr = torch.where(mask, logp - behavior, 0.0)
    raw = truncated_is_weights(lr, mask, upper=math.inf).weights
    mk = truncated_is_weights(lr, mask, action="mask", upper=2.0, lower=0.5)
    survivors = mask & ~mk.masked
    assert mk.masked.any() and survivors.any()
    assert torch.equal(mk.weights[survivors], raw[survivors])
    # the estimator's masked mean keeps the original denominator: the survivors' share is unchanged
    per_tok = torch.ones_like(lr)
    loss_masked = (per_tok * mk.weights)[mask].sum() / mask.sum()
    assert float(loss_masked) == pytest.approx(float(raw[survivors].sum() / mask.sum()))


def test_metrics_and_padding():
    logp, behavior, mask = random_batch(5, scale=1.5)
    ctrl = TruncatedIS(upper=1.5)
    w = ctrl.token_weights(
        StepContext.local(
            step=0, base_lr=1.0, mask=mask, logprobs=logp, behavior_logprobs=behavior, lags=[0] * 4
        )
    )
    assert torch.equal(w[~mask], torch.ones_like(w[~mask]))
    m = ctrl.metrics()
    assert set(m) >= {
        "is/w_mean",
        "is/w_max",
        "is/frac_truncated",
        "is/frac_masked",
        "is/ess_tok_frac",
        "is/kl_k1",
        "is/kl_k3",
    }
    assert m["is/w_max"] <= 1.5 and 0 < m["is/frac_truncated"] < 1 and m["is/kl_k3"] > 0


@pytest.mark.parametrize(
    "options,field", [({"upper": 0}, "upper"), ({"lower": 3.0}, "lower"), ({"level": "tokn"}, "level")]
)
def test_bad_options_fail_at_build(options, field):
    with pytest.raises(ConfigError) as err:
        build("truncated_is", options)
    assert f"options.{field}" in str(err.value)
