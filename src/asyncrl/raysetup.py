"""Ray worker-process setup: make Ray Data's scheduling loop wake when a task finishes.

Ray Data's streaming executor waits in each loop iteration for *all* active tasks, up to
``WAIT_FOR_TASK_COMPLETION_TIMEOUT_S`` (0.1 s in Ray 2.60). A generator task blocked on the
staleness budget is always active, so every hand-off between stages used to cost one to three
0.1 s ticks (measured in shared/research/raydata_latency.md). A short tick (5 ms) removed the
latency but cost CPU: the loop then ran 200 times a second at about 1 ms of Python each, in the
learner's process (measured: 34 ms of CPU per optimizer step of the demo config, as much as
half the learner's own step).

What asyncrl sets instead, in every process of a run that imports the executor:

- the executor's ``ray.wait`` returns as soon as *one* active task is ready (with every other
  task that is ready by then), so a finished block moves on at once and the loop sleeps while
  nothing finishes;
- ``WAIT_FOR_TASK_COMPLETION_TIMEOUT_S`` = ``ASYNCRL_DATA_TICK_S`` only bounds how long the loop
  sleeps when no task finishes;
- the consumer's poll for the next block (``OpState.get_output_blocking``, the module's only
  sleep) takes ``CONSUMER_POLL_S`` instead of 10 ms, which in lock-step was 5 ms per step on average;
- ``RAY_DATA_METADATA_PREFETCH_ON_THREAD=0`` (Ray's inline metadata fetcher): the threaded one
  emits a finished block one loop iteration later, which with a sleeping loop is one tick later.

On a Ray instance asyncrl started itself (``LOCAL_RAY_MARKER``), Ray Data's executor also gets
``local_cluster_autoscaler``: no per-cluster ``AutoscalingCoordinator`` actor to relay requests to
an autoscaler that a local instance does not have (measured on 2 cores: the learner's init
3.9-4.2 -> 3.2 s, the one-machine config's first step 13.9-14.4 -> 13.1-13.3 s, 3 interleaved pairs).

The executor runs in a Ray Train worker or in Ray Data's split coordinator, so the patch is
installed by ``worker_process_setup_hook`` in every worker process, and applied when (and only
if) that process imports the executor module: importing Ray Data in every helper process would
add about 0.5 s of CPU to each one's start. A Ray version without the patched names fails
loudly rather than silently keeping the slow loop.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

TICK_ENV = "ASYNCRL_DATA_TICK_S"
DEFAULT_TICK_S = 0.1
#: the consumer's poll interval for the next block (Ray's: 10 ms); about 15 us of CPU per poll
CONSUMER_POLL_S = 0.001
#: the Ray Data module whose ``ray.wait`` and tick are patched
EXECUTOR_STATE = "ray.data._internal.execution.streaming_executor_state"
#: the Ray Data module that creates the cluster autoscaler (``local_cluster_autoscaler``)
EXECUTOR = "ray.data._internal.execution.streaming_executor"

#: PyTorch's CPU allocator, in every process of a run (workers included; a value set in the
#: driver's environment wins): tensors of >= 2 MiB page-aligned and ``madvise(MADV_HUGEPAGE)``d.
#: glibc serves an allocation above its mmap threshold (at most 32 MiB) with a fresh mapping that
#: faults in on first touch, 4 KiB at a time unless on huge pages, and is unmapped on free; at a
#: real vocabulary every [B, T, V] tensor is one (136 MiB at B=32, T=7, V=151,936), several per
#: learner step. Measured on 2 cores: allocating one 136 MiB result 73-89 -> 13-17 ms, the
#: qwen-tiny learner step 1.6-1.7x faster (``benchmarks/stage_times.py``). Torch reads it at its
#: first CPU allocation, so it must be set before that: ``apply_env`` (entry points, before any
#: tensor) and ``runtime_env`` (workers).
TORCH_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}

#: environment of every process of a run: no usage stats, no token auth file, no hub access
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DS_ACCELERATOR": "cpu",
}

#: environment of every process of a Ray instance asyncrl starts itself (one machine, no
#: ``pipeline.ray_address``), unless set in the driver's: Ray Train's preemption watcher (an
#: actor process that polls for cloud nodes being drained, started with every worker group) has
#: nothing to watch there, and costs a process start (about 1.3 s of CPU) during the run's start-up
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}

#: env var in the ``runtime_env`` of a Ray instance asyncrl starts on this machine (no
#: ``pipeline.ray_address``; ``asyncrl.pipeline.ray_runtime_env``): how ``asyncrl.raytrain.is_local``
#: tells such an instance (no autoscaler; it stops with the run) from a cluster the caller joined
LOCAL_RAY_MARKER = "ASYNCRL_LOCAL_RAY"


def local_cpus(cfg: RunConfig) -> int:
    """Logical CPUs of the local Ray instance ``asyncrl.pipeline`` starts (``pipeline.num_cpus``)."""
    return cfg.pipeline.num_cpus or max(4, 2 * (os.cpu_count() or 2))


def apply_env() -> None:
    """Set ``RAY_ENV`` (and, unless verbose, ``asyncrl.telemetry.console.quiet_env``) in this
    process where unset (called by entry points, never at import)."""
    from asyncrl.telemetry.console import quiet_env

    for key, value in {**RAY_ENV, **TORCH_ENV, **quiet_env()}.items():
        os.environ.setdefault(key, value)


def setup_worker() -> None:
    """``worker_process_setup_hook``: patch the executor with the tick from the environment
    (no-op if unset), now if Ray Data's executor is already imported, else when it is."""
    tick = os.environ.get(TICK_ENV)
    if tick:
        when_imported(EXECUTOR_STATE, lambda module: patch_executor(module, float(tick)))
    if os.environ.get(LOCAL_RAY_MARKER) == "1":
        when_imported(EXECUTOR, patch_local_autoscaler)


def patch_local_autoscaler(module: ModuleType) -> None:
    """Give ``module`` (``EXECUTOR``) ``local_cluster_autoscaler`` instead of Ray's."""
    if not callable(getattr(module, "create_cluster_autoscaler", None)):
        raise RuntimeError(
            f"{module.__name__} has no create_cluster_autoscaler; pin ray==2.60.0 or set "
            "pipeline.data_tick_s=null"
        )
    module.create_cluster_autoscaler = local_cluster_autoscaler


def local_cluster_autoscaler(*args: Any, **kwargs: Any) -> Any:
    """Ray Data's cluster autoscaler on a local instance asyncrl started (``LOCAL_RAY_MARKER``):
    there is no cluster autoscaler to ask for nodes, so Ray Data's default, which relays its
    requests through a per-cluster ``AutoscalingCoordinator`` actor (a process importing Ray Data,
    about 1.5 s of CPU during a run's CPU-bound start-up), is replaced by one that asks for nothing
    and budgets the instance's whole resources, as Ray Data did before the coordinator existed."""
    import ray
    from ray.data._internal.cluster_autoscaler import ClusterAutoscaler
    from ray.data._internal.execution.interfaces.execution_options import ExecutionResources

    class LocalClusterAutoscaler(ClusterAutoscaler):
        def try_trigger_scaling(self) -> None:
            pass

        def on_executor_shutdown(self) -> None:
            pass

        def get_total_resources(self) -> ExecutionResources:
            return ExecutionResources.from_resource_dict(ray.cluster_resources())

    return LocalClusterAutoscaler()


def patch_executor(module: ModuleType, tick_s: float) -> None:
    """Make ``module`` (``EXECUTOR_STATE``) wait for the first ready task, at most ``tick_s``."""
    import time

    import ray

    if (
        not hasattr(module, "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S")
        or getattr(module, "ray", None) is not ray
        or getattr(module, "time", None) is not time
    ):
        raise RuntimeError(
            f"{module.__name__} has no WAIT_FOR_TASK_COMPLETION_TIMEOUT_S, ray or time global; pin "
            f"ray==2.60.0 or set pipeline.data_tick_s=null"
        )
    module.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = tick_s
    module.ray = FirstReadyRay(ray)
    module.time = ShortSleepTime(time, CONSUMER_POLL_S)


class FirstReadyRay:
    """Stands in for the ``ray`` module inside the executor-state module: ``wait`` returns once
    one ref is ready, with all refs ready by then, instead of waiting for ``num_returns`` of them.

    The executor processes whatever subset ``ray.wait`` returns (on a timeout it always could be
    any subset), so this changes only how soon the loop sees a finished task."""

    def __init__(self, ray_module: ModuleType) -> None:
        self._ray = ray_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ray, name)

    def wait(
        self, refs: list[Any], *, num_returns: int = 1, timeout: float | None = None, fetch_local: bool = True
    ) -> tuple[list[Any], list[Any]]:
        ready, rest = self._ray.wait(refs, num_returns=1, timeout=timeout, fetch_local=fetch_local)
        if ready and rest:
            more, rest = self._ray.wait(rest, num_returns=len(rest), timeout=0, fetch_local=fetch_local)
            ready = ready + more
        return ready, rest


class ShortSleepTime:
    """Stands in for the ``time`` module inside the executor-state module, whose one ``sleep`` is
    the consumer's poll for the next block: sleeps at most ``poll_s``."""

    def __init__(self, time_module: ModuleType, poll_s: float) -> None:
        self._time = time_module
        self._poll_s = poll_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._time, name)

    def sleep(self, seconds: float) -> None:
        self._time.sleep(min(seconds, self._poll_s))


def when_imported(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` now if ``name`` is imported, else right after its first import."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    sys.meta_path.insert(0, _PatchOnImport(name, patch))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: finds ``name`` with the other finders and wraps its loader."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


#: environment of Ray's worker processes only: a worker is always connected, so it must never
#: auto-start a Ray instance of its own (Ray Data's clean-up in a worker that is shutting down
#: calls Ray APIs after the disconnect, and auto-init then starts a local cluster in that process)
WORKER_ENV = {"RAY_ENABLE_AUTO_CONNECT": "0"}


def runtime_env(env_vars: dict[str, str], tick_s: float | None = DEFAULT_TICK_S) -> dict:
    """The ``runtime_env`` asyncrl starts Ray with: env vars, ``TORCH_ENV`` (the driver's own value
    where it has one) and ``WORKER_ENV`` plus the executor patch hook (none when ``tick_s`` is
    None: Ray's own loop)."""
    env = {**{k: os.environ.get(k, v) for k, v in TORCH_ENV.items()}, **env_vars, **WORKER_ENV}
    if tick_s is None:
        return {"env_vars": env}
    env[TICK_ENV] = str(tick_s)
    env["RAY_DATA_METADATA_PREFETCH_ON_THREAD"] = "0"
    return {"env_vars": env, "worker_process_setup_hook": "asyncrl.raysetup.setup_worker"}
