"""Ray Train's ``TorchTrainer`` as asyncrl starts it: less the helper processes a run cannot use.

Ray Train v2 (Ray 2.60) starts, before the first learner worker runs a line of the train function,
a controller actor and, from it, up to four helper actors, each a Python process that imports Ray
(5.4 CPU-s for three of them in one 2026-12-01 run, README "Known issues"):

- an **autoscaling coordinator** (``FixedScalingPolicy.after_controller_start``): the controller
  ``ray.get``s its first resource request, so its whole process start is on the path to the first
  step. It relays resource requests to a cluster autoscaler (Ray Data's streams use the same
  per-cluster actor; on a local instance they get a local autoscaler instead,
  ``asyncrl.raysetup.local_cluster_autoscaler``);
- a **placement-group cleaner** (``PlacementGroupCleanerCallback``): a detached actor that removes
  the worker group's placement group if the controller dies uncleanly; the controller ``ray.get``s
  its registration once the worker group has started, again on the path;
- a **DatasetManager** (``DatasetsCallback.before_init_train_context``), started even for a trainer
  with no datasets: with one learner worker the stream is built by that worker
  (``asyncrl.learner.LearnerSpec.stream``), so the manager only ever idles;
- the synchronization actor (the workers' barrier), which training uses and which stays.

``Trainer`` drops the first two on a **local Ray instance asyncrl started itself** (``is_local``):
it has no autoscaler to ask, and it stops with the run (``ray.shutdown`` removes its placement
groups with everything else; a placement group dies with the controller that created it anyway).
It drops the DatasetManager wherever the trainer has no datasets. On a cluster
(``pipeline.ray_address``, or a Ray instance the caller connected to) the coordinator and the
cleaner stay, as Ray Train starts them. Measured on 2 cores (2026-12-05, 3 interleaved pairs of
``asyncrl run``): Ray Train's part of the start-up (``startup_train_workers_s``) 7.6-9.0 -> 5.3-5.6 s,
the first optimizer step of ``opd_one_machine.yaml`` 16.5-17.6 -> 14.3-15.2 s (13.0-13.3 s with
Ray Data's local autoscaler as well).

The overrides use Ray Train's private hooks of the pinned ``ray==2.60.0``
(``DataParallelTrainer._initialize_and_run_controller`` and the classes above);
``unit_tests/test_raytrain.py`` fails if a Ray release moves them."""

from __future__ import annotations

from typing import Any

import ray
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

from asyncrl.raysetup import LOCAL_RAY_MARKER


def is_local() -> bool:
    """True when the connected Ray instance is one asyncrl started on this machine (its job's
    ``runtime_env`` carries ``LOCAL_RAY_MARKER``): no autoscaler, and it stops with the run."""
    env = ray.get_runtime_context().runtime_env
    return env.get("env_vars", {}).get(LOCAL_RAY_MARKER) == "1"


class LocalScalingPolicy(FixedScalingPolicy):
    """``FixedScalingPolicy`` that registers no resource request: on a local instance there is no
    autoscaler for the coordinator to relay it to, so the coordinator is not started at all."""

    def after_controller_start(self, train_run_context: Any) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass


class NoIdleDatasetsCallback(DatasetsCallback):
    """``DatasetsCallback`` that starts no DatasetManager for a trainer without datasets; it still
    hands the driver's Ray Data context to the workers (``after_worker_group_start``)."""

    def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
        if not self._datasets:
            return {}
        return super().before_init_train_context(workers)


class Trainer(TorchTrainer):
    """``TorchTrainer`` without the helper processes a run cannot use (module docstring).

    ``local``: the Ray instance is one asyncrl started on this machine (``is_local``)."""

    def __init__(self, *args: Any, local: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._asyncrl_local = local

    def _create_default_callbacks(self) -> list[Any]:
        return lean_callbacks(super()._create_default_callbacks(), local=self._asyncrl_local)

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        kw = controller_init_kwargs
        if self._asyncrl_local and type(kw["scaling_policy"]) is FixedScalingPolicy:
            kw["scaling_policy"] = LocalScalingPolicy(kw["scaling_policy"].scaling_config)
        return super()._initialize_and_run_controller(**kw)


def lean_callbacks(callbacks: list[Any], *, local: bool) -> list[Any]:
    """Ray Train's default controller callbacks less the placement-group cleaner (``local``) and
    with a DatasetsCallback that starts no idle DatasetManager (the same datasets, config and
    captured ``DataContext``)."""
    out = []
    for cb in callbacks:
        if local and type(cb) is PlacementGroupCleanerCallback:
            continue
        if type(cb) is DatasetsCallback:
            cb.__class__ = NoIdleDatasetsCallback  # a subclass adding no state: same object, leaner hook
        out.append(cb)
    return out
