"""Building controllers from names and options: the ``CONTROLLERS`` registry, ``build`` and ``build_chain``.

A registered controller is a class with a frozen ``Config`` dataclass (``asyncrl.configurable``)
whose fields are exactly its keyword arguments. ``build`` validates the options through that
config (unknown keys get the nearest valid key, bad values name the field and the fix) and
then constructs the class. Anything else can be referenced by dotted path
(``"my_pkg.mod:MyController"``) and is called with ``**options``; if it has a ``Config``
dataclass, the options are validated through it first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from asyncrl.configurable import ConfigError, from_dict
from asyncrl.registry import Registry, RegistryError

CONTROLLERS: Registry = Registry("controller")


def build(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """One controller from its registered name (or dotted path) and options.

    Errors are ``ConfigError``: field ``name`` for an unknown controller (with the nearest
    registered names), ``options.<key>`` for a bad option.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError("name", name, f"give a registered controller name: {CONTROLLERS.names()}")
    try:
        factory = CONTROLLERS.get(name)
    except RegistryError as err:
        raise ConfigError("name", name, str(err)) from None
    options = dict(options or {})
    config_cls = getattr(factory, "Config", None)
    if isinstance(factory, type) and dataclasses.is_dataclass(config_cls):
        try:
            cfg = from_dict(config_cls, options)
        except ConfigError as err:
            raise err.prefixed("options") from None
        options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    if not callable(factory):
        if options:
            raise ConfigError("options", options, f"{name!r} is an object, not a class; it takes no options")
        return factory
    try:
        return factory(**options)
    except ConfigError as err:
        raise err.prefixed("options") from None
    except TypeError as err:
        raise ConfigError("options", options, f"{name!r} rejected its options: {err}") from None


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
