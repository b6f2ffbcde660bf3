"""GradientAlignment (GAC): damp progress along the previous step's direction (arXiv 2603.01501, spec 4.4).

Asynchronous training shows persistently high cosine between consecutive gradients: a stale
batch still carries the old policy's signal and keeps pushing along the direction already
taken (an unconfigured momentum that overshoots); synchronous training gives near-orthogonal
consecutive gradients. With ``g`` this step's direction, the reference ``r`` = the previous
step's (post-transform) direction and ``c = cos(g, r)``, GAC acts only when ``c > tau`` and the
batch max lag is ``>= min_lag``:

- ``cap``: shrink the component along ``r_hat`` so that ``cos(g', r) = tau`` exactly; the
  orthogonal part is unchanged.
- ``project``: ``g' = g - lam <g, r_hat> r_hat``.
- ``skip``: take no optimizer step (``lr_scale`` returns 0: the weights *and* the optimizer
  state stay as they were; the reference is kept). Decided from the gradient, before the step.

``apply_to`` says which direction ``g`` is:

- ``grad`` (default): the raw gradient, after the DP all-reduce and before grad-norm clipping
  (``transform_gradient``). With AdamW this barely changes the step: Adam's moments and its
  per-coordinate normalisation come after, so the cosine between consecutive *updates* moves
  little (measured in the unit tests).
- ``update``: the optimizer's update ``new - old`` after the step (``transform_update``), so
  the cap holds for the step actually taken: ``cos(update, previous update) <= tau``. The
  moments still see the raw gradient. ``skip`` is decided before the step, so it needs ``grad``.

Low or negative cosine is never touched (this is not PCGrad). The decision needs only
``<g, r>``, ``|g|^2``, ``|r|^2``: with ``sharded=True`` (ZeRO/FSDP) these three numbers are
all-reduced, so every shard applies the same ``g' = scale_g g + coef_r r``. Costs one copy of
the gradient (``update``: one more of the weights, taken by ``loss_step``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from asyncrl.configurable import check, field
from asyncrl.controllers.base import StepContext
from asyncrl.controllers.factory import CONTROLLERS
from asyncrl.controllers.functional import AlignMode, alignment_from_dots

Ref = Literal["prev", "ema"]
ApplyTo = Literal["grad", "update"]


@dataclass(frozen=True)
class GradientAlignmentConfig:
    tau: float = field(0.5, help="cosine threshold: act only when cos(g, r) > tau; in (-1, 1)")
    mode: AlignMode = field(
        "cap", help="cap: cos(g', r) = tau; project: remove lam of the r component; skip: zero g"
    )
    lam: float = field(1.0, help="fraction of the r component removed in project mode")
    min_lag: int = field(1, help="act only if the batch max lag >= min_lag (1 keeps the sync path untouched)")
    ref: Ref = field("prev", help="reference: prev = last step's gradient, ema = EMA of past gradients")
    beta: float = field(0.9, help="EMA factor for ref=ema")
    sharded: bool = field(False, help="gradients are sharded across ranks (ZeRO/FSDP): all-reduce the dots")
    apply_to: ApplyTo = field(
        "grad",
        help="grad: act on the raw gradient before the optimizer; update: on the optimizer's update "
        "(new - old weights) after it",
    )

    def __post_init__(self) -> None:
        check(-1 < self.tau < 1, "tau", self.tau, "use a cosine threshold in (-1, 1), e.g. 0.5")
        check(
            not (self.mode == "skip" and self.apply_to == "update"),
            "apply_to",
            self.apply_to,
            "mode='skip' decides before the optimizer step, from the gradient: use apply_to='grad' "
            "(or mode='cap'/'project' with apply_to='update')",
        )
        check(0 <= self.lam <= 1, "lam", self.lam, "use a value in [0, 1] (1 = remove the whole component)")
        check(self.min_lag >= 0, "min_lag", self.min_lag, "use an integer >= 0")
        check(0 <= self.beta < 1, "beta", self.beta, "use a value in [0, 1)")


@CONTROLLERS.register("gradient_alignment")
class GradientAlignment:
    """GAC on the gradient or the optimizer's update. Metrics: ``gac/cos_prev``, ``gac/active``,
    ``gac/skipped``, ``gac/par_frac_removed`` (1 - a'/a), ``gac/grad_norm_pre``,
    ``gac/grad_norm_post`` (norms of the direction acted on: gradient or update)."""

    name = "gradient_alignment"
    Config = GradientAlignmentConfig

    def __init__(
        self,
        tau: float = 0.5,
        mode: AlignMode = "cap",
        lam: float = 1.0,
        min_lag: int = 1,
        ref: Ref = "prev",
        beta: float = 0.9,
        sharded: bool = False,
        apply_to: ApplyTo = "grad",
    ) -> None:
        self.config = GradientAlignmentConfig(
            tau=tau,
            mode=mode,
            lam=lam,
            min_lag=min_lag,
            ref=ref,
            beta=beta,
            sharded=sharded,
            apply_to=apply_to,
        )
        self.reference: list[torch.Tensor] | None = None
        self.n_active = 0
        self._skip = False
        self._metrics: dict[str, float] = {}

    @property
    def transforms_gradients(self) -> bool:
        return self.config.apply_to == "grad"

    @property
    def transforms_updates(self) -> bool:
        return self.config.apply_to == "update"

    def _dots(self, grads: Sequence[torch.Tensor]) -> tuple[float, float, float]:
        assert self.reference is not None
        device = self.reference[0].device if self.reference else torch.device("cpu")
        acc = torch.zeros(3, dtype=torch.float64, device=device)  # NCCL reduces CUDA tensors only
        for g, r in zip(grads, self.reference):
            gf = g.detach().reshape(-1).to(r.dtype)
            rf = r.reshape(-1)
            acc += torch.stack([torch.dot(gf, rf), torch.dot(gf, gf), torch.dot(rf, rf)]).double()
        if self.config.sharded:
            import torch.distributed as dist

            dist.all_reduce(acc, op=dist.ReduceOp.SUM)
        return float(acc[0]), float(acc[1]), float(acc[2])

    def _check(self, grads: Sequence[torch.Tensor]) -> None:
        assert self.reference is not None
        shapes = [tuple(g.shape) for g in grads]
        ref_shapes = [tuple(r.shape) for r in self.reference]
        if shapes != ref_shapes:
            raise ValueError(
                f"GradientAlignment got gradients of shapes {shapes[:4]}... but its reference has "
                f"{ref_shapes[:4]}...: pass the same parameter list (in the same order) every step"
            )

    @torch.no_grad()
    def _update_reference(self, grads: Sequence[torch.Tensor]) -> None:
        if self.reference is None:
            self.reference = [
                g.detach().to(torch.promote_types(g.dtype, torch.float32)).clone() for g in grads
            ]
            return
        for r, g in zip(self.reference, grads):
            if self.config.ref == "prev":
                r.copy_(g)
            else:
                r.mul_(self.config.beta).add_(g.to(r.dtype), alpha=1 - self.config.beta)

    def transform_gradient(self, grads: Sequence[torch.Tensor], ctx: StepContext) -> None:
        """``apply_to='grad'``: in place on ``grads`` (the ``.grad`` tensors, after the DP all-reduce)."""
        self._skip = False
        if self.config.apply_to == "grad":
            self._align(grads, ctx)

    def lr_scale(self, ctx: StepContext) -> float:
        """0 when ``skip`` acted on this step's gradient (no optimizer step), else 1."""
        return 0.0 if self._skip else 1.0

    def transform_update(self, updates: Sequence[torch.Tensor], ctx: StepContext) -> None:
        """``apply_to='update'``: in place on this step's parameter updates ``new - old``."""
        if self.config.apply_to == "update":
            self._align(updates, ctx)

    @torch.no_grad()
    def _align(self, grads: Sequence[torch.Tensor], ctx: StepContext) -> None:
        grads = list(grads)
        if self.reference is None:
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
            self._metrics = {
                "gac/active": 0.0,
                "gac/skipped": 0.0,
                "gac/grad_norm_pre": norm,
                "gac/grad_norm_post": norm,
            }
            self._update_reference(grads)
            return
        self._check(grads)
        dot, g_sq, r_sq = self._dots(grads)
        cfg = self.config
        al = alignment_from_dots(dot, g_sq, r_sq, tau=cfg.tau, mode=cfg.mode, lam=cfg.lam)
        lag_max = int(ctx.lags_global.max()) if ctx.lags_global.numel() else 0
        act = al.active and lag_max >= cfg.min_lag
        post_sq = g_sq
        skip = act and al.scale_g == 0.0
        if act:
            if skip:  # no optimizer step: lr_scale returns 0 (the gradient itself is left alone)
                self._skip = True
            else:
                for g, r in zip(grads, self.reference):
                    g.add_(r.to(g.dtype), alpha=al.coef_r)
            # |g'|^2 = |g|^2 - a^2 + a'^2 (the orthogonal part is unchanged)
            post_sq = 0.0 if skip else max(g_sq - al.a**2 + al.a_new**2, 0.0)
            self.n_active += 1
        self._metrics = {
            "gac/cos_prev": al.cos,
            "gac/active": float(act),
            "gac/skipped": float(skip),
            "gac/grad_norm_pre": math.sqrt(g_sq),
            "gac/grad_norm_post": math.sqrt(post_sq),
            "gac/active_total": float(self.n_active),
        }
        if act and al.a != 0:
            self._metrics["gac/par_frac_removed"] = 1.0 - al.a_new / al.a
        if not skip:  # a skipped step keeps its reference
            self._update_reference(grads)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def active_fraction(self) -> float | None:
        """1 if GAC changed (or skipped) the last step's direction, else 0 (``gac/active``)."""
        return self._metrics.get("gac/active")

    def state_dict(self) -> dict[str, Any]:
        ref = None if self.reference is None else [r.clone() for r in self.reference]
        return {"reference": ref, "n_active": self.n_active}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ref = state.get("reference")
        self.reference = None if ref is None else [torch.as_tensor(r).clone() for r in ref]
        self.n_active = int(state.get("n_active", 0))
