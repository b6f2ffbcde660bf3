"""Fault injection for reliability tests and soak runs: every fault is off unless configured.

The ``faults:`` config section names where a run should break: a process exits (as an OOM
kill or a segfault would, no cleanup) or the loss turns NaN, at a given count. Each process
kind has one injection point:

- ``generator_exit: k``: a generator process exits right after its k-th admission;
- ``scorer_exit: k``: a teacher/reward scoring process exits at the start of its k-th block;
- ``learner_exit: k``: learner rank 0 exits right after optimizer step k;
- ``nonfinite_step: k`` (with ``nonfinite_count: n``): the student's logits (so the loss and the
  gradient) are NaN in n attempts in a row from the first attempt at optimizer step k on (a
  skipped step does not advance the step count, so its retry is the next attempt), once per run;
- ``skip_weight_load: k``: a generator's engine skips its k-th weight load (it keeps the weights it
  holds and stamps the new version on its tokens: the update never arrived), which the provenance
  check (``pipeline.provenance``) must catch;
- ``engine_dies_mid_sequence: k``: with ``pipeline.inflight_updates``, a generator's engine dies
  (``EngineDeadError``) at its k-th version check between decode steps, i.e. in the middle of a
  rollout whose tokens may already span versions: the partial rollout is discarded and the block is
  regenerated whole (crash-only, as any engine death);
- ``generator_delay_p`` / ``generator_delay_s``: a generator sleeps up to ``s`` seconds before a
  block with probability ``p`` (seeded per block), the slow-generator soak.

Process exits and NaN steps fire once per run directory: the first process to reach the count creates
``RUN/faults/<point>`` (atomically, so two generators cannot both fire), and neither a restarted
process nor a resumed run fires it again. Driver death is injected from outside
(``kill -9`` of the ``asyncrl run`` process group): see ``scripts/soak.py``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.configurable import check, field


@dataclass(frozen=True)
class FaultConfig:
    generator_exit: int = field(
        0, help="chaos testing: a generator process exits after its k-th admission (once per run); 0 = off"
    )
    scorer_exit: int = field(
        0, help="chaos testing: a teacher/reward scorer exits at its k-th block (once per run); 0 = off"
    )
    learner_exit: int = field(
        0, help="chaos testing: learner rank 0 exits after optimizer step k (once per run); 0 = off"
    )
    nonfinite_step: int = field(
        0, help="chaos testing: NaN logits from the first attempt at optimizer step k (once per run); 0 = off"
    )
    nonfinite_count: int = field(
        1, help="chaos testing: how many step attempts in a row nonfinite_step lasts"
    )
    skip_weight_load: int = field(
        0,
        help="chaos testing: a generator's engine skips its k-th weight load but claims the new version "
        "(once per run); 0 = off",
    )
    engine_dies_mid_sequence: int = field(
        0,
        help="chaos testing: with pipeline.inflight_updates, a generator's engine dies at its k-th version "
        "check between decode steps, mid-rollout (once per run); 0 = off",
    )
    generator_delay_p: float = field(0.0, help="chaos testing: probability a generator sleeps before a block")
    generator_delay_s: float = field(0.0, help="chaos testing: longest such sleep (uniform), seconds")

    def __post_init__(self) -> None:
        for name in (
            "generator_exit",
            "scorer_exit",
            "learner_exit",
            "nonfinite_step",
            "skip_weight_load",
            "engine_dies_mid_sequence",
        ):
            check(getattr(self, name) >= 0, name, getattr(self, name), "use 0 (off) or a count k >= 1")
        check(self.nonfinite_count >= 1, "nonfinite_count", self.nonfinite_count, "use an integer >= 1")
        check(
            0.0 <= self.generator_delay_p <= 1.0,
            "generator_delay_p",
            self.generator_delay_p,
            "use a probability in [0, 1]",
        )
        check(self.generator_delay_s >= 0, "generator_delay_s", self.generator_delay_s, "use seconds >= 0")

    @property
    def active(self) -> bool:
        return self != FaultConfig()


@dataclass(frozen=True)
class Faults:
    """A run's fault plan plus where its once-only markers live (picklable; handed to every stage)."""

    config: FaultConfig
    marker_dir: str

    def once(self, point: str, count: int) -> bool:
        """True exactly once per run directory: when ``count`` reaches the configured k of ``point``."""
        k = getattr(self.config, point)
        if k <= 0 or count != k:
            return False
        Path(self.marker_dir).mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(Path(self.marker_dir, point), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def fired(self, point: str) -> bool:
        return Path(self.marker_dir, point).exists()

    def exit_if(self, point: str, count: int) -> None:
        """Exit this process now, without cleanup, if ``point`` fires at ``count``."""
        if self.once(point, count):
            print(f"asyncrl: fault injected: {point} at {count}", flush=True)
            os._exit(1)

    def delay(self, seed: int, block_index: int) -> float:
        """Sleep before a generator block (seeded per block); returns the seconds slept."""
        c = self.config
        if c.generator_delay_p <= 0 or c.generator_delay_s <= 0:
            return 0.0
        rng = np.random.default_rng([seed, block_index, 7])
        if rng.random() >= c.generator_delay_p:
            return 0.0
        seconds = float(rng.uniform(0.0, c.generator_delay_s))
        time.sleep(seconds)
        return seconds


NO_FAULTS = Faults(FaultConfig(), "")


class InjectedNaN:
    """``nonfinite_step``: NaN logits from ``model``'s output head in ``nonfinite_count`` step
    attempts in a row from the first attempt at step k (a skipped step's retry is the next attempt)."""

    def __init__(self, faults: Faults, model: Any) -> None:
        self.faults = faults
        self.model = model
        self.left = 0  # injected NaN attempts still to come

    @contextlib.contextmanager
    def __call__(self, step: int) -> Iterator[None]:
        """Around one attempt at optimizer ``step``: the loss and the gradient are NaN if it fires."""
        if self.left == 0 and self.faults.once("nonfinite_step", step):
            self.left = self.faults.config.nonfinite_count
        if self.left == 0:
            yield
            return
        self.left -= 1
        head = self.model.get_output_embeddings()
        handle = head.register_forward_hook(lambda module, args, out: out * float("nan"))
        try:
            yield
        finally:
            handle.remove()
