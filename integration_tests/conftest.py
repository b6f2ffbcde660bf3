"""Integration fixtures: one Ray instance per module, tiny pretrained models cached per machine."""

from __future__ import annotations

import os
from pathlib import Path

for _k, _v in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S": "120",
}.items():
    os.environ.setdefault(_k, _v)

import pytest  # noqa: E402
import torch  # noqa: E402

from asyncrl.config import RunConfig, load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("ASYNCRL_TEST_CACHE", REPO / ".asyncrl_cache"))

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair():
    """Teacher/student for the built-in addition task at the `tiny` preset (trained once, < 1 min)."""
    from asyncrl.workloads.pretrain import pretrain

    return pretrain(task="addition", preset="tiny", cache_dir=CACHE, seed=0, progress=False)


@pytest.fixture(scope="session")
def small_pair():
    """The demo pair (`small` preset): capable enough that 60 OPD steps move its accuracy (~3 min once)."""
    from asyncrl.workloads.pretrain import pretrain

    return pretrain(task="addition", preset="small", cache_dir=CACHE, seed=0, progress=False)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from asyncrl.raysetup import RAY_ENV, runtime_env

    # the Ray Data tick users get (pipeline.data_tick_s default), so tests run what users run
    ray.init(num_cpus=4, include_dashboard=False, runtime_env=runtime_env(RAY_ENV))
    yield ray
    ray.shutdown()


def tiny_config(run_dir: Path, *overrides: str, config: str = "opd_tiny.yaml") -> RunConfig:
    """A shipped config (default: the tiny OPD one) plus overrides, writing into ``run_dir``."""
    base = [
        f"run_dir={run_dir}",
        f"workload.cache_dir={CACHE}",
        "telemetry.progress=false",
        "telemetry.tensorboard=false",
    ]
    return load_config(REPO / "examples" / "configs" / config, base + list(overrides))
