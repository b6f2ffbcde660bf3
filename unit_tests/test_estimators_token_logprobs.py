"""The optional ``token_logprobs`` keyword: a precomputed log π_θ(y_t) gives the same loss, gradient
and metrics as the estimator's own gather; a wrong one fails naming ``token_logprobs``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import caches as C
from asyncrl import records as R
from asyncrl.estimators import ESTIMATORS, accepts_token_logprobs, build
from asyncrl.estimators.functional import gather_logprobs
from asyncrl.estimators.grpo import REF_LOGPROBS

torch.set_num_threads(1)
f64 = torch.float64
B, T, V, K, M = 4, 5, 11, 3, 3

#: the built-in estimators that read log π_θ at the generated token (and so use token_logprobs)
USERS = [
    ("grpo", {}),
    ("grpo", {"kl_coef": 0.1, "clip_eps_high": 0.28, "aggregation": "seq_mean"}),
    ("reverse_kl_mc", {"source": "token"}),
    ("reverse_kl_mc", {"source": "token", "form": "value"}),
    ("reverse_kl_mc", {"source": "token", "advantage": "stale", "clip_eps": 0.2}),
]
#: estimators that gather elsewhere (teacher support, MC draws) and must ignore it
OTHERS = [
    ("forward_kl", {}),
    ("reverse_kl", {"dense": True}),
    ("reverse_kl_mc", {}),
    ("forward_kl_mc", {}),
    ("reverse_kl_stratified", {}),
]


def _batch(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Student logits and a record with every column any built-in estimator reads."""
    g = torch.Generator().manual_seed(seed)
    z, zt, noise = torch.randn(3, B, T, V, dtype=f64, generator=g)
    lb_full = torch.log_softmax(z + 0.3 * noise, -1)  # the behavior policy, near the student
    lengths = torch.tensor([3, T, 1, T])
    draws = torch.multinomial(lb_full.exp().view(-1, V), M, replacement=True, generator=g).view(B, T, M)
    batch = {R.COMPLETION_MASK: torch.arange(T) < lengths[:, None], R.COMPLETION_IDS: draws[..., 0].clone()}
    batch[R.BEHAVIOR_LOGPROBS] = lb_full.gather(-1, draws[..., :1]).squeeze(-1)
    batch[R.MC_IDS], batch[R.MC_BEHAVIOR_LOGPROBS] = draws, lb_full.gather(-1, draws)
    batch[R.REWARD], batch[R.GROUP_ID] = torch.rand(B, dtype=f64, generator=g), torch.tensor([0, 0, 1, 1])
    batch[REF_LOGPROBS] = torch.log_softmax(zt, -1).gather(-1, draws[..., :1]).squeeze(-1)
    for kind in ("topk_behavior_mc", "token", "teacher_mc", "dense"):
        batch.update(C.CACHES.get(kind)(**C.cache_options(kind, k=K, m=M)).build(zt, batch, seed=seed))
    return z, batch


def _run(name, opts, z, batch, *, precompute: bool, chunk: int = 0):
    zl = z.detach().clone().requires_grad_(True)
    kw = {}
    if precompute:
        kw["token_logprobs"] = gather_logprobs(zl, batch[R.COMPLETION_IDS], chunk_size=chunk)
    out = build(name, opts)(zl, batch, **kw)
    out.loss.backward()
    return out, zl.grad


@pytest.mark.parametrize(("name", "opts"), USERS + OTHERS)
def test_precomputed_token_logprobs_change_nothing(name, opts) -> None:
    z, batch = _batch(0)
    own, g_own = _run(name, opts, z, batch, precompute=False)
    given_, g_given = _run(name, opts, z, batch, precompute=True)
    assert torch.equal(own.loss, given_.loss)
    assert torch.equal(g_own, g_given)
    assert g_own.abs().sum() > 0  # the gradient flows through the precomputed value too
    assert own.metrics == given_.metrics
    assert own.per_sample.keys() == given_.per_sample.keys()
    for key, val in own.per_sample.items():
        assert torch.equal(val, given_.per_sample[key]), key


@pytest.mark.parametrize(("name", "opts"), USERS)
def test_the_users_read_the_given_value(name, opts) -> None:
    """Not a silent no-op: a different (shifted) value changes the loss of the estimators that use it."""
    z, batch = _batch(1)
    zl = z.clone().requires_grad_(True)
    lq = gather_logprobs(zl, batch[R.COMPLETION_IDS])
    est = build(name, opts)
    base = est(zl, batch, token_logprobs=lq).loss
    shifted = est(zl, batch, token_logprobs=lq - 0.5).loss
    assert not torch.equal(base, shifted)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, T + 1), st.sampled_from(USERS))
def test_any_chunk_size_gives_the_same_loss_and_gradient(seed, chunk, case) -> None:
    name, opts = case
    z, batch = _batch(seed)
    own, g_own = _run(name, opts, z, batch, precompute=False)
    given_, g_given = _run(name, opts, z, batch, precompute=True, chunk=chunk)
    torch.testing.assert_close(given_.loss, own.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_given, g_own, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("name", "opts"), USERS + OTHERS[:1])
def test_bad_token_logprobs_raise_naming_the_keyword(name, opts) -> None:
    z, batch = _batch(2)
    zl = z.clone().requires_grad_(True)
    lq = gather_logprobs(zl, batch[R.COMPLETION_IDS])
    est = build(name, opts)
    bad = {
        "shape": lq[:, :-1],
        "3-D": lq.unsqueeze(-1),
        "integer": batch[R.COMPLETION_IDS],
        "detached": lq.detach(),
    }
    for why, value in bad.items():
        with pytest.raises(ValueError, match="token_logprobs") as err:
            est(zl, batch, token_logprobs=value)
        assert name in str(err.value) and "gather_logprobs" in str(err.value), why
    # without grad on the logits (evaluation), a detached value is fine
    est(z, batch, token_logprobs=gather_logprobs(z, batch[R.COMPLETION_IDS]))


def test_accepts_token_logprobs() -> None:
    for name, cls in ESTIMATORS.items():
        assert accepts_token_logprobs(cls()), name

    class Old:  # written against the protocol before the keyword existed
        def __call__(self, student_logits, batch, *, token_weights=None): ...

    class Open:
        def __call__(self, student_logits, batch, **kw): ...

    assert not accepts_token_logprobs(Old())
    assert accepts_token_logprobs(Open())
    assert not accepts_token_logprobs(object())
