"""Engines by dotted path (``pipeline.engine=package.module:Class``): what the plan checks before
any actor starts, and the ``PacedEngine`` study wrapper (latency padding, heavy-tailed calls)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.engines import SamplingParams
from asyncrl.engines.base import check_engine
from asyncrl.engines.paced import PacedEngine
from asyncrl.plan import check_components

REPO = Path(__file__).resolve().parents[1]
PARAMS = SamplingParams(max_new_tokens=3)


class NotAnEngine:
    """Has from_pretrained and generate, but no load_weights / check_supported."""

    @classmethod
    def from_pretrained(cls, path, *, version=0):
        return cls()

    def generate(self, *args, **kwargs):
        return {}


class FakeEngine:
    """The smallest engine: fixed completions, stamps its version."""

    name = "fake"
    supports_mc = False
    pad_id = 0

    def __init__(self, version: int = 0) -> None:
        self._version = version
        self.calls = 0

    @classmethod
    def from_pretrained(cls, path, *, version=0, width: int = 2):
        return cls(version)

    @classmethod
    def check_supported(cls, path, params, **options):
        return None

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state_dict, version):
        self._version = version

    def generate(self, prompt_ids, prompt_mask, params, *, seed):
        self.calls += 1
        B = prompt_ids.shape[0]
        return {
            "completion_ids": torch.full((B, 2), 5),
            "completion_mask": torch.ones(B, 2, dtype=torch.bool),
            "behavior_logprobs": torch.full((B, 2), -0.5),
            "token_versions": torch.full((B, 2), self._version, dtype=torch.int32),
        }


def config(*overrides: str):
    return load_config(REPO / "examples" / "configs" / "opd_tiny.yaml", list(overrides))


def test_a_dotted_engine_is_resolved_and_checked_before_any_actor():
    cfg = config(f"pipeline.engine={__name__}:FakeEngine", "pipeline.engine_options={width: 3}")
    check_components(cfg, None)  # resolves, has every hook, takes the options


def test_a_class_without_the_engine_hooks_is_refused_by_name():
    cfg = config(f"pipeline.engine={__name__}:NotAnEngine")
    with pytest.raises(ValueError, match=r"NotAnEngine.*not a rollout engine.*check_supported, load_weights"):
        check_components(cfg, None)


def test_engine_options_its_from_pretrained_does_not_take_are_refused():
    with pytest.raises(ValueError, match=r"pipeline\.engine_options=.*'widht'.*from_pretrained"):
        check_engine(FakeEngine, "FakeEngine", {"widht": 3})
    cfg = config("pipeline.engine=hf", "pipeline.engine_options={dtyp: float32}")
    with pytest.raises(ValueError, match=r"engine_options.*dtyp"):
        check_components(cfg, None)
    paced = config(
        "pipeline.engine=asyncrl.engines.paced:PacedEngine", "pipeline.engine_options={latency_s: -1}"
    )
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        check_components(paced, None)


def test_an_unimportable_dotted_engine_fails_at_load_with_the_name():
    with pytest.raises(ValueError, match=r"pipeline\.engine.*no_such_module"):
        config("pipeline.engine=no_such_module:Engine")


def test_paced_engine_pads_to_its_latency_and_keeps_the_rollout():
    inner = FakeEngine(version=3)
    paced = PacedEngine(inner, latency_s=0.05)
    ids, mask = torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool)
    t0 = time.perf_counter()
    out = paced.generate(ids, mask, PARAMS, seed=1)
    assert time.perf_counter() - t0 >= 0.05  # sleep never returns early
    ref = FakeEngine(version=3).generate(ids, mask, PARAMS, seed=1)
    assert all(torch.equal(out[k], ref[k]) for k in ref) and inner.calls == 1
    paced.load_weights({}, 7)
    assert paced.version == 7 and paced.pad_id == 0 and not paced.supports_mc


def test_heavy_tail_is_per_sample_seeded_and_takes_the_whole_call():
    paced = PacedEngine(FakeEngine(), latency_s=1.0, tail_prob=0.05, tail_factor=10.0, tail_seed=3)
    durations = np.array([paced.duration(16, seed) for seed in range(2000)])
    assert set(np.unique(durations)) == {1.0, 10.0}
    # a call is long when any of its 16 samples is: 1 - 0.95^16 = 0.56
    assert abs((durations == 10.0).mean() - (1 - 0.95**16)) < 0.04
    again = np.array([paced.duration(16, seed) for seed in range(2000)])
    assert np.array_equal(durations, again)  # the same blocks straggle in every run
    assert PacedEngine(FakeEngine(), latency_s=1.0).duration(16, 0) == 1.0
    with pytest.raises(ValueError, match="tail_factor"):
        PacedEngine(FakeEngine(), latency_s=1.0, tail_factor=0.5)
