"""``PacedStep``: a controller that pads every optimizer step by a fixed sleep (a study tool).

The learner-side twin of ``asyncrl.engines.paced:PacedEngine``. On a cluster the learner runs on
its own accelerators and a step takes 0.1-10 s; on a 2-core machine the tiny model's step takes
10-30 ms, so a scale-out study there asks the pipeline to move 35-77 blocks/s, and what it measures
is the per-block CPU of two cores (Ray Data hand-offs, serialization, teacher scoring), not how
the pipeline scales. Sleeping ``pad_s`` in ``after_step`` (inside the step, before the new
weights are published) emulates a learner of step time ``t_L + pad_s`` that uses no extra CPU,
as ``PacedEngine`` emulates generators on their own hardware. The update itself is unchanged,
so every contract check (lag bound, on-policy at ``max_lag=0``, sample ledger) still applies.

By dotted path (it is not registered, so no real run picks it up by name)::

    controllers=[{name: asyncrl.controllers.paced:PacedStep, options: {pad_s: 0.1}}]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from asyncrl.configurable import check, field


@dataclass(frozen=True)
class PacedStepConfig:
    pad_s: float = field(0.1, help="seconds slept after every optimizer step (>= 0)")

    def __post_init__(self) -> None:
        check(self.pad_s >= 0, "pad_s", self.pad_s, "use >= 0 seconds")


class PacedStep:
    """Sleep ``pad_s`` after each optimizer step; implements only ``after_step`` and ``metrics``."""

    name = "paced_step"
    Config = PacedStepConfig

    def __init__(self, pad_s: float = 0.1) -> None:
        self.config = PacedStepConfig(pad_s=pad_s)
        self.slept_s = 0.0

    def after_step(self, ctx: Any) -> None:
        t0 = time.perf_counter()
        time.sleep(self.config.pad_s)
        self.slept_s += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {"paced_step/slept_s": self.slept_s}
