"""The public API is listed once, in ``asyncrl.__all__``, and the API reference of the docs site
documents each name; the docs hook that makes ``mkdocs build --strict`` fail on a public name
without a docstring finds one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import asyncrl

REPO = Path(__file__).resolve().parents[1]
INDEX = REPO / "docs" / "reference" / "index.md"


def _hook():
    spec = importlib.util.spec_from_file_location(
        "public_api_hook", REPO / "docs" / "hooks" / "public_api.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_resolves_and_is_listed_in_the_reference():
    listed = INDEX.read_text()
    for name in asyncrl.__all__:
        assert getattr(asyncrl, name) is not None, name
        assert f"`{name}`" in listed, f"docs/reference/index.md does not list asyncrl.{name}"
    assert set(asyncrl.__all__) == {"__version__", "run", *asyncrl._PUBLIC, *asyncrl._MODULES}
    with pytest.raises(AttributeError, match="no attribute 'pipeline_internals'"):
        asyncrl.pipeline_internals  # noqa: B018


def test_import_asyncrl_loads_neither_torch_nor_ray():
    code = "import sys, asyncrl; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_docs_hook_reports_a_public_name_without_a_docstring(tmp_path):
    griffe = pytest.importorskip("griffe")
    pkg = tmp_path / "pkg_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        '"""A package."""\n__all__ = ["documented", "bare", "Proto", "Impl"]\n'
        "from typing import Protocol\n"
        'def documented():\n    """Has one."""\n'
        "def bare():\n    pass\n"
        'class Proto(Protocol):\n    """A seam."""\n    def hook(self):\n        """A hook."""\n'
        'class Impl:\n    """Implements Proto."""\n    def hook(self):\n        pass\n'
        "    def extra(self):\n        pass\n"
    )
    hook = _hook()
    loader = griffe.GriffeLoader(search_paths=[str(tmp_path)])
    loader.load("pkg_probe")
    loader.resolve_aliases(implicit=True)
    module = loader.modules_collection["pkg_probe"]
    hooks = hook.protocol_hooks([module, *(m for m in hook.public_members(module, None))])
    assert hooks == {"hook"}
    # Impl.hook is documented by the protocol; Impl.extra and bare are not documented anywhere
    assert hook.undocumented("pkg_probe", None, loader, hooks) == ["pkg_probe.bare", "pkg_probe.Impl.extra"]
    assert hook.undocumented("pkg_probe", ["documented"], loader, hooks) == []
