"""The one door to Ray's private internals: every use of a private Ray API in asyncrl, each behind a
check of the installed Ray version.

asyncrl runs on stock Ray. The patches below only make a run start sooner, hand blocks on sooner
or print less noise; none changes what is generated, admitted or trained. Each patch names the Ray
versions it was written for (``Patch.since`` .. ``Patch.before``, against the pinned
``ray==2.60.0``). With another Ray, or where a private name it needs is gone, the patch is skipped
with one ``RayPatchSkipped`` warning per process and the run uses stock Ray: a slower start or
slower hand-offs, the same results. ``ASYNCRL_RAY_PATCHES=off`` in the driver's environment turns
every patch off (stock Ray everywhere); ``pipeline.data_tick_s=null`` turns off the two worker-side
patches (Ray Data's loop and its local autoscaler), as before.

The patches (``PATCHES``), what each touches, what it buys, and what stock Ray does instead:

- ``executor_wait``: Ray Data's ``streaming_executor_state`` (its ``ray`` and ``time`` globals,
  ``WAIT_FOR_TASK_COMPLETION_TIMEOUT_S``). A finished block moves on at once; stock Ray waits up
  to one 0.1 s tick per stage hand-off.
- ``local_autoscaler``: Ray Data's ``streaming_executor.create_cluster_autoscaler``. No
  ``AutoscalingCoordinator`` actor on a local instance; stock Ray starts one more actor process.
- ``train_helpers``: Ray Train v2's ``DataParallelTrainer._create_default_callbacks`` and
  ``_initialize_and_run_controller``, ``FixedScalingPolicy``, ``DatasetsCallback``,
  ``PlacementGroupCleanerCallback``. Ray Train starts no helper actor a run cannot use; stock Ray
  starts up to three more actor processes before the first step.
- ``log_filter``: ``ray._private``'s worker log dispatcher and ``print_to_stdstream``. Ray's
  bookkeeping notes are hidden from the terminal; stock Ray prints every forwarded line.
- ``node_stats``: ``ray._private.internal_api.node_stats``. The ``mem/ray_workers_rss_mb`` and
  ``mem/object_store_mb`` metrics; without it those two are left out.

The measured gains are in ``docs/performance.md`` ("Start-up" and "Ray Data's scheduling loop").
The driver decides the worker-side patches: it installs the worker setup hook (``setup_worker``)
only when they apply (a Ray cluster runs the driver's Ray version). Nothing here imports Ray at
module import time: ``asyncrl.config`` and ``asyncrl.raysetup`` stay free of Ray and torch.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from types import ModuleType
from typing import Any

#: ``off`` (or ``0``, ``false``, ``none``) in the driver's environment: every patch off, stock Ray
DISABLE_ENV = "ASYNCRL_RAY_PATCHES"
_OFF = frozenset({"0", "off", "false", "none", "no"})

#: env var carrying ``pipeline.data_tick_s`` to the worker setup hook (``executor_wait``)
TICK_ENV = "ASYNCRL_DATA_TICK_S"
#: the consumer's poll interval for the next block (Ray's: 10 ms); about 15 us of CPU per poll
CONSUMER_POLL_S = 0.001
#: the Ray Data module whose ``ray.wait``, tick and sleep ``executor_wait`` patches
EXECUTOR_STATE = "ray.data._internal.execution.streaming_executor_state"
#: the Ray Data module that creates the cluster autoscaler (``local_autoscaler``)
EXECUTOR = "ray.data._internal.execution.streaming_executor"
#: env var in the ``runtime_env`` of a Ray instance asyncrl starts on this machine (no
#: ``pipeline.ray_address``; ``asyncrl.pipeline.ray_runtime_env``): how ``is_local`` and the worker
#: hook tell such an instance (no autoscaler; it stops with the run) from a cluster the caller joined
LOCAL_RAY_MARKER = "ASYNCRL_LOCAL_RAY"
#: Ray Data's scheduling-loop tick of the worker-side patch (``pipeline.data_tick_s``' default)
DEFAULT_TICK_S = 0.1
#: Ray's handler name on the driver's log dispatcher (``ray._private.worker.connect``)
RAY_HANDLER = "ray_print_logs"
#: the name ``log_filter`` installs its handler under
FILTER_HANDLER = "asyncrl_print_logs"


class RayPatchSkipped(RuntimeWarning):
    """A patch of Ray's internals was skipped: the run uses stock Ray there (slower, same results)."""


@dataclass(frozen=True)
class Patch:
    """One patch of Ray's internals: the Ray versions it was written for, ``since`` (inclusive) to
    ``before`` (exclusive), what it touches and what it buys."""

    name: str
    touches: str
    gain: str
    since: tuple[int, ...] = (2, 60, 0)
    before: tuple[int, ...] = (2, 61, 0)

    def covers(self, version: tuple[int, ...]) -> bool:
        """True when ``version`` lies in the range the patch was written for."""
        return self.since <= version < self.before

    def range_text(self) -> str:
        return f">={'.'.join(map(str, self.since))},<{'.'.join(map(str, self.before))}"


PATCHES: dict[str, Patch] = {
    p.name: p
    for p in (
        Patch(
            "executor_wait",
            "Ray Data's streaming_executor_state (ray.wait, WAIT_FOR_TASK_COMPLETION_TIMEOUT_S, time.sleep)",
            "a finished block moves on at once instead of at the next 0.1 s tick",
        ),
        Patch(
            "local_autoscaler",
            "Ray Data's streaming_executor.create_cluster_autoscaler",
            "no AutoscalingCoordinator actor on a local Ray instance",
        ),
        Patch(
            "train_helpers",
            "Ray Train v2's DataParallelTrainer private hooks and controller callbacks",
            "Ray Train starts no helper actor the run cannot use",
        ),
        Patch(
            "log_filter",
            "ray._private's worker log dispatcher and print_to_stdstream",
            "Ray's bookkeeping notes are hidden from the terminal",
        ),
        Patch(
            "node_stats",
            "ray._private.internal_api.node_stats",
            "the mem/ray_workers_rss_mb and mem/object_store_mb metrics",
        ),
    )
}

_warned: set[str] = set()  # patches skipped with a warning in this process (one warning each)


def ray_version() -> str:
    """The installed Ray's version string (read from its distribution metadata: Ray is not imported)."""
    try:
        return _dist_version("ray")
    except PackageNotFoundError:
        return "0"


def parse_version(text: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"2.60.0"`` -> (2, 60, 0), ``"3.0.0.dev0"``
    -> (3, 0, 0), ``"2.61.0rc1"`` -> (2, 61, 0); a trailing non-numeric part is dropped."""
    out: list[int] = []
    for part in text.split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) < len(part):  # "0rc1": the release ends here
            break
    return tuple(out)


def disabled_by_env() -> bool:
    """True when ``ASYNCRL_RAY_PATCHES`` turns every patch off."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _OFF


def active(name: str) -> bool:
    """Whether patch ``name`` applies in this process: not turned off by ``ASYNCRL_RAY_PATCHES``
    and the installed Ray lies in its range; outside the range the patch is skipped with one
    ``RayPatchSkipped`` warning."""
    patch = PATCHES[name]
    if disabled_by_env():
        return False
    installed = ray_version()
    if patch.covers(parse_version(installed)):
        return True
    skip(name, f"it was written for ray{patch.range_text()} and ray {installed} is installed")
    return False


def skip(name: str, why: str) -> None:
    """Warn once per process that patch ``name`` is skipped, and why (the run uses stock Ray)."""
    if name in _warned:
        return
    _warned.add(name)
    warnings.warn(
        f"asyncrl: skipping its patch {name!r} of Ray's internals ({PATCHES[name].touches}): {why}. "
        f"The run uses stock Ray there: same results, without this gain: {PATCHES[name].gain}.",
        RayPatchSkipped,
        stacklevel=3,
    )


def guarded(name: str, apply: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    """``apply`` that fails open: an exception (a private name moved) skips patch ``name`` with one
    warning instead of failing the import of the module it patches."""

    def run(module: ModuleType) -> None:
        try:
            apply(module)
        except Exception as err:
            skip(name, f"{type(err).__name__}: {err}")

    return run


# --- the driver's view of the Ray instance ------------------------------------------------------


def is_local() -> bool:
    """True when the connected Ray instance is one asyncrl started on this machine (its job's
    ``runtime_env`` carries ``LOCAL_RAY_MARKER``): no autoscaler, and it stops with the run."""
    import ray

    env = ray.get_runtime_context().runtime_env
    return env.get("env_vars", {}).get(LOCAL_RAY_MARKER) == "1"


def worker_hook(tick_s: float | None, *, local: bool) -> dict[str, Any]:
    """What the driver adds to a run's ``runtime_env`` for the worker-side patches: the env vars and
    ``worker_process_setup_hook`` (``setup_worker``), or nothing when ``tick_s`` is None or neither
    ``executor_wait`` nor (``local``) ``local_autoscaler`` applies."""
    if tick_s is None:
        return {}
    wait = active("executor_wait")
    autoscaler = local and active("local_autoscaler")
    if not (wait or autoscaler):
        return {}
    env: dict[str, str] = {}
    if wait:
        env[TICK_ENV] = str(tick_s)
        # Ray's inline metadata fetcher: the threaded one emits a finished block one loop
        # iteration later, which with a sleeping loop is one tick later
        env["RAY_DATA_METADATA_PREFETCH_ON_THREAD"] = "0"
    return {"env_vars": env, "worker_process_setup_hook": "asyncrl.ray_internals.setup_worker"}


# --- executor_wait and local_autoscaler: Ray Data, in every worker process ----------------------


def setup_worker() -> None:
    """``worker_process_setup_hook``: apply the worker-side patches the driver chose (its env vars),
    now if Ray Data's executor is already imported, else right after its first import (importing
    Ray Data in every helper process would add about 0.5 s of CPU to each one's start)."""
    tick = os.environ.get(TICK_ENV)
    if tick and active("executor_wait"):
        when_imported(EXECUTOR_STATE, guarded("executor_wait", lambda m: patch_executor(m, float(tick))))
    if os.environ.get(LOCAL_RAY_MARKER) == "1" and active("local_autoscaler"):
        when_imported(EXECUTOR, guarded("local_autoscaler", patch_local_autoscaler))


def patch_executor(module: ModuleType, tick_s: float) -> None:
    """Make ``module`` (``EXECUTOR_STATE``) wait for the first ready task, at most ``tick_s``.

    Ray Data's streaming executor waits in each loop iteration for *all* active tasks, up to
    ``WAIT_FOR_TASK_COMPLETION_TIMEOUT_S`` (0.1 s in Ray 2.60). A generator task blocked on the
    staleness budget is always active, so every stage hand-off would cost one to three ticks; a
    short tick removes that latency but runs the loop hundreds of times a second in the learner's
    process. Instead the loop's ``ray.wait`` returns as soon as *one* task is ready (with every task
    ready by then), the tick only bounds how long the loop sleeps when nothing finishes, and the
    consumer's poll for the next block (the module's only ``time.sleep``) takes ``CONSUMER_POLL_S``.
    Raises ``RuntimeError`` (nothing changed) when the module lacks a name it replaces."""
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


def patch_local_autoscaler(module: ModuleType) -> None:
    """Give ``module`` (``EXECUTOR``) ``local_cluster_autoscaler`` instead of Ray's; raises
    ``RuntimeError`` (nothing changed) when the module has no ``create_cluster_autoscaler``."""
    if not callable(getattr(module, "create_cluster_autoscaler", None)):
        raise RuntimeError(
            f"{module.__name__} has no create_cluster_autoscaler; pin ray==2.60.0 or set "
            "pipeline.data_tick_s=null"
        )
    module.create_cluster_autoscaler = local_cluster_autoscaler


def local_cluster_autoscaler(*args: Any, **kwargs: Any) -> Any:
    """Ray Data's cluster autoscaler on a local instance asyncrl started (``LOCAL_RAY_MARKER``):
    there is no cluster autoscaler to ask for nodes, so Ray Data's default, which relays its
    requests through a per-cluster ``AutoscalingCoordinator`` actor (a process importing Ray Data
    during a run's CPU-bound start-up), is replaced by one that asks for nothing and budgets the
    instance's whole resources, as Ray Data did before the coordinator existed."""
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


# --- train_helpers: Ray Train's controller, in the driver ----------------------------------------


def torch_trainer(*args: Any, local: bool, **kwargs: Any) -> Any:
    """A ``ray.train.torch.TorchTrainer`` for ``args``/``kwargs``: with ``train_helpers`` the lean
    subclass (``train_classes``) that starts none of Ray Train's helper actors a run cannot use,
    else Ray's own class. ``local``: the Ray instance is one asyncrl started (``is_local``).

    Ray Train v2 starts, before the first learner worker runs a line of the train function, a
    controller actor and from it up to four helper actors, each a Python process importing Ray:
    an autoscaling coordinator (the controller waits for its first resource request), a detached
    placement-group cleaner (the controller waits for its registration), a DatasetManager (started
    even for a trainer with no datasets) and the synchronization actor (the workers' barrier, which
    stays). On a local instance asyncrl started, the first two have nothing to do (no autoscaler;
    ``ray.shutdown`` removes the placement groups); the DatasetManager idles wherever the trainer
    has no datasets (one learner worker builds its own stream). On a cluster the coordinator and
    the cleaner stay, as Ray Train starts them."""
    from ray.train.torch import TorchTrainer

    if not active("train_helpers"):
        return TorchTrainer(*args, **kwargs)
    try:
        lean = train_classes()["Trainer"]
    except Exception as err:  # a private module or class moved
        skip("train_helpers", f"{type(err).__name__}: {err}")
        return TorchTrainer(*args, **kwargs)
    return lean(*args, local=local, **kwargs)


@functools.cache
def train_classes() -> dict[str, type]:
    """The classes of ``train_helpers``, built on Ray Train's private ones at first use:
    ``Trainer`` (a ``TorchTrainer``), ``LocalScalingPolicy`` and ``NoIdleDatasetsCallback``."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

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

    def lean_callbacks(callbacks: list[Any], *, local: bool) -> list[Any]:
        out = []
        for cb in callbacks:
            if local and type(cb) is PlacementGroupCleanerCallback:
                continue
            if type(cb) is DatasetsCallback:
                cb.__class__ = NoIdleDatasetsCallback  # a subclass adding no state: same object
            out.append(cb)
        return out

    class Trainer(TorchTrainer):
        """``TorchTrainer`` without the helper processes a run cannot use (``torch_trainer``)."""

        def __init__(self, *args: Any, local: bool, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._asyncrl_local = local

        def _create_default_callbacks(self) -> list[Any]:
            callbacks = super()._create_default_callbacks()
            try:
                return lean_callbacks(callbacks, local=self._asyncrl_local)
            except Exception as err:  # fail open: Ray Train's own list
                skip("train_helpers", f"{type(err).__name__}: {err}")
                return super()._create_default_callbacks()

        def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
            kw = controller_init_kwargs
            policy = kw.get("scaling_policy")
            if self._asyncrl_local and type(policy) is FixedScalingPolicy:
                kw["scaling_policy"] = LocalScalingPolicy(policy.scaling_config)
            return super()._initialize_and_run_controller(**kw)

    return {
        "Trainer": Trainer,
        "LocalScalingPolicy": LocalScalingPolicy,
        "NoIdleDatasetsCallback": NoIdleDatasetsCallback,
    }


# --- log_filter: the driver's forwarding of worker logs -------------------------------------------


def filter_worker_logs(select: Callable[[dict[str, Any]], list[str]]) -> bool:
    """Route the lines Ray forwards from worker processes to the driver's terminal through
    ``select`` (a forwarded batch -> the lines to print; call after ``ray.init``). Idempotent.

    Fails open: an exception inside ``select`` prints the batch as Ray would, and a Ray whose
    dispatcher is not as expected keeps Ray's own printing (one ``RayPatchSkipped`` warning).
    Returns True when the filter is installed."""
    if not active("log_filter"):
        try:  # stock printing: drop a filter an earlier ray.init of this process left behind
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

            names = [name for name, _ in dispatcher.handlers]
            if FILTER_HANDLER in names and RAY_HANDLER in names:
                dispatcher.remove_handler(FILTER_HANDLER)
        except Exception:
            pass
        return False
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        names = [name for name, _ in dispatcher.handlers]
        original = ray_worker.print_to_stdstream
        ignore_prefix_of = ray_worker._should_ignore_worker_log_prefix
    except Exception as err:
        skip("log_filter", f"{type(err).__name__}: {err}")
        return False
    if RAY_HANDLER not in names:  # filtered already, or Ray does not forward logs (log_to_driver=False)
        return FILTER_HANDLER in names
    dispatcher.remove_handler(FILTER_HANDLER)  # one left from an earlier ray.init in this process
    ignore_prefix = ignore_prefix_of(ray_worker.global_worker)
    # Ray's own printer (not the filtering wrapper below, which would filter every line twice)
    printer = getattr(original, "__wrapped__", original)

    def forward(data: dict[str, Any]) -> None:
        lines = selected(select, data)
        if lines:
            printer({**data, "lines": lines}, ignore_prefix=ignore_prefix)

    dispatcher.remove_handler(RAY_HANDLER)
    dispatcher.add_handler(FILTER_HANDLER, forward)
    filter_error_messages(ray_worker, select)
    return True


def selected(select: Callable[[dict[str, Any]], list[str]], data: dict[str, Any]) -> list[str]:
    """``select(data)``, or every line of ``data`` when ``select`` raises (the filter fails open)."""
    try:
        return list(select(data))
    except Exception:
        return list(data.get("lines", []))


def filter_error_messages(ray_worker: Any, select: Callable[[dict[str, Any]], list[str]]) -> None:
    """The driver's GCS error subscriber (``listen_error_messages``: e.g. the raylet's "task ... will
    be retried" notes) prints through ``print_to_stdstream`` directly, not through the dispatcher:
    wrap that function with the same ``select`` (once per process)."""
    original = ray_worker.print_to_stdstream
    if hasattr(original, "__wrapped__"):  # wrapped already
        return

    def filtered(data: dict[str, Any], ignore_prefix: bool) -> None:
        lines = selected(select, data)
        if lines:
            original({**data, "lines": lines}, ignore_prefix)

    filtered.__wrapped__ = original  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = filtered


# --- node_stats: the raylet's view of its workers, for mem/* -------------------------------------


def raylet_node_stats(address: str, port: int) -> Any | None:
    """The raylet's ``GetNodeStats`` reply (workers' pids, object-store bytes) of the node at
    ``address:port``; None when ``node_stats`` is skipped (Ray has no public API for these)."""
    if not active("node_stats"):
        return None
    try:
        from ray._private.internal_api import node_stats
    except Exception as err:
        skip("node_stats", f"{type(err).__name__}: {err}")
        return None
    return node_stats(address, port, include_memory_info=False)
