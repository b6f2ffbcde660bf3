"""The core apart from the lab, and no import circle: read from the source, importing nothing.

Every module under ``src/asyncrl`` is parsed with ``ast``; every import statement counts, at module
level or inside a function, class or ``if TYPE_CHECKING:`` block (a deferred or type-only import
hides a circle from the interpreter, not from a reader). Edges are between modules of the package:

- ``import asyncrl.a.b`` and ``from asyncrl.a import b`` (``b`` a submodule) are edges to
  ``asyncrl.a.b``; ``from asyncrl.a import name`` (``name`` defined in ``a``, or in
  ``a/__init__.py`` for a package) is an edge to ``asyncrl.a``. Relative imports are resolved.
- Package ``__init__`` modules are nodes like any other. The implicit import of a module's parent
  packages (Python runs ``asyncrl/x/__init__.py`` before ``asyncrl.x.y``) is left out: with it,
  every package that re-exports its submodules would be a circle. What it would catch is caught
  by the explicit edges instead: a submodule that needs a name of its package's ``__init__`` names
  it (``from asyncrl.x import name``), and that edge closes a circle if the ``__init__`` imports
  the submodule, lazily or not.
- Names loaded by ``importlib.import_module`` or a dotted-path string are not edges; a core
  module may not name the lab in a string it passes to a call either (``_dotted_lab_strings``).

The lab (``asyncrl.lab`` and below) and the command line (``asyncrl.cli``, the application over
both) are not core. Checked: (a) no core module imports the lab or the CLI; (b) the whole graph,
core, lab and CLI, is acyclic (a failure names one circle).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "asyncrl"
NOT_CORE = ("asyncrl.lab", "asyncrl.cli")


def module_files(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``) for every ``.py`` file of the package."""
    out = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _owner(name: str, modules: Iterable[str]) -> str | None:
    """The longest module prefix of the dotted ``name`` (``asyncrl.a.b.C`` -> ``asyncrl.a.b``)."""
    known = set(modules)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, is_pkg: bool, tree: ast.AST, modules: Iterable[str]) -> set[str]:
    """The package modules ``module`` imports, from every import statement anywhere in ``tree``."""
    known = set(modules)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    out.add(_owner(alias.name, known) or PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name != PACKAGE and not name.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                out.add(sub if sub in known else _owner(name, known) or PACKAGE)
    out.discard(module)
    return out


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    files = module_files(src)
    return {
        m: imports_of(m, is_pkg, ast.parse(path.read_text(), filename=str(path)), files)
        for m, (path, is_pkg) in files.items()
    }


def is_core(module: str) -> bool:
    return not any(module == n or module.startswith(n + ".") for n in NOT_CORE)


def core_to_lab_edges(graph: Mapping[str, Iterable[str]]) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in graph.items() if is_core(m) for d in deps if not is_core(d))


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One circle of ``graph`` as ``[a, b, ..., a]``, or None when it is acyclic (iterative DFS)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for root in sorted(graph):
        if color[root] != WHITE:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        color[root] = GREY
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                color[path.pop()] = BLACK
                stack.pop()
            elif color.get(nxt, BLACK) == GREY:
                return [*path[path.index(nxt) :], nxt]
            elif color.get(nxt, BLACK) == WHITE:
                color[nxt] = GREY
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def _dotted_lab_strings(src: Path = SRC) -> list[str]:
    """Core modules passing a string that names the lab or the CLI to a call (``import_module``,
    ``import_dotted``, a registry lookup): an import the AST edges cannot see."""
    found = []
    for m, (path, _) in module_files(src).items():
        if not is_core(m):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    named = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                    if named and any(arg.value.startswith(n) for n in NOT_CORE):
                        found.append(f"{m}: {arg.value!r}")
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_the_package(graph: dict[str, set[str]]) -> None:
    assert {"asyncrl", "asyncrl.pipeline", "asyncrl.lab", "asyncrl.lab.sweep", "asyncrl.cli"} <= set(graph)
    # deferred (in-function) and relative imports are edges too
    assert "asyncrl.lab.report" in graph["asyncrl.cli"]
    assert "asyncrl.pipeline" in graph["asyncrl"]  # inside asyncrl.run
    assert "asyncrl.lab.aggregate" in graph["asyncrl.lab.sweep_report"]  # a submodule by name


def test_the_core_imports_nothing_from_the_lab(graph: dict[str, set[str]]) -> None:
    edges = core_to_lab_edges(graph)
    assert not edges, "core modules import the lab or the CLI: " + ", ".join(f"{a} -> {b}" for a, b in edges)
    assert not _dotted_lab_strings(), _dotted_lab_strings()


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


# --- the checks fail when they should -----------------------------------------------------------------
def test_find_cycle_reports_a_circle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    cycle = find_cycle(g)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_a_core_to_lab_edge_is_reported() -> None:
    g = {"asyncrl.plan": {"asyncrl.lab.tasks", "asyncrl.config"}, "asyncrl.lab.tasks": {"asyncrl.plan"}}
    assert core_to_lab_edges(g) == [("asyncrl.plan", "asyncrl.lab.tasks")]
    assert core_to_lab_edges({"asyncrl.config": {"asyncrl.cli"}}) == [("asyncrl.config", "asyncrl.cli")]
    assert core_to_lab_edges({"asyncrl.cli": {"asyncrl.lab.sweep"}, "asyncrl.lab.sweep": {"asyncrl"}}) == []


def test_hidden_imports_are_edges(tmp_path: Path) -> None:
    """A deferred import, a ``TYPE_CHECKING`` import, a relative one and a package ``__init__``."""
    pkg = tmp_path / PACKAGE
    (pkg / "lab").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def run():\n    from asyncrl import core\n")
    (pkg / "lab" / "__init__.py").write_text("")
    (pkg / "lab" / "tool.py").write_text("from .. import core\n")
    (pkg / "core.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from asyncrl.other import X\n"
        "def f():\n    import asyncrl.lab.tool\n"
    )
    (pkg / "other.py").write_text("from . import core\nfrom asyncrl import __version__\n")
    g = import_graph(tmp_path)
    assert g["asyncrl.core"] == {"asyncrl.other", "asyncrl.lab.tool"}
    assert g["asyncrl.other"] == {"asyncrl.core", "asyncrl"}
    assert g["asyncrl.lab.tool"] == {"asyncrl.core"}
    assert g["asyncrl"] == {"asyncrl.core"}
    assert core_to_lab_edges(g) == [("asyncrl.core", "asyncrl.lab.tool")]
    cycle = find_cycle(g)  # two circles: core <-> other, core <-> lab.tool; one is named
    assert cycle is not None and cycle[0] == cycle[-1] and "asyncrl.core" in cycle
    del g["asyncrl.lab.tool"], g["asyncrl.other"]
    assert find_cycle(g) is None
