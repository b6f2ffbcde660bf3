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
- the batch's rows are dealt round-robin into ``G`` groups (``GROUPS`` = 4; fewer only when the
  batch has fewer rows, never below 2): rows, not tokens, are the independent unit (tokens of one
  completion share its states and its draws). Group ``k`` has reduction count ``N_k`` (valid tokens
  or samples) and mean-reduced gradients ``ĝ_k``, ``g_k``; ``ĝ = Σ N_k ĝ_k / Σ N_k`` exactly (both
  reductions), so one forward/backward per group gives the whole-batch and per-group figures;
- ``A_k = N_k (ĝ_k − g_k)``: the group's error sum (over its tokens of the per-token gradient
  error); ``d = ĝ − g = Σ A_k / N`` with ``N = Σ N_k``.

If every token's error has expectation ``b`` and the groups are independent, ``E[A_k·A_j] =
N_k N_j ‖b‖²`` for ``k ≠ j`` whatever the within-group correlation or tails, so the cross-product

    B = (‖Σ_k A_k‖² − Σ_k ‖A_k‖²) / ((Σ_k N_k)² − Σ_k N_k²)

is an unbiased estimate of the squared bias ``‖b‖²`` (``cross_product_sq``); ``‖d‖² − B`` is then
an unbiased estimate of the trace of ``Var(d)``. One probe's ``B`` may be negative (it is an
unbiased estimate of a non-negative number, not a norm); a run or a cell reports the ratio of
sums over its probes, ``Σ B / Σ ‖g‖²`` (``ratio_of_sums``), never a mean of per-probe ratios.
Metrics of one probe:

- ``gradref/bias_sq`` = ``B`` and ``gradref/ref_sq`` = ``‖g‖²`` (what runs and cells sum);
  ``gradref/bias_sq_rel = B / ‖g‖²`` (this probe alone);
- ``gradref/noise_sq`` = ``‖d‖² − B`` and ``gradref/noise_rel`` = that over ``‖g‖²``: the variance
  of the estimator's error (sampling noise of MC draws, plus how the error varies between states);
- ``gradref/var_rel`` and ``gradref/ref_var_rel``: the same decomposition for ``ĝ`` and ``g``
  (state-sampling noise of a batch of this size, for scale);
- ``gradref/cos = cos(ĝ, g)`` and ``gradref/rel_err = ‖d‖ / ‖g‖`` (bias and noise together);
- ``gradref/norm_est``, ``gradref/norm_ref``: ``‖ĝ‖`` and ``‖g‖`` before clipping;
  ``gradref/groups``: ``G``;
- ``kl/teacher_reverse``, ``kl/teacher_forward``: the exact ``KL(π_θ‖p)`` and ``KL(p‖π_θ)`` per
  valid token on the batch (the objective itself, on the student's own samples).

In a run the bias of a stale estimator and the state noise move with θ. ``frozen_theta`` measures
at one θ and one fixed set of states instead: it redraws only the Monte Carlo columns ``R`` times
(``mc_redraw``), so the squared bias and the variance of different cache sizes (m draws, top-k)
are compared at equal θ and equal states (module ``frozen_theta`` docstring).

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
from collections.abc import Callable, Mapping, Sequence
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
    "GROUPS",
    "MAX_VOCAB",
    "FrozenTheta",
    "GradientProbe",
    "GradientTrace",
    "LearnerGradients",
    "WithDenseLogits",
    "cross_product_sq",
    "dense_reference_due",
    "estimand",
    "flat_grad",
    "frozen_theta",
    "mc_redraw",
    "ratio_of_sums",
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
#: independent row groups a probed batch is split into (``cross_product_sq``; >= 4 as a rule, 2 at least)
GROUPS = 4
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
    scoring stage uses for the blocks the probe runs on (``dense_reference_due``).

    The column holds ``z / τ`` with the wrapped cache's temperature τ (the rollout's): every cache
    keeps scores of ``softmax(z/τ)`` and the learner computes the student at τ, so the exact KL the
    probe compares against must be the one at τ too (raw ``z`` would make it a different objective
    and read as bias whenever τ ≠ 1)."""

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
        tau = float(getattr(self.cache, "temperature", 1.0))
        dense = teacher_logits.float()
        out[R.TEACHER_LOGITS] = (dense if tau == 1.0 else dense / tau).contiguous()
        return out


def flat_grad(grads: Any) -> torch.Tensor:
    """Gradients (a sequence of tensors, None for unused parameters) as one float64 vector."""
    return torch.cat([g.detach().reshape(-1).double() for g in grads if g is not None])


#: the exact KLs to the teacher reported on every probed batch (mean per valid token)
_KL_VALUES = {N.KL_TEACHER_REVERSE: reverse_kl_dense, N.KL_TEACHER_FORWARD: forward_kl_dense}


def _dense_kl(direction: Direction) -> Any:
    return forward_kl_dense if direction == "forward" else reverse_kl_dense


def cross_product_sq(sums: Sequence[torch.Tensor], counts: Sequence[float]) -> float:
    """``(‖Σ_k A_k‖² − Σ_k ‖A_k‖²) / ((Σ_k N_k)² − Σ_k N_k²)``: an unbiased estimate of ``‖b‖²``
    when the ``A_k`` are independent with ``E[A_k] = N_k b`` (module docstring).

    ``sums``: per group, the sum ``A_k`` of its units' vectors (flat, float64); ``counts``: ``N_k``
    (units per group; 1 each for independent replicates, e.g. redraws). Needs >= 2 groups. Only
    the cross terms ``A_k·A_j`` (k ≠ j) enter, so the units' variance, correlation within a group
    and tails cannot leak into it; its value may be negative (it estimates a square, it is not one).
    """
    if len(sums) != len(counts) or len(sums) < 2:
        raise ValueError(
            f"cross_product_sq needs >= 2 groups, one count each; got {len(sums)} sums, {len(counts)} counts"
        )
    total = torch.stack(list(sums)).sum(0)
    own = sum(float(a.dot(a)) for a in sums)
    n = float(sum(counts))
    pairs = n * n - sum(float(c) * float(c) for c in counts)
    if pairs <= 0:
        raise ValueError(
            f"cross_product_sq: counts {list(counts)} leave no pair of units in different groups"
        )
    return (float(total.dot(total)) - own) / pairs


def ratio_of_sums(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """``Σ numerators / Σ denominators`` over the finite pairs (NaN if none or the sum is 0): how runs
    and cells normalise ``gradref/bias_sq`` by ``gradref/ref_sq`` (a mean of per-probe ratios would
    weight each probe by its own noisy ``1/‖g‖²``)."""
    pairs = [(float(a), float(b)) for a, b in zip(numerators, denominators)]
    pairs = [(a, b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    den = sum(b for _, b in pairs)
    return sum(a for a, _ in pairs) / den if pairs and den > 0 else math.nan


@dataclass
class _Group:
    est: torch.Tensor  # estimator gradient, flat, mean-reduced over the group
    ref: torch.Tensor  # dense-KL gradient, flat, mean-reduced over the group
    n: float  # the reduction count (valid tokens or samples)
    kl_sums: dict[str, float] = field(default_factory=dict)  # metric key -> sum over valid tokens
    tokens: int = 0


@dataclass
class GradientProbe:
    """The dense-reference diagnostics of one batch (see the module docstring).

    ``model``: the student (unwrapped; the probe calls ``torch.autograd.grad``, so no ``.grad``
    is written and no DDP hook fires). ``temperature``: the sampling tau (the student's logits
    are divided by it, as ``loss_step`` does). ``groups``: row groups ``G`` (one forward/backward
    each; a batch of fewer rows uses one group per row).
    """

    model: torch.nn.Module
    estimator: Any
    temperature: float = 1.0
    groups: int = GROUPS
    direction: Direction = field(init=False)
    aggregation: str = field(init=False)

    def __post_init__(self) -> None:
        if self.groups < 2:
            raise ValueError(
                f"GradientProbe groups must be >= 2 (the cross-product needs pairs); got {self.groups}"
            )
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
        g = min(self.groups, len(rows))
        groups = [self._group(tb, rows[k::g]) for k in range(g)]
        out = _decompose(groups)
        if lags is not None:
            out.update(self._bucket_norms(tb, rows, np.asarray(lags)[rows], groups))
        return out

    # -- pieces -----------------------------------------------------------------------------------
    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _logits(self, tb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logits = R.completion_logits(
            self.model, tb[R.PROMPT_IDS], tb[R.PROMPT_MASK], tb[R.COMPLETION_IDS], tb[R.COMPLETION_MASK]
        )
        return logits if self.temperature == 1.0 else logits / self.temperature

    def _teacher(self, tb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The teacher's logits with padded positions zeroed (they are masked out of every sum)."""
        mask = tb[R.COMPLETION_MASK].bool()
        return torch.where(mask.unsqueeze(-1), tb[R.TEACHER_LOGITS], torch.zeros_like(tb[R.TEACHER_LOGITS]))

    def _reference_loss(
        self, logits: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The exact dense KL in the estimator's direction, reduced as the estimator reduces its loss."""
        loss, _ = reduce_loss(_dense_kl(self.direction)(logits, teacher), mask, aggregation=self.aggregation)
        return loss

    def _group(self, tb: Mapping[str, torch.Tensor], rows: np.ndarray) -> _Group:
        idx = torch.as_tensor(rows, device=tb[R.COMPLETION_MASK].device)
        sub = {k: v.index_select(0, idx) for k, v in tb.items()}
        params = self._params()
        logits = self._logits(sub)
        mask = sub[R.COMPLETION_MASK].bool()
        est = self.estimator(logits, sub)
        teacher = self._teacher(sub)
        ref_loss = self._reference_loss(logits, teacher, mask)
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
        return _Group(_fill(g_est, params), _fill(g_ref, params), n, sums, int(mask.sum()))

    def _bucket_norms(
        self, tb: Mapping[str, torch.Tensor], rows: np.ndarray, lags: np.ndarray, groups: list[_Group]
    ) -> dict[str, float]:
        labels = lag_bucket_index(lags)
        present = np.unique(labels)
        if len(present) == 1:  # one bucket: its gradient is the whole batch's
            g = _pooled(groups, "est")
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


def _pooled(groups: Sequence[_Group], which: str) -> torch.Tensor:
    """The whole batch's mean-reduced gradient ``Σ N_k x_k / Σ N_k`` from the groups' (``est``/``ref``)."""
    n = sum(gr.n for gr in groups)
    return sum(getattr(gr, which) * (gr.n / n) for gr in groups)


def _decompose(groups: Sequence[_Group]) -> dict[str, float]:
    """The ``gradref/*`` figures from the row groups (module docstring)."""
    counts = [gr.n for gr in groups]
    g_est, g_ref = _pooled(groups, "est"), _pooled(groups, "ref")
    d = g_est - g_ref
    ref_sq = float(g_ref.dot(g_ref))
    scale = max(ref_sq, _EPS)

    def split(vecs: list[torch.Tensor], mean: torch.Tensor) -> tuple[float, float]:
        # (‖E x‖² estimate, trace Var(mean) estimate) from the groups' sums N_k x_k
        sq = cross_product_sq([v * c for v, c in zip(vecs, counts)], counts)
        return sq, float(mean.dot(mean)) - sq

    bias_sq, noise = split([gr.est - gr.ref for gr in groups], d)
    _, var_est = split([gr.est for gr in groups], g_est)
    _, var_ref = split([gr.ref for gr in groups], g_ref)
    norm_est, norm_ref = float(g_est.norm()), math.sqrt(ref_sq)
    tokens = max(sum(gr.tokens for gr in groups), 1)
    kls = {key: sum(gr.kl_sums.get(key, 0.0) for gr in groups) / tokens for key in groups[0].kl_sums}
    return kls | {
        N.GRADREF_COS: float(g_est.dot(g_ref)) / max(norm_est * norm_ref, _EPS),
        N.GRADREF_REL_ERR: float(d.norm()) / max(norm_ref, _EPS),
        N.GRADREF_BIAS_SQ: bias_sq,
        N.GRADREF_REF_SQ: ref_sq,
        N.GRADREF_NOISE_SQ: noise,
        N.GRADREF_BIAS_SQ_REL: bias_sq / scale,
        N.GRADREF_NOISE_REL: noise / scale,
        "gradref/var_rel": var_est / scale,
        "gradref/ref_var_rel": var_ref / scale,
        "gradref/norm_est": norm_est,
        "gradref/norm_ref": norm_ref,
        N.GRADREF_GROUPS: float(len(groups)),
    }


# --- frozen θ: bias and variance at one θ and fixed states, over redraws of the MC columns ----------------
Redraw = Callable[[int], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class FrozenTheta:
    """One estimator at one θ and one fixed set of states (``frozen_theta``).

    ``d_r = ĝ_r − g`` is the error of redraw ``r`` (same θ, same states, same teacher; only the Monte
    Carlo columns redrawn): ``bias_sq`` estimates ``‖E_r[d_r]‖²`` (``cross_product_sq`` over the
    redraws, unbiased; ``‖d‖²`` itself when nothing is redrawn), ``var`` the trace of ``Var_r(d_r)``
    (the Monte Carlo variance at these states, ``Σ‖d_r − d̄‖² / (R − 1)``; 0 when nothing is redrawn),
    ``ref_sq`` = ``‖g‖²``. At fixed states ``E_r[d_r]`` is the estimator's bias averaged over these
    states: 0 for an unbiased estimator whatever the states, the top-k truncation's or a stale
    advantage's systematic error otherwise."""

    bias_sq: float
    var: float
    ref_sq: float
    redraws: int
    cos: float  # cos(mean over redraws of ĝ_r, g)

    @property
    def bias_sq_rel(self) -> float:
        return self.bias_sq / max(self.ref_sq, _EPS)

    @property
    def var_rel(self) -> float:
        return self.var / max(self.ref_sq, _EPS)

    def as_dict(self) -> dict[str, float]:
        return {
            "bias_sq": self.bias_sq,
            "var": self.var,
            "ref_sq": self.ref_sq,
            "redraws": float(self.redraws),
            "cos": self.cos,
            "bias_sq_rel": self.bias_sq_rel,
            "var_rel": self.var_rel,
        }


def frozen_theta(
    model: torch.nn.Module,
    estimator: Any,
    states: Mapping[str, Any],
    redraw: Redraw | None = None,
    *,
    redraws: int = 1,
    temperature: float = 1.0,
) -> FrozenTheta:
    """Bias and Monte Carlo variance of ``estimator``'s gradient at the model's current θ and the fixed
    ``states`` (prompt/completion columns, ``teacher_logits``, and whatever cache columns do not
    change between redraws, e.g. top-k), redrawing the Monte Carlo columns ``redraws`` times.

    ``redraw(r)`` returns redraw ``r``'s columns (``mc_redraw`` builds one from a proposal and the
    teacher); None: the estimator is deterministic given ``states`` (top-k, dense) and one
    evaluation is exact (``redraws`` must be 1). Same reference and reduction as ``GradientProbe``.
    Use it on a tabular model in tests and on a run's checkpoint (load the weights, sample fixed
    states once, then compare m and k at equal θ: ``scripts/frozen_theta.py``)."""
    if redraw is None and redraws != 1:
        raise ValueError(
            "frozen_theta: without a redraw function the estimate is deterministic; use redraws=1"
        )
    if redraw is not None and redraws < 2:
        raise ValueError(f"frozen_theta: redraws must be >= 2 to separate bias from variance; got {redraws}")
    probe = GradientProbe(model, estimator, temperature)
    device = next(model.parameters()).device
    cols0 = R.to_torch({k: v for k, v in states.items() if k in R.COLUMNS})
    base = {k: v.to(device) for k, v in cols0.items()}
    # θ and the states are fixed, so the student's logits and the dense reference are too: one forward
    # and one reference backward, then one backward of the estimator's loss per redraw of its columns
    params = probe._params()
    logits = probe._logits(base)
    ref_loss = probe._reference_loss(logits, probe._teacher(base), base[R.COMPLETION_MASK].bool())
    ref = _fill(torch.autograd.grad(ref_loss, params, retain_graph=True, allow_unused=True), params)
    errors, ests = [], []
    for r in range(redraws):
        cols = dict(base)
        if redraw is not None:
            cols.update({k: v.to(device) for k, v in R.to_torch(dict(redraw(r))).items()})
        loss = probe.estimator(logits, cols).loss
        est = _fill(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True), params)
        errors.append(est - ref)
        ests.append(est)
    ref_sq = float(ref.dot(ref))
    mean_est = torch.stack(ests).mean(0)
    cos = float(mean_est.dot(ref)) / max(float(mean_est.norm()) * math.sqrt(ref_sq), _EPS)
    if redraw is None:
        return FrozenTheta(float(errors[0].dot(errors[0])), 0.0, ref_sq, 1, cos)
    total = torch.stack(errors).sum(0)
    own = sum(float(e.dot(e)) for e in errors)
    var = (own - float(total.dot(total)) / redraws) / (redraws - 1)
    return FrozenTheta(cross_product_sq(errors, [1.0] * redraws), var, ref_sq, redraws, cos)


def mc_redraw(
    proposal_logprobs: torch.Tensor,
    teacher_logits: torch.Tensor,
    m: int,
    *,
    source: Literal["behavior", "teacher"] = "behavior",
    seed: int = 0,
) -> Redraw:
    """A ``frozen_theta`` redraw: ``m`` fresh i.i.d. draws per position, seeded by ``(seed, r)``.

    ``source="behavior"``: draws from ``proposal_logprobs`` [B, T, V] (log π_b at the fixed states:
    the current student's for an on-policy probe, an older checkpoint's for a stale one) into
    ``mc_ids``, ``mc_behavior_logprobs`` and ``teacher_mc_logprobs`` (the ``behavior_mc`` cache);
    ``source="teacher"``: draws from the teacher into ``teacher_mc_ids``/``teacher_mc_logprobs``
    (``forward_kl_mc``; ``proposal_logprobs`` unused). All m columns are fresh draws (in a rollout
    column 0 is the generated token, which is part of the state here): the per-state expectation
    is the same."""
    if m < 1:
        raise ValueError(f"mc_redraw: m must be >= 1; got {m}")
    teacher_lp = torch.log_softmax(teacher_logits.double(), -1)
    lp = teacher_lp if source == "teacher" else proposal_logprobs.double()
    B, T, V = lp.shape

    def draw(r: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(r))
        probs = lp.exp().reshape(B * T, V).cpu()
        ids = torch.multinomial(probs, m, replacement=True, generator=gen).reshape(B, T, m).to(lp.device)
        at_teacher = teacher_lp.gather(-1, ids)
        if source == "teacher":
            return {R.TEACHER_MC_IDS: ids, R.TEACHER_MC_LOGPROBS: at_teacher}
        return {R.MC_IDS: ids, R.MC_BEHAVIOR_LOGPROBS: lp.gather(-1, ids), R.TEACHER_MC_LOGPROBS: at_teacher}

    return draw


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
