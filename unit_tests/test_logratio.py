"""The shared log-ratio helpers: each KL estimate has the direction its name says."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.logratio import LOG_RATIO_CLAMP, importance_log_ratio, kl_qp_k1, kl_qp_k3, masked_mean


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.1, 3.0))
def test_kl_qp_estimates_are_unbiased_for_kl_q_p(seed: int, scale: float) -> None:
    """E_{y~q}[k1] = E_{y~q}[k3] = KL(q||p), by exact enumeration over a vocabulary of 7."""
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(scale * torch.randn(7, generator=g, dtype=torch.float64), -1)
    logp = torch.log_softmax(scale * torch.randn(7, generator=g, dtype=torch.float64), -1)
    q = logq.exp()
    kl_qp = (q * (logq - logp)).sum()
    kl_pq = (logp.exp() * (logp - logq)).sum()
    assert torch.allclose((q * kl_qp_k1(logq, logp)).sum(), kl_qp, atol=1e-12)
    assert torch.allclose((q * kl_qp_k3(logq, logp)).sum(), kl_qp, atol=1e-12)
    assert (kl_qp_k3(logq, logp) >= 0).all()
    if abs(float(kl_qp - kl_pq)) > 1e-3:  # the other direction is a different number
        assert not torch.allclose((q * kl_qp_k3(logq, logp)).sum(), kl_pq, atol=1e-6)


def test_clamp_and_masked_mean() -> None:
    lr = importance_log_ratio(torch.tensor([100.0, -100.0, 0.5]), torch.zeros(3))
    assert lr.tolist() == [LOG_RATIO_CLAMP, -LOG_RATIO_CLAMP, 0.5]
    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    mask = torch.tensor([[True, False], [True, True]])
    assert float(masked_mean(x, mask)) == 3.0  # the NaN at padding never reaches the value
    assert masked_mean(x, mask, dim=-1).tolist() == [1.0, 4.0]
    draws = torch.arange(8.0).reshape(2, 2, 2)  # [B, T, m]: the [B, T] mask broadcasts over m
    assert float(masked_mean(draws, mask)) == float(draws[mask].mean())
    assert float(masked_mean(x, torch.zeros_like(mask))) == 0.0
