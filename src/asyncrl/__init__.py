"""asyncrl: composable asynchronous on-policy distillation and RL post-training on Ray.

The parts (``asyncrl.estimators``, ``asyncrl.controllers``, ``asyncrl.caches``,
``asyncrl.engines``, ``asyncrl.records``) are plain PyTorch and import no Ray; the
pipeline (``asyncrl.run``) wires them into Ray Data + Ray Train.
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


__all__ = ["__version__", "run"]
