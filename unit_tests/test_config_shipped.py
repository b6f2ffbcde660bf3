"""Every shipped config loads, resolves its components, passes the pipeline's build checks, and
says what its name promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import RunConfig, load_config
from asyncrl.plan import check_components

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
SHIPPED = (
    "grpo.yaml",
    "opd_async.yaml",
    "opd_lora.yaml",
    "opd_one_machine.yaml",
    "opd_reverse_kl_mc.yaml",
    "opd_smollm2.yaml",
    "opd_smollm2_lora.yaml",
    "opd_sync.yaml",
    "opd_tiny.yaml",
    "soak.yaml",
)


def test_the_shipped_set() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(SHIPPED)


@pytest.fixture(params=SHIPPED)
def shipped(request: pytest.FixtureRequest) -> tuple[str, RunConfig]:
    return request.param, load_config(CONFIGS / request.param)


def test_loads_and_passes_build_checks(shipped: tuple[str, RunConfig]) -> None:
    name, cfg = shipped
    check_components(cfg, None)  # estimator/cache/engine pairings, MC samples, batch divisibility
    assert Path(cfg.run_dir).name == Path(name).stem  # each writes its own run directory


def test_each_config_is_what_its_name_says() -> None:
    cfg = {p: load_config(CONFIGS / p) for p in SHIPPED}
    sync, asyn = cfg["opd_sync.yaml"], cfg["opd_async.yaml"]
    assert sync.pipeline.max_lag == 0 and asyn.pipeline.max_lag >= 1
    # the sync baseline differs from the async run only in the bound and the run directory
    assert sync.__class__(**{**vars(sync), "run_dir": asyn.run_dir, "pipeline": asyn.pipeline}) == asyn
    grpo = cfg["grpo.yaml"]
    assert (grpo.algo, grpo.estimator.name) == ("rl", "grpo") and grpo.train.group_size >= 4
    assert asyn.estimator.name == "forward_kl" and asyn.cache.k >= 1
    rkl = cfg["opd_reverse_kl_mc.yaml"]
    assert rkl.estimator.name == "reverse_kl_mc" and rkl.sampling.mc_samples >= 2
    assert rkl.estimator.options["advantage"] == "online"  # the "recompute" fix
    assert cfg["opd_tiny.yaml"].workload.preset == "tiny"
    one = cfg["opd_one_machine.yaml"]  # async in one process, optimizer steps of the demo's size
    assert one.pipeline.colocate and one.pipeline.max_lag >= 1 and one.train.minibatches >= 2
    assert one.train.batch_size // one.train.minibatches == asyn.train.batch_size
    assert one.train.steps == asyn.train.steps and one.estimator == asyn.estimator and one.cache == asyn.cache
    lora = cfg["opd_lora.yaml"]  # the async demo with a LoRA student: adapters only, checked provenance
    assert lora.train.lora is not None and lora.pipeline.provenance == "strict"
    assert lora.workload == asyn.workload and lora.estimator == asyn.estimator and lora.pipeline.max_lag >= 1
    for c in cfg.values():
        if c.algo == "opd":
            assert c.estimator.name != "grpo"


def test_real_config_is_the_real_demo() -> None:
    """examples/configs/opd_smollm2.yaml is what `asyncrl demo --preset smollm2` runs (its async run)."""
    from asyncrl.cli import REAL_DEMO_OVERRIDES, REAL_DEMO_STEPS

    shipped = load_config(CONFIGS / "opd_smollm2.yaml")
    demo = load_config(
        None,
        [
            "workload.preset=smollm2",
            f"train.steps={REAL_DEMO_STEPS}",
            *REAL_DEMO_OVERRIDES,
            f"run_dir={shipped.run_dir}",
            f"pipeline.max_lag={shipped.pipeline.max_lag}",
        ],
    )
    for part in ("workload", "sampling", "cache", "train", "seed"):
        assert getattr(demo, part) == getattr(shipped, part), part
    assert demo.estimator.name == shipped.estimator.name and shipped.estimator.options == {"tail": "bucket"}
    assert demo.pipeline == shipped.pipeline
    assert shipped.workload.preset == "smollm2" and shipped.workload.prompts_path is None


def test_real_lora_config_is_the_real_config_with_adapters() -> None:
    full, lora = load_config(CONFIGS / "opd_smollm2.yaml"), load_config(CONFIGS / "opd_smollm2_lora.yaml")
    assert full.train.lora is None and lora.train.lora is not None and lora.pipeline.provenance == "strict"
    assert lora.workload == full.workload and lora.sampling == full.sampling and lora.cache == full.cache
    assert lora.train.steps == full.train.steps and lora.train.batch_size == full.train.batch_size
    assert lora.pipeline.max_lag == full.pipeline.max_lag
