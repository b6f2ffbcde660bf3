"""LoRA students and version provenance end to end (tiny preset, Ray Data + Ray Train).

- LoRA at max_lag 0 reproduces, step by step, a plain single-process LoRA loop
  (``conftest.plain_loop_losses``; through the stage actors, and colocated in the learner).
- LoRA async with 2 generators keeps the staleness contract; every block's fingerprint is checked.
- An engine that drops one weight update (``faults.skip_weight_load``), adapters or full weights,
  fails the run loudly, naming the engine and both versions.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import check_contract, plain_loop_losses, tiny_config

from asyncrl.pipeline import run
from asyncrl.plan import make_plan
from asyncrl.telemetry.sinks import read_metrics
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray

LORA = "train.lora={r: 4, alpha: 8.0}"


@pytest.mark.parametrize("colocate", [False, True], ids=["stages", "colocated"])
def test_lora_sync_reproduces_plain_lora_loop(ray_local, tiny_pair, tmp_path, colocate):
    cfg = tiny_config(
        tmp_path / "lora_sync",
        LORA,
        "pipeline.max_lag=0",
        "train.steps=6",
        "train.eval_every=0",
        f"pipeline.colocate={str(colocate).lower()}",
    )
    result = run(cfg)
    samples = read_samples(result.run_dir)
    assert samples["kept"].all() and (samples["lag"] == 0).all()
    metrics = [m for m in read_metrics(result.run_dir) if "loss" in m]
    losses = [m["loss"] for m in metrics]
    np.testing.assert_allclose(losses, plain_loop_losses(cfg), atol=1e-5, rtol=0)
    assert sum(m["provenance/checked"] for m in metrics) == 6 * cfg.train.batch_size
    assert all(m["provenance/mismatches"] == 0 for m in metrics)
    if not colocate:  # only adapters travel: far fewer bytes than the student's weights
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_pretrained(make_plan(cfg).models.student_dir)
        full_bytes = sum(p.numel() * p.element_size() for p in full.state_dict().values())
        assert 0 < metrics[-1]["weights/publish_bytes"] < full_bytes / 2


def test_lora_async_two_generators_keep_the_staleness_contract(ray_local, tiny_pair, tmp_path):
    cfg = tiny_config(
        tmp_path / "lora_async",
        LORA,
        "pipeline.max_lag=1",
        "pipeline.generators=2",
        "train.steps=8",
        "train.eval_every=0",
    )
    result = run(cfg)
    check_contract(result, steps=8)
    metrics = [m for m in read_metrics(result.run_dir) if "loss" in m]
    assert sum(m["provenance/checked"] for m in metrics) == 8 * cfg.train.batch_size
    assert len({e for e in read_samples(result.run_dir).get("gen_engine", [])} or {None}) >= 1


@pytest.mark.parametrize("lora", [True, False], ids=["adapters", "full"])
def test_an_engine_that_drops_a_weight_update_fails_the_run(ray_local, tiny_pair, tmp_path, lora):
    """The 3rd weight load of the generator is skipped (it keeps v1 and stamps v2): the learner's
    provenance check fails the run at that block, naming the engine and both versions."""
    cfg = tiny_config(
        tmp_path / "dropped",
        *([LORA] if lora else []),
        "pipeline.max_lag=0",
        "train.steps=6",
        "train.eval_every=0",
        "faults.skip_weight_load=3",
    )
    with pytest.raises(Exception, match="provenance mismatch") as err:
        run(cfg)
    text = str(err.value)
    assert "stamped v2" in text and "the weights of v1" in text and "engine hf (actor" in text
