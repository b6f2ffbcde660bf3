"""Learner observers: what watches the learner's steps without changing them (telemetry, faults).

The learner (``asyncrl.learner``) calls ONE observer at fixed points of its recipe; every hook is
optional (a no-op when an observer lacks it), and ``Observers(a, b, ...)`` calls its members in
order::

    on_start(version, started_at)      weights published, before the first batch (the step-0 eval)
    on_batch()                         a rollout batch arrived
    before_step(mb, keep, version, first=...) -> metrics      before each mini-batch's loss_step
    attempt(version + 1)               context manager around one loss_step attempt
    after_step(result) -> metrics      after it (gradients still in place)
    on_step(mb, result, version, t_got=..., t_computed=..., extra=...)   after the publication
    on_checkpoint()                    before a checkpoint is written
    on_finish()                        the run ended (or aborted)

Built-ins: ``StepTelemetry`` (``StepLogger``: metrics.jsonl, samples.parquet, evals, start-up
marks; ``LearnerGradients``: gradient diagnostics) and ``FaultHooks`` (``faults.nonfinite_step``,
``faults.learner_exit``). The metric names are ``asyncrl.telemetry.names``'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from asyncrl.faults import Faults, InjectedNaN
from asyncrl.telemetry.gradients import LearnerGradients
from asyncrl.telemetry.steps import StepLogger


class LearnerObserver(Protocol):
    """Hooks the learner calls; implement any subset (``Observers`` skips the missing ones)."""

    def on_start(self, version: int, started_at: float) -> None: ...

    def on_batch(self) -> None: ...

    def before_step(
        self, batch: Mapping[str, Any], keep: np.ndarray, version: int, *, first: bool
    ) -> dict[str, float]: ...

    def attempt(self, step: int) -> AbstractContextManager[None]: ...

    def after_step(self, result: Any) -> dict[str, float]: ...

    def on_step(self, batch: Mapping[str, Any], result: Any, version: int, **times_extra: Any) -> None:
        """After the step's publication; keywords ``t_got``, ``t_computed`` (perf_counter seconds:
        data arrived, step computed) and ``extra`` (metrics to log with the step)."""

    def on_checkpoint(self) -> None: ...

    def on_finish(self) -> None: ...


class Observers:
    """Several observers as one, called in the given order; metrics of ``before_step`` and
    ``after_step`` are merged (a later observer's key wins)."""

    def __init__(self, *observers: Any) -> None:
        self.observers = observers

    def _each(self, hook: str) -> Iterator[Any]:
        for o in self.observers:
            fn = getattr(o, hook, None)
            if fn is not None:
                yield fn

    def on_start(self, version: int, started_at: float) -> None:
        for fn in self._each("on_start"):
            fn(version, started_at)

    def on_batch(self) -> None:
        for fn in self._each("on_batch"):
            fn()

    def before_step(
        self, batch: Mapping[str, Any], keep: np.ndarray, version: int, *, first: bool
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        for fn in self._each("before_step"):
            out |= fn(batch, keep, version, first=first)
        return out

    @contextlib.contextmanager
    def attempt(self, step: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for fn in self._each("attempt"):
                stack.enter_context(fn(step))
            yield

    def after_step(self, result: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for fn in self._each("after_step"):
            out |= fn(result)
        return out

    def on_step(self, batch: Mapping[str, Any], result: Any, version: int, **times_extra: Any) -> None:
        for fn in self._each("on_step"):
            fn(batch, result, version, **times_extra)

    def on_checkpoint(self) -> None:
        for fn in self._each("on_checkpoint"):
            fn()

    def on_finish(self) -> None:
        for fn in self._each("on_finish"):
            fn()


class StepTelemetry:
    """The step log (``asyncrl.telemetry.steps.StepLogger``) and the gradient diagnostics
    (``asyncrl.telemetry.gradients.LearnerGradients``, on the first mini-batch of a rollout batch
    before its step, and after every step)."""

    def __init__(self, steps: Any, gradients: Any, backend: Any) -> None:
        self.steps, self.gradients, self.backend = steps, gradients, backend

    def on_start(self, version: int, started_at: float) -> None:
        self.steps.start(version)  # a fresh run's step-0 eval
        self.steps.ready(started_at)  # start-up marks; the step clock starts

    def on_batch(self) -> None:
        self.steps.first_batch()

    def before_step(
        self, batch: Mapping[str, Any], keep: np.ndarray, version: int, *, first: bool
    ) -> dict[str, float]:
        return self.gradients.before(batch, keep, version) if first else {}

    def after_step(self, result: Any) -> dict[str, float]:
        return self.gradients.after(result, self.backend)

    def on_step(self, batch: Mapping[str, Any], result: Any, version: int, **times_extra: Any) -> None:
        self.steps.log(batch, result, version, **times_extra)

    def on_checkpoint(self) -> None:
        self.steps.flush()  # the sample rows the checkpoint's ledger keeps are on disk before it

    def on_finish(self) -> None:
        self.steps.close()


class FaultHooks:
    """Fault injection in the learner (``asyncrl.faults``): ``nonfinite_step`` (NaN logits around a
    step attempt, ``InjectedNaN``) and ``learner_exit`` (rank 0 exits after the step that reached
    version k, once per run)."""

    def __init__(self, faults: Faults, model: Any, *, rank0: bool) -> None:
        self.faults, self.rank0 = faults, rank0
        self.injected_nan = InjectedNaN(faults, model)

    def attempt(self, step: int) -> AbstractContextManager[None]:
        return self.injected_nan(step)

    def on_step(self, batch: Mapping[str, Any], result: Any, version: int, **times_extra: Any) -> None:
        if self.rank0 and result.stepped:
            self.faults.exit_if("learner_exit", result.version)


def learner_observer(
    spec: Any, comm: Any, backend: Any, estimator: Any, *, resumed: Any, snapshots: Any = None
) -> Observers:
    """A learner worker's observer: ``StepTelemetry`` then ``FaultHooks`` (``spec``: the
    ``LearnerSpec``; ``resumed``: the ``checkpoint.Restored`` the worker loaded, or None;
    ``snapshots``: ``LearnerPublication.take_snapshot``, the weights published at a version)."""
    rank0, model = comm.rank == 0, backend.module
    steps = StepLogger(spec, comm, model, resumed=resumed, snapshots=snapshots)
    gradients = LearnerGradients(spec.cfg, model, estimator, rank0=rank0)
    return Observers(StepTelemetry(steps, gradients, backend), FaultHooks(spec.faults, model, rank0=rank0))
