"""Pure OPD and RL loss math: per-position losses from aligned student logits and finite teacher scores.

Every function here is a plain tensor function, usable in any training loop. Inputs are
aligned to completion tokens (``student_logits[b, t]`` scored ``completion_ids[b, t]``, see
``asyncrl.records``); contract functions return the per-position loss ``[B, T]``, unreduced
and unmasked, differentiable w.r.t. ``student_logits``. Masking, token weights, reduction
and metrics belong to the Estimator classes.

Notation (``shared/research/opd_estimators.md`` section 2): student ``π_θ = softmax(z)``,
teacher ``p``, behavior policy ``π_b``, ``l_θ(y) = log π_θ(y) − log p(y)``,
``RKL = KL(π_θ‖p) = Σ_y π_θ l_θ``, ``FKL = KL(p‖π_θ)``, ``ρ = π_θ/π_b``, ``sg`` = stop-gradient,
``M_q(S) = Σ_{y∈S} q(y)``.

Dtypes: the loss is computed in the *compute dtype* of the student logits: float64 stays
float64, everything else (float32, bfloat16, float16) is computed and returned in float32,
so half-precision logits always get an fp32 log-softmax.

Memory: estimators read the student only through ``gather_logprobs``, which walks the
sequence in chunks and never holds more than one ``[B, chunk, V]`` temporary (forward and
backward), so a top-k or MC loss costs no more than the logits and their gradient.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from asyncrl.logratio import importance_log_ratio

Tail = Literal["drop", "bucket", "renorm"]
Form = Literal["value", "pg"]
Advantage = Literal["online", "stale"]
AdvantageScale = Literal["std", "none"]

__all__ = [
    "compute_dtype",
    "forward_kl_dense",
    "forward_kl_mc",
    "forward_kl_mc_from_logprobs",
    "forward_kl_topk",
    "forward_kl_topk_from_logprobs",
    "gather_logprobs",
    "gather_logprobs_and_log_tail",
    "grpo_advantages",
    "importance_log_ratio",  # re-exported from asyncrl.logratio, its home
    "log1mexp",
    "log_tail_mass",
    "policy_gradient_loss",
    "reverse_kl_dense",
    "reverse_kl_mc",
    "reverse_kl_mc_from_logprobs",
    "reverse_kl_stratified",
    "reverse_kl_stratified_from_logprobs",
    "reverse_kl_topk",
    "reverse_kl_topk_from_logprobs",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: log tail mass of an empty tail (the support is the whole vocabulary): e^-1000 is 0 in every
#: float dtype, and a finite value keeps ``0 * (lt_w - lt_o)`` away from ``inf - inf``
LOG_TAIL_FLOOR = -1000.0
#: a tail sum (relative to the row's largest exp term) below which ``_GatherLogSoftmaxTail``
#: recomputes the tail's normaliser shifted by its own maximum: fp32 denormals start at ~1.2e-38
_TAIL_REDO = 1e-25


def _log_mass_ceiling(dtype: torch.dtype) -> float:
    # The largest log-mass treated as < 1: log-sum-exps closer to 0 than this are rounding noise.
    return -1e-12 if dtype == torch.float64 else -1e-7


# --- numerics -----------------------------------------------------------------------------------
def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − exp(x))`` for ``x ≤ 0``, accurate everywhere (Mächler 2012).

    Uses ``log(−expm1(x))`` near 0 and ``log1p(−exp(x))`` below ``−log 2``; both branches stay
    finite for ``x < 0`` so gradients through ``torch.where`` never see NaN. ``x = 0`` gives −inf.
    """
    near_zero = x > -math.log(2.0)
    a = torch.log(-torch.expm1(torch.where(near_zero, x, torch.full_like(x, -1.0))))
    b = torch.log1p(-torch.exp(torch.where(near_zero, torch.full_like(x, -1.0), x)))
    return torch.where(near_zero, a, b)


def log_tail_mass(logprobs: torch.Tensor) -> torch.Tensor:
    """``log(1 − M(S))`` from the log-probabilities on a support S: ``[..., k] -> [...]``.

    ``M(S) = exp(logsumexp(logprobs))``; the log-mass is clamped to at most ``−1e-7`` (fp32) or
    ``−1e-12`` (fp64) first, so the result is finite (about −16 resp. −28) when the support holds
    all the mass up to rounding, and the clamp stops the gradient there (spec T22).

    Precision: ``1 − M`` is derived from head log-probs, so in fp32 a tail below ~1e-6 carries
    a relative error of order ``ε_fp32 / (1 − M)`` and one below ~1e-7 is lost. Where the logits
    are at hand, ``gather_logprobs_and_log_tail`` forms the tail directly (a masked logsumexp),
    exact in any dtype; the top-k cache stores the teacher's that way.
    """
    lse = torch.logsumexp(logprobs, dim=-1)
    return log1mexp(lse.clamp(max=_log_mass_ceiling(logprobs.dtype)))


# --- chunked log-softmax gather -------------------------------------------------------------------
class _GatherLogSoftmax(torch.autograd.Function):
    """``log_softmax(z)[..., ids]`` over ``[B, T, V]`` in sequence chunks.

    Forward keeps only the per-position log-normaliser ``[B, T]``; backward rebuilds the softmax
    one chunk at a time: ``∂ lp_k / ∂ z_j = 1[j = id_k] − π_j``, so
    ``grad_z = scatter_add(g at ids) − π · Σ_k g_k``.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, chunk: int) -> torch.Tensor:  # type: ignore[override]
        cdtype = compute_dtype(logits.dtype)
        B, T, _ = logits.shape
        lse = torch.empty(B, T, dtype=cdtype, device=logits.device)
        out = torch.empty(ids.shape, dtype=cdtype, device=logits.device)
        for s in range(0, T, chunk):
            z = logits[:, s : s + chunk].to(cdtype)  # a view when the dtype already matches
            lse_c = torch.logsumexp(z, dim=-1)  # [B, c]
            lse[:, s : s + chunk] = lse_c
            out[:, s : s + chunk] = z.gather(-1, ids[:, s : s + chunk]) - lse_c.unsqueeze(-1)
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        logits, ids, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        chunk, T = ctx.chunk, logits.shape[1]
        cdtype = lse.dtype
        grad = torch.empty_like(logits)
        for s in range(0, T, chunk):
            g = grad_out[:, s : s + chunk].to(cdtype)  # [B, c, K]
            soft = _exp_shifted(logits[:, s : s + chunk], lse[:, s : s + chunk], grad[:, s : s + chunk])
            soft.mul_(-g.sum(-1, keepdim=True))
            soft.scatter_add_(-1, ids[:, s : s + chunk], g)
            if soft.data_ptr() != grad[:, s : s + chunk].data_ptr():
                grad[:, s : s + chunk] = soft
        return grad, None, None


def _exp_shifted(z: torch.Tensor, shift: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """``exp(z - shift[..., None])`` in the compute dtype, written into ``into`` (a slice of the
    gradient being built) when that is the compute dtype: two passes over a [B, c, V] chunk and no
    temporary, where ``z.to(copy=True).sub_().exp_()`` then a copy into the gradient takes four."""
    cdtype = shift.dtype
    if into.dtype == cdtype and z.dtype == cdtype:
        return torch.sub(z, shift.unsqueeze(-1), out=into).exp_()
    return (z.to(cdtype) - shift.unsqueeze(-1)).exp_()


def gather_logprobs(logits: torch.Tensor, ids: torch.Tensor, *, chunk_size: int = 0) -> torch.Tensor:
    """``log_softmax(logits)`` at ``ids`` without materialising the full log-softmax.

    Shapes: ``logits [B, T, V]`` with ``ids [B, T, K] -> [B, T, K]`` or ``ids [B, T] -> [B, T]``
    (2-D ``logits [N, V]`` are treated as one sequence). ``chunk_size`` is the number of sequence
    positions per chunk; 0 means all of T at once. The log-normaliser is computed in the compute
    dtype (fp32 for half-precision logits); the result has that dtype. Differentiable w.r.t.
    ``logits``; every chunk size gives the same value and gradient.
    """
    squeeze_pos = logits.dim() == 2
    if squeeze_pos:
        logits, ids = logits.unsqueeze(0), ids.unsqueeze(0)
    single = ids.dim() == logits.dim() - 1
    if single:
        ids = ids.unsqueeze(-1)
    logits, ids, chunk, _ = _prepare_gather(logits, ids, chunk_size)
    out = _GatherLogSoftmax.apply(logits, ids.long().contiguous(), chunk)
    if single:
        out = out.squeeze(-1)
    return out.squeeze(0) if squeeze_pos else out


def _prepare_gather(
    logits: torch.Tensor, ids: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Check ``logits [B, T, V]`` and ``ids [B, T, K]``; return them with the chunk length and V."""
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 = no chunking), got {chunk_size}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got dtype {logits.dtype}")
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    if ids.dim() != 3 or ids.shape[:2] != logits.shape[:2]:
        raise ValueError(
            f"ids must have shape [B, T] or [B, T, K] matching logits [B, T, V]={tuple(logits.shape)}, "
            f"got {tuple(ids.shape)}"
        )
    if ids.is_floating_point():
        raise ValueError(f"ids must be an integer tensor, got dtype {ids.dtype}")
    V = logits.shape[-1]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"ids outside the vocabulary [0, {V}): min {int(ids.min())}, max {int(ids.max())}")
    T = logits.shape[1]
    chunk = T if chunk_size == 0 else min(chunk_size, max(T, 1))
    return logits, ids, max(chunk, 1), V


class _GatherLogSoftmaxTail(torch.autograd.Function):
    """``log_softmax(z)`` at a support ``S`` = ids ``[B, T, k]`` and the log mass outside it,
    ``log Σ_{j∉S} π_j = logsumexp_{j∉S} z_j − logsumexp_j z_j`` ``[B, T]``, in sequence chunks.

    The tail is a masked logsumexp of the logits, not ``log(1 − Σ_S π)``: no cancellation, so a
    tail of 1e-30 is as exact as one of 0.5, in fp32 too. Backward rebuilds both softmaxes one
    chunk at a time: ``∂ lp_k/∂z_j = 1[j = id_k] − π_j`` and ``∂ lt/∂z_j = 1[j ∉ S] q_j − π_j``
    with ``q`` the softmax over the tail. An empty tail gives ``LOG_TAIL_FLOOR`` (no gradient).
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, ids: torch.Tensor, chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        cdtype = compute_dtype(logits.dtype)
        B, T, _ = logits.shape
        lse = torch.empty(B, T, dtype=cdtype, device=logits.device)
        lse_tail = torch.empty(B, T, dtype=cdtype, device=logits.device)
        out = torch.empty(ids.shape, dtype=cdtype, device=logits.device)
        for s in range(0, T, chunk):
            z = logits[:, s : s + chunk].to(cdtype)
            ids_c = ids[:, s : s + chunk]
            # both log-normalisers from one exp pass: e = exp(z - max); lse = max + log Σ e, and
            # the tail's = max + log Σ_{j∉S} e (S zeroed: a sum of positive terms, no cancellation)
            top = z.amax(-1, keepdim=True)
            e = torch.sub(z, top).exp_()  # the one [B, c, V] temporary
            lse_c = top.squeeze(-1) + e.sum(-1).log()
            tail_sum = e.scatter_(-1, ids_c, 0.0).sum(-1)
            lse_t = top.squeeze(-1) + tail_sum.log()
            # a tail below ~1e-25 of the row's largest term lives in denormals (or underflowed):
            # those rows take the masked logsumexp, which shifts by the tail's own maximum
            small = tail_sum < _TAIL_REDO
            if bool(small.any()):
                lse_t[small] = torch.logsumexp(z[small].scatter(-1, ids_c[small], -math.inf), dim=-1)
            lse[:, s : s + chunk] = lse_c
            lse_tail[:, s : s + chunk] = lse_t
            out[:, s : s + chunk] = z.gather(-1, ids_c) - lse_c.unsqueeze(-1)
        tail = (lse_tail - lse).clamp(LOG_TAIL_FLOOR, 0.0)
        ctx.save_for_backward(logits, ids, lse, lse_tail)
        ctx.chunk = chunk
        return out, tail

    @staticmethod
    @once_differentiable
    def backward(
        ctx, grad_out: torch.Tensor, grad_tail: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        logits, ids, lse, lse_tail = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        chunk, T = ctx.chunk, logits.shape[1]
        cdtype = lse.dtype
        # the clamp at LOG_TAIL_FLOOR (an empty or vanishing tail) passes no gradient
        live = (lse_tail - lse) > LOG_TAIL_FLOOR
        grad = torch.empty_like(logits)
        for s in range(0, T, chunk):
            sl = slice(s, s + chunk)
            g = grad_out[:, sl].to(cdtype)  # [B, c, k]
            live_c, lse_c, lt_c = live[:, sl], lse[:, sl], lse_tail[:, sl]
            gt = torch.where(live_c, grad_tail[:, sl].to(cdtype), 0.0)  # [B, c]
            head = -(g.sum(-1) + gt)  # the coefficient of π_j, every j
            ids_c = ids[:, sl]
            # off S: head π_j + gt q_j = exp(z_j − lt) (head e^{lt − lse} + gt), both terms from one
            # exp; shifting by the tail's normaliser keeps every off-S term <= 1 (lt <= lse). Without
            # a live tail: head π_j = exp(z_j − lse) head.
            shift = torch.where(live_c, lt_c, lse_c)
            coef = torch.where(live_c, head * (lt_c - lse_c).exp() + gt, head)
            grad_c = _exp_shifted(logits[:, sl], shift, grad[:, sl])
            grad_c.mul_(coef.unsqueeze(-1))
            # on S (where the shared exp may overflow): head π_j + g_j, π_j from the saved normaliser
            pi_s = (logits[:, sl].gather(-1, ids_c).to(cdtype) - lse_c.unsqueeze(-1)).exp()
            grad_c.scatter_(-1, ids_c, pi_s * head.unsqueeze(-1))
            grad_c.scatter_add_(-1, ids_c, g)
            if grad_c.data_ptr() != grad[:, sl].data_ptr():
                grad[:, sl] = grad_c
        return grad, None, None


def gather_logprobs_and_log_tail(
    logits: torch.Tensor, ids: torch.Tensor, *, chunk_size: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits)`` at a support ``ids`` and the log mass outside it, in one pass.

    ``logits [B, T, V]``, ``ids [B, T, k]`` -> ``(logprobs [B, T, k], log_tail [B, T])`` with
    ``log_tail = log(1 − Σ_{ids} π)`` computed as a masked logsumexp of the logits (exact even
    for tails far below fp32's epsilon; ``LOG_TAIL_FLOOR`` when the ids cover the vocabulary).
    Differentiable w.r.t. ``logits``; memory as ``gather_logprobs`` (one ``[B, chunk, V]``
    temporary at a time, two in backward). Ids should be distinct (a support, not draws).
    """
    logits, ids, chunk, _ = _prepare_gather(logits, ids, chunk_size)
    if ids.dim() != 3:
        raise ValueError(f"ids must have shape [B, T, k] for a support, got {tuple(ids.shape)}")
    return _GatherLogSoftmaxTail.apply(logits, ids.long().contiguous(), chunk)


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)


# --- dense (exact) ----------------------------------------------------------------------------------
def forward_kl_dense(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """E1, exact ``FKL = Σ_y p (log p − log π_θ)``: ``[B, T, V] x [B, T, V] -> [B, T]``.

    Gradient ``∂/∂z_j = π_j − p_j``. Teacher zeros (−inf logits) contribute 0. Computed as TRL's
    chunked kernel does, ``Σ p (z_t − z) − logsumexp z_t + logsumexp z`` with ``p`` normalised
    explicitly and both log-normalisers from ``torch.logsumexp``'s pairwise sums: at V = 151,936 in
    fp32 the elementwise ``Σ p (log p − log π_θ)`` was 7.4e-5 off its fp64 value on a ``qwen-tiny``
    batch (``torch.log_softmax``'s CPU kernel sums the exponentials in running fp32 lanes; TRL 6.6e-8),
    and ``Σ p log p − Σ p z + (logsumexp z) Σ p`` 1.1e-4 (Σp's error times the log-normaliser). The
    per-element gap ``z_t − z`` is O(1) where the logits are O(10), so nothing large cancels; the
    student's log-softmax is never materialised (its gradient comes from logsumexp's backward).
    """
    z = student_logits.to(compute_dtype(student_logits.dtype))
    with torch.no_grad():
        zt = teacher_logits.to(z.dtype)
        if bool(torch.isneginf(zt).any()):  # p = 0 there: 0 times a finite gap, not 0 * (−inf)
            zt = zt.clamp(min=torch.finfo(z.dtype).min)
        top = zt.amax(-1, keepdim=True)
        p = torch.sub(zt, top).exp_()
        total = p.sum(-1, keepdim=True)
        p.div_(total)
        lse_t = (top + total.log()).squeeze(-1)
    return ((zt - z) * p).sum(-1) - lse_t + torch.logsumexp(z, dim=-1)


def reverse_kl_dense(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """E2, exact ``RKL = Σ_y π_θ (log π_θ − log p)``: ``[B, T, V] x [B, T, V] -> [B, T]``.

    Gradient ``∂/∂z_j = π_j (l_j − RKL)``. Also serves as ``KL(π_θ‖π_b)`` given behavior logits.
    """
    lq = _log_softmax(student_logits)
    lp = torch.log_softmax(teacher_logits.to(lq.dtype), dim=-1)
    return (lq.exp() * (lq - lp)).sum(-1)


# --- top-k support with a tail rule ------------------------------------------------------------------
def _check_tail(tail: str) -> None:
    if tail not in ("drop", "bucket", "renorm"):
        raise ValueError(f"tail must be one of 'drop', 'bucket', 'renorm', got {tail!r}")


def _support_kl(
    lq: torch.Tensor,
    lp: torch.Tensor,
    tail: str,
    lt_q: torch.Tensor | None = None,
    lt_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ_S q (log q − log p)`` plus the tail rule; ``q`` is the weighting side. ``[..., k] -> [...]``.

    ``lt_q``/``lt_p``: log tail masses ``log(1 − M(S))`` ``[...]``; derived from the head
    (``log_tail_mass``) when None."""
    head = (lq.exp() * (lq - lp)).sum(-1)
    if tail == "drop":
        return head
    if tail == "bucket":
        lt_q = log_tail_mass(lq) if lt_q is None else lt_q.to(lq.dtype)
        lt_p = log_tail_mass(lp) if lt_p is None else lt_p.to(lq.dtype)
        return head + lt_q.exp() * (lt_q - lt_p)
    # renorm: KL(q|S ‖ p|S) = head / M_q − log M_q + log M_p
    lm_q, lm_p = torch.logsumexp(lq, dim=-1), torch.logsumexp(lp, dim=-1)
    return head * torch.exp(-lm_q) - lm_q + lm_p


def forward_kl_topk_from_logprobs(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    tail: Tail = "bucket",
    student_log_tail: torch.Tensor | None = None,
    teacher_log_tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """E3 on already-gathered log-probs: both ``[B, T, k]`` on the teacher's support S -> ``[B, T]``.

    With ``M_p = M_p(S)``, ``M_θ = M_θ(S)``:

    - ``drop``:   ``Σ_S p log(p/π_θ)``; stationary at ``π_θ = p|S`` with the student tail pushed to 0.
    - ``bucket``: ``+ (1−M_p) log((1−M_p)/(1−M_θ))``; ``0 ≤ L ≤ FKL``, the gap is
      ``(1−M_p) KL(p|T ‖ π_θ|T)``; stationary at ``π_θ = p`` (tail allocation free).
    - ``renorm``: ``KL(p|S ‖ π_θ|S)``; blind to the student's S-mass.

    Deterministic (no variance) and biased unless S = V. Teacher log-probs must be normalised over
    the full vocabulary, and the support ids distinct.

    ``student_log_tail``/``teacher_log_tail`` ``[B, T]``: ``log(1 − M(S))`` for ``bucket``, formed
    from the full logits (``gather_logprobs_and_log_tail``; the top-k cache stores the teacher's).
    When None they are derived from the head log-probs, which in fp32 loses tails below ~1e-7
    (``log_tail_mass``): with such tails the bucket term loses its meaning and its gradient on
    the student's tail can take the wrong sign.
    """
    _check_tail(tail)
    return _support_kl(
        teacher_logprobs.to(student_logprobs.dtype),
        student_logprobs,
        tail,
        teacher_log_tail,
        student_log_tail,
    )


def reverse_kl_topk_from_logprobs(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    tail: Tail = "bucket",
    student_log_tail: torch.Tensor | None = None,
    teacher_log_tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """E4 on already-gathered log-probs: both ``[B, T, k]`` on a fixed support S -> ``[B, T]``.

    - ``drop``:   ``Σ_S π_θ l_θ``; NOT stationary at ``π_θ = p`` (gradient ``π ⊙ (1_S − M_θ(S))``),
      can be negative, pushes student mass out of S.
    - ``bucket``: ``+ (1−M_θ) log((1−M_θ)/(1−M_p))``; ``0 ≤ L ≤ RKL``, the gap is
      ``(1−M_θ) KL(π_θ|T ‖ p|T)``; stationary at ``π_θ = p``.
    - ``renorm``: ``KL(π_θ|S ‖ p|S)``.

    π_θ is recomputed on S at learner time, so no importance ratio is needed (S is enumerated,
    not sampled); the tail bias cannot be reweighted away (no proposal density for the tail).
    The log tails are as in ``forward_kl_topk_from_logprobs``.
    """
    _check_tail(tail)
    return _support_kl(
        student_logprobs,
        teacher_logprobs.to(student_logprobs.dtype),
        tail,
        student_log_tail,
        teacher_log_tail,
    )


def forward_kl_topk(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    tail: Tail = "bucket",
    teacher_log_tail: torch.Tensor | None = None,
    chunk_size: int = 0,
) -> torch.Tensor:
    """E3, sparse ``KL(p‖π_θ)`` on the teacher's top-k: ``[B, T, V]``, ``[B, T, k]`` x2 -> ``[B, T]``.

    See ``forward_kl_topk_from_logprobs`` for the tail rules. The support is chosen by the teacher,
    so there is no token-level staleness. ``bucket`` forms the student's tail from its logits
    (masked logsumexp) and takes the teacher's from ``teacher_log_tail`` (the cache's column; derived
    from the head when None).
    """
    _check_tail(tail)
    lq, lt_q = _support_logprobs(student_logits, teacher_ids, tail, chunk_size)
    return forward_kl_topk_from_logprobs(
        lq, teacher_logprobs, tail=tail, student_log_tail=lt_q, teacher_log_tail=teacher_log_tail
    )


def _support_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, tail: str, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Student log-probs on a support, plus its log tail mass when the tail rule needs it."""
    if tail == "bucket":
        return gather_logprobs_and_log_tail(logits, ids, chunk_size=chunk_size)
    return gather_logprobs(logits, ids, chunk_size=chunk_size), None


def reverse_kl_topk(
    student_logits: torch.Tensor,
    support_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    tail: Tail = "bucket",
    teacher_log_tail: torch.Tensor | None = None,
    chunk_size: int = 0,
) -> torch.Tensor:
    """E4, sparse ``KL(π_θ‖p)`` recomputed on a support S: ``[B, T, V]``, ``[B, T, k]`` x2 -> ``[B, T]``.

    See ``reverse_kl_topk_from_logprobs`` for the tail rules. With a behavior-chosen support,
    coverage ``M_θ(S)`` falls as staleness grows and so does the bias. Tails as in ``forward_kl_topk``.
    """
    _check_tail(tail)
    lq, lt_q = _support_logprobs(student_logits, support_ids, tail, chunk_size)
    return reverse_kl_topk_from_logprobs(
        lq, teacher_logprobs, tail=tail, student_log_tail=lt_q, teacher_log_tail=teacher_log_tail
    )


# --- policy gradient core ----------------------------------------------------------------------------
def policy_gradient_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """Importance-weighted (PPO-clip) policy-gradient loss per element, same shape as ``logprobs``.

    ``ρ = exp(log π_θ − log π_b)``, ``A = sg(advantages)``; unclipped (``clip_eps=None``):
    ``−A ρ`` whose gradient is ``−A ρ ∇log π_θ`` (unbiased under y ~ π_b). Clipped:
    ``max(−A ρ, −A clip(ρ, 1−ε, 1+ε_high))``; dual clip ``c > 1`` caps the loss at ``−c A`` for ``A < 0``.
    ``advantages`` is ``[B]`` (broadcast over T and any sample axis) or the shape of ``logprobs``.
    Shared by GRPO ([B, T]) and the MC estimators ([B, T, m]).
    """
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0 or None (unclipped), got {clip_eps}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip}")
    adv = advantages.detach().to(logprobs.dtype)
    if adv.dim() < logprobs.dim():
        if adv.shape != logprobs.shape[: adv.dim()]:
            raise ValueError(
                f"advantages shape {tuple(adv.shape)} is neither [B] nor the shape of logprobs "
                f"{tuple(logprobs.shape)}"
            )
        adv = adv.reshape(adv.shape + (1,) * (logprobs.dim() - adv.dim()))
    ratio = importance_log_ratio(logprobs, behavior_logprobs).exp()
    loss = -adv * ratio
    if clip_eps is not None:
        high = clip_eps if clip_eps_high is None else clip_eps_high
        loss = torch.maximum(loss, -adv * ratio.clamp(1.0 - clip_eps, 1.0 + high))
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale: AdvantageScale = "std", eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages ``A_i = (R_i − mean_g R) / (std_g R + eps)``: ``[N], [N] -> [N]``.

    ``scale="std"`` is GRPO (sample std, Bessel-corrected as in TRL/verl); ``"none"`` is Dr.GRPO
    (centre only). Advantages sum to 0 within each group; zero-variance and singleton groups get 0.
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both have shape [N], got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    r = rewards.detach().to(compute_dtype(rewards.dtype) if rewards.is_floating_point() else torch.float32)
    _, inv = torch.unique(group_ids, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.bincount(inv, minlength=G).to(r.dtype)
    mean = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, r) / count
    centered = r - mean[inv]
    # zero-variance groups get exactly 0 (the centring above can leave rounding noise)
    hi = torch.full((G,), -math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    lo = torch.full((G,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin")
    centered = torch.where((hi == lo)[inv], torch.zeros_like(centered), centered)
    if scale == "none":
        return centered
    var = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, centered**2)
    denom = (var / (count - 1).clamp(min=1)).sqrt()[inv] + eps
    return centered / torch.where(
        denom > 0, denom, torch.ones_like(denom)
    )  # 0/0 only in zero-variance groups


# --- sampled (Monte Carlo) estimators ---------------------------------------------------------------
def reverse_kl_mc_from_logprobs(
    student_logprobs: torch.Tensor,
    proposal_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    form: Form = "pg",
    advantage: Advantage = "online",
    clip_eps: float | None = None,
    loo_baseline: bool = False,
    anchor_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """E5/E6 on gathered log-probs at m draws ``y_j ~ π_b``: three ``[B, T, m]`` -> ``[B, T]``.

    - ``form="value"``: ``(1/m) Σ_j ρ_j (log π_θ(y_j) − log p(y_j))`` with ρ NOT detached.
      ``E[L] = RKL`` and ``E[∇L] = ∇RKL`` (autograd). Requires ``advantage="online"``, no clipping.
    - ``form="pg"``: ``(1/m) Σ_j max(−A_j ρ_j, −A_j clip(ρ_j, 1±ε))``. With ``A = sg(log p − log π_θ)``
      (``"online"``, the recompute fix) and ``clip_eps=None``, ``E[∇L] = ∇RKL``. With
      ``A = log p − log π_b`` (``"stale"``) ``E[∇L] = ∇RKL − ∇_θ KL(π_θ‖π_b)``: an anti-trust-region
      pull that is 0 at staleness 0 and grows with it. Clipping trades variance for bias.
    - ``loo_baseline``: subtract ``b_{−j} = mean_{k≠j} A_k`` (needs m ≥ 2); still unbiased because
      ``E_{π_b}[ρ ∇log π_θ] = 0``.

    Variance is ``Var_1 / m`` for i.i.d. draws (duplicates kept); m = 1 is the single-sample
    estimator. The cache holds the proposal density π_b(y_j), so the estimate is MC-correctable.

    ``anchor_logprobs``: the denominator of ρ (default ``proposal_logprobs``). Decoupled PPO
    passes ``sg(student_logprobs)`` (π_prox, the weights before the step): ρ = 1 in value with
    ``∇ρ = ∇log π_θ``, and the caller weights each term by ``π_prox/π_b`` (the expectations
    above then hold with that weight in place of ρ). The stale advantage keeps ``log π_b``.
    """
    if form not in ("value", "pg"):
        raise ValueError(f"form must be 'value' or 'pg', got {form!r}")
    if advantage not in ("online", "stale"):
        raise ValueError(f"advantage must be 'online' or 'stale', got {advantage!r}")
    lq = student_logprobs
    lb = proposal_logprobs.to(lq.dtype)
    lp = teacher_logprobs.to(lq.dtype)
    base = lb if anchor_logprobs is None else anchor_logprobs.to(lq.dtype)
    if form == "value":
        if advantage != "online" or clip_eps is not None or loo_baseline:
            raise ValueError(
                "form='value' is the differentiable estimate of KL(π_θ‖p) itself: it needs "
                "advantage='online', clip_eps=None and loo_baseline=False"
            )
        rho = importance_log_ratio(lq, base).exp()
        return (rho * (lq - lp)).mean(-1)
    adv = (lp - lq).detach() if advantage == "online" else lp - lb
    if loo_baseline:
        m = adv.shape[-1]
        if m < 2:
            raise ValueError("loo_baseline needs m >= 2 samples per position")
        adv = adv - (adv.sum(-1, keepdim=True) - adv) / (m - 1)
    return policy_gradient_loss(lq, base, adv, clip_eps=clip_eps).mean(-1)


def reverse_kl_mc(
    student_logits: torch.Tensor,
    sample_ids: torch.Tensor,
    proposal_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    form: Form = "pg",
    advantage: Advantage = "online",
    clip_eps: float | None = None,
    loo_baseline: bool = False,
    chunk_size: int = 0,
) -> torch.Tensor:
    """E5/E6, sampled ``KL(π_θ‖p)`` from m behavior draws: ``[B, T, V]``, ``[B, T, m]`` x3 -> ``[B, T]``.

    ``sample_ids`` are draws from the proposal π_b (column 0 = the generated token),
    ``proposal_logprobs = log π_b(y_j)``, ``teacher_logprobs = log p(y_j)``. See
    ``reverse_kl_mc_from_logprobs`` for the forms and their bias.
    """
    lq = gather_logprobs(student_logits, sample_ids, chunk_size=chunk_size)
    return reverse_kl_mc_from_logprobs(
        lq,
        proposal_logprobs,
        teacher_logprobs,
        form=form,
        advantage=advantage,
        clip_eps=clip_eps,
        loo_baseline=loo_baseline,
    )


def forward_kl_mc_from_logprobs(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor
) -> torch.Tensor:
    """E8 on gathered log-probs at m teacher draws ``y_j ~ p``: ``[B, T, m]`` x2 -> ``[B, T]``.

    ``(1/m) Σ_j (sg(log p(y_j)) − log π_θ(y_j))``: unbiased for FKL and for its gradient ``π − p``.
    """
    return (teacher_logprobs.detach().to(student_logprobs.dtype) - student_logprobs).mean(-1)


def forward_kl_mc(
    student_logits: torch.Tensor,
    sample_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    chunk_size: int = 0,
) -> torch.Tensor:
    """E8, ``KL(p‖π_θ)`` from m teacher-sampled ids: ``[B, T, V]``, ``[B, T, m]`` x2 -> ``[B, T]``.

    Unbiased in value and gradient, variance ``∝ 1/m``; the proposal is the teacher, so there is
    no token-level staleness.
    """
    lq = gather_logprobs(student_logits, sample_ids, chunk_size=chunk_size)
    return forward_kl_mc_from_logprobs(lq, teacher_logprobs)


def reverse_kl_stratified_from_logprobs(
    support_logprobs: torch.Tensor,
    support_teacher_logprobs: torch.Tensor,
    sample_logprobs: torch.Tensor,
    proposal_logprobs: torch.Tensor,
    sample_teacher_logprobs: torch.Tensor,
    in_support: torch.Tensor,
) -> torch.Tensor:
    """E7 on gathered log-probs: head ``[B, T, k]`` x2, samples ``[B, T, m]`` x3 + bool mask -> ``[B, T]``.

    ``L = Σ_{y∈S} π_θ l_θ + (1/m) Σ_j 1[y_j ∉ S] ρ_j l_θ(y_j)`` (value form, autograd through both).
    Unbiased for RKL and its gradient when S is fixed before sampling; variance only from the tail,
    small when ``M_θ(S)`` is near 1. ``in_support[b, t, j]`` marks draws that fall in S.
    """
    lq_s = support_logprobs
    head = (lq_s.exp() * (lq_s - support_teacher_logprobs.to(lq_s.dtype))).sum(-1)
    lq = sample_logprobs
    rho = importance_log_ratio(lq, proposal_logprobs).exp()
    terms = rho * (lq - sample_teacher_logprobs.to(lq.dtype))
    tail = torch.where(in_support, torch.zeros_like(terms), terms).mean(-1)
    return head + tail


def reverse_kl_stratified(
    student_logits: torch.Tensor,
    support_ids: torch.Tensor,
    support_teacher_logprobs: torch.Tensor,
    sample_ids: torch.Tensor,
    proposal_logprobs: torch.Tensor,
    sample_teacher_logprobs: torch.Tensor,
    *,
    chunk_size: int = 0,
) -> torch.Tensor:
    """E7, exact top-k head plus an importance-sampled tail: ``[B, T, V]``, ``[B, T, k]`` x2,
    ``[B, T, m]`` x3 -> ``[B, T]``. Unbiased for ``KL(π_θ‖p)``; reduces to E4-drop at m = 0 and to
    the value-form E6 at k = 0. One gather serves both the support and the samples.
    """
    k = support_ids.shape[-1]
    ids = torch.cat([support_ids.long(), sample_ids.long()], dim=-1)
    lq = gather_logprobs(student_logits, ids, chunk_size=chunk_size)
    in_support = (sample_ids.long().unsqueeze(-1) == support_ids.long().unsqueeze(-2)).any(-1)
    return reverse_kl_stratified_from_logprobs(
        lq[..., :k],
        support_teacher_logprobs,
        lq[..., k:],
        proposal_logprobs,
        sample_teacher_logprobs,
        in_support,
    )
