"""Ray worker-process setup: shorten Ray Data's scheduling tick in every process of a run.

Ray Data's streaming executor waits up to ``WAIT_FOR_TASK_COMPLETION_TIMEOUT_S`` (0.1 s in
Ray 2.60) for *all* active tasks in each loop iteration. A generator task blocked on the
staleness budget is always active, so every hand-off between stages costs one to three 0.1 s
ticks (measured in shared/research/raydata_latency.md): at lock-step that is most of a step,
and it caps async throughput too. The executor runs in a Ray Train helper actor, so the
constant is set through ``worker_process_setup_hook`` in every worker process, from the
``ASYNCRL_DATA_TICK_S`` environment variable. A Ray version without the constant fails loudly
rather than silently keeping the slow tick.
"""

from __future__ import annotations

import os

TICK_ENV = "ASYNCRL_DATA_TICK_S"
DEFAULT_TICK_S = 0.005

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


def apply_env() -> None:
    """Set ``RAY_ENV`` (and, unless verbose, ``asyncrl.telemetry.console.quiet_env``) in this
    process where unset (called by entry points, never at import)."""
    from asyncrl.telemetry.console import quiet_env

    for key, value in {**RAY_ENV, **quiet_env()}.items():
        os.environ.setdefault(key, value)


def setup_worker() -> None:
    """``worker_process_setup_hook``: apply the tick from the environment (no-op if unset)."""
    tick = os.environ.get(TICK_ENV)
    if tick:
        set_data_tick(float(tick))


def set_data_tick(seconds: float) -> None:
    from ray.data._internal.execution import streaming_executor_state as ses

    if not hasattr(ses, "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S"):
        raise RuntimeError("this Ray version has no WAIT_FOR_TASK_COMPLETION_TIMEOUT_S; pin ray==2.60.0")
    ses.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = seconds


#: environment of Ray's worker processes only: a worker is always connected, so it must never
#: auto-start a Ray instance of its own (Ray Data's clean-up in a worker that is shutting down
#: calls Ray APIs after the disconnect, and auto-init then starts a local cluster in that process)
WORKER_ENV = {"RAY_ENABLE_AUTO_CONNECT": "0"}


def runtime_env(env_vars: dict[str, str], tick_s: float | None = DEFAULT_TICK_S) -> dict:
    """The ``runtime_env`` asyncrl starts Ray with: env vars (and ``WORKER_ENV``) plus the tick hook."""
    env = {**env_vars, **WORKER_ENV}
    if tick_s is not None:
        env[TICK_ENV] = str(tick_s)
    return {"env_vars": env, "worker_process_setup_hook": "asyncrl.raysetup.setup_worker"}
