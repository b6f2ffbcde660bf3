"""The ``train_helpers`` patch of ``asyncrl.ray_internals``, without a Ray cluster: the Trainer hands
Ray Train's controller the same callbacks and scaling policy less the helper processes a local run
cannot use, and the private Ray Train hooks it overrides still exist in the pinned Ray (a Ray
release that moves them fails here; a run on it falls back to stock Ray, ``test_ray_internals``)."""

from __future__ import annotations

import inspect

import pytest
from ray.train import ScalingConfig
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.execution.scaling_policy import (
    FixedScalingPolicy,
    ResizeDecision,
)
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from asyncrl import ray_internals
from asyncrl.pipeline import ray_runtime_env
from asyncrl.raysetup import LOCAL_RAY_MARKER

CLASSES = ray_internals.train_classes()
Trainer = CLASSES["Trainer"]
NoIdleDatasetsCallback = CLASSES["NoIdleDatasetsCallback"]
LocalScalingPolicy = CLASSES["LocalScalingPolicy"]


def _loop(config):  # a train function: never run here
    pass


def _trainer(local: bool, **kw):
    return Trainer(_loop, local=local, scaling_config=ScalingConfig(num_workers=1), **kw)


def test_torch_trainer_is_the_lean_one_on_the_pinned_ray_and_rays_own_when_patches_are_off(monkeypatch):
    from ray.train.torch import TorchTrainer

    kw = {"scaling_config": ScalingConfig(num_workers=1)}
    assert type(ray_internals.torch_trainer(_loop, local=True, **kw)) is Trainer
    monkeypatch.setenv(ray_internals.DISABLE_ENV, "off")
    assert type(ray_internals.torch_trainer(_loop, local=True, **kw)) is TorchTrainer


def test_ray_train_hooks_asyncrl_overrides_exist_with_their_signatures():
    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert params(DataParallelTrainer._initialize_and_run_controller) == ["self", "controller_init_kwargs"]
    assert params(DataParallelTrainer._create_default_callbacks) == ["self"]
    assert params(DatasetsCallback.before_init_train_context) == ["self", "workers"]
    for name in (
        "after_controller_start",
        "_maybe_send_resource_request",
        "make_decision_for_non_running_worker_group",
    ):
        assert callable(getattr(FixedScalingPolicy, name)), name
    # fit() builds the controller from exactly these keyword arguments
    src = inspect.getsource(DataParallelTrainer)
    for kw in ("scaling_policy=create_scaling_policy(", "callbacks=self._create_default_callbacks()"):
        assert kw in src, kw


def test_local_trainer_drops_the_cleaner_and_the_idle_dataset_manager():
    cbs = _trainer(local=True)._create_default_callbacks()
    types = [type(cb) for cb in cbs]
    assert PlacementGroupCleanerCallback not in types
    assert DatasetsCallback not in types and types.count(NoIdleDatasetsCallback) == 1
    # everything else is Ray Train's own list, in its order
    full = DataParallelTrainer._create_default_callbacks(_trainer(local=True))
    kept = [type(cb) for cb in full if type(cb) is not PlacementGroupCleanerCallback]
    assert [NoIdleDatasetsCallback if t is DatasetsCallback else t for t in kept] == types


def test_cluster_trainer_keeps_the_cleaner():
    types = [type(cb) for cb in _trainer(local=False)._create_default_callbacks()]
    assert types.count(PlacementGroupCleanerCallback) == 1
    assert NoIdleDatasetsCallback in types and DatasetsCallback not in types


def test_no_idle_datasets_callback_keeps_the_data_context_and_starts_a_manager_only_for_datasets(monkeypatch):
    from ray.data import DataContext

    DataContext.get_current().target_max_block_size = 12345
    try:
        cbs = _trainer(local=True)._create_default_callbacks()
        (cb,) = [c for c in cbs if isinstance(c, DatasetsCallback)]
    finally:
        DataContext._set_current(None)
    assert cb._data_context.target_max_block_size == 12345  # what after_worker_group_start hands on
    assert cb.before_init_train_context(workers=[object()]) == {}  # no datasets: no DatasetManager

    seen = []
    stock = lambda self, workers: seen.append(workers) or {"x": workers}  # noqa: E731
    monkeypatch.setattr(DatasetsCallback, "before_init_train_context", stock)
    cb._datasets = {"train": object()}
    assert cb.before_init_train_context(workers=["w"]) == {"x": ["w"]} and seen == [["w"]]


def test_local_scaling_policy_decides_like_fixed_without_an_autoscaler():
    cfg = ScalingConfig(num_workers=2)
    policy = LocalScalingPolicy(cfg)
    policy.after_controller_start(train_run_context=None)  # would create the coordinator actor
    assert policy._coordinator_client is None
    decision = policy.make_decision_for_non_running_worker_group()
    expected = FixedScalingPolicy(cfg)
    expected._maybe_send_resource_request = lambda: None
    assert isinstance(decision, ResizeDecision)
    assert decision == expected.make_decision_for_non_running_worker_group()
    policy.before_controller_abort()  # cancelling a request never sent: no error


@pytest.mark.parametrize("local", [True, False])
def test_trainer_swaps_the_scaling_policy_only_locally(monkeypatch, local):
    got = {}
    run_controller = lambda self, **kw: got.update(kw)  # noqa: E731
    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller", run_controller)
    fixed = FixedScalingPolicy(ScalingConfig(num_workers=1))
    _trainer(local=local)._initialize_and_run_controller(scaling_policy=fixed, callbacks=[])
    assert type(got["scaling_policy"]) is (LocalScalingPolicy if local else FixedScalingPolicy)
    assert got["scaling_policy"].scaling_config is fixed.scaling_config


def test_only_a_ray_instance_the_run_starts_itself_is_marked_local():
    from asyncrl.config import RunConfig
    from asyncrl.configurable import from_dict

    local = RunConfig()
    joined = from_dict(RunConfig, {"pipeline": {"ray_address": "auto"}})
    assert ray_runtime_env(local)["env_vars"][LOCAL_RAY_MARKER] == "1"
    assert LOCAL_RAY_MARKER not in ray_runtime_env(joined)["env_vars"]
