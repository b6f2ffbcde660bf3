"""MkDocs hook: every public name the API reference documents has a docstring.

mkdocstrings renders a name without a docstring as a bare signature and says nothing; this hook
makes it a warning, so ``mkdocs build --strict`` fails on it. It reads each ``::: identifier`` of
``docs/reference/*.md`` (and its ``members:`` option, if any), loads the package statically with
griffe (what mkdocstrings renders from), and checks the object and what the reference renders of
it: a module's public names (its ``__all__`` where it has one, else the names not starting with
``_`` that it defines), and each public class's own public methods. It also checks that every
name of ``asyncrl.__all__`` is documented on ``docs/reference/index.md``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("mkdocs.hooks.public_api")

DIRECTIVE = re.compile(r"^:::\s+(\S+)\s*$")


def directives(page: Path) -> list[tuple[str, list[str] | None]]:
    """The ``::: identifier`` blocks of ``page`` with their ``members:`` option (None: default)."""
    lines = page.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        match = DIRECTIVE.match(line)
        if not match:
            continue
        block = []
        for follow in lines[i + 1 :]:
            if follow.strip() and not follow.startswith(" "):
                break
            block.append(follow)
        options = (yaml.safe_load("\n".join(block)) or {}).get("options", {}) if block else {}
        out.append((match.group(1), options.get("members")))
    return out


def _target(obj: Any) -> Any:
    return obj.final_target if obj.is_alias else obj


def public_members(obj: Any, members: list[str] | None) -> list[Any]:
    """What the reference renders of ``obj`` below its own heading."""
    if members is not None:
        return [obj.members[name] for name in members]
    if obj.is_module:
        if obj.exports is not None:
            names = [n if isinstance(n, str) else n.name for n in obj.exports]
            return [obj.members[n] for n in names if n in obj.members]
        return [m for name, m in obj.members.items() if not name.startswith("_") and not m.is_alias]
    if obj.is_class:
        return [
            m
            for name, m in obj.members.items()
            if not name.startswith("_") and not m.is_alias and m.is_function
        ]
    return []


def inherits_docstring(cls: Any, method: str, protocol_hooks: set[str]) -> bool:
    """True when a base class of ``cls`` documents ``method``, or when ``method`` is a hook that a
    documented protocol of the reference documents (a class implements a protocol structurally,
    without inheriting from it: ``StalenessController.keep`` documents every controller's ``keep``)."""
    if method in protocol_hooks:
        return True
    try:
        bases = cls.mro()
    except Exception:  # a base outside the loaded packages
        return False
    return any(method in base.members and _target(base.members[method]).docstring for base in bases)


def protocol_hooks(objects: list[Any]) -> set[str]:
    """Names of the documented methods of the ``Protocol`` classes among ``objects``."""
    hooks = set()
    for obj in objects:
        if obj.is_class and any(str(base).endswith("Protocol") for base in obj.bases):
            hooks |= {name for name, m in obj.members.items() if m.is_function and _target(m).docstring}
    return hooks


def undocumented(identifier: str, members: list[str] | None, loader: Any, hooks: set[str]) -> list[str]:
    """The documented functions and classes under ``identifier`` (and each public class's own
    public methods) that have no docstring; a method documented by a base class counts as
    documented. Attributes are not checked (their notes are ``#:`` comments)."""
    obj = _target(loader.modules_collection.get_member(identifier))
    missing = [] if obj.docstring else [obj.path]
    for member in public_members(obj, members):
        target = _target(member)
        if not (target.is_function or target.is_class):
            continue  # a submodule has its own reference entry; attributes are not checked
        if not target.docstring:
            missing.append(target.path)
        if target.is_class:
            for method in public_members(target, None):
                if not _target(method).docstring and not inherits_docstring(target, method.name, hooks):
                    missing.append(_target(method).path)
    return missing


def on_pre_build(config: Any, **kwargs: Any) -> None:
    import griffe

    docs = Path(config["docs_dir"])
    reference = sorted((docs / "reference").glob("*.md"))
    root = Path(config["config_file_path"]).resolve().parent
    loader = griffe.GriffeLoader(search_paths=[str(root / "src")])
    loader.load("asyncrl")
    loader.resolve_aliases(implicit=True)
    entries = [(page, identifier, members) for page in reference for identifier, members in directives(page)]
    rendered = []
    for _, identifier, members in entries:
        obj = _target(loader.modules_collection.get_member(identifier))
        rendered += [obj, *(_target(m) for m in public_members(obj, members))]
    hooks = protocol_hooks(rendered)
    for page, identifier, members in entries:
        for path in undocumented(identifier, members, loader, hooks):
            log.warning(f"{page.relative_to(docs)}: {path} is documented but has no docstring")
    index = (docs / "reference" / "index.md").read_text()
    package = loader.modules_collection["asyncrl"]
    for name in package.exports or []:
        name = name if isinstance(name, str) else name.name
        if f"`{name}`" not in index:
            log.warning(f"reference/index.md does not list asyncrl.{name} (in asyncrl.__all__)")
