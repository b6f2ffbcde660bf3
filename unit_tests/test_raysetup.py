"""The environment asyncrl gives Ray's processes."""

from __future__ import annotations

from asyncrl.raysetup import RAY_ENV, TICK_ENV, WORKER_ENV, runtime_env


def test_workers_never_auto_start_a_ray_instance_and_get_the_tick() -> None:
    env = runtime_env(dict(RAY_ENV), 0.01)
    assert env["env_vars"]["RAY_ENABLE_AUTO_CONNECT"] == "0" and WORKER_ENV.items() <= env["env_vars"].items()
    assert env["env_vars"][TICK_ENV] == "0.01"
    assert env["worker_process_setup_hook"] == "asyncrl.raysetup.setup_worker"
    assert TICK_ENV not in runtime_env({}, None)["env_vars"]
