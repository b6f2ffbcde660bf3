"""Name -> component registries.

Every pluggable family (estimators, controllers, caches, tasks, engines, presets) owns one
``Registry``. Users add their own entries with the ``register`` decorator, or reference any
object by dotted path (``"my_pkg.module:MyController"`` or ``"my_pkg.module.MyController"``)
without registering it, e.g. from YAML. ``Registry.build`` is the one way a component is made
from a name and plain (YAML-shaped) options, whatever its family.

Plugins: an installed distribution adds entries to a registry of kind ``K`` by declaring an entry
point in the group ``asyncrl.K`` (spaces as underscores: ``asyncrl.task``, ``asyncrl.preset``,
``asyncrl.estimator``, ...), e.g. ``[project.entry-points."asyncrl.task"] mine = "my_pkg.tasks"``:
a module that registers its entries when imported, or a callable that registers them when called
with no arguments. A registry loads its group once per process, the first time it is asked for a
name it does not hold or for its names (``load_plugins``), so a name resolves the same in the
driver and in every Ray worker, and a family's lookups import only that family's plugins. asyncrl's
own lab registers its built-in tasks and model presets this way (``asyncrl.lab.tasks``,
``asyncrl.lab.presets``); the core never imports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from asyncrl.configurable import ConfigError, from_dict

T = TypeVar("T")

_loaded: set[str] = set()  # entry-point groups loaded (or loading) in this process


def load_plugins(group: str) -> None:
    """Load every installed entry point of ``group`` once per process (see the module docstring):
    a module is imported, a callable called. One that fails raises, naming it, and is retried on
    the next lookup, so a broken plugin is never silently missing."""
    if group in _loaded:
        return
    from importlib.metadata import entry_points

    _loaded.add(group)  # first: a plugin registering its entries may look names up meanwhile
    try:
        for ep in entry_points(group=group):
            try:
                obj = ep.load()
                if callable(obj):
                    obj()
            except Exception as err:
                raise ImportError(f"asyncrl plugin {ep.name!r} ({ep.value}) failed to load: {err}") from err
    except BaseException:
        _loaded.discard(group)
        raise


class RegistryError(KeyError):
    """Unknown name; the message lists the nearest valid names."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable.
        return str(self.args[0]) if self.args else ""


def import_dotted(path: str) -> object:
    """Import ``"pkg.mod:attr"`` or ``"pkg.mod.attr"`` and return the attribute."""
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        raise ImportError(f"{path!r} is not a dotted path of the form 'package.module:Name'")
    module = importlib.import_module(mod_name)
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as err:
        raise ImportError(f"module {mod_name!r} has no attribute {attr!r}") from err
    return obj


class Registry(Generic[T]):
    """A small named registry with helpful errors.

    ``kind`` is the noun used in messages ("estimator", "controller", ...).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        #: the entry-point group of this family's plugins (``load_plugins``)
        self.group = "asyncrl." + kind.replace(" ", "_")
        self._entries: dict[str, T] = {}

    def register(self, name: str | None = None) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            key = name or getattr(obj, "name", None) or getattr(obj, "__name__", None)
            if not isinstance(key, str):
                raise TypeError(f"cannot infer a registry name for {obj!r}; pass name=")
            if key in self._entries and self._entries[key] is not obj:
                raise ValueError(f"{self.kind} {key!r} is already registered")
            self._entries[key] = obj
            return obj

        return deco

    def add(self, name: str, obj: T) -> T:
        return self.register(name)(obj)

    def get(self, name: str) -> T:
        """Look ``name`` up; dotted paths are imported. Unknown names raise with suggestions."""
        if name in self._entries:
            return self._entries[name]
        load_plugins(self.group)
        if name in self._entries:
            return self._entries[name]
        if "." in name or ":" in name:
            try:
                return import_dotted(name)  # type: ignore[return-value]
            except ImportError as err:
                raise RegistryError(f"cannot import {self.kind} {name!r}: {err}") from err
        close = difflib.get_close_matches(name, list(self._entries), n=3, cutoff=0.4)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        if not self._entries:  # the built-ins of this family come from plugins, and none is installed
            hint += (
                f" (no {self.kind} plugin is installed: entry-point group {self.group!r}; an install older "
                f"than its pyproject.toml needs `pip install -e .` again)"
            )
        raise RegistryError(
            f"unknown {self.kind} {name!r}{hint} Registered: {sorted(self._entries)}. "
            f"A user class can be given as a dotted path 'package.module:Class'."
        )

    def build(self, name: str, options: Mapping[str, Any] | None = None) -> Any:
        """One component from its registered name (or dotted path) and plain options.

        A class with a frozen ``Config`` dataclass: ``options`` are validated through it
        (``configurable.from_dict``: an unknown key names the nearest valid one, a bad value the
        field and the fix) and the class is called with the validated fields as keywords. Any
        other callable is called with ``**options``; a registered non-callable object takes none.

        Errors are ``ConfigError``: field ``name`` for an unknown name (nearest registered names
        listed), ``options.<key>`` for a bad option.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError("name", name, f"give a registered {self.kind} name: {self.names()}")
        try:
            factory: Any = self.get(name)
        except RegistryError as err:
            raise ConfigError("name", name, str(err)) from None
        opts = dict(options or {})
        config_cls = getattr(factory, "Config", None)
        if isinstance(factory, type) and dataclasses.is_dataclass(config_cls):
            try:
                cfg = from_dict(config_cls, opts)
            except ConfigError as err:
                raise err.prefixed("options") from None
            opts = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
        if not callable(factory):
            if opts:
                raise ConfigError("options", opts, f"{name!r} is an object, not a class; it takes no options")
            return factory
        try:
            return factory(**opts)
        except ConfigError as err:
            raise err.prefixed("options") from None
        except TypeError as err:
            raise ConfigError("options", opts, f"{name!r} rejected its options: {err}") from None

    def names(self) -> list[str]:
        load_plugins(self.group)
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        load_plugins(self.group)
        yield from sorted(self._entries.items())

    def __contains__(self, name: object) -> bool:
        if name not in self._entries:
            load_plugins(self.group)
        return name in self._entries

    def __len__(self) -> int:
        load_plugins(self.group)
        return len(self._entries)
