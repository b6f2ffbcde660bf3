"""AdmissionBudget: the producer side of the staleness bound, as a pure state machine.

The coordinator actor (``asyncrl.coordinator.PolicyStore``) wraps one. Generators ask
``try_acquire(n, block_index)`` before they start the ``n`` samples of an input block; the
learner reports ``start(version)`` when it (re)starts, ``set_version`` after every optimizer
step and ``on_consumed`` after each rollout batch. Whether a block may start is the configured
controller chain's decision (``admit``; ``bounded_staleness`` holds the bound): this class only
supplies the facts the decision needs and keeps the books.

**Ordering rule (why the pipeline cannot deadlock).** Blocks are admitted strictly in stream
order: block ``i`` is considered only once blocks ``0..i-1`` were admitted. The stream is
consumed in the same order (Ray Data ``preserve_order``; with W learner workers rollout batch
``r`` is blocks ``rW .. rW+W-1``, one per rank). So the block waiting for admission is always
the earliest unadmitted one, every block before it is admitted and will reach the learner, and
the learner's progress is what frees the budget: the wait always ends. (First-come admission
with in-order consumption deadlocks: a later block can take the last budget and then wait
behind an earlier block that can never be admitted.)

**Expected version.** Because consumption is in order, the learner version at which block
``i``'s rollout batch ``r = i // W`` is first trained is known at admission time (assuming
every batch before it takes its optimizer steps): ``expected = v_rel + (r - released) N``, where
``v_rel`` is the learner version when the last rollout batch was released, ``released`` the
number of rollout batches released since the stream (re)started and ``N`` optimizer steps per
rollout batch (``train.minibatches``). ``expected - learner_version`` is the lag the block will
have if it starts now; ``bounded_staleness`` admits only if that is <= S. A controller may also
pin the behavior version (``behavior_version``: fixed-lag studies generate block ``i`` with the
weights of version ``expected - S``).

Counters obey ``dispatched = trained + dropped + lost + in_flight``; ``lost`` counts samples in
flight when a checkpoint was restored (the caller regenerates them). A second request for an
admitted block is a retry (its generator died and Ray Data re-ran the block on a restarted
actor): it gets the same admission back and takes no new budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.controllers.base import AdmissionRequest


@dataclass(frozen=True)
class Admission:
    """A granted request: ``ticket`` (= block index), the learner ``version`` at admission,
    ``expected_version`` (when the block will be trained) and ``behavior_version`` (the weights
    version the block must be generated with; None = the latest)."""

    ticket: int
    version: int
    expected_version: int
    behavior_version: int | None


class AdmissionBudget:
    """Books of the admission side: block order, expected versions, retries and counters."""

    def __init__(
        self,
        controller: Any,
        batch_size: int,
        *,
        blocks_per_rollout: int = 1,
        versions_per_rollout: int = 1,
    ) -> None:
        if not callable(getattr(controller, "admit", None)):
            raise TypeError(f"controller must have an admit(req) hook (e.g. a chain), got {controller!r}")
        for name, value in (
            ("batch_size", batch_size),
            ("blocks_per_rollout", blocks_per_rollout),
            ("versions_per_rollout", versions_per_rollout),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.controller = controller
        self.batch_size = batch_size
        self.blocks_per_rollout = blocks_per_rollout
        self.versions_per_rollout = versions_per_rollout
        self.version = 0  # learner version (optimizer steps applied)
        self.release_version = 0  # learner version when the last rollout batch was released
        self.released = 0  # rollout batches released since the stream (re)started
        self.next_block = 0  # the only block index that may be admitted next
        self.admitted: dict[int, Admission] = {}  # block index -> admission (retries, pins)
        self.dispatched = 0
        self.trained = 0
        self.dropped = 0
        self.lost = 0
        self.retries = 0

    @property
    def in_flight(self) -> int:
        return self.dispatched - self.trained - self.dropped - self.lost

    def expected_version(self, block_index: int) -> int:
        """Learner version at which ``block_index`` will first be trained (see module docstring)."""
        rollout = block_index // self.blocks_per_rollout
        return self.release_version + (rollout - self.released) * self.versions_per_rollout

    def request(self, n: int, block_index: int) -> AdmissionRequest:
        """What the controllers are asked about ``n`` samples of ``block_index`` starting now."""
        return AdmissionRequest(
            n=n,
            learner_version=self.version,
            in_flight=self.in_flight,
            batch_size=self.batch_size,
            block_index=block_index,
            expected_version=self.expected_version(block_index),
        )

    def try_acquire(self, n: int, block_index: int) -> Admission | None:
        """Admit block ``block_index`` of ``n`` samples now, or None (not its turn, or refused)."""
        if block_index in self.admitted:
            self.retries += 1
            return self.admitted[block_index]
        if n < 1:
            raise ValueError(f"n must be >= 1 sample, got {n}")
        if block_index < self.next_block:
            raise ValueError(
                f"block {block_index} was already admitted and its admission released; a block index is "
                f"used once per stream"
            )
        if block_index != self.next_block:
            return None  # blocks are admitted in stream order
        req = self.request(n, block_index)
        if not self.controller.admit(req):
            return None
        pin = getattr(self.controller, "behavior_version", None)
        behavior = pin(req) if callable(pin) else None
        if behavior is not None and not 0 <= behavior <= self.version:
            raise ValueError(
                f"behavior_version {behavior} for block {block_index} is not a published version "
                f"(0..{self.version}): a pinning controller must also refuse admission until it is"
            )
        admission = Admission(block_index, self.version, req.expected_version, behavior)
        self.admitted[block_index] = admission
        self.next_block += 1
        self.dispatched += n
        return admission

    def start(self, version: int) -> None:
        """The learner (re)starts at ``version`` with a new stream: block indices start at 0 again."""
        self.version = self.release_version = version
        self.released = 0
        self.next_block = 0
        self.admitted = {}

    def set_version(self, version: int) -> None:
        """The learner finished ``version`` optimizer steps (call before ``on_consumed``, so a block
        admitted with the released budget sees the new weights)."""
        if version < self.version:
            raise ValueError(f"version went back from {self.version} to {version}")
        self.version = version

    def on_consumed(self, n_trained: int, n_dropped: int) -> None:
        """One rollout batch was consumed: ``n_trained`` samples trained, ``n_dropped`` dropped."""
        if n_trained < 0 or n_dropped < 0:
            raise ValueError(f"counts must be >= 0, got n_trained={n_trained}, n_dropped={n_dropped}")
        if n_trained + n_dropped > self.in_flight:
            raise ValueError(
                f"on_consumed({n_trained}, {n_dropped}) releases more than the {self.in_flight} samples in "
                f"flight: every trained or dropped sample must have been admitted by try_acquire"
            )
        self.trained += n_trained
        self.dropped += n_dropped
        self.released += 1
        self.release_version = self.version
        done = self.released * self.blocks_per_rollout
        self.admitted = {i: a for i, a in self.admitted.items() if i >= done}

    def counters(self) -> dict[str, int]:
        """The budget's books: version, blocks and samples dispatched, admitted and released."""
        return {
            "version": self.version,
            "dispatched": self.dispatched,
            "trained": self.trained,
            "dropped": self.dropped,
            "lost": self.lost,
            "in_flight": self.in_flight,
            "retries": self.retries,
        }

    def metrics(self) -> dict[str, float]:
        """``counters`` as ``admission/*`` metrics."""
        return {f"admission/{k}": float(v) for k, v in self.counters().items()}

    def state_dict(self) -> dict[str, Any]:
        """The budget's books for a checkpoint (the PolicyStore restores them on resume)."""
        return {
            "batch_size": self.batch_size,
            "version": self.version,
            "dispatched": self.dispatched,
            "trained": self.trained,
            "dropped": self.dropped,
            "lost": self.lost,
            "retries": self.retries,
            "controller": self.controller.state_dict() if hasattr(self.controller, "state_dict") else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the books; samples in flight at save time count as lost (they are generated
        again), and the stream restarts at block 0 when the learner calls ``start``."""
        if state.get("batch_size", self.batch_size) != self.batch_size:
            raise ValueError(
                f"checkpoint admission state has batch_size={state.get('batch_size')} but this run has "
                f"batch_size={self.batch_size}: resume with the same train.batch_size"
            )
        self.dispatched = int(state["dispatched"])
        self.trained = int(state["trained"])
        self.dropped = int(state["dropped"])
        self.lost = self.dispatched - self.trained - self.dropped  # saved lost + saved in-flight
        self.retries = int(state.get("retries", 0))
        if state.get("controller") and hasattr(self.controller, "load_state_dict"):
            self.controller.load_state_dict(state["controller"])
        self.start(int(state["version"]))
