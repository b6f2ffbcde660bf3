"""The worker-side patches of ``asyncrl.ray_internals`` (``executor_wait``, ``local_autoscaler``),
without a Ray cluster: the first-ready wait, the import hook that applies them lazily, and the
runtime environment of ``asyncrl.raysetup`` that carries them (and the environment asyncrl gives
Ray's worker processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from asyncrl import ray_internals, raysetup


class _FakeRay:
    """``ray.wait`` over refs that are ints: a ref is ready iff it is in ``self.ready``."""

    def __init__(self, ready: set[int]) -> None:
        self.ready = ready
        self.calls: list[tuple[int, float | None]] = []
        self.other = "passed through"

    def wait(self, refs, *, num_returns=1, timeout=None, fetch_local=True):
        self.calls.append((num_returns, timeout))
        ready = [r for r in refs if r in self.ready][:num_returns]
        return ready, [r for r in refs if r not in ready]


def test_first_ready_wait_returns_every_ready_ref_after_the_first():
    fake = _FakeRay(ready={2, 3})
    ready, rest = ray_internals.FirstReadyRay(fake).wait(
        [1, 2, 3, 4], num_returns=4, timeout=0.1, fetch_local=False
    )
    assert sorted(ready) == [2, 3] and sorted(rest) == [1, 4]
    # one blocking wait for the first ready ref, then a non-blocking sweep of the rest
    assert fake.calls == [(1, 0.1), (3, 0)]


def test_first_ready_wait_times_out_with_nothing_and_passes_other_names_through():
    fake = _FakeRay(ready=set())
    stand_in = ray_internals.FirstReadyRay(fake)
    assert stand_in.wait([1, 2], num_returns=2, timeout=0.1) == ([], [1, 2])
    assert stand_in.other == "passed through"


def test_when_imported_patches_at_first_import(tmp_path, monkeypatch):
    (tmp_path / "asyncrl_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    ray_internals.when_imported("asyncrl_probe_mod", lambda m: (seen.append(m.VALUE), setattr(m, "VALUE", 2)))
    try:
        assert seen == []  # nothing imported yet
        import asyncrl_probe_mod

        assert seen == [1] and asyncrl_probe_mod.VALUE == 2
        assert not any(isinstance(f, ray_internals._PatchOnImport) for f in sys.meta_path)  # one-shot
    finally:
        sys.modules.pop("asyncrl_probe_mod", None)


def test_when_imported_patches_an_imported_module_now():
    module = types.ModuleType("asyncrl_probe_loaded")
    sys.modules[module.__name__] = module
    try:
        ray_internals.when_imported(module.__name__, lambda m: setattr(m, "patched", True))
        assert module.patched is True
    finally:
        del sys.modules[module.__name__]


def test_patch_executor_sets_the_idle_bound_and_the_wait():
    import time

    import ray

    module = types.ModuleType("executor_state_like")
    module.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = 0.1
    module.ray = ray
    module.time = time
    ray_internals.patch_executor(module, 0.25)
    assert module.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S == 0.25
    assert isinstance(module.ray, ray_internals.FirstReadyRay)
    assert module.time.time() > 0  # everything else passes through
    t0 = time.perf_counter()
    module.time.sleep(0.01)  # the consumer's poll: shortened to CONSUMER_POLL_S
    assert time.perf_counter() - t0 < 0.01


def test_patch_executor_fails_loudly_on_an_unknown_ray():
    with pytest.raises(RuntimeError, match=r"pin ray==2\.60\.0"):
        ray_internals.patch_executor(types.ModuleType("not_the_executor"), 0.1)


def test_the_pinned_ray_has_what_the_patch_replaces():
    from ray.data._internal.execution import streaming_executor_state as ses

    assert hasattr(ses, "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S")
    import inspect
    import time

    import ray

    assert ses.ray is ray or isinstance(ses.ray, ray_internals.FirstReadyRay)
    assert ses.time is time or isinstance(ses.time, ray_internals.ShortSleepTime)
    # the module's only sleep is the consumer's poll (what ShortSleepTime shortens)
    assert inspect.getsource(ses).count("time.sleep(") == 1


def test_runtime_env_carries_the_hook_unless_disabled(monkeypatch):
    for key in raysetup.TORCH_ENV:
        monkeypatch.delenv(key, raising=False)
    env = raysetup.runtime_env({"A": "1"}, 0.05)
    assert env["worker_process_setup_hook"] == "asyncrl.ray_internals.setup_worker"
    assert env["env_vars"] == {
        "A": "1",
        **raysetup.TORCH_ENV,
        **raysetup.WORKER_ENV,
        ray_internals.TICK_ENV: "0.05",
        "RAY_DATA_METADATA_PREFETCH_ON_THREAD": "0",
    }
    assert raysetup.runtime_env({"A": "1"}, None) == {
        "env_vars": {"A": "1", **raysetup.TORCH_ENV, **raysetup.WORKER_ENV}
    }


def test_workers_get_torchs_allocator_setting_and_the_drivers_own_value_wins(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "")  # recorded, so apply_env's value is undone after
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert raysetup.runtime_env({}, None)["env_vars"]["THP_MEM_ALLOC_ENABLE"] == "1"
    raysetup.apply_env()  # the driver: set where unset
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    raysetup.apply_env()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
    assert raysetup.runtime_env({}, None)["env_vars"]["THP_MEM_ALLOC_ENABLE"] == "0"


def test_the_pinned_torch_takes_the_huge_page_path_for_large_tensors_with_torch_env() -> None:
    """What ``TORCH_ENV`` relies on: with THP_MEM_ALLOC_ENABLE=1 torch's CPU allocator page-aligns
    a tensor of >= 2 MiB (its huge-page path, which then madvises MADV_HUGEPAGE; otherwise 64-byte
    alignment), read at the process's first allocation."""
    code = (
        "import torch; xs = [torch.empty((4 << 20) + 64 * i, dtype=torch.uint8) for i in range(4)]; "
        "print(sum(x.data_ptr() % 4096 for x in xs))"
    )
    run = lambda value: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env={**os.environ, "THP_MEM_ALLOC_ENABLE": value},
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert run("1") == "0"
    assert run("0") != "0"  # glibc's mapping plus its header, 64-byte aligned: the check can fail


def test_workers_never_auto_start_a_ray_instance_and_get_the_tick() -> None:
    env = raysetup.runtime_env(dict(raysetup.RAY_ENV), 0.01)
    assert env["env_vars"]["RAY_ENABLE_AUTO_CONNECT"] == "0"
    assert raysetup.WORKER_ENV.items() <= env["env_vars"].items()
    assert env["env_vars"][ray_internals.TICK_ENV] == "0.01"
    assert env["worker_process_setup_hook"] == "asyncrl.ray_internals.setup_worker"
    plain = raysetup.runtime_env({}, None)["env_vars"]
    assert ray_internals.TICK_ENV not in plain and raysetup.WORKER_ENV.items() <= plain.items()


def _cfg(**pipeline):
    from asyncrl.config import load_config

    return load_config(None, [f"pipeline.{k}={v}" for k, v in pipeline.items()])


def test_a_local_ray_gets_the_local_env_and_a_cluster_does_not(monkeypatch) -> None:
    from asyncrl.pipeline import ray_runtime_env

    for key in raysetup.LOCAL_RAY_ENV:
        monkeypatch.delenv(key, raising=False)
    local = ray_runtime_env(_cfg())["env_vars"]
    assert raysetup.LOCAL_RAY_ENV.items() <= local.items()
    assert raysetup.RAY_ENV.items() <= local.items()
    cluster = ray_runtime_env(_cfg(ray_address="ray://head:10001"))["env_vars"]
    assert not set(raysetup.LOCAL_RAY_ENV) & set(cluster)  # a cluster keeps Ray's own defaults
    assert raysetup.RAY_ENV.items() <= cluster.items()


def test_the_users_own_setting_of_a_local_env_variable_wins(monkeypatch) -> None:
    from asyncrl.pipeline import ray_runtime_env

    for key in raysetup.LOCAL_RAY_ENV:
        monkeypatch.setenv(key, "1")
    env = ray_runtime_env(_cfg())["env_vars"]
    assert not set(raysetup.LOCAL_RAY_ENV) & set(env)  # inherited from this process as it is


def test_the_pinned_ray_train_reads_the_variables_of_the_local_env() -> None:
    from ray.train.v2._internal import constants

    assert constants.ENABLE_PREEMPTION_WATCHER_ENV_VAR in raysetup.LOCAL_RAY_ENV


def test_local_cluster_autoscaler_asks_for_nothing_and_budgets_the_whole_instance(monkeypatch) -> None:
    import ray
    from ray.data._internal.cluster_autoscaler import ClusterAutoscaler

    resources = {"CPU": 4.0, "memory": 8e9, "object_store_memory": 2e9}
    monkeypatch.setattr(ray, "cluster_resources", lambda: resources)
    scaler = ray_internals.local_cluster_autoscaler("topology", "resources", "context", execution_id="x")
    assert isinstance(scaler, ClusterAutoscaler)
    total = scaler.get_total_resources()
    assert (total.cpu, total.gpu, total.memory, total.object_store_memory) == (4.0, 0.0, 8e9, 2e9)
    scaler.try_trigger_scaling()  # no coordinator, no autoscaler: nothing to ask
    scaler.on_executor_shutdown()


@pytest.mark.parametrize("local", [True, False])
def test_a_worker_of_a_local_instance_gets_the_local_cluster_autoscaler(local) -> None:
    """``setup_worker`` in a fresh process (Ray Data not yet imported), as a Ray worker runs it:
    on a local instance (``LOCAL_RAY_MARKER``) Ray Data's executor creates the local autoscaler, and
    the pinned executor still has the name the patch replaces (else the patch is skipped with a
    warning, the executor keeps Ray's autoscaler and this prints False)."""
    code = (
        "from asyncrl import ray_internals; ray_internals.setup_worker(); "
        "from ray.data._internal.execution import streaming_executor as se; "
        "print(se.create_cluster_autoscaler is ray_internals.local_cluster_autoscaler)"
    )
    drop = (raysetup.LOCAL_RAY_MARKER, ray_internals.DISABLE_ENV)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if local:
        env[raysetup.LOCAL_RAY_MARKER] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(local)


def test_patch_local_autoscaler_fails_loudly_on_an_unknown_ray():
    with pytest.raises(RuntimeError, match=r"pin ray==2\.60\.0"):
        ray_internals.patch_local_autoscaler(types.ModuleType("not_the_executor"))
