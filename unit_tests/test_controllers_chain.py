"""chain / as_controller composition rules, the CONTROLLERS registry, build and build_chain."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch
import yaml

from asyncrl.configurable import ConfigError
from asyncrl.controllers import (
    CONTROLLERS,
    AdmissionRequest,
    BoundedStaleness,
    SampleInfo,
    StepContext,
    as_controller,
    build,
    build_chain,
    chain,
)

torch.set_num_threads(1)
BUILT_INS = {
    "bounded_staleness": "BoundedStaleness",
    "truncated_is": "TruncatedIS",
    "ess_lr": "ESSLR",
    "gradient_alignment": "GradientAlignment",
    "staleness_lr_law": "StalenessLRLaw",
    "lag_bucket_decay": "LagBucketDecay",
}


def ctx(b: int = 3, t: int = 2, lags=None) -> StepContext:
    mask = torch.ones(b, t, dtype=torch.bool)
    z = torch.zeros(b, t)
    return StepContext.local(
        step=4,
        base_lr=0.5,
        mask=mask,
        logprobs=z,
        behavior_logprobs=z,
        lags=lags if lags is not None else [0] * b,
    )


class Scale:
    """Partial controller: only an LR scale, weights and metrics."""

    def __init__(self, s: float, w: float | None = None, name: str = "scale"):
        self.s, self.w, self.name = s, w, name
        self.steps = 0

    def lr_scale(self, ctx):
        return self.s

    def token_weights(self, ctx):
        return None if self.w is None else torch.full(ctx.mask.shape, self.w)

    def after_step(self, ctx):
        self.steps += 1

    def metrics(self):
        return {"x/s": self.s}

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class DropOdd:
    name = "drop_odd"

    def keep(self, info, learner_version):
        return info.sample_id % 2 == 0  # deliberately not group-atomic

    def admit(self, req):
        return req.n <= 2


class Recorder:
    def __init__(self, tag, log):
        self.tag, self.log = tag, log

    def transform_gradient(self, grads, ctx):
        self.log.append(self.tag)
        for g in grads:
            g.mul_(2.0)


def test_registry_has_the_built_ins_with_matching_config_defaults():
    assert set(CONTROLLERS.names()) >= set(BUILT_INS)
    for name, cls_name in BUILT_INS.items():
        cls = CONTROLLERS.get(name)
        assert cls.__name__ == cls_name and cls.name == name
        params = inspect.signature(cls.__init__).parameters
        for f in dataclasses.fields(cls.Config):  # __init__ keywords == Config fields, same defaults
            assert params[f.name].default == f.default, (name, f.name)
        assert isinstance(build(name), cls)


def test_as_controller_fills_no_ops():
    c = as_controller(Scale(0.5))
    info = SampleInfo(np.arange(3), np.arange(3), np.zeros(3), np.zeros(3))
    assert c.admit(AdmissionRequest(1, 0, 0, 4, block_index=0, expected_version=0)) is True
    assert c.behavior_version(AdmissionRequest(1, 0, 0, 4, block_index=0, expected_version=0)) is None
    assert c.keep(info, 0).all()
    grads = [torch.ones(2)]
    c.transform_gradient(grads, ctx())
    assert torch.equal(grads[0], torch.ones(2))
    assert c.lr_scale(ctx()) == 0.5 and c.name == "scale"
    assert as_controller(as_controller(Recorder("a", [])).inner).name == "recorder"
    with pytest.raises(TypeError, match="pass an instance"):
        as_controller(Scale)
    with pytest.raises(TypeError, match="none of the controller hooks"):
        as_controller(object())


def test_chain_combination_rules():
    log: list[str] = []
    c = chain(
        Scale(0.5, w=2.0),
        Scale(0.25, w=3.0),
        BoundedStaleness(1),
        DropOdd(),
        Recorder("a", log),
        Recorder("b", log),
    )
    assert c.names == ["scale", "scale_1", "bounded_staleness", "drop_odd", "recorder", "recorder_1"]

    # admit = AND: bounded staleness (S = 1) refuses an expected lag of 2
    def req(expected: int) -> AdmissionRequest:
        return AdmissionRequest(
            n=2, learner_version=0, in_flight=0, batch_size=4, block_index=0, expected_version=expected
        )

    assert c.admit(req(1))
    assert not c.admit(req(2))
    # keep = AND, widened to groups, drops counted per controller
    info = SampleInfo(np.arange(6), np.array([0, 0, 1, 1, 2, 2]), np.array([5, 5, 5, 5, 2, 5]), np.zeros(6))
    keep = c.keep(info, 5)
    assert keep.tolist() == [False] * 6  # every group has an odd member; group 2 is also stale
    m = c.metrics()
    assert m["chain/dropped"] == 6 and m["chain/dropped_by/drop_odd"] == 3
    assert m["chain/dropped_by/bounded_staleness"] == 2
    # token weights = product, lr = product, gradient transforms in order
    assert torch.equal(c.token_weights(ctx()), torch.full((3, 2), 6.0))
    assert c.lr_scale(ctx()) == 0.125
    grads = [torch.ones(2)]
    c.transform_gradient(grads, ctx())
    assert log == ["a", "b"] and torch.equal(grads[0], torch.full((2,), 4.0))
    c.after_step(ctx())
    assert c["scale"].steps == c["scale_1"].steps == 1
    m = c.metrics()
    assert m["x/s"] == 0.5 and m["scale_1/x/s"] == 0.25  # collision: later key prefixed
    assert m["lr/scale"] == 0.125 and m["lr/applied"] == 0.5 * 0.125 and m["lr/scale/scale_1"] == 0.25
    assert c.transforms_gradients and not chain(BoundedStaleness(1)).transforms_gradients


def test_token_weights_none_when_nobody_weights_and_shape_checked():
    assert chain(Scale(1.0), BoundedStaleness(0)).token_weights(ctx()) is None

    class Bad:
        def token_weights(self, ctx):
            return torch.ones(1)

    with pytest.raises(ValueError, match="token_weights shape"):
        chain(Bad()).token_weights(ctx())

    class Negative:
        def lr_scale(self, ctx):
            return -1.0

    with pytest.raises(ValueError, match="must be finite and >= 0"):
        chain(Negative()).lr_scale(ctx())


def test_state_dict_roundtrip_keyed_by_unique_names():
    a = chain(Scale(0.5), Scale(0.5), BoundedStaleness(0))
    a.after_step(ctx())
    a.keep(SampleInfo(np.arange(2), np.arange(2), np.array([0, 1]), np.zeros(2)), 1)
    state = a.state_dict()
    assert set(state) == {"scale", "scale_1", "bounded_staleness", "_chain"}
    b = chain(Scale(0.5), Scale(0.5), BoundedStaleness(0))
    b.load_state_dict(state)
    assert b["scale_1"].steps == 1
    assert b.metrics()["chain/dropped_total"] == 1
    with pytest.raises(ValueError, match="same controllers"):
        chain(Scale(0.5)).load_state_dict(state)


def test_build_errors_name_the_field_and_the_fix():
    with pytest.raises(ConfigError) as err:
        build("bounded_stalenes", {})
    assert err.value.field == "name" and "bounded_staleness" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build("ess_lr", {"rho_bse": 0.5})
    assert err.value.field == "options.rho_bse" and "rho_base" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_chain([("bounded_staleness", {}), ("truncated_is", {"upper": -1})])
    assert err.value.field == "controllers[1].options.upper"
    with pytest.raises(ConfigError, match=r"not\.a\.module"):
        build("not.a.module:Thing")


class UserController:
    """A user controller referenced by dotted path, called with **options."""

    def __init__(self, factor: float = 1.0):
        self.factor = factor

    def lr_scale(self, ctx):
        return self.factor


def test_build_chain_from_yaml_with_dotted_paths():
    spec = yaml.safe_load(f"""
controllers:
  - name: bounded_staleness
    options: {{max_lag: 3}}
  - name: truncated_is
    options: {{level: sequence, upper: 8}}
  - ess_lr
  - name: {__name__}:UserController
    options: {{factor: 0.5}}
  - name: asyncrl.controllers.bucket_decay:LagBucketDecay
    options: {{gamma: 1}}
""")
    c = build_chain(spec["controllers"])
    assert c.names == ["bounded_staleness", "truncated_is", "ess_lr", "user_controller", "lag_bucket_decay"]
    assert c["bounded_staleness"].max_lag == 3 and c["truncated_is"].config.upper == 8.0
    assert c["lag_bucket_decay"].config.gamma == 1.0
    assert c.lr_scale(ctx(lags=[0, 0, 0])) == 0.5
    with pytest.raises(ConfigError, match="rejected its options"):
        build(f"{__name__}:UserController", {"facto": 1})
