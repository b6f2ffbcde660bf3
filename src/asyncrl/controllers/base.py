"""The StalenessController protocol: every point where a run reacts to staleness.

A controller may act at any of these points; each hook is optional (a missing hook is a
no-op, see ``chain``). In the order they run:

1. ``admit(req)``: producer side, inside the coordinator actor. May a rollout of
   ``req.n`` samples start now? (AND across controllers.) Optionally
   ``behavior_version(req)``: the weights version the block must be generated with (None =
   the latest; at most one controller may pin).
2. ``keep(info, learner_version)``: consumption gate on arriving samples, [N] bool.
   Must be group-atomic. (AND.)
3. ``token_weights(ctx)``: detached per-token loss weights [B, T]. (Product.)
4. ``transform_gradient(grads, ctx)``: in place, after the DP all-reduce and before
   gradient clipping. (Applied in chain order.)
5. ``lr_scale(ctx)``: multiplicative LR factor for this one step; the learner sets
   ``lr = base_lr * prod(scales)``, steps, then restores the scheduled LR. (Product.) A
   product of exactly 0 takes no optimizer step: the weights *and* the optimizer state stay
   as they were (with AdamW an ``lr = 0`` step would still move the moments), the learner
   version still advances (``lr/applied`` = 0 says so). This is how a controller skips a step.
6. ``transform_update(updates, ctx)``: in place on this step's parameter updates
   ``new - old`` (after ``optimizer.step()``, so in the optimizer's update direction, e.g.
   AdamW's); ``asyncrl.step.loss_step`` writes ``old + updates`` back. (Applied in chain
   order.) Costs one copy of the weights per step, only when a controller implements it.
7. ``after_step(ctx)``: bookkeeping after the step; ``ctx.lr_applied`` holds the LR actually
   applied (the scheduled LR times the product of every controller's scale).
8. ``metrics()``: floats for the last step, slash-namespaced.
9. ``state_dict()`` / ``load_state_dict(d)``: everything needed to resume.

Optional attributes, read when a run is composed (``asyncrl.step.check_composition`` and the
backend checks):

- ``importance_level``: a controller whose ``token_weights`` are importance weights
  ``π_θ/π_b`` (``truncated_is``) says at which level it forms them (``token``, ``sequence``,
  ``geometric``), so that an estimator that already carries ``π_θ/π_b`` is anchored on
  ``π_prox`` instead (decoupled PPO) or the pairing is refused.
- ``active_fraction()``: the fraction of what the controller acts on that it changed at the last
  step, in [0, 1] (tokens it reweighted, samples it dropped, or 1/0 for a step whose LR or
  gradient it changed), or None; ``chain`` logs it as ``active/<name>`` (its mean over steps is
  the controller's acting fraction over a run). A ``keep``-only controller needs none: the chain
  logs the fraction of the step's samples it dropped.
- ``transforms_gradients`` / ``transforms_updates``: whether ``transform_gradient`` /
  ``transform_update`` change anything (default: whether the hook exists). Both need the full,
  unpartitioned gradients or weights on every rank, so ZeRO backends refuse them.

Controllers are pure functions of (config, step context, their own explicit state). They
must not read the wall clock except for metrics, and all randomness is seeded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@dataclass(frozen=True)
class AdmissionRequest:
    """A generator asks to start the ``n`` samples (whole groups) of input block ``block_index``.

    Blocks are admitted in stream order and consumed in the same order, so the learner version
    at which this block will be trained is known now: ``expected_version`` (assuming every
    batch before it takes its optimizer steps). ``expected_version - learner_version`` is the
    lag the block will have if it starts now.
    """

    n: int
    learner_version: int
    #: samples started but not yet trained or dropped (not counting this request)
    in_flight: int
    #: samples the learner consumes per rollout batch (B)
    batch_size: int
    #: position of the block in the prompt stream (0, 1, 2, ... since the stream (re)started)
    block_index: int
    #: learner version when this block is first trained (see ``AdmissionBudget``)
    expected_version: int

    @property
    def expected_lag(self) -> int:
        """The lag this block will have at consumption if it is generated now."""
        return self.expected_version - self.learner_version


@dataclass(frozen=True)
class SampleInfo:
    """Per-sample bookkeeping at consumption; all arrays have length N."""

    sample_id: np.ndarray
    group_id: np.ndarray
    version_first: np.ndarray
    version_last: np.ndarray

    def lag(self, learner_version: int) -> np.ndarray:
        """Head lag: learner version minus the version of the sample's first token."""
        return learner_version - self.version_first


@dataclass
class StepContext:
    """What the learner knows at one optimizer step, after the forward pass.

    Per-token tensors are local to this DP rank and detached. ``seq_log_ratio`` and
    ``lags_global`` are gathered over all DP ranks so that batch statistics (ESS, max lag)
    and therefore LR scales are identical on every rank.
    """

    step: int  # optimizer steps applied so far == learner version v
    base_lr: float  # scheduled LR for this step
    mask: torch.Tensor  # [B, T] bool
    logprobs: torch.Tensor  # [B, T] log pi_theta(y_t), detached
    behavior_logprobs: torch.Tensor  # [B, T] log pi_b(y_t)
    token_versions: torch.Tensor  # [B, T] int
    lags: torch.Tensor  # [B] int, head lag of each local sample
    group_ids: torch.Tensor  # [B] int
    seq_log_ratio: torch.Tensor  # [N_global] sum_t (log pi_theta - log pi_b), all ranks
    lags_global: torch.Tensor  # [N_global] int, all ranks
    world_size: int = 1
    rank: int = 0
    #: the LR the optimizer step used (base_lr * the chain's scale; 0 = no step); set after the
    #: step, before ``after_step``, so a controller can record what was actually applied
    lr_applied: float | None = None

    @property
    def learner_version(self) -> int:
        return self.step

    @classmethod
    def local(
        cls,
        *,
        step: int,
        base_lr: float,
        mask: torch.Tensor,
        logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        lags: torch.Tensor | Sequence[int],
        token_versions: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> StepContext:
        """A single-process (world_size 1) context: ``seq_log_ratio`` and ``lags_global`` are
        this process's own. For users' own loops and tests; the learner gathers them over DP
        ranks instead. ``token_versions`` defaults to ``step - lag`` for every token."""
        mask = mask.bool()
        lags = torch.as_tensor(lags, dtype=torch.long, device=mask.device)
        if token_versions is None:
            token_versions = (step - lags)[:, None].expand(mask.shape)
        if group_ids is None:
            group_ids = torch.arange(mask.shape[0], device=mask.device)
        diff = logprobs.detach() - behavior_logprobs.detach()
        log_ratio = torch.where(mask, diff, torch.zeros_like(diff))
        return cls(
            step=step,
            base_lr=base_lr,
            mask=mask,
            logprobs=logprobs.detach(),
            behavior_logprobs=behavior_logprobs.detach(),
            token_versions=token_versions,
            lags=lags,
            group_ids=group_ids,
            seq_log_ratio=log_ratio.sum(-1),
            lags_global=lags,
        )

    @property
    def log_ratio(self) -> torch.Tensor:
        """Token log-ratio l_t = log pi_theta - log pi_b, zero at padding."""
        return torch.where(self.mask, self.logprobs - self.behavior_logprobs, torch.zeros_like(self.logprobs))


@runtime_checkable
class StalenessController(Protocol):
    """Structural type of a controller. Implement any subset of the hooks below plus ``name``;
    ``chain`` and ``as_controller`` supply no-ops for the rest."""

    name: str

    def admit(self, req: AdmissionRequest) -> bool:
        """Admission: may the block ``req`` start generating now? (the PolicyStore asks)"""
        ...

    def behavior_version(self, req: AdmissionRequest) -> int | None:
        """The weights version an admitted block must be generated with, or None: the latest."""
        ...

    def keep(self, info: SampleInfo, learner_version: int) -> np.ndarray:
        """Consumption gate: a bool [N] mask of the samples to train (the rest are dropped, counted)."""
        ...

    def token_weights(self, ctx: StepContext) -> torch.Tensor | None:
        """Detached per-token loss weights [B, T] (multiplied across a chain), or None: all 1."""
        ...

    def transform_gradient(self, grads: Sequence[torch.Tensor], ctx: StepContext) -> None:
        """Change the full gradients in place, after backward and before clipping."""
        ...

    def lr_scale(self, ctx: StepContext) -> float:
        """Factor on the scheduled LR for this step only (0: no optimizer step)."""
        ...

    def transform_update(self, updates: Sequence[torch.Tensor], ctx: StepContext) -> None:
        """Change the optimizer's applied update (new minus old weights) in place, after the step."""
        ...

    def after_step(self, ctx: StepContext) -> None:
        """Update the controller's own state once the step is taken."""
        ...

    def metrics(self) -> dict[str, float]:
        """The controller's slash-namespaced metrics of the last step; reading them changes no state."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The controller's state, JSON-serialisable, for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state ``state_dict`` returned."""
        ...


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[list[float]]:
    """Apply ``lr * scale`` to every param group for one ``optimizer.step()``, then restore.

    Restoring (rather than letting the scheduler overwrite) keeps the schedule's state
    identical to a run without controllers (spec 7.3 e). Yields the applied LRs.
    """
    saved = [g["lr"] for g in optimizer.param_groups]
    try:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr * scale
        yield [g["lr"] for g in optimizer.param_groups]
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr
