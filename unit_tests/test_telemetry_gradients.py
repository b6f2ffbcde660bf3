"""Gradient diagnostics (asyncrl.telemetry.gradients): the estimator's gradient against the exact
dense-KL gradient on the same batch, the row-group cross-product bias and variance, per-bucket norms,
which blocks carry the dense logits, the consecutive-gradient cosine, and the plan-time refusals."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from asyncrl import records as R
from asyncrl.caches import CACHES, score_teacher
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.estimators import build
from asyncrl.telemetry import gradients as G
from asyncrl.telemetry import names as N
from asyncrl.telemetry.steps import bucket_metrics, teacher_mass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
V = 12
EOS, PAD = 1, 0


def _lm(seed: int, hidden: int = 16, scale: float = 1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def _batch(
    student, teacher, cache: str, *, seed: int, n: int = 16, m: int = 4, k: int = 4, tau: float = 1.0
) -> dict:
    """Rollouts of ``student`` at temperature ``tau`` (with m behavior draws) scored by ``teacher`` into
    ``cache`` + dense, as the scoring stage scores a probed block (the cache's τ is the rollout's)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, V, (n, 3), generator=g)
    prompt_mask = torch.ones(n, 3, dtype=torch.bool)
    engine = HFEngine(student, {"eos_id": EOS, "pad_id": PAD})
    params = SamplingParams(max_new_tokens=4, mc_samples=m, temperature=tau)
    out = engine.generate(prompt_ids, prompt_mask, params, seed=seed)
    batch = {R.PROMPT_IDS: prompt_ids, R.PROMPT_MASK: prompt_mask, **out}
    batch[R.MC_BEHAVIOR_LOGPROBS] = batch[R.MC_BEHAVIOR_LOGPROBS].double()
    kind = CACHES.get(cache)(**({"k": k} if cache == "topk" else {}), temperature=tau)
    batch |= score_teacher(teacher, batch, G.WithDenseLogits(kind))
    return batch


@pytest.fixture(scope="module")
def pair():
    return _lm(0), _lm(1, hidden=32, scale=3.0)


def _probe(student, name: str, options: dict | None = None) -> G.GradientProbe:
    return G.GradientProbe(student, build(name, options or {}))


_COLS = (R.PROMPT_IDS, R.PROMPT_MASK, R.COMPLETION_IDS, R.COMPLETION_MASK)


# --- against the dense reference ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl"])
def test_a_dense_estimator_is_its_own_reference(pair, name) -> None:
    student, teacher = pair
    batch = _batch(student, teacher, "dense", seed=0)
    out = _probe(student, name, {"dense": True})(batch)
    # the probed batch's exact KLs are the dense estimators' losses (token means)
    with torch.no_grad():
        z = R.completion_logits(
            student,
            batch[R.PROMPT_IDS],
            batch[R.PROMPT_MASK],
            batch[R.COMPLETION_IDS],
            batch[R.COMPLETION_MASK],
        )
    for direction, key in (("forward_kl", N.KL_TEACHER_FORWARD), ("reverse_kl", N.KL_TEACHER_REVERSE)):
        loss = build(direction, {"dense": True})(z, batch).loss
        assert out[key] == pytest.approx(float(loss), rel=1e-9)
    assert out[N.GRADREF_COS] == pytest.approx(1.0, abs=1e-9)
    assert out[N.GRADREF_REL_ERR] == pytest.approx(0.0, abs=1e-7)
    assert out[N.GRADREF_BIAS_SQ_REL] == pytest.approx(0.0, abs=1e-12)
    assert out[N.GRADREF_NOISE_REL] == pytest.approx(0.0, abs=1e-12)
    assert out["gradref/norm_est"] == pytest.approx(out["gradref/norm_ref"], rel=1e-9)
    assert out["gradref/var_rel"] == pytest.approx(out["gradref/ref_var_rel"], rel=1e-9)


def test_forward_topk_is_exact_at_k_equal_v_and_biased_below(pair) -> None:
    student, teacher = pair
    full = _probe(student, "forward_kl")(_batch(student, teacher, "topk", seed=1, k=V))
    assert full[N.GRADREF_COS] == pytest.approx(1.0, abs=1e-9)
    small = _probe(student, "forward_kl")(_batch(student, teacher, "topk", seed=1, k=2))
    assert small[N.GRADREF_COS] < 0.999
    assert small[N.GRADREF_REL_ERR] > 1e-3


@pytest.mark.parametrize("tau", [0.5, 2.0])
def test_the_reference_is_the_tempered_teacher_the_estimator_sees(pair, tau) -> None:
    """At τ ≠ 1 the caches keep softmax(z/τ) of the teacher and the learner computes the student at τ,
    so the dense reference must be KL at τ too: a top-k cache holding the whole vocabulary is then exact,
    and the online MC estimator unbiased on policy."""
    student, teacher = pair
    batch = _batch(student, teacher, "topk", seed=7, k=V, tau=tau)
    full = G.GradientProbe(student, build("forward_kl"), temperature=tau)(batch)
    assert full[N.GRADREF_COS] == pytest.approx(1.0, abs=1e-9)
    assert full[N.GRADREF_REL_ERR] == pytest.approx(0.0, abs=1e-6)
    online = G.GradientProbe(student, build("reverse_kl_mc", {"advantage": "online"}), temperature=tau)
    on_policy = online(_batch(student, teacher, "behavior_mc", seed=7, m=4, tau=tau))
    assert on_policy[N.GRADREF_COS] > 0.5  # noisy, but an estimate of the same gradient
    raw = R.completion_logits(teacher, *[batch[c] for c in _COLS]).float().detach()
    torch.testing.assert_close(batch[R.TEACHER_LOGITS], raw / tau)  # z/τ, as every cache's scores are


def test_mc_noise_falls_with_m_and_the_online_estimator_is_unbiased(pair) -> None:
    """reverse_kl_mc (online advantage, unbiased): the error's variance falls ~1/m, and averaged
    over batches the squared-bias estimate is near 0, unlike the biased top-2 reverse KL."""
    student, teacher = pair
    mc = _probe(student, "reverse_kl_mc", {"advantage": "online"})
    noise = {}
    for m in (1, 16):
        runs = [mc(_batch(student, teacher, "behavior_mc", seed=s, m=m, n=32)) for s in range(6)]
        noise[m] = np.mean([r[N.GRADREF_NOISE_REL] for r in runs])
        if m == 16:
            bias_mc = np.mean([r[N.GRADREF_BIAS_SQ_REL] for r in runs])
    assert noise[1] > 5 * noise[16]
    topk = _probe(student, "reverse_kl")
    bias_topk = np.mean(
        [topk(_batch(student, teacher, "topk", seed=s, k=2, n=32))[N.GRADREF_BIAS_SQ_REL] for s in range(6)]
    )
    assert abs(bias_mc) < 0.25 * noise[16] + 0.02
    assert bias_topk > 0.1 and bias_topk > 5 * abs(bias_mc)


def test_decompose_formulas_on_known_groups() -> None:
    """Constant per-token bias c in every group: B = |c|^2 exactly, noise 0; groups weighted by counts."""
    refs = [torch.tensor(v, dtype=torch.float64) for v in ([1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [3.0, -1.0])]
    counts = [1.0, 3.0, 2.0, 4.0]
    c = torch.tensor([0.5, -0.5], dtype=torch.float64)
    out = G._decompose([G._Group(r + c, r, n) for r, n in zip(refs, counts)])
    g = sum(r * n for r, n in zip(refs, counts)) / sum(counts)
    assert out[N.GRADREF_BIAS_SQ] == pytest.approx(float(c.dot(c)))
    assert out[N.GRADREF_NOISE_SQ] == pytest.approx(0.0, abs=1e-12)
    assert out[N.GRADREF_BIAS_SQ_REL] == pytest.approx(float(c.dot(c) / g.dot(g)))
    assert out[N.GRADREF_REF_SQ] == pytest.approx(float(g.dot(g)))
    assert out["gradref/norm_ref"] == pytest.approx(float(g.norm()))
    assert out[N.GRADREF_GROUPS] == 4


def test_cross_product_is_unbiased_where_split_half_is_not() -> None:
    """Heavy-tailed, unequal-variance groups (rows of different lengths whose tokens share one draw):
    the cross-product B averages to the true |b|^2 = 0 while the split-half formula the probe used to
    have, |d|^2 − w_A w_B |d_A − d_B|^2, does not (its diagonal terms leak the variance)."""
    gen = np.random.default_rng(0)
    dim, b = 20, np.zeros(20)
    cross, split = [], []
    for _ in range(4000):
        lengths = gen.choice([1, 16], size=8)  # tokens per row
        sums = [n * (b + gen.standard_t(3, size=dim)) for n in lengths]  # a row's tokens share a draw
        groups = [
            G._Group(
                torch.from_numpy(sum(sums[k::4]) / lengths[k::4].sum()),
                torch.zeros(dim, dtype=torch.float64),
                float(lengths[k::4].sum()),
            )
            for k in range(4)
        ]
        cross.append(G._decompose(groups)[N.GRADREF_BIAS_SQ])
        na, nb = float(lengths[0::2].sum()), float(lengths[1::2].sum())
        da, db = sum(sums[0::2]) / na, sum(sums[1::2]) / nb
        d = (na * da + nb * db) / (na + nb)
        w = na * nb / (na + nb) ** 2
        split.append(float(d @ d - w * (da - db) @ (da - db)))
    cross, split = np.array(cross), np.array(split)
    se_c, se_s = cross.std(ddof=1) / math.sqrt(len(cross)), split.std(ddof=1) / math.sqrt(len(split))
    assert abs(cross.mean()) < 4 * se_c
    assert abs(split.mean()) > 6 * se_s  # the old estimator is biased here


def test_keep_restricts_and_buckets_get_gradient_norms(pair) -> None:
    student, teacher = pair
    batch = _batch(student, teacher, "topk", seed=2)
    probe = _probe(student, "forward_kl")
    keep = np.ones(16, dtype=bool)
    keep[:4] = False
    lags = np.array([0] * 8 + [3] * 8)
    out = probe(batch, keep=keep, lags=lags)
    assert {N.bucket_key("0", "grad_norm"), N.bucket_key("3-4", "grad_norm")} <= set(out)
    sub = {k: v[4:] for k, v in batch.items()}
    assert out[N.GRADREF_COS] == pytest.approx(probe(sub)[N.GRADREF_COS], abs=1e-12)
    one = probe(batch, lags=np.full(16, 2))
    assert one[N.bucket_key("2", "grad_norm")] == pytest.approx(one["gradref/norm_est"], rel=1e-12)


def test_probe_writes_no_grad_and_needs_the_dense_column(pair) -> None:
    student, teacher = pair
    batch = _batch(student, teacher, "topk", seed=3)
    _probe(student, "forward_kl")(batch)
    assert all(p.grad is None for p in student.parameters())
    batch.pop(R.TEACHER_LOGITS)
    with pytest.raises(ValueError, match="teacher_logits"):
        _probe(student, "forward_kl")(batch)


def test_estimand_of_each_estimator() -> None:
    assert G.estimand(build("forward_kl_mc", {})) == "forward"
    assert G.estimand(build("reverse_kl_stratified", {})) == "reverse"
    with pytest.raises(ValueError, match=r"grpo.*grad_reference=none"):
        G.estimand(build("grpo", {}))


# --- which blocks carry the dense logits ----------------------------------------------------------------
def test_dense_reference_due_per_block() -> None:
    due = [b for b in range(12) if G.dense_reference_due(b, every=3, workers=1, minibatches=1)]
    assert due == [0, 3, 6, 9]
    # two workers: rank 0's blocks (even) of rollouts 0, 3
    due = [b for b in range(12) if G.dense_reference_due(b, every=3, workers=2, minibatches=1)]
    assert due == [0, 6]
    # two mini-batches per rollout: rollout r trains versions 2r, 2r+1; every 3 -> rollouts 0, 1, 3, 4
    due = [b for b in range(6) if G.dense_reference_due(b, every=3, workers=1, minibatches=2)]
    assert due == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="grad_every"):
        G.dense_reference_due(0, every=0, workers=1, minibatches=1)


def test_with_dense_logits_adds_the_full_logits(pair) -> None:
    student, teacher = pair
    batch = _batch(student, teacher, "topk", seed=4)
    z = R.completion_logits(
        teacher, batch[R.PROMPT_IDS], batch[R.PROMPT_MASK], batch[R.COMPLETION_IDS], batch[R.COMPLETION_MASK]
    )
    torch.testing.assert_close(batch[R.TEACHER_LOGITS], z.float().detach())
    wrapped = G.WithDenseLogits(CACHES.get("topk")(k=4))
    assert wrapped.columns() == (*CACHES.get("topk")(k=4).columns(), R.TEACHER_LOGITS)


# --- consecutive gradients and teacher mass ----------------------------------------------------------------
def test_gradient_trace_cosine() -> None:
    trace = G.GradientTrace()
    a = [torch.tensor([1.0, 0.0]), torch.tensor([2.0])]
    assert trace(a) == {}
    assert trace([torch.tensor([1.0, 0.0]), torch.tensor([2.0])])[N.GRAD_COS_PREV] == pytest.approx(1.0)
    assert trace([torch.tensor([-1.0, 0.0]), torch.tensor([-2.0])])[N.GRAD_COS_PREV] == pytest.approx(-1.0)
    assert trace([torch.tensor([0.0, 3.0]), torch.tensor([0.0])])[N.GRAD_COS_PREV] == pytest.approx(0.0)


def test_teacher_mass_per_sample_and_bucket() -> None:
    lp = np.log(np.array([[[0.5, 0.25], [0.9, 0.05]], [[0.1, 0.1], [0.2, 0.2]]]))
    mask = np.array([[True, True], [True, False]])
    mass = teacher_mass(lp, mask)
    np.testing.assert_allclose(mass, [(0.75 + 0.95) / 2, 0.2])
    rows = {
        "kept": np.array([True, True]),
        "lag": np.array([0, 2]),
        "loss": np.zeros(2),
        "kl_behavior_current": np.zeros(2),
        "reward": np.zeros(2),
        "seq_log_ratio": np.zeros(2),
        N.SAMPLE_TEACHER_MASS: mass,
    }
    out = bucket_metrics(rows)
    assert out[N.bucket_key("0", "teacher_mass")] == pytest.approx(0.85)
    assert out[N.bucket_key("2", "teacher_mass")] == pytest.approx(0.2)


# --- plan-time refusals ----------------------------------------------------------------------------------
def _check(overrides: list[str], student_dir: str | None = None) -> None:
    from asyncrl.config import load_config
    from asyncrl.estimators import build as build_est
    from asyncrl.plan import check_gradient_telemetry

    cfg = load_config(None, overrides)
    check_gradient_telemetry(cfg, build_est(cfg.estimator.name, dict(cfg.estimator.options)), student_dir)


def test_plan_refuses_rl_large_vocab_and_deepspeed(tmp_path, monkeypatch) -> None:
    _check(["telemetry.grad_reference=dense"])
    with pytest.raises(ValueError, match="learns from rewards"):
        _check(["telemetry.grad_reference=dense", "estimator.name=grpo", "train.group_size=2"])
    with pytest.raises(ValueError, match="deepspeed"):
        _check(["telemetry.grad_cos_prev=true", "pipeline.backend=deepspeed"])
    _lm(0).save_pretrained(tmp_path)
    _check(["telemetry.grad_reference=dense"], str(tmp_path))
    monkeypatch.setattr(G, "MAX_VOCAB", V - 1)
    with pytest.raises(ValueError, match=rf"V={V}.*grad_reference=none"):
        _check(["telemetry.grad_reference=dense"], str(tmp_path))
    with pytest.raises(Exception, match="grad_every"):
        _check(["telemetry.grad_every=0"])
