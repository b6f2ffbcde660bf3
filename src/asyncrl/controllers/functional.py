"""Pure tensor math behind the staleness controllers (spec: research/staleness_controllers.md).

Everything here is a function of tensors and options, with no state, so a user's own loop
can call it directly. Symbols follow spec section 1:

- token log-ratio ``l_t = log pi_theta(y_t) - log pi_b(y_t)``; sequence log-ratio
  ``L_i = sum_t l_t``; importance weight ``w = exp(l)`` (always detached);
- ESS fraction ``rho = (sum w)^2 / (N sum w^2)`` in ``[1/N, 1]``, computed in log space as
  ``log rho = 2 LSE(log w) - LSE(2 log w) - log N`` so it is finite for ``|log w|`` up to
  1e4 (VCPO's ``exp(sum_t l_t)`` overflows fp32 after ~90 nats);
- GAC: ``g = a r_hat + g_perp`` with ``a = <g, r_hat>``; ``cos(g, r) = a / |g|``;
- staleness-LR law (spec 4.5): ``eta <= c R_batch / (S G)`` and
  ``eta <= c (R_crit - D) / ((T - t) G)``.

The log-ratio helpers (clamp, KL estimates with their direction, masked means) live in
``asyncrl.logratio``, shared with the estimators.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from asyncrl.logratio import LOG_RATIO_CLAMP

Level = Literal["token", "sequence", "geometric"]
Action = Literal["truncate", "mask"]
Rule = Literal["sqrt", "linear"]
AlignMode = Literal["cap", "project", "skip"]


# --- importance weights -----------------------------------------------------------------------
@dataclass(frozen=True)
class ISWeights:
    """Output of ``truncated_is_weights``; all tensors [B, T] and detached.

    ``weights`` is 1 at padding (neutral under the controller product); ``truncated`` marks
    valid tokens whose weight was changed by truncation, ``masked`` valid tokens set to 0.
    """

    weights: torch.Tensor
    raw_log_weights: torch.Tensor
    truncated: torch.Tensor
    masked: torch.Tensor


@torch.no_grad()
def truncated_is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: Level = "token",
    action: Action = "truncate",
    upper: float = 2.0,
    lower: float = 0.0,
) -> ISWeights:
    """Detached importance weights ``w = pi_theta / pi_b`` at ``level`` with truncation or masking.

    - ``token``: ``w_t = exp(l_t)``; ``sequence``: ``w_i = exp(L_i)`` broadcast over the
      sequence; ``geometric``: ``exp(L_i / T_i)`` broadcast (length-invariant; spec 4.2).
    - The log-weight is clamped to ``[-20, 20]`` before ``exp`` (never overflows).
    - ``truncate``: ``w <- min(w, upper)`` and, if ``lower > 0``, ``max(w, lower)`` (TIS).
      ``mask``: ``w <- 0`` outside ``[lower, upper]`` (IcePop / rejection); survivors keep
      their weight, never renormalised, so masking cannot inflate them (spec 7.2 g).

    ``log_ratio``, ``mask``: [B, T]. Weights are computed in fp64 and returned in the dtype
    of ``log_ratio``. With ``pi_theta == pi_b`` every weight is exactly 1.
    """
    if log_ratio.shape != mask.shape or log_ratio.dim() != 2:
        raise ValueError(
            f"log_ratio {tuple(log_ratio.shape)} and mask {tuple(mask.shape)} must both be [B, T]"
        )
    if not upper > 0 or not 0 <= lower < upper:
        raise ValueError(f"need 0 <= lower < upper and upper > 0, got lower={lower}, upper={upper}")
    m = mask.bool()
    lr = torch.where(m, log_ratio.detach().double(), 0.0)
    if level == "token":
        lw = lr
    elif level in ("sequence", "geometric"):
        seq = lr.sum(-1, keepdim=True)
        if level == "geometric":
            seq = seq / m.sum(-1, keepdim=True).clamp_min(1)
        lw = seq.expand_as(lr)
    else:
        raise ValueError(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")
    w = lw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if action == "truncate":
        out = w.clamp(max=upper)
        if lower > 0:
            out = out.clamp(min=lower)
        truncated = m & (out != w)
        masked = torch.zeros_like(m)
    elif action == "mask":
        masked = m & ((w > upper) | (w < lower))
        out = torch.where(masked, 0.0, w)
        truncated = torch.zeros_like(m)
    else:
        raise ValueError(f"action must be 'truncate' or 'mask', got {action!r}")
    out = torch.where(m, out, 1.0).to(log_ratio.dtype)
    return ISWeights(out, torch.where(m, lw, 0.0).to(log_ratio.dtype), truncated, masked)


# --- effective sample size -----------------------------------------------------------------------
def _check_log_weights(log_weights: torch.Tensor, what: str) -> torch.Tensor:
    lw = log_weights.detach().reshape(-1).double()
    if torch.isnan(lw).any() or (lw == math.inf).any():
        raise ValueError(f"{what}: log-weights contain nan or +inf; check the logprob columns")
    return lw


def ess_partials(log_weights: torch.Tensor) -> torch.Tensor:
    """Sufficient statistics of one shard for ``ess_fraction``: fp64 ``[m, s1, s2, n]``.

    ``m = max log w``, ``s1 = sum exp(log w - m)``, ``s2 = sum exp(2 (log w - m))``, ``n`` the
    count. Shards combine exactly (``ess_fraction_from_partials``): this is the DP all-reduce
    (max of m, then sums of the rescaled s1, s2, n).
    """
    lw = _check_log_weights(log_weights, "ess_partials")
    if lw.numel() == 0:
        return torch.tensor([-math.inf, 0.0, 0.0, 0.0], dtype=torch.float64, device=lw.device)
    m = lw.max()
    if m == -math.inf:
        return torch.tensor([-math.inf, 0.0, 0.0, float(lw.numel())], dtype=torch.float64, device=lw.device)
    z = lw - m
    n = torch.tensor(float(lw.numel()), dtype=torch.float64, device=lw.device)
    return torch.stack([m, z.exp().sum(), (2 * z).exp().sum(), n])


def rescale_partials(partials: torch.Tensor, m_global: torch.Tensor | float) -> torch.Tensor:
    """Re-express one shard's ``[m, s1, s2, n]`` relative to the global max ``m_global``."""
    m, s1, s2, n = partials.unbind(-1)
    mg = torch.as_tensor(m_global, dtype=torch.float64, device=partials.device)
    d = torch.where(torch.isfinite(m), m - mg, -math.inf)
    return torch.stack([mg, s1 * d.exp(), s2 * (2 * d).exp(), n])


def ess_fraction_from_partials(partials: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """``rho`` from per-shard ``ess_partials`` (list or [K, 4]).

    Equals ``ess_fraction`` of the concatenated shards (up to rounding)."""
    p = torch.stack(list(partials)) if not isinstance(partials, torch.Tensor) else partials.reshape(-1, 4)
    m_global = p[:, 0].max()
    n = p[:, 3].sum()
    if n == 0:
        raise ValueError("ess_fraction needs at least one weight (got an empty batch)")
    if m_global == -math.inf:
        raise ValueError("ess_fraction: every weight is 0 (all log-weights are -inf)")
    r = torch.stack([rescale_partials(row, m_global) for row in p])
    s1, s2 = r[:, 1].sum(), r[:, 2].sum()
    # log rho = 2 log s1 - log s2 - log n; the global max m cancels.
    return (2 * s1.log() - s2.log() - n.log()).exp().clamp(max=1.0)


def ess_fraction(log_weights: torch.Tensor) -> torch.Tensor:
    """``rho = (sum w)^2 / (N sum w^2) = ESS / N`` from log-weights of any shape, in log space.

    ``log ESS = 2 LSE(log w) - LSE(2 log w)``; fp64 throughout, so finite for log-weights in
    ``[-1e4, 1e4]``. Invariant to ``w -> c w``; equals 1 iff all weights are equal and
    tends to ``1/N`` when one weight dominates. Returns a 0-dim fp64 tensor.
    """
    lw = _check_log_weights(log_weights, "ess_fraction")
    if lw.numel() == 0:
        raise ValueError("ess_fraction needs at least one weight (got an empty tensor)")
    if (lw == -math.inf).all():
        raise ValueError("ess_fraction: every weight is 0 (all log-weights are -inf)")
    log_ess = 2 * torch.logsumexp(lw, 0) - torch.logsumexp(2 * lw, 0)
    return (log_ess - math.log(lw.numel())).exp().clamp(max=1.0)


def ess_lr_scale(
    rho: float | torch.Tensor, *, rho_base: float = 1.0, rule: Rule = "sqrt", min_scale: float = 0.0
) -> float:
    """VCPO's LR factor: ``s = min(1, rho / rho_base)``; ``sqrt(s)`` (``rule="sqrt"``) or ``s``.

    The result is floored at ``min_scale``. Non-decreasing in ``rho``; 1 when ``rho >= rho_base``.
    """
    if not 0 < rho_base <= 1:
        raise ValueError(f"rho_base must be in (0, 1], got {rho_base}")
    s = min(1.0, float(rho) / rho_base)
    if rule == "sqrt":
        scale = math.sqrt(max(s, 0.0))
    elif rule == "linear":
        scale = s
    else:
        raise ValueError(f"rule must be 'sqrt' or 'linear', got {rule!r}")
    return max(scale, min_scale)


# --- gradient alignment (GAC) ----------------------------------------------------------------------
@dataclass(frozen=True)
class Alignment:
    """How to change ``g``: ``g' = scale_g * g + coef_r * r`` when ``active``, else leave ``g`` untouched.

    Expressed through three scalars (``<g, r>``, ``|g|^2``, ``|r|^2``) so a sharded gradient
    needs one all-reduce of three numbers and each shard applies the same update.
    """

    cos: float
    active: bool
    scale_g: float = 1.0
    coef_r: float = 0.0
    #: the component of g along r_hat before (a) and after (a') the transform
    a: float = 0.0
    a_new: float = 0.0


def alignment_from_dots(
    dot: float, g_sq: float, r_sq: float, *, tau: float, mode: AlignMode = "cap", lam: float = 1.0
) -> Alignment:
    """GAC decision from ``<g, r>``, ``|g|^2``, ``|r|^2`` (spec 4.4).

    ``c = <g, r> / (|g| |r|)``; nothing happens unless ``c > tau`` (a zero g or r gives no
    decision). With ``a = <g, r_hat>`` and ``|g_perp|^2 = |g|^2 - a^2``:

    - ``cap``: ``a' = tau |g_perp| / sqrt(1 - tau^2)`` (< a exactly when c > tau), so
      ``cos(g', r) = tau`` and ``g_perp`` is unchanged; ``|g'| <= |g|`` for ``tau >= 0``.
    - ``project``: ``g' = g - lam a r_hat`` (``lam = 1``: ``<g', r> = 0``).
    - ``skip``: ``g' = 0``.
    """
    if not -1 < tau < 1:
        raise ValueError(f"tau must be in (-1, 1), got {tau}")
    if g_sq <= 0 or r_sq <= 0 or not math.isfinite(dot):
        return Alignment(cos=0.0, active=False)
    g_norm, r_norm = math.sqrt(g_sq), math.sqrt(r_sq)
    c = max(-1.0, min(1.0, dot / (g_norm * r_norm)))
    a = dot / r_norm
    if c <= tau:
        return Alignment(cos=c, active=False, a=a, a_new=a)
    if mode == "cap":
        perp = math.sqrt(max(g_sq - a * a, 0.0))
        a_new = tau * perp / math.sqrt(1.0 - tau * tau)
        return Alignment(c, True, 1.0, (a_new - a) / r_norm, a, a_new)
    if mode == "project":
        return Alignment(c, True, 1.0, -lam * a / r_norm, a, (1.0 - lam) * a)
    if mode == "skip":
        return Alignment(c, True, 0.0, 0.0, a, 0.0)
    raise ValueError(f"mode must be 'cap', 'project' or 'skip', got {mode!r}")


def align_gradient(
    grad: torch.Tensor, ref: torch.Tensor, *, tau: float, mode: AlignMode = "cap", lam: float = 1.0
) -> torch.Tensor:
    """GAC on one (flattened) gradient: damp the component of ``grad`` along ``ref`` when ``cos > tau``.

    ``cap`` caps the component so ``cos(g', ref) = tau`` (orthogonal part unchanged); ``project``
    removes ``lam`` of it; ``skip`` returns zeros. When ``cos <= tau`` (including negative
    cosine: this is not PCGrad) ``grad`` itself is returned, bitwise unchanged.
    """
    if grad.shape != ref.shape:
        raise ValueError(f"grad {tuple(grad.shape)} and ref {tuple(ref.shape)} must have the same shape")
    g, r = grad.detach().double(), ref.detach().double()
    al = alignment_from_dots(
        float((g * r).sum()), float((g * g).sum()), float((r * r).sum()), tau=tau, mode=mode, lam=lam
    )
    if not al.active:
        return grad
    return (al.scale_g * g + al.coef_r * r).to(grad.dtype)


# --- staleness-LR law ----------------------------------------------------------------------------
def inverse_lag_scale(s_eff: float, *, s_ref: float = 1.0, gamma: float = 1.0) -> float:
    """``min(1, s_ref / S_eff)^gamma``; 1 for ``S_eff <= s_ref`` (so 1 at S_eff = 0).

    ``gamma = 1`` keeps ``S_eff * eta`` constant for ``S_eff >= s_ref``: the O(S eta) bias-term
    reading of arXiv 2607.01083.
    """
    if s_eff <= s_ref:
        return 1.0
    return (s_ref / s_eff) ** gamma


@dataclass(frozen=True)
class LawLR:
    """``eta = min(eta_sched, eta_batch, eta_horizon)`` and which term binds ('none', 'batch', 'horizon')."""

    eta: float
    eta_batch: float
    eta_horizon: float
    binding: str


def two_constraint_lr(
    eta_sched: float,
    *,
    s_eff: float,
    g_hat: float,
    r_batch: float,
    r_crit: float = math.inf,
    drift_used: float = 0.0,
    steps_left: float = math.inf,
    c_safety: float = 0.5,
) -> LawLR:
    """Two-constraint law (spec 4.5, our operationalisation of arXiv 2607.01083).

    - ``eta_batch = c R_batch / (S_eff G)``: keeps the drift accumulated over one stale cycle,
      ``S_eff eta G``, inside the batch clipping radius (inf when S_eff = 0 or G unknown).
    - ``eta_horizon = c (R_crit - D) / ((T - t) G)``: spends the remaining cumulative-drift
      budget evenly over the remaining steps (inf while ``R_crit`` is inf).

    ``G`` (``g_hat``) is the policy drift per step per unit LR, ``D`` the drift spent so far.
    Ties go to the earlier term in (sched, batch, horizon).
    """
    eta_batch = math.inf
    if s_eff > 0 and g_hat > 0:
        eta_batch = c_safety * r_batch / (s_eff * g_hat)
    eta_horizon = math.inf
    if math.isfinite(r_crit) and g_hat > 0:
        eta_horizon = c_safety * max(r_crit - drift_used, 0.0) / (max(steps_left, 1.0) * g_hat)
    eta = min(eta_sched, eta_batch, eta_horizon)
    binding = "none" if eta == eta_sched else ("batch" if eta == eta_batch else "horizon")
    return LawLR(eta, eta_batch, eta_horizon, binding)


def decay_factor(
    lag: float,
    *,
    table: Sequence[tuple[float, float]] | None = None,
    gamma: float | None = None,
    lag0: float = 1.0,
) -> float:
    """Lag-bucket decay ``f(lag)`` (spec 4.6).

    With ``gamma``: ``f = min(1, (lag0 / lag)^gamma)`` (1 at lag 0). Otherwise ``table`` is a
    list of ``(min_lag, factor)`` sorted by ``min_lag`` starting at 0; ``f`` is the factor of
    the last row with ``min_lag <= lag``.
    """
    if gamma is not None:
        return 1.0 if lag <= lag0 else (lag0 / lag) ** gamma
    if not table:
        raise ValueError("decay_factor needs a table or gamma")
    f = table[0][1]
    for lo, factor in table:
        if lag >= lo:
            f = factor
        else:
            break
    return float(f)
