"""BoundedStaleness: the hard per-sample bound ``lag <= S`` (DESIGN.md section 2, spec 4.1).

Two mechanisms, because either alone is not enough (spec section 0.1):

- **admission**: a block may start only if the lag it will have when it is trained,
  ``expected_version - learner_version``, is at most S (blocks are admitted and consumed in
  stream order, so the version that will train a block is known when it starts; see
  ``asyncrl.controllers.admission``). With one optimizer step per rollout batch this is the
  AReaL/SkyRL capacity rule ``in_flight + n <= (S + 1) B``; with N mini-batch steps per batch
  it allows ``floor(S / N) + 1`` batches in flight at a batch boundary (``ceil(S / N) + 1`` during
  a batch's mini-batch steps, when the next batch may start). With S = 0 exactly one step of work is in
  flight (lock-step, synchronous on-policy).
- **consumption gate** (prime-rl/TRL): ``keep`` drops every sample whose head lag
  ``v_L - v_first`` exceeds S, group-atomically (a group's lag is the max over its members).
  This is what makes the bound strict for stragglers. It is meant to run on arrival *and*
  again at batch assembly, since a sample can age in the queue.

``mode="fixed"`` (``pipeline.lag_mode: fixed``, for studies) also pins every block's behavior
version to ``expected_version - S``: each batch after the first S is trained at exactly lag
S, whatever the machine's timing (``bound`` only guarantees ``<= S``).

**The one owner of the bound.** ``pipeline.max_lag`` is the bound's one declaration;
``BoundedStaleness.from_config(cfg)`` builds it (with ``pipeline.lag_mode`` and
``train.minibatches``), and every reader asks the object instead of the number: the controller
chain (``spec``), the PolicyStore (``kept_versions``), the stream's sizing (``batches_ahead``), the
learner (``synchronous``, ``kept_versions``) and the simulator. ``admissible`` / ``admissible_tokens``
state the rule per sample and per token; ``batches_in_flight`` what admission allows.

Drops are counted with a reason (``lag``: the sample itself was too old; ``group``: a member
of its group was), never silent. ``straggler="accept_and_log"`` keeps late samples and
counts them as ``staleness/violations`` instead (AReaL/SkyRL behaviour; voids the guarantee).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from asyncrl.configurable import check, field
from asyncrl.controllers.base import AdmissionRequest, SampleInfo
from asyncrl.controllers.factory import CONTROLLERS
from asyncrl.controllers.verdicts import DropCounter, group_max

Straggler = Literal["drop", "accept_and_log"]
LagMode = Literal["bound", "fixed"]


@dataclass(frozen=True)
class BoundedStalenessConfig:
    max_lag: int = field(2, help="S: max head lag (learner version - version of the first token); 0 = sync")
    straggler: Straggler = field(
        "drop", help="what happens to a sample with lag > S: drop it, or keep it and count a violation"
    )
    mode: LagMode = field(
        "bound",
        help="bound: lag <= S; fixed: every batch after the first S is generated exactly S versions back",
    )
    minibatches: int = field(
        1,
        help="N: optimizer steps per rollout batch (train.minibatches); sets the versions the PolicyStore "
        "keeps (fixed mode) and the rollout batches in flight",
    )

    def __post_init__(self) -> None:
        check(
            isinstance(self.max_lag, int) and self.max_lag >= 0,
            "max_lag",
            self.max_lag,
            "use 0 (synchronous) or a positive integer number of optimizer steps",
        )
        check(
            self.straggler in ("drop", "accept_and_log"),
            "straggler",
            self.straggler,
            "use 'drop' or 'accept_and_log'",
        )
        check(self.mode in ("bound", "fixed"), "mode", self.mode, "use 'bound' or 'fixed'")
        check(
            isinstance(self.minibatches, int) and self.minibatches >= 1,
            "minibatches",
            self.minibatches,
            "use an integer >= 1 (optimizer steps per rollout batch)",
        )


@CONTROLLERS.register("bounded_staleness")
class BoundedStaleness:
    """Admission at expected lag ``<= S`` plus a group-atomic consumption gate ``lag <= S``.

    Metrics cover the ``keep`` calls since the window was last reported (by ``metrics`` or
    ``after_step``), i.e. one learner step: ``staleness/lag_mean``,
    ``staleness/lag_max`` of kept samples, ``staleness/dropped`` and
    ``staleness/dropped/{lag,group}``, ``staleness/dropped_total`` (whole run),
    ``staleness/violations`` (accept_and_log only).
    """

    name = "bounded_staleness"
    Config = BoundedStalenessConfig

    def __init__(
        self, max_lag: int = 2, straggler: Straggler = "drop", mode: LagMode = "bound", minibatches: int = 1
    ) -> None:
        self.config = BoundedStalenessConfig(
            max_lag=max_lag, straggler=straggler, mode=mode, minibatches=minibatches
        )
        self.drops = DropCounter()
        self.violations_total = 0
        self._window: dict[str, float] = {}
        self._new_window = False

    @classmethod
    def from_config(cls, cfg: Any) -> BoundedStaleness:
        """The run's bound, built from ``pipeline.max_lag`` (its one declaration), ``pipeline.lag_mode``
        and ``train.minibatches`` of a ``RunConfig``: what plan, pipeline and learner ask."""
        return cls(cfg.pipeline.max_lag, mode=cfg.pipeline.lag_mode, minibatches=cfg.train.minibatches)

    def spec(self) -> tuple[str, dict[str, Any]]:
        """``(name, options)`` that rebuild this bound in another process (``build_chain``)."""
        return self.name, dataclasses.asdict(self.config)

    # --- the questions the rest of the code asks (DESIGN.md section 2) ------------------------------
    @property
    def max_lag(self) -> int:
        """S: the largest lag (optimizer steps) a trained sample, or token, may have."""
        return self.config.max_lag

    @property
    def synchronous(self) -> bool:
        """S = 0: lock-step, strictly on-policy (one step of work in flight)."""
        return self.config.max_lag == 0

    def admissible(self, lag: Any) -> Any:
        """Whether a lag (an int or an array of them) is within the bound: ``lag <= S``."""
        return lag <= self.config.max_lag

    def admissible_tokens(self, token_versions: Any, mask: Any, learner_version: int) -> np.ndarray:
        """[B] bool: every valid token of each row has lag ``learner_version - token_version <= S``
        (the per-token bound of in-flight updates; ``token_versions`` [B, T] int, ``mask`` [B, T] bool).
        Implied by the head-lag gate, since a row's tokens are no older than its first."""
        versions = np.where(np.asarray(mask, dtype=bool), np.asarray(token_versions), learner_version)
        return (self.admissible(learner_version - versions)).all(axis=1)

    @property
    def kept_versions(self) -> int:
        """Past weight versions the PolicyStore must keep fetchable besides the latest: a fixed-lag
        run generates up to ``S + N - 1`` versions back (N mini-batch steps per rollout batch)."""
        c = self.config
        return c.max_lag + c.minibatches if c.mode == "fixed" else 0

    @property
    def batches_in_flight(self) -> int:
        """Most rollout batches started-but-untrained at once: ``ceil(S / N) + 1`` (during a batch's
        mini-batch steps; ``floor(S / N) + 1`` at a batch boundary). N = 1: the capacity rule
        ``in_flight + n <= (S + 1) B``."""
        return -(-self.config.max_lag // self.config.minibatches) + 1

    @property
    def batches_ahead(self) -> int:
        """Rollout batches a stream must hold beyond the one training, for every N: ``S + 1``
        (>= ``batches_in_flight``)."""
        return self.config.max_lag + 1

    def fixed_lag_version(self, expected_version: int) -> int | None:
        """``fixed`` mode: the version a block trained at ``expected_version`` is generated with
        (exactly S back, never before version 0); None in ``bound`` mode (the latest)."""
        if self.config.mode != "fixed":
            return None
        return max(0, expected_version - self.config.max_lag)

    # --- the controller hooks -----------------------------------------------------------------------
    def admit(self, req: AdmissionRequest) -> bool:
        """Start the block only if it will be trained at lag <= S."""
        return bool(self.admissible(req.expected_lag))

    def behavior_version(self, req: AdmissionRequest) -> int | None:
        """``fixed`` mode: generate with the weights exactly S versions before the training version."""
        return self.fixed_lag_version(req.expected_version)

    def keep(self, info: SampleInfo, learner_version: int) -> np.ndarray:
        """[N] bool: True iff every member of the sample's group has head lag <= S."""
        if self._new_window:
            self.drops.reset_window()
            self._window = {}
            self._new_window = False
        lag = np.asarray(info.lag(learner_version), dtype=np.int64)
        if (lag < 0).any():
            raise ValueError(
                f"version_first > learner version {learner_version} for samples "
                f"{np.asarray(info.sample_id)[lag < 0][:5].tolist()}: "
                f"versions must come from the learner's counter"
            )
        own_ok = self.admissible(lag)
        group_ok = self.admissible(group_max(lag, info.group_id))
        if self.config.straggler == "accept_and_log":
            keep = np.ones_like(own_ok)
            n_viol = int((~own_ok).sum())
            self.violations_total += n_viol
            self._window["violations"] = self._window.get("violations", 0.0) + n_viol
        else:
            keep = group_ok
            self.drops.add("lag", int((~own_ok).sum()))
            self.drops.add("group", int((own_ok & ~group_ok).sum()))
        kept = lag[keep]
        if kept.size:
            n_prev = self._window.get("n_kept", 0.0)
            total = self._window.get("lag_sum", 0.0) + float(kept.sum())
            self._window["n_kept"] = n_prev + kept.size
            self._window["lag_sum"] = total
            self._window["lag_max"] = max(self._window.get("lag_max", 0.0), float(kept.max()))
        return keep

    def after_step(self, ctx: Any) -> None:
        self._new_window = True  # the next keep() starts the next step's window

    def metrics(self) -> dict[str, float]:
        self._new_window = True  # reported: the next keep() starts a new window
        out = self.drops.metrics("staleness")
        n = self._window.get("n_kept", 0.0)
        if n:
            out["staleness/lag_mean"] = self._window["lag_sum"] / n
            out["staleness/lag_max"] = self._window["lag_max"]
        if self.config.straggler == "accept_and_log":
            out["staleness/violations"] = self._window.get("violations", 0.0)
            out["staleness/violations_total"] = float(self.violations_total)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"drops": self.drops.state_dict(), "violations_total": self.violations_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drops.load_state_dict(state.get("drops", {}))
        self.violations_total = int(state.get("violations_total", 0))
        self._window = {}
