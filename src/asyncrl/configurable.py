"""Typed, frozen component configs: building them from plain dicts with field-level errors.

Every component defines a frozen ``@dataclass`` config beside itself, documents each field
with ``field(default, help="...")`` and validates values in ``__post_init__`` by raising
``ConfigError(field, value, fix)``. ``from_dict`` turns YAML-shaped dicts into those
dataclasses, recursing into nested configs, coercing scalars, and rejecting unknown keys
with the nearest valid key. Pure Python: every layer may import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

C = TypeVar("C")

__all__ = ["ConfigError", "check", "field", "field_docs", "from_dict", "to_dict"]


class ConfigError(ValueError):
    """A bad config value. ``str(err)`` names the field, the value and the fix."""

    def __init__(self, field: str, value: Any, fix: str) -> None:
        self.field, self.value, self.fix = field, value, fix
        super().__init__(f"config field {field!r}: got {value!r}; {fix}")

    def prefixed(self, prefix: str) -> ConfigError:
        if not prefix:
            return self
        name = f"{prefix}.{self.field}" if self.field else prefix
        return ConfigError(name, self.value, self.fix)


def field(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING):
    """A dataclass field that carries its one-line documentation (used by the config reference)."""
    kw: dict[str, Any] = {"metadata": {"help": help}}
    if default_factory is not dataclasses.MISSING:
        kw["default_factory"] = default_factory
    else:
        kw["default"] = default
    return dataclasses.field(**kw)


def check(cond: bool, field: str, value: Any, fix: str) -> None:
    """Raise ``ConfigError(field, value, fix)`` unless ``cond``; for use in ``__post_init__``."""
    if not cond:
        raise ConfigError(field, value, fix)


def _nearest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return (
        f"did you mean {close[0]!r}? valid keys: {sorted(valid)}" if close else f"valid keys: {sorted(valid)}"
    )


def _coerce(tp: Any, value: Any, name: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.0)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(name, value, f"choose one of {list(choices)}{hint}")
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, name)
            except ConfigError as err:
                errors.append(err.fix)
        raise ConfigError(name, value, " or ".join(errors) or f"expected {tp}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(name, value, f"expected a mapping for {tp.__name__}")
        return from_dict(tp, value, prefix=name)
    if origin in (tuple, list):
        if isinstance(value, str) or not isinstance(value, typing.Sequence):
            raise ConfigError(name, value, "expected a list")
        args = get_args(tp)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            items = [_coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value)]
        elif origin is tuple and args:
            if len(args) != len(value):
                raise ConfigError(name, value, f"expected {len(args)} items")
            items = [_coerce(a, v, f"{name}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
        else:
            sub = args[0] if args else Any
            items = [_coerce(sub, v, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(name, value, "expected a mapping")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(name, value, "expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(name, value, "expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(name, value, "expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(name, value, "expected a number")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(name, value, "expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(name, value, "expected a string")
    return value


def from_dict(cls: type[C], data: Mapping[str, Any] | None, *, prefix: str = "") -> C:
    """Build the frozen dataclass ``cls`` from ``data``; unknown keys and bad values raise ConfigError."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        name = f"{prefix}.{key}" if prefix else key
        raise ConfigError(name, data[key], f"unknown key; {_nearest(key, list(fields))}")
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _coerce(hints[key], value, name)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.prefixed(prefix) from None
    except TypeError as err:  # missing required fields
        raise ConfigError(prefix or cls.__name__, data, f"{err}") from None


def to_dict(cfg: Any) -> Any:
    """Plain, YAML-serialisable form of a config (tuples become lists)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def field_docs(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted name, type, default, help) for every field, recursing into nested configs."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(field_docs(tp, name))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        tname = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
        rows.append((name, tname, to_dict(default), f.metadata.get("help", "")))
    return rows
