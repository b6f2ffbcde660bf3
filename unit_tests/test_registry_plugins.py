"""Registries load plugins by entry point: the lab's built-in tasks and presets the way a user's are."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl import registry
from asyncrl.registry import Registry, RegistryError

ROOT = Path(__file__).resolve().parents[1]


def _entry_points(eps: dict[str, list[SimpleNamespace]]):
    return lambda *, group: eps.get(group, [])


def test_a_registry_loads_its_group_once_on_a_missing_name(monkeypatch: pytest.MonkeyPatch) -> None:
    reg: Registry = Registry("gadget thing")
    assert reg.group == "asyncrl.gadget_thing"
    calls = []

    def register() -> None:
        calls.append(1)
        reg.add("widget", 42)

    ep = SimpleNamespace(name="mine", value="my_pkg:register", load=lambda: register)
    monkeypatch.setattr("importlib.metadata.entry_points", _entry_points({reg.group: [ep]}))
    monkeypatch.setattr(registry, "_loaded", set())
    assert reg.get("widget") == 42 and "widget" in reg and reg.names() == ["widget"]
    with pytest.raises(RegistryError, match="widget"):  # still unknown: suggestions include plugins'
        reg.get("widgt")
    assert calls == [1]


def test_a_failing_plugin_raises_with_its_name_and_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    reg: Registry = Registry("gizmo")

    def broken() -> None:
        raise RuntimeError("boom")

    ep = SimpleNamespace(name="bad", value="bad_pkg:register", load=lambda: broken)
    monkeypatch.setattr("importlib.metadata.entry_points", _entry_points({reg.group: [ep]}))
    monkeypatch.setattr(registry, "_loaded", set())
    for _ in range(2):
        with pytest.raises(ImportError, match=r"plugin 'bad' \(bad_pkg:register\).*boom"):
            reg.get("anything")


def test_pyproject_declares_the_lab_as_plugins_of_existing_registries() -> None:
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    lab = {group: spec["lab"] for group, spec in eps.items() if "lab" in spec}
    assert lab == {"asyncrl.task": "asyncrl.lab.tasks", "asyncrl.preset": "asyncrl.lab.presets"}
    for module in lab.values():
        assert (ROOT / "src" / (module.replace(".", "/") + ".py")).is_file()


def test_the_builtins_resolve_by_name_without_importing_the_lab_first() -> None:
    """In a fresh process (a Ray worker is one): the core finds ``addition`` and ``tiny`` through the
    installed entry points; an unrelated lookup (is this a real preset?) imports no lab module."""
    code = (
        "import sys\n"
        "from asyncrl.workloads.real import is_real\n"
        "assert not is_real('small')\n"
        "assert not [m for m in sys.modules if m.startswith('asyncrl.lab')], 'lab imported early'\n"
        "from asyncrl.workloads.tasks import get_task\n"
        "from asyncrl.workloads.models import PRESETS\n"
        "print(type(get_task('addition')).__module__, PRESETS.get('tiny').name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + "\n(entry points missing? reinstall: pip install -e .)"
    assert proc.stdout.split() == ["asyncrl.lab.tasks", "tiny"]


def test_an_empty_family_says_no_plugin_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    reg: Registry = Registry("doohickey")
    monkeypatch.setattr("importlib.metadata.entry_points", _entry_points({}))
    with pytest.raises(
        RegistryError, match=r"no doohickey plugin is installed: entry-point group 'asyncrl.doohickey'"
    ):
        reg.get("anything")
