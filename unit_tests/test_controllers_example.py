"""examples/custom_controller.py runs: a user controller registered, built from YAML and trained with."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.configurable import ConfigError
from asyncrl.controllers import CONTROLLERS, StepContext, build

torch.set_num_threads(1)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_controller.py"


def load_example():
    name = "asyncrl_example_custom_controller"
    if name not in sys.modules:  # import once: the module registers "kl_guard" at import time
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_example_main_trains_with_the_custom_controller():
    example = load_example()
    summary = example.main(steps=12, verbose=False)
    assert summary["trained"] == 12 * example.B  # 12 optimizer steps over whole (kept) batches
    assert summary["dropped"] == summary["dropped_total"] > 0  # lag-3 batches were dropped, and counted
    assert summary["p_token3"] > 0.3  # REINFORCE learned to emit token 3 (uniform: 1/8)


def test_custom_controller_is_registered_validated_and_acts():
    example = load_example()
    assert CONTROLLERS.get("kl_guard") is example.KLGuard
    with pytest.raises(ConfigError, match=r"options\.max_k3"):
        build("kl_guard", {"max_k3": -1})
    guard = build("kl_guard", {"max_k3": 0.1})
    mask = torch.ones(2, 4, dtype=torch.bool)
    logp = torch.zeros(2, 4)
    behavior = torch.stack([torch.zeros(4), torch.full((4,), -1.0)])  # sample 1: k3 = e - 2 > 0.1
    w = guard.token_weights(
        StepContext.local(
            step=1, base_lr=1.0, mask=mask, logprobs=logp, behavior_logprobs=behavior, lags=[0, 1]
        )
    )
    assert w[0].eq(1).all() and w[1].eq(0).all()
    assert guard.metrics()["kl_guard/masked"] == 1
