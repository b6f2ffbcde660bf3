"""A run on stock Ray: with every patch of ``asyncrl.ray_internals`` off (``ASYNCRL_RAY_PATCHES=off``,
what a Ray outside the patches' version range gets), the pipeline keeps the same staleness contract.

The patches only shorten the start-up and the stage hand-offs; this checks that nothing the
contract needs depends on them: no worker setup hook in the Ray instance, Ray's own log printing,
Ray Train's own ``TorchTrainer``, and still every sample admitted in block order, trained once, at a
lag within the bound, on 2 generators that overlap generation with training."""

from __future__ import annotations

import pytest
from conftest import check_contract, init_local_ray, tiny_config

from asyncrl import ray_internals
from asyncrl.pipeline import run
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray

STEPS = 6


@pytest.fixture(scope="module")
def stock_ray():
    """A local Ray instance started as ``asyncrl run`` starts one, with every patch off."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ray_internals.DISABLE_ENV, "off")
        init_local_ray()
        yield mp
        ray.shutdown()


def test_every_patch_off_keeps_the_staleness_contract(stock_ray, tiny_pair, tmp_path):
    import ray
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    def lean_trainer_built():
        raise AssertionError("the lean Trainer was built with every patch off")

    stock_ray.setattr(ray_internals, "train_classes", lean_trainer_built)
    assert "worker_process_setup_hook" not in ray.get_runtime_context().runtime_env
    cfg = tiny_config(
        tmp_path / "stock",
        "pipeline.generators=2",
        "pipeline.max_lag=1",
        f"train.steps={STEPS}",
        "train.eval_every=0",
    )
    result = run(cfg)
    check_contract(result, steps=STEPS)
    assert read_samples(result.run_dir)["lag"].max() >= 1, "generation never overlapped training"
    names = [name for name, _ in dispatcher.handlers]
    assert ray_internals.FILTER_HANDLER not in names  # Ray prints worker logs itself
