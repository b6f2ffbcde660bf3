"""Name -> component registries.

Every pluggable family (estimators, controllers, caches, tasks, engines, presets) owns one
``Registry``. Users add their own entries with the ``register`` decorator, or reference any
object by dotted path (``"my_pkg.module:MyController"`` or ``"my_pkg.module.MyController"``)
without registering it, e.g. from YAML.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


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
        if "." in name or ":" in name:
            try:
                return import_dotted(name)  # type: ignore[return-value]
            except ImportError as err:
                raise RegistryError(f"cannot import {self.kind} {name!r}: {err}") from err
        close = difflib.get_close_matches(name, list(self._entries), n=3, cutoff=0.4)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise RegistryError(
            f"unknown {self.kind} {name!r}{hint} Registered: {sorted(self._entries)}. "
            f"A user class can be given as a dotted path 'package.module:Class'."
        )

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        yield from sorted(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)
