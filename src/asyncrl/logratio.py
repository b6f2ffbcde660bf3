"""Log-ratio helpers shared by the estimators, the controllers, the step and telemetry.

One home, because the same symbols used to mean different things in two places (a k3 of
``KL(π_θ‖π_ref)`` in the estimators, a k3 of ``KL(π_b‖π_θ)`` in the controllers). Here every
KL estimate names its direction: ``kl_qp_k1(logq, logp)`` and ``kl_qp_k3(logq, logp)``
estimate ``KL(q‖p)`` from draws ``y ~ q`` (Schulman, "Approximating KL divergence"), with
``q`` the distribution that sampled ``y``, first, as in the name. Examples:

- ``kl_qp_k3(behavior_logprobs, logprobs)``: ``KL(π_b‖π_θ)`` over rollout tokens (staleness).
- ``kl_qp_k3(logprobs, ref_logprobs)``: ``KL(π_θ‖π_ref)`` over on-policy tokens.

Log-ratios are clamped to ``±LOG_RATIO_CLAMP`` before any ``exp`` (as AsyncOPD and verl do),
so one wild token cannot overflow.
"""

from __future__ import annotations

import torch

__all__ = [
    "LOG_RATIO_CLAMP",
    "importance_log_ratio",
    "kl_qp_k1",
    "kl_qp_k3",
    "masked_mean",
    "masked_token_log_ratio",
    "sequence_log_ratio",
]

#: |log ratio| is clamped here before exponentiating, so no importance weight overflows
LOG_RATIO_CLAMP = 20.0


def importance_log_ratio(logprobs: torch.Tensor, base_logprobs: torch.Tensor) -> torch.Tensor:
    """``log(π/π_base) = log π − log π_base``, clamped to ``±LOG_RATIO_CLAMP`` (differentiable inside)."""
    return (logprobs - base_logprobs.to(logprobs.dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def kl_qp_k1(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per-draw k1 estimate of ``KL(q‖p)`` from ``y ~ q``: ``log q(y) − log p(y)``.

    Unbiased; can be negative."""
    return logq - logp.to(logq.dtype)


def kl_qp_k3(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per-draw k3 estimate of ``KL(q‖p)`` from ``y ~ q``: ``e^u − u − 1`` with ``u = log p − log q``
    (clamped to ``±LOG_RATIO_CLAMP``).

    Non-negative, unbiased under ``y ~ q`` (``E_q[e^u] = 1``), lower variance than k1. A value
    estimate only: its pathwise gradient in ``log q`` is not ``∇KL(q‖p)`` (see ``estimators.grpo``).
    """
    u = (logp.to(logq.dtype) - logq).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(u) - u


def masked_token_log_ratio(
    logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """[B, T] detached ``l_t = log π_θ − log π_b``, zero at padding."""
    if logprobs.shape != behavior_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, behavior_logprobs {tuple(behavior_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must have the same [B, T] shape"
        )
    diff = logprobs.detach() - behavior_logprobs.detach()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B] ``L_i = Σ_t l_t`` over valid tokens (accumulated in fp64, returned in input dtype)."""
    m = mask.bool()
    return torch.where(m, log_ratio.double(), 0.0).sum(-1).to(log_ratio.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid positions (all of them, or along ``dim``); 0 where none is valid.

    ``mask`` [B, T] is broadcast over trailing axes of ``x`` (e.g. ``[B, T, m]`` draws); padded
    values never reach the result (``torch.where``), even when they are not finite.
    """
    m = mask.bool()
    while m.dim() < x.dim():
        m = m.unsqueeze(-1)
    m = m.expand_as(x)
    xs = torch.where(m, x, torch.zeros_like(x))
    if dim is None:
        return xs.sum() / m.sum().clamp_min(1)
    return xs.sum(dim) / m.sum(dim).clamp_min(1)
