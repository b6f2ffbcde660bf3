"""GAC: align_gradient and GradientAlignment (spec 7.4 a-g)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from asyncrl.configurable import ConfigError
from asyncrl.controllers import GradientAlignment, StepContext, build
from asyncrl.controllers.functional import align_gradient, alignment_from_dots

torch.set_num_threads(1)
SETTINGS = settings(max_examples=50, deadline=None)

vec = st.lists(st.floats(-10, 10), min_size=3, max_size=12)


def pair(data, dim=None):
    g = data.draw(vec if dim is None else st.lists(st.floats(-10, 10), min_size=dim, max_size=dim))
    r = data.draw(st.lists(st.floats(-10, 10), min_size=len(g), max_size=len(g)))
    g, r = torch.tensor(g, dtype=torch.float64), torch.tensor(r, dtype=torch.float64)
    assume(g.norm() > 1e-3 and r.norm() > 1e-3)
    return g, r


def aligned_pair(data):
    """A pair whose cosine is usually high: g leans towards r by a drawn amount (keeps filtering low)."""
    g, r = pair(data)
    lean = data.draw(st.floats(0.0, 20.0))
    return g + lean * r * (g.norm() / r.norm()), r


def cos(a, b):
    return float(a @ b / (a.norm() * b.norm()))


def ctx(lag_max: int = 2) -> StepContext:
    mask = torch.ones(2, 1, dtype=torch.bool)
    z = torch.zeros(2, 1)
    return StepContext.local(
        step=5, base_lr=1.0, mask=mask, logprobs=z, behavior_logprobs=z, lags=[0, lag_max]
    )


@SETTINGS
@given(st.data(), st.floats(-0.95, 0.95), st.sampled_from(["cap", "project", "skip"]))
def test_at_or_below_tau_is_bitwise_unchanged(data, tau, mode):  # 7.4 a
    g, r = pair(data)
    assume(cos(g, r) <= tau - 1e-9)
    out = align_gradient(g, r, tau=tau, mode=mode)
    assert torch.equal(out, g)
    ctrl = GradientAlignment(tau=tau, mode=mode)
    grads = [g.clone()]
    ctrl.transform_gradient([r.clone()], ctx())  # sets the reference
    ctrl.transform_gradient(grads, ctx())
    assert torch.equal(grads[0], g)
    assert ctrl.metrics()["gac/active"] == 0.0


@SETTINGS
@given(st.data(), st.floats(0.0, 0.95))
def test_cap_sets_cosine_to_tau_keeps_orthogonal_part(data, tau):  # 7.4 b
    g, r = aligned_pair(data)
    c = cos(g, r)
    assume(c > tau + 1e-6 and c < 1 - 1e-6)
    out = align_gradient(g, r, tau=tau, mode="cap")
    assert cos(out, r) == pytest.approx(tau, abs=1e-6)
    r_hat = r / r.norm()
    perp_before, perp_after = g - (g @ r_hat) * r_hat, out - (out @ r_hat) * r_hat
    assert torch.allclose(perp_before, perp_after, atol=1e-9 * (1 + g.norm()))
    assert out.norm() <= g.norm() + 1e-12


@SETTINGS
@given(st.data(), st.floats(-0.9, 0.9))
def test_project_removes_the_reference_component(data, tau):  # 7.4 c
    g, r = aligned_pair(data)
    assume(cos(g, r) > tau + 1e-9)
    out = align_gradient(g, r, tau=tau, mode="project", lam=1.0)
    assert abs(float(out @ r)) <= 1e-9 * g.norm() * r.norm()


def test_first_step_without_reference_is_identity():  # 7.4 d
    g = torch.tensor([1.0, 2.0, 3.0])
    grads = [g.clone()]
    ctrl = GradientAlignment(tau=-0.99)
    ctrl.transform_gradient(grads, ctx())
    assert torch.equal(grads[0], g)
    assert ctrl.metrics()["gac/active"] == 0.0
    assert alignment_from_dots(1.0, 1.0, 0.0, tau=0.0).active is False  # zero reference


@SETTINGS
@given(st.data(), st.floats(0.0, 0.9), st.sampled_from(["cap", "project"]))
def test_idempotent_for_a_fixed_reference(data, tau, mode):  # 7.4 e
    g, r = pair(data)
    once = align_gradient(g, r, tau=tau, mode=mode)
    twice = align_gradient(once, r, tau=tau, mode=mode)
    assert torch.allclose(once, twice, atol=1e-7 * (1 + g.norm()))


@SETTINGS
@given(st.data(), st.floats(-0.5, 0.9), st.sampled_from(["cap", "project", "skip"]))
def test_sharded_equals_unsharded(data, tau, mode):  # 7.4 f
    g, r = pair(data, dim=12)
    cuts = sorted(data.draw(st.lists(st.integers(1, 11), min_size=1, max_size=3, unique=True)))
    bounds = list(zip([0, *cuts], [*cuts, 12]))
    dots = np.sum(
        [[float(g[a:b] @ r[a:b]), float(g[a:b] @ g[a:b]), float(r[a:b] @ r[a:b])] for a, b in bounds], 0
    )
    al = alignment_from_dots(*dots, tau=tau, mode=mode)
    shards = [g[a:b] if not al.active else al.scale_g * g[a:b] + al.coef_r * r[a:b] for a, b in bounds]
    # |g_perp| comes from dot products (sqrt(|g|^2 - a^2)); at cos ~ 1 that cancels to ~1e-8 |g|
    assert torch.allclose(
        torch.cat(shards), align_gradient(g, r, tau=tau, mode=mode), atol=1e-7 * (1 + g.norm())
    )


def test_skip_asks_for_no_step_and_keeps_the_reference():  # 7.4 g
    torch.manual_seed(0)
    ctrl = GradientAlignment(tau=0.5, mode="skip")
    g = torch.randn(6)
    ctrl.transform_gradient([g.clone()], ctx())
    assert ctrl.lr_scale(ctx()) == 1.0  # the first step only sets the reference
    ref = ctrl.reference[0].clone()
    grads = [1.1 * g]  # parallel: cos 1 > tau
    ctrl.transform_gradient(grads, ctx())
    assert ctrl.metrics()["gac/skipped"] == 1.0 and ctrl.lr_scale(ctx()) == 0.0
    assert torch.equal(grads[0], 1.1 * g)  # the gradient is left alone: the step is what is skipped
    assert torch.equal(ctrl.reference[0], ref)
    ctrl.transform_gradient([torch.randn(6)], ctx(lag_max=0))  # min_lag 1: a fresh batch never skips
    assert ctrl.lr_scale(ctx()) == 1.0
    with pytest.raises(ConfigError, match="apply_to"):
        build("gradient_alignment", {"mode": "skip", "apply_to": "update"})


# --- through loss_step with AdamW (issue 12 item 6) -------------------------------------------------------
def _adamw_run(options: dict | None, steps: int = 12, lr: float = 0.05):
    """The same stale (lag 1) batch every step through loss_step with AdamW; returns the applied
    updates, the step results and the backend."""
    from tabular import RecordingBackend, TabularLM, rollout_batch, sequences, states_along

    from asyncrl import records as R
    from asyncrl.caches import DenseCache
    from asyncrl.controllers import chain
    from asyncrl.estimators import build as build_estimator
    from asyncrl.step import StepOptions, StepParts, loss_step

    V, T = 4, 2
    g = torch.Generator().manual_seed(5)
    theta = torch.randn(5, V, dtype=torch.float64, generator=g)
    teacher = 2 * torch.randn(5, V, dtype=torch.float64, generator=g)
    ys = sequences(V, T)
    st_ = states_along(ys, V)
    backend = RecordingBackend(TabularLM(theta, T), lr=lr)
    parts = StepParts(
        backend=backend,
        estimator=build_estimator("forward_kl", {"dense": True}),
        controllers=chain(*([build("gradient_alignment", options)] if options is not None else [])),
        options=StepOptions(grad_clip=0.0),
    )
    param = backend.module.table
    updates, results = [], []
    for v in range(steps):
        lb = torch.log_softmax(theta, -1)[st_, ys]  # generated by the starting weights
        batch = rollout_batch(ys, lb, version=v + 1, lag=1)
        batch.update(DenseCache().build(teacher[st_], batch))
        batch[R.VERSION_FIRST] = np.full(len(ys), v)
        before = param.detach().clone()
        results.append(loss_step(batch, parts, v + 1))
        updates.append((param.detach() - before).flatten())
    return updates, results, backend


def test_update_mode_caps_the_cosine_of_the_applied_adamw_updates():
    """apply_to=update: every applied AdamW update has cos <= tau with the previous applied one;
    without GAC (and with GAC on the raw gradient) consecutive updates stay far above tau."""
    tau = 0.5
    base, _, _ = _adamw_run(None)
    on_grad, _, _ = _adamw_run({"tau": tau, "mode": "cap"})
    on_update, results, _ = _adamw_run({"tau": tau, "mode": "cap", "apply_to": "update"})
    cos_base = [cos(a, b) for a, b in zip(base[1:], base[:-1])]
    cos_grad = [cos(a, b) for a, b in zip(on_grad[1:], on_grad[:-1])]
    cos_update = [cos(a, b) for a, b in zip(on_update[1:], on_update[:-1])]
    assert min(cos_base) > 0.8 and min(cos_grad) > 0.8  # acting on the gradient barely moves it
    assert max(cos_update) <= tau + 1e-9
    assert results[-1].metrics["gac/active"] == 1.0


def test_skip_skips_the_adamw_step_weights_and_optimizer_state():
    """mode=skip: on a skipped step the weights AND AdamW's moments and step count are unchanged;
    the version still advances and lr_applied says 0."""
    updates, results, backend = _adamw_run({"tau": 0.5, "mode": "skip"}, steps=4)
    skipped = [r.metrics["gac/skipped"] for r in results]
    assert skipped[0] == 0.0 and skipped[1] == 1.0  # the second step repeats the first's direction
    assert torch.count_nonzero(updates[1]) == 0
    assert results[1].stepped and results[1].version == 3 and results[1].lr_applied == 0.0
    assert [s for _, s in backend.seen] == [1.0]  # the optimizer was called once, for step 1
    assert all(torch.count_nonzero(u) == 0 for u, s in zip(updates, skipped) if s)
    state = backend.optimizer.state[backend.module.table]
    assert int(state["step"]) == 1  # one AdamW step in four batches: the moments never moved again


def test_min_lag_gates_synchronous_batches():
    g, r = torch.tensor([1.0, 0.1]), torch.tensor([1.0, 0.0])
    ctrl = GradientAlignment(tau=0.5, min_lag=1)
    ctrl.transform_gradient([r.clone()], ctx())
    grads = [g.clone()]
    ctrl.transform_gradient(grads, ctx(lag_max=0))
    assert torch.equal(grads[0], g)
    assert ctrl.metrics()["gac/cos_prev"] > 0.5 and ctrl.metrics()["gac/active"] == 0.0
    g2 = torch.tensor([1.0, 0.3])
    grads = [g2.clone()]
    ctrl.transform_gradient(grads, ctx(lag_max=1))
    assert ctrl.metrics()["gac/active"] == 1.0
    assert cos(grads[0], g) == pytest.approx(0.5, abs=1e-6)  # the reference is now g, from the lag-0 step


def test_multi_tensor_controller_matches_flat_function_and_state_roundtrip():
    torch.manual_seed(1)
    shapes = [(3, 2), (4,), (2, 2, 2)]
    r = [torch.randn(s, dtype=torch.float64) for s in shapes]
    g = [ri + 0.2 * torch.randn(s, dtype=torch.float64) for ri, s in zip(r, shapes)]
    ctrl = GradientAlignment(tau=0.3)
    ctrl.transform_gradient([x.clone() for x in r], ctx())
    state = ctrl.state_dict()
    out = [x.clone() for x in g]
    ctrl.transform_gradient(out, ctx())
    flat = align_gradient(torch.cat([x.flatten() for x in g]), torch.cat([x.flatten() for x in r]), tau=0.3)
    assert torch.allclose(torch.cat([x.flatten() for x in out]), flat, atol=1e-12)
    m = ctrl.metrics()
    assert m["gac/active"] == 1.0 and m["gac/grad_norm_post"] == pytest.approx(float(flat.norm()))
    restored = GradientAlignment(tau=0.3)
    restored.load_state_dict(state)
    out2 = [x.clone() for x in g]
    restored.transform_gradient(out2, ctx())
    assert all(torch.equal(a, b) for a, b in zip(out, out2))
    with pytest.raises(ValueError, match="same parameter list"):
        restored.transform_gradient([torch.zeros(3)], ctx())


@pytest.mark.parametrize("tau", [1.0, -1.0, 2.0])
def test_tau_outside_open_interval_fails_at_build(tau):
    with pytest.raises(ConfigError) as err:
        build("gradient_alignment", {"tau": tau})
    assert "options.tau" in str(err.value) and "(-1, 1)" in str(err.value)
    assert math.isfinite(tau)
