"""loss_step: the sampling policy (eval mode, temperature), the hooks' contract (lr_applied, an LR
scale of 0, refused compositions) and which ESS the log reports (issue 12 items 2, 3, 6, 8)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from tabular import ProbabilityWeights, RecordingBackend, TabularLM, rollout_batch, sequences, states_along

from asyncrl import records as R
from asyncrl.caches import CACHES, DenseCache, TopKCache, cache_options
from asyncrl.controllers import build, chain
from asyncrl.controllers.functional import ess_fraction
from asyncrl.estimators import build as build_estimator
from asyncrl.step import StepOptions, StepParts, loss_step
from asyncrl.telemetry import names as N
from asyncrl.telemetry.steps import step_metrics

torch.set_num_threads(1)
f64 = torch.float64
V, T = 4, 2
_g = torch.Generator().manual_seed(8)
THETA = torch.randn(5, V, dtype=f64, generator=_g)
TEACHER = 2 * torch.randn(5, V, dtype=f64, generator=_g)
YS = sequences(V, T)
STATES = states_along(YS, V)


def _batch(
    behavior_table: torch.Tensor, *, tau: float = 1.0, version: int = 3, lag: int = 0
) -> dict[str, Any]:
    lb = torch.log_softmax(behavior_table / tau, -1)[STATES, YS]
    batch = rollout_batch(YS, lb, version=version, lag=lag)
    batch.update(DenseCache(temperature=tau).build(TEACHER[STATES], batch))
    return batch


def _parts(
    model: torch.nn.Module, *controllers: Any, estimator: str = "forward_kl", tau: float = 1.0, **opts: Any
):
    backend = RecordingBackend(model)
    est = build_estimator(estimator, {"dense": True} if estimator == "forward_kl" else opts)
    return StepParts(backend, est, chain(*controllers), StepOptions(grad_clip=0.0, temperature=tau)), backend


# --- item 8: the learner computes the policy that sampled ----------------------------------------------
@pytest.mark.parametrize("tau", [1.0, 0.7, 1.6])
def test_lag_0_ratios_are_exactly_1_in_eval_mode_at_the_sampling_temperature(tau: float) -> None:
    """The engine samples from softmax(z / tau) without dropout; loss_step computes pi_theta the
    same way, so at lag 0 KL(behavior || current) is 0, every IS weight 1 and ESS 1."""
    model = TabularLM(THETA, T, dropout=0.5)  # eval mode: the dropout is off
    parts, backend = _parts(model, build("truncated_is", {"level": "sequence"}), build("ess_lr", {}), tau=tau)
    result = loss_step(_batch(THETA, tau=tau), parts, 3)
    assert abs(result.kl_behavior_current) < 1e-15
    assert torch.count_nonzero(result.seq_log_ratio_global.abs() > 1e-14) == 0
    assert result.metrics["is/w_mean"] == pytest.approx(1.0, abs=1e-14)
    assert backend.seen[-1][1] == pytest.approx(1.0, abs=1e-12)  # ess_lr leaves fresh samples alone
    # at the wrong temperature they are not
    wrong, _ = _parts(TabularLM(THETA, T), tau=1.0)
    if tau != 1.0:
        assert loss_step(_batch(THETA, tau=tau), wrong, 3).kl_behavior_current > 1e-3


def test_train_mode_is_refused() -> None:
    model = TabularLM(THETA, T, dropout=0.5)
    parts, _ = _parts(model)
    model.train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        loss_step(_batch(THETA), parts, 3)


def test_teacher_caches_score_the_tempered_teacher() -> None:
    """Every kind keeps scores of softmax(z_t / tau); the run passes sampling.temperature."""
    z = 3 * torch.randn(2, 3, 11, dtype=f64, generator=torch.Generator().manual_seed(0))
    batch = {
        R.COMPLETION_MASK: torch.ones(2, 3, dtype=torch.bool),
        R.COMPLETION_IDS: torch.zeros(2, 3, dtype=torch.long),
    }
    for kind in ("topk", "token", "dense"):
        hot = CACHES.get(kind)(**cache_options(kind, k=4, temperature=0.5)).build(z, batch)
        ref = CACHES.get(kind)(**cache_options(kind, k=4)).build(z / 0.5, batch)
        assert hot.keys() == ref.keys()
        for key in hot:
            torch.testing.assert_close(hot[key], ref[key])
    assert cache_options("topk", k=4, m=8, temperature=0.7) == {"k": 4, "temperature": 0.7}
    with pytest.raises(ValueError, match="temperature"):
        TopKCache(temperature=0.0)


def test_the_run_scores_the_teacher_at_the_sampling_temperature() -> None:
    from asyncrl.config import load_config
    from asyncrl.plan import check_components

    cfg = load_config(None, ["sampling.temperature=0.7", "estimator.name=forward_kl"])
    _, kind, opts = check_components(cfg, None)
    assert kind == "topk" and opts["temperature"] == 0.7


# --- items 2 and 6: what the hooks see and do ------------------------------------------------------------
class _Probe:
    """Records ctx.lr_applied in after_step and returns a fixed LR scale."""

    name = "probe"

    def __init__(self, scale: float) -> None:
        self.scale, self.seen = scale, []

    def lr_scale(self, ctx: Any) -> float:
        return self.scale

    def after_step(self, ctx: Any) -> None:
        self.seen.append(ctx.lr_applied)


def test_after_step_sees_the_lr_the_whole_chain_applied() -> None:
    probe = _Probe(0.5)
    parts, backend = _parts(TabularLM(THETA, T), build("lag_bucket_decay", {}), probe)
    result = loss_step(_batch(THETA, lag=2), parts, 3)  # lag 2: the decay table gives 0.75
    assert result.lr_applied == pytest.approx(backend.tc.lr * 0.75 * 0.5)
    assert probe.seen == [result.lr_applied]


def test_an_lr_scale_of_zero_takes_no_optimizer_step() -> None:
    """Weights and AdamW state unchanged, version advanced, lr_applied 0."""
    model = TabularLM(THETA, T)
    parts, backend = _parts(model, _Probe(1.0))
    loss_step(_batch(THETA), parts, 3)  # a first real step creates AdamW's state
    state = {
        k: v.clone() if torch.is_tensor(v) else v for k, v in backend.optimizer.state[model.table].items()
    }
    weights = model.table.detach().clone()
    parts.controllers["probe"].scale = 0.0
    result = loss_step(_batch(THETA, version=4), parts, 4)
    assert result.stepped and result.version == 5 and result.lr_applied == 0.0
    assert torch.equal(model.table, weights)
    after = backend.optimizer.state[model.table]
    assert all(torch.equal(torch.as_tensor(after[k]), torch.as_tensor(v)) for k, v in state.items())
    assert parts.controllers["probe"].seen[-1] == 0.0


def test_partitioned_gradients_refuse_gradient_and_update_transforms() -> None:
    class Zero(RecordingBackend):
        name = "zero2"
        supports_gradient_transform = False

    for opts in ({}, {"apply_to": "update"}):
        with pytest.raises(ValueError, match="backend=ddp"):
            StepParts(
                Zero(TabularLM(THETA, T)),
                build_estimator("forward_kl", {}),
                chain(build("gradient_alignment", opts)),
            )
    StepParts(Zero(TabularLM(THETA, T)), build_estimator("forward_kl", {}), chain(build("ess_lr", {})))


def test_plan_refuses_the_pairings_loss_step_refuses() -> None:
    from dataclasses import replace

    from asyncrl.config import ComponentSpec, load_config
    from asyncrl.plan import check_components

    cfg = load_config(None, ["estimator.name=grpo", "train.group_size=2", "train.batch_size=32"])
    tis = ComponentSpec(name="truncated_is", options={})
    with pytest.raises(ValueError, match="anchor=proximal"):
        check_components(replace(cfg, controllers=[tis]), None)
    ok = replace(cfg, estimator=ComponentSpec(name="grpo", options={"anchor": "proximal", "clip_eps": None}))
    check_components(replace(ok, controllers=[tis]), None)


# --- item 3: the ESS the controller acted on is the one logged under its key ----------------------------
def test_logged_ess_keys_learner_and_controller_are_distinct() -> None:
    stale = THETA + 0.9 * torch.randn(5, V, dtype=f64, generator=torch.Generator().manual_seed(2))
    ess = build("ess_lr", {"source": "seq_clipped", "clip": 1.2})
    parts, backend = _parts(TabularLM(THETA, T), ess)
    result = loss_step(_batch(stale, lag=1), parts, 3)
    logged = step_metrics(result)
    lw = result.seq_log_ratio_global.double()
    acted = float(ess_fraction(lw.clamp(max=math.log(1.2))))
    assert logged[N.ESS_LR_RHO] == pytest.approx(acted, rel=1e-12)  # what the LR was scaled by
    assert backend.seen[-1][1] == pytest.approx(math.sqrt(acted), rel=1e-12)
    assert logged[N.ESS_RHO] == pytest.approx(float(ess_fraction(lw)), rel=1e-12)  # the learner's own
    assert abs(logged[N.ESS_RHO] - logged[N.ESS_LR_RHO]) > 1e-3
    assert N.ESS_RHO != N.ESS_LR_RHO


def test_probability_weights_helper_gives_the_expectation() -> None:
    """The matrix test's device: the weighted token mean over all outcomes is the expected loss."""
    lb = torch.log_softmax(THETA, -1)
    p = lb[STATES, YS].sum(-1).exp()
    batch = _batch(THETA)
    parts, _ = _parts(TabularLM(THETA, T), ProbabilityWeights((len(YS) * p)[:, None]))
    result = loss_step(batch, parts, 3)
    lp = torch.log_softmax(TEACHER, -1)
    fkl = (lp.exp() * (lp - lb)).sum(-1)  # per state
    expected = float((p[:, None] * fkl[STATES]).sum() / T)
    assert result.loss == pytest.approx(expected, rel=1e-12)
    assert np.isfinite(result.samples["loss"]).all()
