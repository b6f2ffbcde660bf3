"""``PacedStep`` (``asyncrl.controllers.paced``), the learner-side study tool of ``benchmarks/scaling.py``:
built by dotted path through the run config, validated, and in a chain only ``after_step`` sleeps."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.config import load_config
from asyncrl.configurable import ConfigError
from asyncrl.controllers import CONTROLLERS, build_chain
from asyncrl.controllers.paced import PacedStep

REPO = Path(__file__).resolve().parents[1]
NAME = "asyncrl.controllers.paced:PacedStep"


def _config(pad: str):
    return load_config(
        REPO / "examples" / "configs" / "opd_tiny.yaml",
        [f"controllers=[{{name: '{NAME}', options: {{pad_s: {pad}}}}}]"],
    )


def test_the_run_config_builds_it_by_dotted_path_and_refuses_a_negative_pad():
    cfg = _config("0.01")
    assert cfg.controllers[0].name == NAME and cfg.controllers[0].options == {"pad_s": 0.01}
    with pytest.raises(ConfigError, match="pad_s"):
        _config("-0.5")
    assert "paced_step" not in CONTROLLERS.names()  # a study tool: never picked up by a short name


def test_in_a_chain_only_after_step_sleeps_and_the_sleep_is_logged():
    ctl = build_chain([(NAME, {"pad_s": 0.05})])
    ctx = SimpleNamespace(base_lr=1e-3)
    t0 = time.perf_counter()
    assert ctl.lr_scale(ctx) == 1.0  # every other hook is the chain's no-op
    assert time.perf_counter() - t0 < 0.04
    t0 = time.perf_counter()
    ctl.after_step(ctx)
    ctl.after_step(ctx)
    took = time.perf_counter() - t0
    assert took >= 0.1
    assert 0.1 <= ctl.metrics()["paced_step/slept_s"] <= took + 1e-6
    assert PacedStep(pad_s=0.0).config.pad_s == 0.0
