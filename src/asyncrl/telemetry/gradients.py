"""Gradient diagnostics: an estimator's gradient against the exact dense-KL gradient on the same batch.

Why: a sparse or sampled teacher cache makes an estimator cheap, and the question "what does it
cost?" is a question about gradients, not losses: a top-k estimator is biased (its expected
gradient is not the KL's), a Monte Carlo one is unbiased but noisy (variance ~ 1/m), and
staleness adds bias to both. This module measures that on real batches, Ray-free: the learner
calls ``GradientProbe`` every ``telemetry.grad_every`` steps *before* ``loss_step`` on the same
batch (the same weights), and the batch carries the teacher's full logits (``teacher_logits``,
added by the scoring stage to those blocks only, small vocabularies only).

Definitions, for one batch with the student's parameters θ (flattened):

- ``ĝ``: gradient of the estimator's loss (no controller token weights: the estimator alone);
- ``g``: gradient of the exact dense KL in the estimand's direction (``KL(p‖π_θ)`` for the
  forward estimators, ``KL(π_θ‖p)`` for the reverse ones), with the estimator's reduction
  (``token_mean`` or ``seq_mean``) over the same valid tokens;
- the batch is split into two halves A, B (even and odd rows); ``ĝ = w_A ĝ_A + w_B ĝ_B`` with
  ``w_h = n_h / (n_A + n_B)`` the halves' shares of the reduction count (exact for both
  reductions), so one forward/backward per half gives the full-batch and split-half gradients;
- ``d = ĝ − g`` (the estimator's error on this batch), ``d_h = ĝ_h − g_h``.

If the halves are independent with ``Var(x_h) ∝ 1/n_h``, then ``Var(w_A x_A + w_B x_B) =
w_A w_B E‖x_A − x_B‖²`` for any per-half vector ``x`` (trace of the covariance), which gives
unbiased one-batch estimates of:

- ``gradref/noise_rel = w_A w_B ‖d_A − d_B‖² / ‖g‖²``: the variance of the estimator's error
  (sampling noise of MC draws, plus how the bias varies between states), relative to ``‖g‖²``;
- ``gradref/bias_sq_rel = (‖d‖² − w_A w_B ‖d_A − d_B‖²) / ‖g‖²``: the squared systematic error
  ``‖E[d]‖²`` relative to ``‖g‖²`` (can be negative on one batch; average over steps);
- ``gradref/var_rel`` and ``gradref/ref_var_rel``: the same variance formula for ``ĝ`` and for
  ``g`` (state-sampling noise of a batch of this size, for scale);
- ``gradref/cos = cos(ĝ, g)`` and ``gradref/rel_err = ‖d‖ / ‖g‖`` (bias and noise together);
- ``gradref/norm_est``, ``gradref/norm_ref``: ``‖ĝ‖`` and ``‖g‖`` before clipping;
- ``kl/teacher_reverse``, ``kl/teacher_forward``: the exact ``KL(π_θ‖p)`` and ``KL(p‖π_θ)`` per
  valid token on the batch (the objective itself, on the student's own samples).

Per lag bucket (``bucket/<label>/grad_norm``): ``‖ĝ‖`` of the estimator's loss over that
bucket's samples alone (one more forward/backward per bucket when a batch spans several).

``GradientTrace`` is the per-step companion: ``grad/cos_prev = cos(g_t, g_{t−1})`` of the
gradients the optimizer actually applied (after controllers' transforms and clipping), the
consecutive-gradient cosine that gradient-alignment methods watch. ``LearnerGradients`` wires
both into the learner (rank 0, as configured).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.estimators.functional import forward_kl_dense, reverse_kl_dense
from asyncrl.estimators.token_loss import reduce_loss, reduction_count
from asyncrl.step import sample_info
from asyncrl.telemetry import names as N
from asyncrl.telemetry.staleness import LAG_BUCKETS, lag_bucket_index

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

__all__ = [
    "ESTIMANDS",
    "MAX_VOCAB",
    "GradientProbe",
    "GradientTrace",
    "LearnerGradients",
    "WithDenseLogits",
    "dense_reference_due",
    "estimand",
    "flat_grad",
]

Direction = Literal["forward", "reverse"]

#: the KL direction whose gradient each built-in estimator estimates (an estimator may instead
#: declare ``estimand = "forward" | "reverse"`` itself)
ESTIMANDS: dict[str, Direction] = {
    "forward_kl": "forward",
    "forward_kl_mc": "forward",
    "reverse_kl": "reverse",
    "reverse_kl_mc": "reverse",
    "reverse_kl_stratified": "reverse",
}
#: the largest vocabulary the dense reference accepts by default: the scoring stage ships
#: 4·V bytes per token for the diagnostic blocks (V = 4096: 16 KiB per token)
MAX_VOCAB = 4096
_EPS = 1e-30


def estimand(estimator: Any) -> Direction:
    """The KL direction ``estimator`` estimates: its ``estimand`` attribute or ``ESTIMANDS``.

    Raises ValueError for an estimator with no KL estimand (RL estimators, custom ones that
    do not declare it)."""
    declared = getattr(estimator, "estimand", None)
    name = getattr(estimator, "name", type(estimator).__name__)
    direction = declared if declared is not None else ESTIMANDS.get(name)
    if direction not in ("forward", "reverse"):
        raise ValueError(
            f"telemetry.grad_reference=dense compares an estimator's gradient with the exact KL's, but "
            f"estimator {name!r} estimates no known KL direction (built-in KL estimators: "
            f"{sorted(ESTIMANDS)}; a custom one declares estimand = 'forward' or 'reverse'); "
            f"set telemetry.grad_reference=none"
        )
    return direction


def dense_reference_due(block_index: int, *, every: int, workers: int, minibatches: int) -> bool:
    """Whether the scoring stage must add ``teacher_logits`` to a block: block ``b`` is rank
    ``b % W``'s share of rollout batch ``r = b // W``, which trains at versions ``rN .. rN+N−1``;
    the probe runs on rank 0 at versions divisible by ``every``."""
    if every < 1:
        raise ValueError(f"telemetry.grad_every must be >= 1, got {every}")
    if block_index % workers:
        return False
    first = (block_index // workers) * minibatches
    return any((first + i) % every == 0 for i in range(minibatches))


@dataclass(frozen=True)
class WithDenseLogits:
    """A teacher cache that also writes ``teacher_logits`` from the same teacher forward: what the
    scoring stage uses for the blocks the probe runs on (``dense_reference_due``)."""

    cache: Any

    @property
    def name(self) -> str:
        return f"{self.cache.name}+dense"

    def columns(self) -> tuple[str, ...]:
        return (*self.cache.columns(), R.TEACHER_LOGITS)

    def input_columns(self) -> tuple[str, ...]:
        return self.cache.input_columns()

    def build(self, teacher_logits: torch.Tensor, batch: Mapping[str, torch.Tensor], **draw: Any) -> dict:
        out = self.cache.build(teacher_logits, batch, **draw)
        out[R.TEACHER_LOGITS] = teacher_logits.float().contiguous()
        return out


def flat_grad(grads: Any) -> torch.Tensor:
    """Gradients (a sequence of tensors, None for unused parameters) as one float64 vector."""
    return torch.cat([g.detach().reshape(-1).double() for g in grads if g is not None])


#: the exact KLs to the teacher reported on every probed batch (mean per valid token)
_KL_VALUES = {N.KL_TEACHER_REVERSE: reverse_kl_dense, N.KL_TEACHER_FORWARD: forward_kl_dense}


def _dense_kl(direction: Direction) -> Any:
    return forward_kl_dense if direction == "forward" else reverse_kl_dense


@dataclass
class _Half:
    est: torch.Tensor  # estimator gradient, flat
    ref: torch.Tensor  # dense-KL gradient, flat
    n: float  # the reduction count (valid tokens or samples)
    kl_sums: dict[str, float] = field(default_factory=dict)  # metric key -> sum over valid tokens
    tokens: int = 0


@dataclass
class GradientProbe:
    """The dense-reference diagnostics of one batch (see the module docstring).

    ``model``: the student (unwrapped; the probe calls ``torch.autograd.grad``, so no ``.grad``
    is written and no DDP hook fires). ``temperature``: the sampling tau (the student's logits
    are divided by it, as ``loss_step`` does).
    """

    model: torch.nn.Module
    estimator: Any
    temperature: float = 1.0
    direction: Direction = field(init=False)
    aggregation: str = field(init=False)

    def __post_init__(self) -> None:
        self.direction = estimand(self.estimator)
        self.aggregation = getattr(getattr(self.estimator, "config", None), "aggregation", "token_mean")

    def __call__(
        self, batch: Mapping[str, Any], *, keep: np.ndarray | None = None, lags: np.ndarray | None = None
    ) -> dict[str, float]:
        """Metrics of one batch: record columns (numpy or torch) with ``teacher_logits``; ``keep``
        [B] restricts to the kept samples; ``lags`` [B] adds ``bucket/<label>/grad_norm``."""
        if R.TEACHER_LOGITS not in batch:
            raise ValueError(
                f"GradientProbe needs the teacher's full logits (column {R.TEACHER_LOGITS!r}); the scoring "
                f"stage adds them to the blocks the probe runs on when telemetry.grad_reference=dense"
            )
        tb = R.to_torch({k: v for k, v in batch.items() if k in R.COLUMNS})
        device = next(self.model.parameters()).device
        tb = {k: v.to(device) for k, v in R.trim_to_longest(tb).items()}
        rows = np.arange(len(tb[R.COMPLETION_MASK]))
        if keep is not None:
            rows = rows[np.asarray(keep, dtype=bool)]
        if len(rows) < 2:
            return {}
        halves = [self._half(tb, rows[0::2]), self._half(tb, rows[1::2])]
        out = _compare(halves)
        if lags is not None:
            out.update(self._bucket_norms(tb, rows, np.asarray(lags)[rows], halves))
        return out

    # -- pieces -----------------------------------------------------------------------------------
    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _logits(self, tb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logits = R.completion_logits(
            self.model, tb[R.PROMPT_IDS], tb[R.PROMPT_MASK], tb[R.COMPLETION_IDS], tb[R.COMPLETION_MASK]
        )
        return logits if self.temperature == 1.0 else logits / self.temperature

    def _half(self, tb: Mapping[str, torch.Tensor], rows: np.ndarray) -> _Half:
        idx = torch.as_tensor(rows, device=tb[R.COMPLETION_MASK].device)
        sub = {k: v.index_select(0, idx) for k, v in tb.items()}
        params = self._params()
        logits = self._logits(sub)
        mask = sub[R.COMPLETION_MASK].bool()
        est = self.estimator(logits, sub)
        teacher = torch.where(
            mask.unsqueeze(-1), sub[R.TEACHER_LOGITS], torch.zeros_like(sub[R.TEACHER_LOGITS])
        )
        ref_loss, _ = reduce_loss(
            _dense_kl(self.direction)(logits, teacher), mask, aggregation=self.aggregation
        )
        g_est = torch.autograd.grad(est.loss, params, retain_graph=True, allow_unused=True)
        g_ref = torch.autograd.grad(ref_loss, params, allow_unused=True)
        n = (
            float(est.normalizer)
            if getattr(est, "normalizer", None) is not None
            else float(reduction_count(mask, self.aggregation))
        )
        with torch.no_grad():  # the objective itself in both directions, per valid token
            z = logits.detach()
            sums = {key: float(fn(z, teacher)[mask].sum()) for key, fn in _KL_VALUES.items()}
        return _Half(_fill(g_est, params), _fill(g_ref, params), n, sums, int(mask.sum()))

    def _bucket_norms(
        self, tb: Mapping[str, torch.Tensor], rows: np.ndarray, lags: np.ndarray, halves: list[_Half]
    ) -> dict[str, float]:
        labels = lag_bucket_index(lags)
        present = np.unique(labels)
        if len(present) == 1:  # one bucket: its gradient is the whole batch's
            wa, wb = _weights(halves)
            g = wa * halves[0].est + wb * halves[1].est
            return {N.bucket_key(LAG_BUCKETS[int(present[0])], "grad_norm"): float(g.norm())}
        out = {}
        params = self._params()
        for b in present:
            idx = torch.as_tensor(rows[labels == b], device=tb[R.COMPLETION_MASK].device)
            sub = {k: v.index_select(0, idx) for k, v in tb.items()}
            loss = self.estimator(self._logits(sub), sub).loss
            g = _fill(torch.autograd.grad(loss, params, allow_unused=True), params)
            out[N.bucket_key(LAG_BUCKETS[int(b)], "grad_norm")] = float(g.norm())
        return out


def _fill(grads: Any, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Flat float64 gradient with zeros for parameters the loss does not reach."""
    return flat_grad([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])


def _weights(halves: list[_Half]) -> tuple[float, float]:
    total = halves[0].n + halves[1].n
    return halves[0].n / total, halves[1].n / total


def _compare(halves: list[_Half]) -> dict[str, float]:
    """The ``gradref/*`` figures from the two halves (module docstring)."""
    a, b = halves
    wa, wb = _weights(halves)
    g_est = wa * a.est + wb * b.est
    g_ref = wa * a.ref + wb * b.ref
    d = g_est - g_ref
    ref_sq = float(g_ref.dot(g_ref))
    scale = max(ref_sq, _EPS)
    w = wa * wb
    noise = w * float((a.est - a.ref - b.est + b.ref).square().sum())
    norm_est, norm_ref = float(g_est.norm()), math.sqrt(ref_sq)
    tokens = max(a.tokens + b.tokens, 1)
    kls = {key: (a.kl_sums.get(key, 0.0) + b.kl_sums.get(key, 0.0)) / tokens for key in a.kl_sums}
    return kls | {
        N.GRADREF_COS: float(g_est.dot(g_ref)) / max(norm_est * norm_ref, _EPS),
        N.GRADREF_REL_ERR: float(d.norm()) / max(norm_ref, _EPS),
        N.GRADREF_BIAS_SQ_REL: (float(d.dot(d)) - noise) / scale,
        N.GRADREF_NOISE_REL: noise / scale,
        "gradref/var_rel": w * float((a.est - b.est).square().sum()) / scale,
        "gradref/ref_var_rel": w * float((a.ref - b.ref).square().sum()) / scale,
        "gradref/norm_est": norm_est,
        "gradref/norm_ref": norm_ref,
    }


class GradientTrace:
    """``grad/cos_prev``: cosine between the gradient the optimizer applied at this step and at the
    previous step (after transforms and clipping; the direction is what matters). Keeps one
    float32 copy of the gradient."""

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None

    def __call__(self, grads: Any) -> dict[str, float]:
        g = torch.cat([x.detach().reshape(-1).float() for x in grads if x is not None])
        out = {}
        if self.prev is not None and self.prev.shape == g.shape:
            denom = float(g.norm()) * float(self.prev.norm())
            out[N.GRAD_COS_PREV] = float(g.dot(self.prev)) / denom if denom > 0 else math.nan
        self.prev = g.clone()
        return out


class LearnerGradients:
    """The learner's gradient telemetry, on rank 0 only (gradients are all-reduced): the probe
    (``telemetry.grad_reference: dense``) before a step and the trace (``telemetry.grad_cos_prev``)
    after it; each is off unless configured, both on the other ranks (``rank0=False``)."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, estimator: Any, *, rank0: bool) -> None:
        """``cfg``: the ``RunConfig`` (its ``telemetry`` switches, the sampling temperature)."""
        tel = cfg.telemetry
        dense = tel.grad_reference == "dense" and rank0
        self.probe = GradientProbe(model, estimator, cfg.sampling.temperature) if dense else None
        self.trace = GradientTrace() if tel.grad_cos_prev and rank0 else None

    def before(self, batch: Mapping[str, Any], keep: np.ndarray, version: int) -> dict[str, float]:
        """Before the step: the dense-reference diagnostics of a batch that carries the teacher's
        full logits (the scoring stage adds them every ``grad_every`` steps)."""
        if self.probe is None or R.TEACHER_LOGITS not in batch:
            return {}
        t0 = time.perf_counter()
        out = self.probe(batch, keep=keep, lags=sample_info(batch).lag(version))
        out["time/grad_probe_s"] = time.perf_counter() - t0
        return out

    def after(self, result: Any, backend: Any) -> dict[str, float]:
        """After a step: ``grad/cos_prev`` of the gradients the optimizer applied."""
        if self.trace is None or not result.stepped:
            return {}
        return self.trace(backend.gradients())
