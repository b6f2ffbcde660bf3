"""``asyncrl.ray_internals``, the one door to Ray's private APIs: each patch applies only to the Ray
versions it was written for; any other Ray takes the fallback (stock Ray) with one warning per
patch, and no other module of asyncrl touches a private Ray API."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from asyncrl import ray_internals, raysetup

SRC = Path(ray_internals.__file__).resolve().parent


@pytest.fixture
def fresh(monkeypatch):
    """No patch warned about yet in this process, and no ``ASYNCRL_RAY_PATCHES`` switch set."""
    monkeypatch.setattr(ray_internals, "_warned", set())
    monkeypatch.delenv(ray_internals.DISABLE_ENV, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("2.60.0", (2, 60, 0)), ("2.60.1", (2, 60, 1)), ("3.0.0.dev0", (3, 0, 0)), ("2.61.0rc1", (2, 61, 0)),
     ("2.60", (2, 60)), ("nightly", ())],
)  # fmt: skip
def test_parse_version(text, parsed):
    assert ray_internals.parse_version(text) == parsed


def test_the_pinned_ray_is_in_every_patchs_range(fresh):
    from importlib.metadata import version

    assert version("ray") == ray_internals.ray_version()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no patch is skipped on the pinned Ray
        assert all(ray_internals.active(name) for name in ray_internals.PATCHES)


@pytest.mark.parametrize("version", ["2.59.9", "2.61.0", "3.0.0.dev0", "nightly"])
def test_an_unknown_ray_version_takes_the_fallback_with_one_warning_per_patch(fresh, version):
    fresh.setattr(ray_internals, "ray_version", lambda: version)
    for name in ray_internals.PATCHES:
        with pytest.warns(ray_internals.RayPatchSkipped, match=rf"'{name}'.*ray {version} is installed"):
            assert not ray_internals.active(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked again: still off, and no second warning
        assert not any(ray_internals.active(name) for name in ray_internals.PATCHES)


def test_an_unknown_ray_gets_no_worker_hook_and_rays_own_trainer(fresh):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    fresh.setattr(ray_internals, "ray_version", lambda: "2.61.0")
    with pytest.warns(ray_internals.RayPatchSkipped):
        env = raysetup.runtime_env({ray_internals.LOCAL_RAY_MARKER: "1"}, 0.1)
    assert "worker_process_setup_hook" not in env
    assert ray_internals.TICK_ENV not in env["env_vars"]
    assert "RAY_DATA_METADATA_PREFETCH_ON_THREAD" not in env["env_vars"]
    with pytest.warns(ray_internals.RayPatchSkipped, match="train_helpers"):
        trainer = ray_internals.torch_trainer(lambda c: None, local=True, scaling_config=ScalingConfig())
    assert type(trainer) is TorchTrainer
    with pytest.warns(ray_internals.RayPatchSkipped, match="node_stats"):
        assert ray_internals.raylet_node_stats("127.0.0.1", 1) is None


def test_the_switch_turns_every_patch_off_silently(fresh):
    fresh.setenv(ray_internals.DISABLE_ENV, "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not any(ray_internals.active(name) for name in ray_internals.PATCHES)
        env = raysetup.runtime_env({ray_internals.LOCAL_RAY_MARKER: "1"}, 0.1)
    assert "worker_process_setup_hook" not in env


def test_a_moved_private_name_is_skipped_with_a_warning_not_an_error(fresh):
    """In the version range, but the module does not look as the patch expects: the import of the
    patched module still succeeds and the module is left as Ray made it."""
    module = types.ModuleType("not_the_executor")
    with pytest.warns(ray_internals.RayPatchSkipped, match="executor_wait.*RuntimeError"):
        ray_internals.guarded("executor_wait", lambda m: ray_internals.patch_executor(m, 0.1))(module)
    assert not hasattr(module, "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S")


def test_a_worker_of_an_unknown_ray_leaves_ray_data_as_it_is():
    """``setup_worker`` in a fresh process whose Ray is not one the patches were written for (the
    version read is replaced before the hook runs): Ray Data's executor keeps its own loop and
    autoscaler, and the process says why on stderr once per patch."""
    code = (
        "from asyncrl import ray_internals; ray_internals.ray_version = lambda: '2.61.0'; "
        "ray_internals.setup_worker(); import ray; "
        "from ray.data._internal.execution import streaming_executor as se, streaming_executor_state as ses; "
        "print(ses.ray is ray, se.create_cluster_autoscaler is not ray_internals.local_cluster_autoscaler)"
    )
    env = {k: v for k, v in os.environ.items() if k != ray_internals.DISABLE_ENV}
    env |= {ray_internals.TICK_ENV: "0.1", ray_internals.LOCAL_RAY_MARKER: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True True"
    assert out.stderr.count("RayPatchSkipped") == 2, out.stderr


def _private_ray_uses(path: Path) -> list[str]:
    """``ray._private`` / ``ray.*._internal`` names that ``path`` imports or reads."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.append(node.value)
        for name in names:
            if name.startswith("ray.") and ("._private" in name or "._internal" in name):
                found.append(name)
    return found


def test_no_module_but_ray_internals_touches_a_private_ray_api():
    users = {
        str(path.relative_to(SRC)): uses
        for path in sorted(SRC.rglob("*.py"))
        if (uses := _private_ray_uses(path))
    }
    assert set(users) == {"ray_internals.py"}, users
