"""Each controller's acting fraction (``active/<name>``, ``gac/active``): what it changed at a step,
computed by the chain, carried by ``loss_step`` into the step record and written to metrics.jsonl."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tabular import RecordingBackend, TabularLM, rollout_batch, sequences, states_along

from asyncrl.caches import DenseCache
from asyncrl.controllers import build, chain
from asyncrl.controllers.base import SampleInfo
from asyncrl.controllers.chain import ACTIVE_PREFIX
from asyncrl.estimators import build as build_estimator
from asyncrl.step import StepOptions, StepParts, loss_step
from asyncrl.telemetry import names as N
from asyncrl.telemetry.sinks import RunWriter, read_metrics
from asyncrl.telemetry.steps import step_metrics

torch.set_num_threads(1)
f64 = torch.float64
V, T = 3, 2
_g = torch.Generator().manual_seed(5)
THETA = torch.randn(4, V, dtype=f64, generator=_g)
STALE = THETA + 1.5 * torch.randn(4, V, dtype=f64, generator=_g)
TEACHER = 2 * torch.randn(4, V, dtype=f64, generator=_g)
YS = sequences(V, T)
STATES = states_along(YS, V)


def _batch(behavior: torch.Tensor, *, version: int, lag: int) -> dict[str, Any]:
    lb = torch.log_softmax(behavior, -1)[STATES, YS]
    batch = rollout_batch(YS, lb, version=version, lag=lag)
    batch.update(DenseCache().build(TEACHER[STATES], batch))
    return batch


def _steps(*controllers: Any, behavior: torch.Tensor = STALE, lag: int = 2, n: int = 3) -> list[dict]:
    """``n`` loss_steps of the tabular model at a fixed lag; the step records (``step_metrics``)."""
    model = TabularLM(THETA, T)
    parts = StepParts(
        RecordingBackend(model, lr=0.05),
        build_estimator("forward_kl", {"dense": True}),
        chain(*controllers),
        StepOptions(grad_clip=0.0),
    )
    return [
        step_metrics(loss_step(_batch(behavior, version=v + lag, lag=lag), parts, v + lag)) for v in range(n)
    ]


def test_names_and_chain_agree_on_the_prefix() -> None:
    assert ACTIVE_PREFIX == N.ACTIVE_PREFIX
    assert N.active_key("ess_lr") == "active/ess_lr"
    with pytest.raises(ValueError, match="'/'"):
        N.active_key("a/b")


@pytest.mark.parametrize("apply_to", ["grad", "update"])
def test_gac_active_is_logged_every_step_after_the_first(apply_to: str) -> None:
    rows = _steps(build("gradient_alignment", {"tau": -0.99, "apply_to": apply_to, "min_lag": 1}))
    for row in rows[1:]:  # the first step only sets the reference
        assert row[N.GAC_ACTIVE] == 1.0
        assert row[N.active_key("gradient_alignment")] == 1.0
        assert row[N.GAC_COS_PREV] > -0.99
    assert rows[0][N.GAC_ACTIVE] == 0.0


def test_gac_does_not_act_below_min_lag() -> None:
    rows = _steps(build("gradient_alignment", {"tau": -0.99, "min_lag": 3}), lag=2)
    assert [r[N.active_key("gradient_alignment")] for r in rows] == [0.0, 0.0, 0.0]


def test_truncated_is_active_is_the_fraction_of_tokens_it_changed() -> None:
    rows = _steps(build("truncated_is", {"level": "sequence", "upper": 1.2, "lower": 0.8}))
    for row in rows:
        changed = row["is/frac_truncated"] + row["is/frac_masked"]
        assert row[N.active_key("truncated_is")] == pytest.approx(changed)
        assert 0 < changed < 1
    fresh = _steps(build("truncated_is", {"level": "sequence", "upper": 1.2}), behavior=THETA, lag=0, n=1)
    assert fresh[0][N.active_key("truncated_is")] == 0.0  # on-policy: every weight is 1


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("ess_lr", {}),
        ("staleness_lr_law", {"mode": "inverse_lag"}),
        ("lag_bucket_decay", {"mode": "batch_lr"}),
    ],
)
def test_lr_controllers_are_active_when_they_lower_the_lr(name: str, options: dict) -> None:
    stale = _steps(build(name, options), lag=2, n=1)[0]
    fresh = _steps(build(name, options), behavior=THETA, lag=0, n=1)[0]
    assert stale[N.active_key(name)] == 1.0 and stale[N.LR_APPLIED] < stale[N.LR_SCHEDULED]
    assert fresh[N.active_key(name)] == 0.0 and fresh[N.LR_APPLIED] == pytest.approx(fresh[N.LR_SCHEDULED])


def test_sample_weight_decay_is_the_fraction_of_samples_down_weighted() -> None:
    ctrl = build("lag_bucket_decay", {"mode": "sample_weight"})
    rows = _steps(ctrl, lag=2, n=1)
    assert rows[0][N.active_key("lag_bucket_decay")] == 1.0  # every sample at lag 2 < 1 weight


def test_a_keep_only_controller_is_active_on_the_samples_it_drops() -> None:
    c = chain(build("bounded_staleness", {"max_lag": 1}), build("ess_lr", {}))
    info = SampleInfo(
        sample_id=np.arange(4), group_id=np.arange(4), version_first=np.array([5, 3, 5, 2]),
        version_last=np.array([5, 3, 5, 2]),
    )  # fmt: skip
    keep = c.keep(info, 5)  # lags 0, 2, 0, 3
    assert keep.tolist() == [True, False, True, False]
    out = c.metrics()
    assert out[N.active_key("bounded_staleness")] == 0.5
    assert N.active_key("ess_lr") not in out  # it has not acted on a step yet


def test_acting_fractions_reach_metrics_jsonl(tmp_path) -> None:
    rows = _steps(
        build("truncated_is", {"level": "sequence", "upper": 1.2}),
        build("gradient_alignment", {"tau": -0.99, "apply_to": "update"}),
        build("ess_lr", {}),
    )
    writer = RunWriter(tmp_path, tensorboard=False)
    for i, row in enumerate(rows, start=1):
        writer.log_step(i, row)
    writer.close()
    logged = read_metrics(tmp_path)
    assert [m[N.active_key("gradient_alignment")] for m in logged] == [0.0, 1.0, 1.0]
    assert [m[N.GAC_ACTIVE] for m in logged] == [0.0, 1.0, 1.0]
    assert all(0 < m[N.active_key("truncated_is")] < 1 and m[N.active_key("ess_lr")] == 1.0 for m in logged)
