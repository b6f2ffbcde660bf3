"""Teacher caches: what each kind writes and costs, validation, seeded teacher draws, pairing with
estimators, and end-to-end alignment through a real causal LM (spec T24)."""

from __future__ import annotations

import os

import pytest
import torch

from asyncrl import caches as C
from asyncrl import records as R
from asyncrl.estimators import build
from asyncrl.estimators import functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
f64 = torch.float64
B, T, V = 3, 5, 11


def _logits(seed: int = 0, dtype: torch.dtype = f64) -> torch.Tensor:
    return (torch.randn(B, T, V, dtype=f64, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def _rollout(seed: int = 0, m: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    mc = torch.randint(0, V, (B, T, m), generator=g)
    return {
        R.COMPLETION_IDS: mc[..., 0].clone(),
        R.COMPLETION_MASK: mask,
        R.MC_IDS: mc,
        R.SAMPLE_ID: torch.tensor([10, 11, 12]),
    }


def _cache(kind: str, k: int = 4, m: int = 4):
    return C.CACHES.get(kind)(**C.cache_options(kind, k=k, m=m))


# --- what each kind writes -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_each_kind_writes_its_columns_and_validates(dtype) -> None:
    zt = _logits(0, dtype)
    batch = _rollout()
    lp_full = torch.log_softmax(zt.double(), -1)
    for kind in C.CACHES.names():
        cache = _cache(kind)
        assert isinstance(cache, C.TeacherCache)
        rec = cache.build(zt, batch)
        assert set(rec) == set(cache.columns()), kind
        for name, x in rec.items():
            assert x.shape[:2] == (B, T), (kind, name)
            if name.endswith("_ids"):
                assert x.dtype == C.ID_DTYPE
            else:
                assert x.dtype == dtype, (kind, name)
        cache.validate({**rec, R.COMPLETION_MASK: batch[R.COMPLETION_MASK]}, vocab_size=V)
        # every log-prob is the full-vocabulary one at its id
        pairs = {
            R.TEACHER_TOPK_LOGPROBS: rec.get(R.TEACHER_TOPK_IDS),
            R.TEACHER_MC_LOGPROBS: rec.get(R.TEACHER_MC_IDS, batch[R.MC_IDS]),
            R.TEACHER_TOKEN_LOGPROBS: batch[R.COMPLETION_IDS][..., None],
        }
        for lp_col, ids in pairs.items():
            if lp_col in rec:
                got = rec[lp_col].double().reshape(B, T, -1)
                torch.testing.assert_close(got, lp_full.gather(-1, ids.long()), atol=1e-5, rtol=0)
    top = _cache("topk", k=4).build(zt, batch)
    expected_ids = zt.topk(4, -1).indices
    assert torch.equal(top[R.TEACHER_TOPK_IDS].long(), expected_ids)
    torch.testing.assert_close(_cache("dense").build(zt, batch)[R.TEACHER_LOGITS], zt)


def test_bytes_per_token() -> None:
    assert C.TopKCache(k=64).bytes_per_token() == 8 * 64 + 4  # ids, log-probs, log tail mass
    assert C.BehaviorMCCache().bytes_per_token(m=64) == 4 * 64
    assert C.BehaviorMCCache().bytes_per_token(m=64, include_inputs=True) == 12 * 64
    assert C.TokenCache().bytes_per_token() == 4
    assert C.TeacherMCCache(m=64).bytes_per_token() == 8 * 64
    assert C.TopKBehaviorMCCache(k=64).bytes_per_token(m=16) == 8 * 64 + 4 + 4 * 16
    assert C.DenseCache().bytes_per_token(vocab_size=151_936) == 4 * 151_936
    with pytest.raises(ValueError, match="m"):
        C.BehaviorMCCache().bytes_per_token()
    with pytest.raises(ValueError, match="vocab_size"):
        C.DenseCache().bytes_per_token()
    table = C.bytes_table(1000, 8, 8)
    assert set(table) == set(C.CACHES.names()) and table["dense"] == 4000


def test_options_are_checked_and_filtered() -> None:
    with pytest.raises(ValueError, match="k"):
        C.TopKCache(k=0)
    with pytest.raises(ValueError, match="m"):
        C.TeacherMCCache(m=0)
    assert C.cache_options("token", k=4, m=8, seed=1) == {}
    assert C.cache_options("teacher_mc", k=4, m=8, seed=1) == {"m": 8, "seed": 1}
    assert C.cache_options("topk", k=4, m=8) == {"k": 4}
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        C.TopKCache(k=V + 1).build(_logits(), _rollout())


# --- validation ----------------------------------------------------------------------------------------
def test_validate_rejects_bad_records_naming_the_column() -> None:
    zt, batch = _logits(1), _rollout()
    mask = batch[R.COMPLETION_MASK]
    topk = _cache("topk")
    rec = {**topk.build(zt, batch), R.COMPLETION_MASK: mask}

    def bad(col, fn):
        x = rec[col].clone()
        fn(x)
        return {**rec, col: x}

    cases = [
        (bad(R.TEACHER_TOPK_LOGPROBS, lambda x: x.view(-1).__setitem__(0, 0.3)), "> 0"),
        (bad(R.TEACHER_TOPK_LOGPROBS, lambda x: x.view(-1).__setitem__(0, float("nan"))), "non-finite"),
        (bad(R.TEACHER_TOPK_IDS, lambda x: x.view(-1).__setitem__(0, V)), "vocabulary"),
        (bad(R.TEACHER_TOPK_IDS, lambda x: x[0, 0].fill_(2)), "distinct"),
    ]
    for record, msg in cases:
        with pytest.raises(ValueError, match=msg) as err:
            topk.validate(record, vocab_size=V)
        assert "teacher_topk" in str(err.value) and "'topk'" in str(err.value)
    renormed = dict(rec)
    renormed[R.TEACHER_TOPK_LOGPROBS] = torch.log_softmax(rec[R.TEACHER_TOPK_LOGPROBS], -1) + 0.05
    renormed[R.TEACHER_TOPK_LOGPROBS] = renormed[R.TEACHER_TOPK_LOGPROBS].clamp(max=0)
    with pytest.raises(ValueError, match=f"{R.TEACHER_TOPK_LOGPROBS}.*mass.*full vocabulary"):
        topk.validate(renormed)
    with pytest.raises(ValueError, match="k=4, expected k=8"):
        C.TopKCache(k=8).validate(rec)
    with pytest.raises(ValueError, match=R.TEACHER_MC_LOGPROBS):
        C.BehaviorMCCache().validate(rec)  # column missing
    # padded positions are not checked
    pad = dict(rec)
    x = rec[R.TEACHER_TOPK_LOGPROBS].clone()
    x[1, 4] = float("nan")
    pad[R.TEACHER_TOPK_LOGPROBS] = x
    topk.validate(pad, vocab_size=V)


def test_behavior_mc_needs_mc_ids() -> None:
    batch = _rollout()
    del batch[R.MC_IDS]
    for kind in ("behavior_mc", "topk_behavior_mc"):
        with pytest.raises(ValueError, match="mc_ids"):
            _cache(kind).build(_logits(), batch)


# --- T24: multisets survive the round trip ---------------------------------------------------------
def test_multiset_round_trip_keeps_ids_duplicates_and_logprobs() -> None:
    zt, batch = _logits(2), _rollout(m=6)
    batch[R.MC_IDS][0, 0] = torch.tensor([3, 3, 3, 1, 3, 1])  # duplicates kept as drawn
    rec = C.BehaviorMCCache().build(zt, batch)
    lp = rec[R.TEACHER_MC_LOGPROBS]
    assert lp.shape == (B, T, 6)
    assert torch.equal(lp[0, 0, [0, 1, 2, 4]], lp[0, 0, 0].expand(4))
    back = R.to_torch(R.to_numpy({**batch, **rec}))
    assert torch.equal(back[R.MC_IDS], batch[R.MC_IDS])
    assert torch.equal(back[R.TEACHER_MC_LOGPROBS], lp)
    tm = C.TeacherMCCache(m=6).build(zt, batch)
    back = R.to_torch(R.to_numpy(tm))
    assert torch.equal(back[R.TEACHER_MC_IDS], tm[R.TEACHER_MC_IDS])
    assert torch.equal(back[R.TEACHER_MC_LOGPROBS], tm[R.TEACHER_MC_LOGPROBS])


# --- seeded teacher draws ------------------------------------------------------------------------------
def test_teacher_draws_are_seeded_and_independent_of_batching() -> None:
    zt, batch = _logits(3), _rollout()
    cache = C.TeacherMCCache(m=5, seed=1)
    a = cache.build(zt, batch, seed=7)[R.TEACHER_MC_IDS]
    assert torch.equal(a, cache.build(zt, batch, seed=7)[R.TEACHER_MC_IDS])
    assert not torch.equal(a, cache.build(zt, batch, seed=8)[R.TEACHER_MC_IDS])
    assert not torch.equal(a, C.TeacherMCCache(m=5, seed=2).build(zt, batch, seed=7)[R.TEACHER_MC_IDS])
    perm = torch.tensor([2, 0, 1])
    shuffled = {k: v[perm] for k, v in batch.items()}
    b = cache.build(zt[perm], shuffled, seed=7)[R.TEACHER_MC_IDS]
    assert torch.equal(b, a[perm])  # per-sample streams: rows can be batched in any order
    g = torch.Generator().manual_seed(0)
    c1 = cache.build(zt, batch, generator=g)[R.TEACHER_MC_IDS]
    assert torch.equal(
        c1, cache.build(zt, batch, generator=torch.Generator().manual_seed(0))[R.TEACHER_MC_IDS]
    )


def test_teacher_draws_follow_the_teacher_distribution() -> None:
    zt = torch.randn(1, 2, 6, dtype=f64, generator=torch.Generator().manual_seed(4))
    ids = C.TeacherMCCache(m=20_000).build(zt, {})[R.TEACHER_MC_IDS].long()
    freq = torch.nn.functional.one_hot(ids, 6).double().mean(-2)  # [1, 2, 6]
    torch.testing.assert_close(freq, torch.softmax(zt, -1), atol=0.015, rtol=0)


# --- pairing -------------------------------------------------------------------------------------------
def test_pairing_check() -> None:
    fkl = build("forward_kl", {})
    assert C.cache_for(fkl) == "topk"
    C.check_pairing(fkl, "topk")
    C.check_pairing(fkl, "auto")
    C.check_pairing(fkl, "topk_behavior_mc")  # writes a superset
    with pytest.raises(ValueError, match=r"needs cache kind 'topk'.*'behavior_mc'.*cache.kind='topk'"):
        C.check_pairing(fkl, "behavior_mc")
    with pytest.raises(ValueError, match=r"cache\.kind='behavior_mc'"):
        C.check_pairing(build("reverse_kl_mc", {}), "teacher_mc")
    with pytest.raises(ValueError, match="needs no teacher cache"):
        C.check_pairing(build("grpo", {}), "topk")
    C.check_pairing(build("grpo", {}), "auto")
    assert C.cache_for(build("grpo", {})) is None
    with pytest.raises(ValueError, match="unknown cache"):
        C.check_pairing(fkl, "topkk")


# --- T24: alignment end to end through a causal LM ----------------------------------------------------
def _tiny_lm(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).double().eval()


def _lm_batch():
    g = torch.Generator().manual_seed(5)
    Bn, P, Tn, Vn, m = 3, 4, 5, 16, 3
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    prompt_ids = torch.randint(1, Vn, (Bn, P), generator=g) * prompt_mask
    mc = torch.randint(1, Vn, (Bn, Tn, m), generator=g)
    return {
        R.PROMPT_IDS: prompt_ids,
        R.PROMPT_MASK: prompt_mask,
        R.COMPLETION_IDS: mc[..., 0] * completion_mask,
        R.COMPLETION_MASK: completion_mask,
        R.MC_IDS: mc,
        R.SAMPLE_ID: torch.arange(Bn),
    }


ALIGN_CASES = [
    ("forward_kl", {}, "topk"),
    ("reverse_kl", {}, "topk"),
    ("forward_kl", {"dense": True}, "dense"),
    ("forward_kl_mc", {}, "teacher_mc"),
    ("reverse_kl_mc", {}, "behavior_mc"),
    ("reverse_kl_mc", {"source": "token"}, "token"),
    ("reverse_kl_stratified", {}, "topk_behavior_mc"),
]


def test_teacher_equal_to_student_gives_exactly_zero_loss_and_misalignment_does_not() -> None:
    model = _tiny_lm(0)
    batch = _lm_batch()
    args = (batch[R.PROMPT_IDS], batch[R.PROMPT_MASK], batch[R.COMPLETION_IDS], batch[R.COMPLETION_MASK])
    student = R.completion_logits(model, *args)
    # the behavior policy is the student itself (staleness 0), recorded like an engine would
    batch[R.MC_BEHAVIOR_LOGPROBS] = F.gather_logprobs(student.detach(), batch[R.MC_IDS])
    batch[R.BEHAVIOR_LOGPROBS] = F.gather_logprobs(student.detach(), batch[R.COMPLETION_IDS])
    # an off-by-one teacher: logits at position P + t scored as if they scored completion token t
    attn = torch.cat([batch[R.PROMPT_MASK], batch[R.COMPLETION_MASK]], 1).long()
    full = model(
        input_ids=torch.cat(args[::2], 1), attention_mask=attn, position_ids=R.position_ids(attn)
    ).logits
    shifted = full[:, batch[R.PROMPT_IDS].shape[1] :].detach()
    for name, opts, kind in ALIGN_CASES:
        est = build(name, opts)
        C.check_pairing(est, kind)
        cache = _cache(kind, k=6, m=3)
        rec = C.score_teacher(model, batch, cache, seed=3)
        cache.validate({**rec, R.COMPLETION_MASK: batch[R.COMPLETION_MASK]}, vocab_size=16)
        out = est(student, {**batch, **rec})
        assert out.loss.item() == 0.0, (name, opts, out.loss.item())
        wrong = cache.build(shifted, batch, seed=3)
        assert abs(est(student, {**batch, **wrong}).loss.item()) > 1e-3, (name, opts)


def test_score_teacher_checks_columns_and_runs_without_grad() -> None:
    model = _tiny_lm(1)
    batch = _lm_batch()
    with pytest.raises(ValueError, match="mc_ids"):
        C.score_teacher(model, {k: v for k, v in batch.items() if k != R.MC_IDS}, "behavior_mc")
    with pytest.raises(ValueError, match="prompt_mask"):
        C.score_teacher(model, {k: v for k, v in batch.items() if k != R.PROMPT_MASK}, "topk")
    rec = C.score_teacher(model, batch, C.TopKCache(k=3))
    assert not any(v.requires_grad for v in rec.values())
    assert rec[R.TEACHER_TOPK_IDS].shape == (3, 5, 3)
