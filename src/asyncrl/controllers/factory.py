"""Building controllers from names and options: the ``CONTROLLERS`` registry, ``build`` and ``build_chain``.

A registered controller is a class with a frozen ``Config`` dataclass (``asyncrl.configurable``)
whose fields are exactly its keyword arguments. ``build`` is ``Registry.build``: it validates
the options through that config (unknown keys get the nearest valid key, bad values name the
field and the fix) and then constructs the class. Anything else can be referenced by dotted
path (``"my_pkg.mod:MyController"``) and is called with ``**options``; if it has a ``Config``
dataclass, the options are validated through it first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from asyncrl.configurable import ConfigError
from asyncrl.registry import Registry

CONTROLLERS: Registry = Registry("controller")


def build(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """One controller from its registered name (or dotted path) and options: ``CONTROLLERS.build``
    (``asyncrl.registry.Registry.build``, the one way every registered component is built)."""
    return CONTROLLERS.build(name, options)


def _spec(item: Any, index: int) -> tuple[str, Mapping[str, Any]]:
    if isinstance(item, str):
        return item, {}
    if isinstance(item, Mapping):
        unknown = set(item) - {"name", "options"}
        if "name" not in item or unknown:
            raise ConfigError(
                f"controllers[{index}]", dict(item), "each entry is {name: <controller>, options: {...}}"
            )
        return item["name"], item.get("options") or {}
    if isinstance(item, tuple | list) and len(item) == 2:
        return item[0], item[1] or {}
    if hasattr(item, "name") and hasattr(item, "options"):  # config.ComponentSpec
        return item.name, item.options or {}
    raise ConfigError(f"controllers[{index}]", item, "use a name, (name, options) or {name:, options:}")


def build_chain(specs: Iterable[Any]) -> Any:
    """``chain(*[build(name, options) ...])`` from ``(name, options)`` pairs, ``{name, options}``
    mappings (YAML), ``ComponentSpec``s or bare names. Errors are prefixed ``controllers[i]``."""
    from asyncrl.controllers.chain import chain

    built = []
    for i, item in enumerate(specs):
        name, options = _spec(item, i)
        try:
            built.append(build(name, options))
        except ConfigError as err:
            raise err.prefixed(f"controllers[{i}]") from None
    return chain(*built)
