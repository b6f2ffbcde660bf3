"""asyncrl: composable asynchronous on-policy distillation and RL post-training on Ray.

The parts (``asyncrl.estimators``, ``asyncrl.controllers``, ``asyncrl.caches``, ``asyncrl.step``,
``asyncrl.engines``, ``asyncrl.records``) are plain PyTorch and import no Ray; the pipeline
(``asyncrl.run``) wires them into Ray Data + Ray Train.

The public API is ``__all__`` below, and it is listed once more, with every name's docstring, in
the API reference of the docs site (``docs/reference/``). Those names are stable: within a 0.x
minor version they keep their signatures and meaning, and a change is announced in CHANGELOG.md
first. Everything else (module paths not listed, names starting with ``_``, the lab tooling in
``asyncrl.lab``: sweeps, simulator, report, pretraining, built-in tasks and presets; benchmarks)
may change in any release. The core never imports ``asyncrl.lab``. Attributes load on first use,
so ``import asyncrl`` imports neither torch nor Ray.
"""

from __future__ import annotations

from importlib.metadata import version as _dist_version
from typing import TYPE_CHECKING, Any

#: one source of truth: the installed distribution's version (pyproject.toml)
__version__ = _dist_version("asyncrl")

if TYPE_CHECKING:
    from asyncrl.pipeline import RunResult
    from asyncrl.telemetry.progress import Display


def run(config: Any, *, display: Display | None = None) -> RunResult:
    """Run a whole pipeline from a ``RunConfig`` (or a path to a YAML file). See ``asyncrl.pipeline``;
    ``display``: show progress as a row of a caller's ``asyncrl.telemetry.progress.Display``."""
    from asyncrl.pipeline import run as _run

    return _run(config, display=display)


#: the public API (stable, see the module docstring): name -> the module that defines it
_PUBLIC = {
    "RunConfig": "asyncrl.config",
    "load_config": "asyncrl.config",
    "RunResult": "asyncrl.pipeline",
    "loss_step": "asyncrl.step",
    "StepParts": "asyncrl.step",
    "StepOptions": "asyncrl.step",
    "StepResult": "asyncrl.step",
}
#: the public modules: each one's own ``__all__`` (or, for ``records``, its documented names) is public
_MODULES = ("backends", "caches", "controllers", "engines", "estimators", "records", "step")

__all__ = [
    "RunConfig",
    "RunResult",
    "StepOptions",
    "StepParts",
    "StepResult",
    "__version__",
    "backends",
    "caches",
    "controllers",
    "engines",
    "estimators",
    "load_config",
    "loss_step",
    "records",
    "run",
    "step",
]


def __getattr__(name: str) -> Any:
    """Load a public name on first use (PEP 562): ``asyncrl.estimators``, ``asyncrl.loss_step``..."""
    import importlib

    if name in _MODULES:
        return importlib.import_module(f"asyncrl.{name}")
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
