"""Composition of controllers: ``chain(a, b, ...)`` behaves as one controller.

Like ``optax.chain``: each part keeps its own explicit state and the composite combines the
hooks (see ``asyncrl.controllers.base`` for their order):

================== =====================================================================
``admit``          AND over controllers (all are asked, so none misses a request)
``behavior_version`` the one controller's pin (None if none pins; two different pins: error)
``keep``           AND, then widened to whole groups; drops are counted per controller
``token_weights``  product of the non-None weights (None if every controller returns None)
``transform_gradient`` applied in chain order
``lr_scale``       product (logged as ``lr/scale`` and ``lr/applied = base_lr * scale``);
                   0 means no optimizer step (``asyncrl.controllers.base``, hook 5)
``transform_update`` applied in chain order, after the optimizer step (hook 6)
``after_step``     every controller
``metrics``        merged; a key already emitted by an earlier controller is prefixed
                   with the later controller's name; plus ``active/<name>`` per controller
                   (its acting fraction at this step: its ``active_fraction()``, or for a
                   ``keep``-only controller the fraction of this step's samples it dropped)
``state_dict``     keyed by controller name (duplicates become ``name_1``, ``name_2``, ...)
================== =====================================================================

Any object implementing any subset of the hooks can take part; ``as_controller`` fills the
missing ones with no-ops.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from asyncrl.controllers.base import AdmissionRequest, SampleInfo, StepContext
from asyncrl.controllers.verdicts import DropCounter, group_all

HOOKS = (
    "admit",
    "behavior_version",
    "keep",
    "token_weights",
    "transform_gradient",
    "lr_scale",
    "transform_update",
    "after_step",
    "metrics",
    "state_dict",
    "load_state_dict",
)


def _default_name(obj: Any) -> str:
    name = getattr(obj, "name", None)
    if isinstance(name, str) and name:
        return name
    cls = type(obj).__name__ if not isinstance(obj, type) else obj.__name__
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls).lower()


class _Filled:
    """Adapter giving a partial controller every hook; missing hooks are no-ops."""

    def __init__(self, inner: Any, name: str) -> None:
        self.inner = inner
        self.name = name
        self.implements = frozenset(h for h in HOOKS if callable(getattr(inner, h, None)))

    def admit(self, req: AdmissionRequest) -> bool:
        return bool(self.inner.admit(req)) if "admit" in self.implements else True

    def behavior_version(self, req: AdmissionRequest) -> int | None:
        return self.inner.behavior_version(req) if "behavior_version" in self.implements else None

    def keep(self, info: SampleInfo, learner_version: int) -> np.ndarray:
        if "keep" in self.implements:
            return self.inner.keep(info, learner_version)
        return np.ones(len(info.sample_id), dtype=bool)

    def token_weights(self, ctx: StepContext) -> torch.Tensor | None:
        return self.inner.token_weights(ctx) if "token_weights" in self.implements else None

    def transform_gradient(self, grads: Sequence[torch.Tensor], ctx: StepContext) -> None:
        if "transform_gradient" in self.implements:
            self.inner.transform_gradient(grads, ctx)

    def lr_scale(self, ctx: StepContext) -> float:
        return float(self.inner.lr_scale(ctx)) if "lr_scale" in self.implements else 1.0

    def transform_update(self, updates: Sequence[torch.Tensor], ctx: StepContext) -> None:
        if "transform_update" in self.implements:
            self.inner.transform_update(updates, ctx)

    def after_step(self, ctx: StepContext) -> None:
        if "after_step" in self.implements:
            self.inner.after_step(ctx)

    def metrics(self) -> dict[str, float]:
        return dict(self.inner.metrics()) if "metrics" in self.implements else {}

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() if "state_dict" in self.implements else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "load_state_dict" in self.implements:
            self.inner.load_state_dict(state)

    def __repr__(self) -> str:
        return f"as_controller({self.inner!r})"


def as_controller(obj: Any) -> Any:
    """``obj`` with every hook of the protocol; missing hooks become no-ops (admit/keep everything,
    no weights, no gradient change, LR scale 1, no metrics, empty state)."""
    if isinstance(obj, type):
        raise TypeError(
            f"as_controller got the class {obj.__name__}; pass an instance, e.g. {obj.__name__}()"
        )
    implemented = [h for h in HOOKS if callable(getattr(obj, h, None))]
    if not implemented:
        raise TypeError(f"{obj!r} implements none of the controller hooks {list(HOOKS)}")
    if len(implemented) == len(HOOKS) and isinstance(getattr(obj, "name", None), str):
        return obj
    return _Filled(obj, _default_name(obj))


def _transforms(c: Any, hook: str, flag: str) -> bool:
    """Does ``c`` change tensors in ``hook``? Its ``flag`` attribute, else whether it has the hook."""
    if isinstance(c, _Filled):
        return hook in c.implements and _transforms(c.inner, hook, flag)
    return bool(getattr(c, flag, callable(getattr(c, hook, None))))


def transforms_gradients(controllers: Any) -> bool:
    """True if ``controllers`` (a chain or one controller) change gradients (``transform_gradient``)."""
    return _transforms(controllers, "transform_gradient", "transforms_gradients")


def transforms_updates(controllers: Any) -> bool:
    """True if ``controllers`` (a chain or one controller) change parameter updates (``transform_update``)."""
    return _transforms(controllers, "transform_update", "transforms_updates")


def importance_levels(controllers: Any) -> list[tuple[str, str]]:
    """``(name, level)`` of each controller whose token weights are importance weights π_θ/π_b."""
    if isinstance(controllers, Chain):
        return controllers.importance_levels
    inner = controllers.inner if isinstance(controllers, _Filled) else controllers
    level = getattr(inner, "importance_level", None)
    return [(_default_name(inner), level)] if level is not None else []


def _levels(name: str, c: Any) -> list[tuple[str, str]]:
    inner = c.inner if isinstance(c, _Filled) else c
    if isinstance(inner, Chain):
        return inner.importance_levels
    level = getattr(inner, "importance_level", None)
    return [(name, level)] if level is not None else []


def _unique(names: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for name in names:
        candidate, k = name, 0
        while candidate in seen:
            k += 1
            candidate = f"{name}_{k}"
        seen.add(candidate)
        out.append(candidate)
    return out


#: metric prefix of each controller's acting fraction (``asyncrl.telemetry.names.ACTIVE_PREFIX``)
ACTIVE_PREFIX = "active/"


def _active_fraction(c: Any) -> float | None:
    """The controller's own ``active_fraction()`` for the last step (None if it has none or says None)."""
    inner = c.inner if isinstance(c, _Filled) else c
    fn = getattr(inner, "active_fraction", None)
    value = fn() if callable(fn) else None
    return None if value is None else float(value)


def _keeps(c: Any) -> bool:
    return "keep" in c.implements if isinstance(c, _Filled) else callable(getattr(c, "keep", None))


class Chain:
    """Several controllers acting as one (module docstring has the combination rules)."""

    name = "chain"

    def __init__(self, *controllers: Any) -> None:
        self.controllers: list[Any] = [as_controller(c) for c in controllers]
        self.names: list[str] = _unique([c.name for c in self.controllers])
        self._drops_by = DropCounter()  # per controller (a sample dropped by two counts for both)
        self._dropped_window = 0
        self._dropped_total = 0
        self._kept_window = 0
        self._new_window = False
        self._lr: dict[str, float] = {}

    # -- container -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.controllers)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.controllers)

    def __getitem__(self, name: str) -> Any:
        """The controller registered under ``name`` (after de-duplication), unwrapped."""
        try:
            c = self.controllers[self.names.index(name)]
        except ValueError:
            raise KeyError(f"no controller {name!r} in the chain; have {self.names}") from None
        return c.inner if isinstance(c, _Filled) else c

    def __repr__(self) -> str:
        return f"chain({', '.join(self.names)})"

    @property
    def transforms_gradients(self) -> bool:
        """True if any controller changes gradients (needs full, unpartitioned gradients)."""
        return any(transforms_gradients(c) for c in self.controllers)

    @property
    def transforms_updates(self) -> bool:
        """True if any controller changes the optimizer's updates (needs full weights on every rank)."""
        return any(transforms_updates(c) for c in self.controllers)

    @property
    def importance_levels(self) -> list[tuple[str, str]]:
        """``(name, level)`` of each controller whose token weights are importance weights π_θ/π_b."""
        return [lv for name, c in zip(self.names, self.controllers) for lv in _levels(name, c)]

    # -- hooks ---------------------------------------------------------------------------
    def admit(self, req: AdmissionRequest) -> bool:
        verdicts = [bool(c.admit(req)) for c in self.controllers]
        return all(verdicts)

    def behavior_version(self, req: AdmissionRequest) -> int | None:
        pins = {
            name: v
            for name, c in zip(self.names, self.controllers)
            if (v := c.behavior_version(req)) is not None
        }
        if len(set(pins.values())) > 1:
            raise ValueError(
                f"controllers pin different behavior versions for block {req.block_index}: {pins}"
            )
        return next(iter(pins.values()), None)

    def keep(self, info: SampleInfo, learner_version: int) -> np.ndarray:
        if self._new_window:
            self._drops_by.reset_window()
            self._dropped_window = self._kept_window = 0
            self._new_window = False
        n = len(info.sample_id)
        keep = np.ones(n, dtype=bool)
        for name, c in zip(self.names, self.controllers):
            k = np.asarray(c.keep(info, learner_version), dtype=bool)
            if k.shape != (n,):
                raise ValueError(f"controller {name!r}: keep() returned shape {k.shape}, expected ({n},)")
            self._drops_by.add(name, int((~k).sum()))
            keep &= k
        keep = group_all(keep, info.group_id)
        dropped = int((~keep).sum())
        self._dropped_window += dropped
        self._dropped_total += dropped
        self._kept_window += n - dropped
        return keep

    def token_weights(self, ctx: StepContext) -> torch.Tensor | None:
        out: torch.Tensor | None = None
        for name, c in zip(self.names, self.controllers):
            w = c.token_weights(ctx)
            if w is None:
                continue
            if w.shape != ctx.mask.shape:
                raise ValueError(
                    f"controller {name!r}: token_weights shape {tuple(w.shape)} != "
                    f"mask {tuple(ctx.mask.shape)}"
                )
            out = w.detach() if out is None else out * w.detach()
        return out

    def transform_gradient(self, grads: Sequence[torch.Tensor], ctx: StepContext) -> None:
        for c in self.controllers:
            c.transform_gradient(grads, ctx)

    def lr_scale(self, ctx: StepContext) -> float:
        scale = 1.0
        self._lr = {}
        for name, c in zip(self.names, self.controllers):
            if isinstance(c, _Filled) and "lr_scale" not in c.implements:
                continue
            s = float(c.lr_scale(ctx))
            if not (math.isfinite(s) and s >= 0):
                raise ValueError(f"controller {name!r}: lr_scale returned {s}; it must be finite and >= 0")
            self._lr[f"lr/scale/{name}"] = s
            scale *= s
        self._lr["lr/scale"] = scale
        self._lr["lr/applied"] = ctx.base_lr * scale
        return scale

    def transform_update(self, updates: Sequence[torch.Tensor], ctx: StepContext) -> None:
        for c in self.controllers:
            c.transform_update(updates, ctx)

    def after_step(self, ctx: StepContext) -> None:
        for c in self.controllers:
            c.after_step(ctx)
        self._new_window = True

    def metrics(self) -> dict[str, float]:
        """Merged metrics; the drop counts cover the ``keep`` calls since the last report."""
        self._new_window = True
        out: dict[str, float] = {}
        for name, c in zip(self.names, self.controllers):
            for key, value in c.metrics().items():
                out[f"{name}/{key}" if key in out else key] = float(value)
        out.update(self._lr)
        seen = self._kept_window + self._dropped_window
        for name, c in zip(self.names, self.controllers):
            active = _active_fraction(c)
            if active is None and _keeps(c) and seen:
                active = self._drops_by.window.get(name, 0) / seen
            if active is not None:
                out[ACTIVE_PREFIX + name] = active
        out["chain/kept"] = float(self._kept_window)
        out["chain/dropped"] = float(self._dropped_window)
        out["chain/dropped_total"] = float(self._dropped_total)
        out.update({f"chain/dropped_by/{r}": float(n) for r, n in self._drops_by.window.items()})
        return out

    def state_dict(self) -> dict[str, Any]:
        state = {name: c.state_dict() for name, c in zip(self.names, self.controllers)}
        state["_chain"] = {"dropped_total": self._dropped_total, "drops_by": self._drops_by.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore every controller from its own entry. ``strict``: the saved names must match."""
        saved = set(state) - {"_chain"}
        if strict and saved != set(self.names):
            raise ValueError(
                f"controller state has {sorted(saved)} but the chain is {self.names}; resume with the same "
                f"controllers, or pass strict=False to start the missing ones fresh"
            )
        for name, c in zip(self.names, self.controllers):
            if name in state:
                c.load_state_dict(state[name])
        own = state.get("_chain", {})
        self._dropped_total = int(own.get("dropped_total", 0))
        self._drops_by.load_state_dict(own.get("drops_by", {}))


def chain(*controllers: Any) -> Chain:
    """Compose controllers (any objects implementing any subset of the hooks) into one."""
    return Chain(*controllers)
