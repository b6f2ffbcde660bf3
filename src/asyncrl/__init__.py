"""asyncrl: composable asynchronous on-policy distillation and RL post-training on Ray.

The parts (``asyncrl.estimators``, ``asyncrl.controllers``, ``asyncrl.caches``,
``asyncrl.engines``, ``asyncrl.records``) are plain PyTorch and import no Ray; the
pipeline (``asyncrl.run``) wires them into Ray Data + Ray Train.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from asyncrl.pipeline import RunResult


def run(config: Any) -> RunResult:
    """Run a whole pipeline from a ``RunConfig`` (or a path to a YAML file). See ``asyncrl.pipeline``."""
    from asyncrl.pipeline import run as _run

    return _run(config)


__all__ = ["__version__", "run"]
