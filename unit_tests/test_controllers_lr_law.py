"""StalenessLRLaw (spec 7.5 a-e) and LagBucketDecay (spec 7.6 a-d)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.configurable import ConfigError
from asyncrl.controllers import LagBucketDecay, StalenessLRLaw, StepContext, build
from asyncrl.controllers.functional import decay_factor, inverse_lag_scale, two_constraint_lr

torch.set_num_threads(1)
SETTINGS = settings(max_examples=50, deadline=None)
pos = st.floats(1e-3, 1e3)


def ctx(lags, *, step=10, base_lr=1e-3, log_ratio=None, token_versions=None) -> StepContext:
    n = len(lags)
    mask = torch.ones(n, 3, dtype=torch.bool)
    logp = torch.zeros(n, 3, dtype=torch.float64)
    behavior = logp - (log_ratio if log_ratio is not None else 0.0)
    return StepContext.local(
        step=step,
        base_lr=base_lr,
        mask=mask,
        logprobs=logp,
        behavior_logprobs=behavior,
        lags=lags,
        token_versions=token_versions,
    )


# --- 7.5 StalenessLRLaw ------------------------------------------------------------------------
def test_zero_lag_gives_scale_one_or_only_the_horizon_cap():  # 7.5 a
    assert StalenessLRLaw().lr_scale(ctx([0, 0, 0])) == 1.0
    law = two_constraint_lr(1.0, s_eff=0, g_hat=2.0, r_batch=0.2)
    assert law.eta == 1.0 and math.isinf(law.eta_batch) and law.binding == "none"
    law = two_constraint_lr(1.0, s_eff=0, g_hat=2.0, r_batch=0.2, r_crit=1.0, steps_left=10)
    assert math.isinf(law.eta_batch) and law.binding == "horizon"


@SETTINGS
@given(pos, pos, pos, pos, pos, pos, st.floats(0.05, 1.0))
def test_eta_monotone_in_lag_drift_and_radius(s1, s2, g1, g2, r1, r2, c):  # 7.5 b
    lo_s, hi_s = sorted((s1, s2))
    lo_g, hi_g = sorted((g1, g2))
    lo_r, hi_r = sorted((r1, r2))

    def eta(s, g, r):
        return two_constraint_lr(1.0, s_eff=s, g_hat=g, r_batch=r, r_crit=50.0, steps_left=20, c_safety=c).eta

    assert eta(hi_s, g1, r1) <= eta(lo_s, g1, r1)
    assert eta(s1, hi_g, r1) <= eta(s1, lo_g, r1)
    assert eta(s1, g1, lo_r) <= eta(s1, g1, hi_r)
    assert inverse_lag_scale(hi_s) <= inverse_lag_scale(lo_s)


@SETTINGS
@given(pos, pos, pos, st.floats(0.05, 1.0), st.floats(1e-4, 10))
def test_batch_cap_bounds_s_eta_g(s, g, r, c, eta_sched):  # 7.5 c, d
    law = two_constraint_lr(
        eta_sched, s_eff=s, g_hat=g, r_batch=r, r_crit=5.0, drift_used=1.0, steps_left=7, c_safety=c
    )
    caps = {"none": eta_sched, "batch": law.eta_batch, "horizon": law.eta_horizon}
    assert law.eta == min(caps.values())
    assert caps[law.binding] == law.eta  # the flag names the argmin
    if law.binding == "batch":
        assert s * law.eta * g <= c * r * (1 + 1e-12)


@SETTINGS
@given(st.floats(1.0, 100.0), st.floats(1.0, 100.0))
def test_gamma_one_keeps_s_eta_constant(s1, s2):  # 7.5 e
    s_ref = 1.0
    assert s1 * inverse_lag_scale(s1, s_ref=s_ref, gamma=1.0) == pytest.approx(s_ref)
    assert s2 * inverse_lag_scale(s2, s_ref=s_ref, gamma=1.0) == pytest.approx(s_ref)
    ctrl = StalenessLRLaw(s_ref=2.0)
    lags = [0, 4, int(s1) + 2]
    scale = ctrl.lr_scale(ctx(lags))
    assert ctrl.metrics()["law/S_eta"] == pytest.approx(2.0 * 1e-3)
    assert scale == pytest.approx(2.0 / max(lags))


def test_two_constraint_measures_drift_and_caps_the_lr():
    law = StalenessLRLaw(mode="two_constraint", r_batch=0.2, c_safety=0.5)
    # step 0..2: fresh batches (no drift information) -> no caps
    for step in range(3):
        c = ctx([0, 0], step=step, base_lr=0.1)
        assert law.lr_scale(c) == 1.0
        c.lr_applied = 0.1
        law.after_step(c)
    assert law.g_hat is None
    # step 3: tokens 2 versions old whose log-prob moved by 0.4 -> drift 0.2 per step at lr 0.1 -> G = 2
    c3 = ctx([2, 2], step=3, base_lr=0.1, log_ratio=0.4)
    law.lr_scale(c3)
    c3.lr_applied = 0.1
    law.after_step(c3)
    assert law.g_hat == pytest.approx(2.0)
    assert law.metrics()["law/drift_step"] == pytest.approx(0.2)
    # step 4, lag 4: eta_batch = 0.5 * 0.2 / (4 * 2) = 0.0125 < 0.1 -> scale 0.125, batch binds
    scale = law.lr_scale(ctx([4, 1], step=4, base_lr=0.1))
    assert scale == pytest.approx(0.125)
    m = law.metrics()
    assert m["law/binding_batch"] == 1.0 and m["law/eta_batch_cap"] == pytest.approx(0.0125)
    state = law.state_dict()
    fresh = StalenessLRLaw(mode="two_constraint")
    fresh.load_state_dict(state)
    assert fresh.lr_scale(ctx([4, 1], step=4, base_lr=0.1)) == pytest.approx(scale)


def test_law_validation():
    with pytest.raises(ConfigError, match="total_steps"):
        build("staleness_lr_law", {"r_crit": 1.0})
    with pytest.raises(ConfigError, match="c_safety"):
        build("staleness_lr_law", {"c_safety": 0})
    assert build("staleness_lr_law", {"r_crit": "inf"}).config.r_crit == math.inf


# --- 7.6 LagBucketDecay --------------------------------------------------------------------------
tables = st.sampled_from([None, 0.5, 1.0, 2.0])


@SETTINGS
@given(tables, st.floats(0, 1), st.floats(0, 100), st.floats(0, 100))
def test_decay_is_one_for_fresh_and_non_increasing(gamma, fresh, l1, l2):  # 7.6 a, b
    ctrl = LagBucketDecay(gamma=gamma)
    assert ctrl.factor(fresh) == 1.0
    lo, hi = sorted((l1, l2))
    assert ctrl.factor(hi) <= ctrl.factor(lo)
    assert 0 < ctrl.factor(hi) <= 1


def test_default_table_matches_spec():
    f = [LagBucketDecay().factor(x) for x in (0, 1, 2, 3, 4, 7, 8, 15, 16, 100)]
    assert f == [1.0, 1.0, 0.75, 0.75, 0.5, 0.5, 0.35, 0.35, 0.25, 0.25]
    assert decay_factor(4, gamma=1.0) == 0.25


@pytest.mark.parametrize("stat", ["mean", "max"])
def test_all_fresh_batch_leaves_lr_unchanged(stat):  # 7.6 c
    ctrl = LagBucketDecay(stat=stat)
    assert ctrl.lr_scale(ctx([0, 1, 0, 1])) == 1.0
    assert LagBucketDecay(stat=stat).lr_scale(ctx([0, 16])) == (
        0.35 if stat == "mean" else 0.25
    )  # mean 8, max 16


def test_sample_weight_mode_with_adam_undoes_uniform_decay():  # 7.6 d
    def one_step(weight: float) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-12)
        x = torch.randn(16, 5)
        (weight * model(x).pow(2).mean()).backward()
        opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    ctrl = LagBucketDecay(mode="sample_weight")
    w = ctrl.token_weights(ctx([5, 5, 5]))
    assert torch.equal(w, torch.full_like(w, 0.5)) and ctrl.lr_scale(ctx([5, 5, 5])) == 1.0
    # uniform lag -> uniform weight 0.5 -> Adam's normalisation gives (almost) the same update
    assert torch.allclose(one_step(0.5), one_step(1.0), rtol=0, atol=1e-6)


def test_bucket_table_validation():
    with pytest.raises(ConfigError, match="non-increasing"):
        build("lag_bucket_decay", {"table": [[0, 1.0], [2, 0.5], [4, 0.75]]})
    with pytest.raises(ConfigError, match=r"\[0, 1.0\]"):
        build("lag_bucket_decay", {"table": [[1, 1.0]]})
    ctrl = build("lag_bucket_decay", {"table": [[0, 1.0], [3, 0.5]], "stat": "max"})
    assert ctrl.factor(3) == 0.5


def test_two_constraint_measures_drift_per_unit_of_the_lr_the_chain_applied():
    """Issue 12 item 2: chained after ess_lr, the law estimates G from the LR actually applied
    (scheduled x every controller's scale, ``ctx.lr_applied``), not from its own scale."""
    from asyncrl.controllers import chain

    law = StalenessLRLaw(mode="two_constraint", r_batch=0.2, c_safety=0.5)
    c = chain(build("ess_lr", {}), law)
    rng = torch.Generator().manual_seed(0)
    applied, noise = [], []
    for step in range(3):
        noise.append(0.8 * torch.randn(6, 1, generator=rng, dtype=torch.float64))  # uneven: ESS < 1
        cx = ctx([0] * 6 if step < 2 else [2] * 6, step=step, base_lr=0.1, log_ratio=noise[-1])
        scale = c.lr_scale(cx)
        cx.lr_applied = 0.1 * scale
        applied.append(cx.lr_applied)
        c.after_step(cx)
    assert list(law.lr_history) == applied
    assert applied[0] < 0.1 * 0.9  # ess_lr scaled it down: the law's own scale (1) would say 0.1
    # step 2: tokens 2 versions old drifted |log ratio| / 2 per step, over steps 0 and 1 at their applied LR
    drift = float(noise[2].abs().mean()) / 2
    assert law.g_hat == pytest.approx(drift / ((applied[0] + applied[1]) / 2), rel=1e-12)
    with pytest.raises(ValueError, match="lr_applied"):
        StalenessLRLaw(mode="two_constraint").after_step(ctx([1], step=1))
