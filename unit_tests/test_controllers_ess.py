"""ESS fraction and ESSLR (spec 7.3 a-g)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.configurable import ConfigError
from asyncrl.controllers import ESSLR, StepContext, build, scaled_lr
from asyncrl.controllers.functional import (
    ess_fraction,
    ess_fraction_from_partials,
    ess_lr_scale,
    ess_partials,
)

torch.set_num_threads(1)
SETTINGS = settings(max_examples=40, deadline=None)

log_w = st.lists(st.floats(-30, 30), min_size=1, max_size=40)


def naive_rho(lw: list[float]) -> float:
    w = np.exp(np.asarray(lw, dtype=np.float64))
    return float(w.sum() ** 2 / (len(w) * (w**2).sum()))


def seq_ctx(seq_log_ratio: torch.Tensor, base_lr: float = 1e-3) -> StepContext:
    n = seq_log_ratio.numel()
    mask = torch.ones(n, 1, dtype=torch.bool)
    behavior = torch.zeros(n, 1, dtype=torch.float64)
    return StepContext.local(
        step=3,
        base_lr=base_lr,
        mask=mask,
        logprobs=seq_log_ratio[:, None].double(),
        behavior_logprobs=behavior,
        lags=[0] * n,
    )


def test_identical_policies_give_ess_n_and_unit_scale():  # 7.3 a
    lw = torch.zeros(16)
    assert float(ess_fraction(lw)) == 1.0
    ctx = seq_ctx(lw)
    ctrl = ESSLR()
    assert ctrl.lr_scale(ctx) == 1.0
    assert ctrl.metrics()["ess/rho"] == 1.0
    assert ctrl.metrics()["ess/ess_abs"] == 16.0


@SETTINGS
@given(log_w)
def test_rho_bounds_and_naive_formula(lw):  # 7.3 b, f
    rho = float(ess_fraction(torch.tensor(lw, dtype=torch.float64)))
    n = len(lw)
    assert 1 / n - 1e-12 <= rho <= 1.0
    assert rho == pytest.approx(naive_rho(lw), rel=1e-9, abs=1e-12)


def test_dominant_weight_tends_to_one_over_n():  # 7.3 b
    for n in (2, 7, 50):
        lw = torch.zeros(n)
        lw[0] = 1e4
        assert float(ess_fraction(lw)) == pytest.approx(1 / n, rel=1e-12)


@SETTINGS
@given(log_w, st.floats(-50, 50))
def test_scale_invariance(lw, log_c):  # 7.3 c
    a = ess_fraction(torch.tensor(lw, dtype=torch.float64))
    b = ess_fraction(torch.tensor(lw, dtype=torch.float64) + log_c)
    assert float(a) == pytest.approx(float(b), rel=1e-9)


@SETTINGS
@given(st.floats(0, 1), st.floats(0, 1), st.floats(0.01, 1), st.sampled_from(["sqrt", "linear"]))
def test_lr_scale_monotone_and_exact(r1, r2, rho_base, rule):  # 7.3 d
    lo, hi = sorted((r1, r2))
    assert ess_lr_scale(lo, rho_base=rho_base, rule=rule) <= ess_lr_scale(hi, rho_base=rho_base, rule=rule)
    s = min(1.0, hi / rho_base)
    expected = math.sqrt(s) if rule == "sqrt" else s
    assert ess_lr_scale(hi, rho_base=rho_base, rule=rule) == pytest.approx(expected, rel=1e-12)


@SETTINGS
@given(st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=30))
def test_finite_for_huge_log_weights(lw):  # 7.3 f
    t = torch.tensor(lw, dtype=torch.float32)  # fp32 input: the sum is done in log space, fp64
    rho = float(ess_fraction(t))
    assert math.isfinite(rho) and 0 < rho <= 1
    ctrl = ESSLR(rho_base=0.5)
    scale = ctrl.lr_scale(seq_ctx(t))
    assert math.isfinite(scale) and 0 <= scale <= 1


@SETTINGS
@given(st.lists(st.floats(-300, 300), min_size=2, max_size=40), st.data())
def test_dp_sharding_equals_single_batch(lw, data):  # 7.3 g
    t = torch.tensor(lw, dtype=torch.float64)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(lw)), min_size=0, max_size=4)))
    shards = [t[a:b] for a, b in zip([0, *cuts], [*cuts, len(lw)])]
    combined = ess_fraction_from_partials([ess_partials(s) for s in shards])
    assert float(combined) == pytest.approx(float(ess_fraction(t)), rel=1e-10)


def test_scheduler_lr_restored_and_scheduler_state_unchanged():  # 7.3 e
    def run(use_controller: bool) -> tuple[list[float], dict, list[float]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        ctrl = ESSLR()
        applied = []
        for _ in range(4):
            loss = model(torch.ones(2, 3)).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            scale = 1.0
            if use_controller:
                ctx = seq_ctx(torch.tensor([0.0, 3.0, -1.0]), base_lr=sched.get_last_lr()[0])
                scale = ctrl.lr_scale(ctx)
                assert scale < 1
            with scaled_lr(opt, scale) as lrs:
                applied.append(lrs[0])
                opt.step()
            sched.step()
        return [g["lr"] for g in opt.param_groups], sched.state_dict(), applied

    lr_on, state_on, applied_on = run(True)
    lr_off, state_off, applied_off = run(False)
    assert lr_on == lr_off
    assert state_on == state_off
    assert all(a < b for a, b in zip(applied_on, applied_off))


def test_seq_clipped_and_token_sources():
    lw = torch.tensor([0.0, 5.0, -2.0])
    clipped = ESSLR(source="seq_clipped", clip=2.0)
    ctx = seq_ctx(lw)
    clipped.lr_scale(ctx)
    expected = float(ess_fraction(lw.clamp(max=math.log(2.0))))
    assert clipped.metrics()["ess/rho"] == pytest.approx(expected)
    tok = ESSLR(source="tok")
    tok.lr_scale(ctx)
    assert tok.metrics()["ess/rho"] == pytest.approx(float(ess_fraction(lw)))


def test_min_scale_floor():
    ctrl = ESSLR(min_scale=0.6)
    lw = torch.tensor([0.0, 20.0, 0.0, 0.0])
    assert ctrl.lr_scale(seq_ctx(lw)) == 0.6


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_rho_base_outside_unit_interval_fails_at_build(bad):
    with pytest.raises(ConfigError) as err:
        build("ess_lr", {"rho_base": bad})
    assert "rho_base" in str(err.value) and "(0, 1]" in str(err.value)


def test_nan_log_weights_raise():
    with pytest.raises(ValueError, match="nan"):
        ess_fraction(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="at least one"):
        ess_fraction(torch.tensor([]))
