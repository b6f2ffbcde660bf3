"""Estimator classes: registry and options, masking, token weights, reduction, metrics, bad input (T16)."""

from __future__ import annotations

import pytest
import torch

from asyncrl import caches as C
from asyncrl import records as R
from asyncrl.configurable import ConfigError
from asyncrl.estimators import (
    ESTIMATORS,
    Estimator,
    ForwardKL,
    ForwardKLMC,
    ReverseKL,
    ReverseKLMC,
    ReverseKLStratified,
    build,
)

torch.set_num_threads(1)
f64 = torch.float64
B, T, V, K, M = 3, 6, 13, 4, 3

#: (name, options) covering every built-in estimator and cache kind
CASES = [
    ("forward_kl", {}),
    ("forward_kl", {"tail": "drop"}),
    ("forward_kl", {"tail": "renorm", "aggregation": "seq_mean"}),
    ("forward_kl", {"dense": True}),
    ("reverse_kl", {}),
    ("reverse_kl", {"dense": True}),
    ("reverse_kl_mc", {}),
    ("reverse_kl_mc", {"form": "value"}),
    ("reverse_kl_mc", {"advantage": "stale", "clip_eps": 0.2}),
    ("reverse_kl_mc", {"loo_baseline": True}),
    ("reverse_kl_mc", {"source": "token"}),
    ("forward_kl_mc", {}),
    ("reverse_kl_stratified", {}),
    ("grpo", {}),
]


def _make_batch(seed: int = 0, dtype: torch.dtype = f64):
    """A full record: rollout columns plus every cache kind's columns, from random teacher logits."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, dtype=f64, generator=g)
    zt = torch.randn(B, T, V, dtype=f64, generator=g) * 1.5
    zb = z + 0.3 * torch.randn(B, T, V, dtype=f64, generator=g)
    lb_full = torch.log_softmax(zb, -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 2:] = False
    ids = torch.multinomial(lb_full.exp().view(-1, V), M, replacement=True, generator=g).view(B, T, M)
    batch = {
        R.COMPLETION_MASK: mask,
        R.COMPLETION_IDS: ids[..., 0].clone(),
        R.BEHAVIOR_LOGPROBS: lb_full.gather(-1, ids[..., :1])[..., 0],
        R.TOKEN_VERSIONS: torch.zeros(B, T, dtype=torch.int32),
        R.MC_IDS: ids,
        R.MC_BEHAVIOR_LOGPROBS: lb_full.gather(-1, ids),
        R.REWARD: torch.tensor([1.0, 0.0, 0.5]),
        R.GROUP_ID: torch.tensor([0, 0, 1]),
    }
    for kind in ("topk_behavior_mc", "token", "teacher_mc", "dense"):
        cache = C.CACHES.get(kind)(**C.cache_options(kind, k=K, m=M))
        batch.update(cache.build(zt, batch, seed=seed))
    return z.to(dtype), batch


def _run(name, opts, z, batch, **kw):
    zl = z.detach().clone().requires_grad_(True)
    out = build(name, opts)(zl, batch, **kw)
    out.loss.backward()
    return out, zl.grad


# --- registry, options, protocol -----------------------------------------------------------------------
def test_registry_lists_all_builtins_and_each_satisfies_the_protocol() -> None:
    assert set(ESTIMATORS.names()) >= {
        "forward_kl", "reverse_kl", "reverse_kl_mc", "forward_kl_mc", "reverse_kl_stratified", "grpo",
    }  # fmt: skip
    for name, opts in CASES:
        est = build(name, opts)
        assert isinstance(est, Estimator)
        assert est.name == name
        C.check_pairing(est, C.cache_for(est))
        if est.cache_kind is not None:
            cache = C.CACHES.get(est.cache_kind)()
            rollout = {
                R.COMPLETION_MASK,
                R.COMPLETION_IDS,
                R.BEHAVIOR_LOGPROBS,
                R.MC_IDS,
                R.MC_BEHAVIOR_LOGPROBS,
            }
            assert est.required_columns() <= set(cache.columns()) | rollout, name


def test_unknown_options_and_bad_values_fail_with_the_field_name() -> None:
    with pytest.raises(ConfigError, match=r"'options\.advantge'.*did you mean 'advantage'"):
        build("reverse_kl_mc", {"advantge": "stale"})
    with pytest.raises(ConfigError, match="tail"):
        build("forward_kl", {"tail": "chop"})
    with pytest.raises(ConfigError, match="advantage"):
        build("reverse_kl_mc", {"form": "value", "advantage": "stale"})
    with pytest.raises(ConfigError, match="chunk_size"):
        build("reverse_kl", {"chunk_size": -2})
    with pytest.raises(ConfigError, match=r"'name'.*did you mean 'reverse_kl'"):
        build("revers_kl", {})
    assert isinstance(build("asyncrl.estimators.kl:ForwardKL", {"tail": "drop"}), ForwardKL)
    with pytest.raises(TypeError, match="either"):
        ForwardKL(ForwardKL.Config(), tail="drop")


def test_cache_kind_follows_options() -> None:
    assert ForwardKL().cache_kind == "topk" and ForwardKL(dense=True).cache_kind == "dense"
    assert ReverseKL().cache_kind == "topk"
    assert ReverseKLMC().cache_kind == "behavior_mc" and ReverseKLMC(source="token").cache_kind == "token"
    assert ForwardKLMC().cache_kind == "teacher_mc"
    assert ReverseKLStratified().cache_kind == "topk_behavior_mc"


# --- outputs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "opts"), CASES)
def test_outputs_metrics_and_per_sample(name, opts) -> None:
    z, batch = _make_batch()
    out, grad = _run(name, opts, z, batch)
    assert out.loss.dim() == 0 and out.loss.dtype == f64 and torch.isfinite(out.loss)
    assert torch.isfinite(grad).all()
    assert out.per_sample["loss"].shape == (B,) and not out.per_sample["loss"].requires_grad
    for key, value in out.metrics.items():
        assert key.startswith("est/") and isinstance(value, float), key
    if name != "grpo":
        assert "est/kl_value" in out.metrics
    if name in ("forward_kl", "reverse_kl") and not opts.get("dense"):
        assert 0 < out.metrics["est/teacher_mass"] <= 1 and 0 < out.metrics["est/student_mass"] <= 1
    if name in ("reverse_kl_mc", "reverse_kl_stratified"):
        assert out.metrics["est/is_ratio_mean"] > 0 and 0 < out.metrics["est/ess_mc"] <= 1


@pytest.mark.parametrize(("name", "opts"), CASES)
def test_padding_cannot_reach_loss_or_gradient(name, opts) -> None:
    z, batch = _make_batch(1)
    mask = batch[R.COMPLETION_MASK]
    ref, ref_grad = _run(name, opts, z, batch)
    # garbage at padded positions: huge student logits, NaN / positive teacher scores
    pad = ~mask
    z_bad = torch.where(pad[..., None], torch.full_like(z, 1e4), z)
    bad = dict(batch)
    for col in (
        R.TEACHER_TOPK_LOGPROBS,
        R.TEACHER_MC_LOGPROBS,
        R.TEACHER_TOKEN_LOGPROBS,
        R.MC_BEHAVIOR_LOGPROBS,
    ):
        x = batch[col]
        m = pad.view(B, T, *([1] * (x.dim() - 2))).expand_as(x)
        bad[col] = torch.where(m, torch.full_like(x, float("nan")), x)
    bad[R.BEHAVIOR_LOGPROBS] = torch.where(
        pad, torch.full_like(batch[R.BEHAVIOR_LOGPROBS], 5.0), batch[R.BEHAVIOR_LOGPROBS]
    )
    out, grad = _run(name, opts, z_bad, bad)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.per_sample["loss"], ref.per_sample["loss"])
    assert torch.count_nonzero(grad[pad]) == 0
    torch.testing.assert_close(grad[mask], ref_grad[mask])


@pytest.mark.parametrize(("name", "opts"), CASES)
def test_token_weights_are_detached_and_weight_zero_removes_a_token(name, opts) -> None:
    z, batch = _make_batch(2)
    mask = batch[R.COMPLETION_MASK]
    w = torch.ones(B, T, dtype=f64)
    w[1, 0] = 0.0
    w[1, 1] = 2.5
    w = w.requires_grad_(True)
    est = build(name, opts)
    zl = z.clone().requires_grad_(True)
    out = est(zl, batch, token_weights=w)
    out.loss.backward()
    assert w.grad is None  # detached
    assert torch.count_nonzero(zl.grad[1, 0]) == 0  # weight 0: no gradient from that token
    ones = est(z, batch, token_weights=torch.ones(B, T, dtype=f64))
    plain = est(z, batch)
    torch.testing.assert_close(ones.loss, plain.loss)
    with pytest.raises(ValueError, match="token_weights"):
        est(z, batch, token_weights=torch.ones(B, T + 1))
    assert mask.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, f64])
def test_loss_dtype_is_the_compute_dtype(dtype) -> None:
    z, batch = _make_batch(3, dtype=dtype)
    for name, opts in CASES:
        out = build(name, opts)(z, batch)
        assert out.loss.dtype == (f64 if dtype == f64 else torch.float32), (name, dtype)
        assert torch.isfinite(out.loss), (name, dtype)


def test_chunk_size_option_does_not_change_results() -> None:
    z, batch = _make_batch(4)
    for name, opts in CASES:
        a, ga = _run(name, opts, z, batch)
        b, gb = _run(name, {**opts, "chunk_size": 1}, z, batch)
        torch.testing.assert_close(a.loss, b.loss, atol=1e-12, rtol=0)
        torch.testing.assert_close(ga, gb, atol=1e-12, rtol=0)


# --- T16: forward KL ignores the behavior policy; stale reverse KL does not -----------------------
def test_forward_kl_invariant_to_behavior_logprobs_and_versions() -> None:
    z, batch = _make_batch(5)
    perturbed = dict(batch)
    perturbed[R.BEHAVIOR_LOGPROBS] = batch[R.BEHAVIOR_LOGPROBS] - 0.7
    perturbed[R.MC_BEHAVIOR_LOGPROBS] = batch[R.MC_BEHAVIOR_LOGPROBS] - 0.7
    perturbed[R.TOKEN_VERSIONS] = batch[R.TOKEN_VERSIONS] + 5
    for name, opts in [("forward_kl", {}), ("forward_kl", {"dense": True}), ("forward_kl_mc", {})]:
        a, ga = _run(name, opts, z, batch)
        b, gb = _run(name, opts, z, perturbed)
        assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb), name
    a, ga = _run("reverse_kl_mc", {"advantage": "stale"}, z, batch)
    b, gb = _run("reverse_kl_mc", {"advantage": "stale"}, z, perturbed)
    assert not torch.allclose(ga, gb)


# --- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "opts", "column"),
    [
        ("forward_kl", {}, R.TEACHER_TOPK_LOGPROBS),
        ("reverse_kl_mc", {}, R.TEACHER_MC_LOGPROBS),
        ("reverse_kl_mc", {}, R.MC_BEHAVIOR_LOGPROBS),
        ("reverse_kl_mc", {"source": "token"}, R.TEACHER_TOKEN_LOGPROBS),
        ("forward_kl_mc", {}, R.TEACHER_MC_LOGPROBS),
        ("grpo", {}, R.BEHAVIOR_LOGPROBS),
    ],
)
def test_bad_logprobs_raise_naming_the_column(name, opts, column) -> None:
    z, batch = _make_batch(6)
    est = build(name, opts)
    for bad_value, msg in ((0.5, "> 0"), (float("nan"), "non-finite"), (float("inf"), "non-finite")):
        bad = dict(batch)
        x = batch[column].clone()
        x.view(-1)[0] = bad_value  # position (0, 0) is valid
        bad[column] = x
        with pytest.raises(ValueError, match=column) as err:
            est(z, bad)
        assert msg in str(err.value) and name in str(err.value)


@pytest.mark.parametrize(
    ("name", "column"),
    [("forward_kl", R.TEACHER_TOPK_IDS), ("reverse_kl_mc", R.MC_IDS), ("forward_kl_mc", R.TEACHER_MC_IDS)],
)
def test_ids_outside_vocabulary_raise_naming_the_column(name, column) -> None:
    z, batch = _make_batch(7)
    bad = dict(batch)
    x = batch[column].clone()
    x.view(-1)[0] = V
    bad[column] = x
    with pytest.raises(ValueError, match=f"{column}.*vocabulary"):
        build(name, {})(z, bad)


def test_shape_mismatches_and_missing_columns_raise() -> None:
    z, batch = _make_batch(8)
    with pytest.raises(ValueError, match="student_logits"):
        build("forward_kl", {})(z[:, :-1], batch)
    with pytest.raises(ValueError, match="student_logits"):
        build("forward_kl", {})(z[0], batch)
    bad = {k: v for k, v in batch.items() if k != R.TEACHER_MC_LOGPROBS}
    with pytest.raises(ValueError, match=R.TEACHER_MC_LOGPROBS):
        build("reverse_kl_mc", {})(z, bad)
    bad = dict(batch)
    bad[R.MC_BEHAVIOR_LOGPROBS] = batch[R.MC_BEHAVIOR_LOGPROBS][..., :2]
    with pytest.raises(ValueError, match="m="):
        build("reverse_kl_mc", {})(z, bad)
    bad = dict(batch)
    bad[R.TEACHER_LOGITS] = batch[R.TEACHER_LOGITS][..., :-1]
    with pytest.raises(ValueError, match=R.TEACHER_LOGITS):
        build("forward_kl", {"dense": True})(z, bad)
    one = {**batch, R.MC_IDS: batch[R.MC_IDS][..., :1]}
    one[R.MC_BEHAVIOR_LOGPROBS] = batch[R.MC_BEHAVIOR_LOGPROBS][..., :1]
    one[R.TEACHER_MC_LOGPROBS] = batch[R.TEACHER_MC_LOGPROBS][..., :1]
    with pytest.raises(ValueError, match="m >= 2"):
        build("reverse_kl_mc", {"loo_baseline": True})(z, one)


def test_per_sample_loss_is_the_masked_mean_per_sample() -> None:
    z, batch = _make_batch(9)
    from asyncrl.estimators import functional as F

    lq = F.gather_logprobs(z, batch[R.TEACHER_MC_IDS])
    per_tok = (batch[R.TEACHER_MC_LOGPROBS] - lq).mean(-1)
    mask = batch[R.COMPLETION_MASK]
    out = ForwardKLMC()(z, batch)
    torch.testing.assert_close(out.per_sample["loss"], (per_tok * mask).sum(-1) / mask.sum(-1))
    torch.testing.assert_close(out.loss, (per_tok * mask).sum() / mask.sum())
