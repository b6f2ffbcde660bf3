"""The environment of a run's Ray processes: env vars, the ``runtime_env`` and CPU count.

What every process of a run gets (``RAY_ENV``, ``TORCH_ENV``; ``LOCAL_RAY_ENV`` on a Ray instance
asyncrl starts itself; ``WORKER_ENV`` in Ray's workers) and the ``runtime_env`` the driver starts
or joins Ray with. The worker-side patches of Ray Data's internals (``pipeline.data_tick_s``: its
scheduling loop wakes when a task finishes) and the worker setup hook that applies them live in
``asyncrl.ray_internals``, the one module that touches Ray's private APIs, each patch behind a
check of the installed Ray version; ``runtime_env`` asks it which ones apply.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from asyncrl.ray_internals import DEFAULT_TICK_S, LOCAL_RAY_MARKER, worker_hook

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

#: PyTorch's CPU allocator, in every process of a run (workers included; a value set in the
#: driver's environment wins): tensors of >= 2 MiB page-aligned and ``madvise(MADV_HUGEPAGE)``d.
#: glibc serves an allocation above its mmap threshold (at most 32 MiB) with a fresh mapping that
#: faults in on first touch, 4 KiB at a time unless on huge pages, and is unmapped on free; at a
#: real vocabulary every [B, T, V] tensor is one (136 MiB at B=32, T=7, V=151,936), several per
#: learner step (what it saves: docs/performance.md, "A real vocabulary"). Torch reads it at its
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
#: nothing to watch there, and costs a process start during the run's CPU-bound start-up
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def local_cpus(cfg: RunConfig) -> int:
    """Logical CPUs of the local Ray instance ``asyncrl.pipeline`` starts (``pipeline.num_cpus``)."""
    return cfg.pipeline.num_cpus or max(4, 2 * (os.cpu_count() or 2))


def apply_env() -> None:
    """Set ``RAY_ENV`` (and, unless verbose, ``asyncrl.telemetry.console.quiet_env``) in this
    process where unset (called by entry points, never at import)."""
    from asyncrl.telemetry.console import quiet_env

    for key, value in {**RAY_ENV, **TORCH_ENV, **quiet_env()}.items():
        os.environ.setdefault(key, value)


#: environment of Ray's worker processes only: a worker is always connected, so it must never
#: auto-start a Ray instance of its own (Ray Data's clean-up in a worker that is shutting down
#: calls Ray APIs after the disconnect, and auto-init then starts a local cluster in that process)
WORKER_ENV = {"RAY_ENABLE_AUTO_CONNECT": "0"}


def runtime_env(env_vars: dict[str, str], tick_s: float | None = DEFAULT_TICK_S) -> dict:
    """The ``runtime_env`` asyncrl starts Ray with: env vars, ``TORCH_ENV`` (the driver's own value
    where it has one) and ``WORKER_ENV``, plus the worker setup hook of ``asyncrl.ray_internals``
    with the tick (none when ``tick_s`` is None, Ray's own loop, or when no worker-side patch
    applies to the installed Ray)."""
    env = {**{k: os.environ.get(k, v) for k, v in TORCH_ENV.items()}, **env_vars, **WORKER_ENV}
    hook = worker_hook(tick_s, local=env_vars.get(LOCAL_RAY_MARKER) == "1")
    if not hook:
        return {"env_vars": env}
    env |= hook["env_vars"]
    return {"env_vars": env, "worker_process_setup_hook": hook["worker_process_setup_hook"]}
