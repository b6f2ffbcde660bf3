"""Evaluation without a verifier: each agreement metric against a hand-computed value."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.workloads.agreement import (
    METRICS,
    AgreementEvaluator,
    distinct_n,
    left_pad,
    rouge_l,
    sequence_nll,
    token_agreement,
)
from asyncrl.workloads.tasks import prompt_token_ids
from asyncrl.workloads.tokenizer import char_tokenizer

torch.set_num_threads(1)
TOK = char_tokenizer()


def _kl(a: list[float], b: list[float]) -> float:
    """KL(a || b) of two probability lists, by enumeration."""
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


def test_token_agreement_equals_enumeration() -> None:
    q_logits = torch.tensor([[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [9.0, 9.0, 9.0]]])  # [1, 3, 3]
    p_logits = torch.tensor([[[2.0, 1.0, 0.0], [0.5, 0.0, 0.1], [0.0, 0.0, 0.0]]])
    mask = torch.tensor([[True, True, False]])  # the third position is padding
    out = token_agreement(q_logits, p_logits, mask)
    fwd = rev = agree = 0.0
    for t in range(2):
        q = torch.softmax(q_logits[0, t].double(), -1).tolist()
        p = torch.softmax(p_logits[0, t].double(), -1).tolist()
        fwd += _kl(p, q)
        rev += _kl(q, p)
        agree += float(max(range(3), key=p.__getitem__) == max(range(3), key=q.__getitem__))
    assert float(out["tokens"]) == 2.0
    assert float(out["kl_forward"]) == pytest.approx(fwd, abs=1e-12)
    assert float(out["kl_reverse"]) == pytest.approx(rev, abs=1e-12)
    assert float(out["top1_agree"]) == agree == 1.0  # position 0 disagrees, position 1 agrees


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=10_000))
def test_token_agreement_properties(seed: int) -> None:
    """KLs are >= 0, zero exactly for equal distributions, and invariant to a logit shift."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 7, generator=g, dtype=torch.float64)
    p = torch.randn(2, 4, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 4, generator=g) > 0.3
    out = token_agreement(q, p, mask)
    assert float(out["kl_forward"]) >= 0 and float(out["kl_reverse"]) >= 0
    same = token_agreement(q, q + 5.0, mask)
    assert float(same["kl_forward"]) == pytest.approx(0.0, abs=1e-10)
    assert float(same["top1_agree"]) == float(mask.sum())


def test_token_agreement_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        token_agreement(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), torch.ones(1, 2, dtype=torch.bool))


def test_sequence_nll_by_hand() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    ids = torch.tensor([[0, 2]])
    s, n = sequence_nll(logits, ids, torch.tensor([[True, True]]))
    assert n == 2.0 and s == pytest.approx(-(math.log(0.5) + math.log(0.8)))
    s, n = sequence_nll(logits, ids, torch.tensor([[True, False]]))
    assert n == 1.0 and s == pytest.approx(-math.log(0.5))


def test_rouge_l_against_hand_computed_lcs() -> None:
    # LCS("the cat sat", "the cat sat down") = 3 words: P = 3/3, R = 3/4, F = 2PR/(P+R) = 6/7
    assert rouge_l(["the cat sat"], ["the cat sat down"]) == pytest.approx(6 / 7)
    # LCS("a b c d", "a x c y") = "a c": P = R = 1/2
    assert rouge_l(["a b c d"], ["a x c y"]) == pytest.approx(0.5)
    assert rouge_l(["same words", ""], ["same words", ""]) == pytest.approx(1.0)
    assert rouge_l(["nothing shared"], ["entirely different"]) == 0.0
    with pytest.raises(ValueError, match="predictions for"):
        rouge_l(["a"], ["a", "b"])


def test_distinct_n_by_hand() -> None:
    # bigrams of [1,2,1,2] and [1,2,3]: (1,2) (2,1) (1,2) | (1,2) (2,3) -> 3 distinct of 5
    assert distinct_n([[1, 2, 1, 2], [1, 2, 3]], 2) == pytest.approx(3 / 5)
    assert distinct_n([[7] * 64], 2) == pytest.approx(1 / 63)  # one token repeated: degenerate
    assert distinct_n([[1, 2, 3, 4]], 2) == 1.0
    assert distinct_n([[5], []], 2) == 0.0  # no bigram at all: no variety to credit
    assert distinct_n([[1, 1, 2]], 1) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="n must be"):
        distinct_n([[1]], 0)


def test_left_pad() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]


def _model(seed: int) -> torch.nn.Module:
    spec = ModelSpec("llama", hidden=32, layers=1, heads=2, intermediate=64, max_positions=64)
    return build_model(spec, len(TOK), seed).eval()


def _evaluator(teacher: torch.nn.Module, **kw) -> AgreementEvaluator:
    prompts = prompt_token_ids(TOK, ["12+34=", "7+8=", "hello=", "x"])
    return AgreementEvaluator(teacher, TOK, prompts, max_new_tokens=6, batch_size=3, **kw)


def test_evaluator_of_the_teacher_itself_agrees_perfectly() -> None:
    teacher = _model(0)
    res = _evaluator(teacher)(teacher)
    assert set(res.metrics) == set(METRICS)
    assert res.metrics["kl_forward"] == pytest.approx(0.0, abs=1e-9)
    assert res.metrics["kl_reverse"] == pytest.approx(0.0, abs=1e-9)
    assert res.metrics["top1_agree"] == 1.0
    assert res.metrics["rouge_l"] == 1.0
    assert res.metrics["teacher_nll"] > 0
    assert res.metrics["kl_forward_ref"] == pytest.approx(0.0, abs=1e-9)
    assert res.metrics["top1_agree_ref"] == 1.0
    assert 0.0 < res.metrics["distinct_2"] <= 1.0


def test_reference_metrics_are_teacher_forced_on_the_teachers_response() -> None:
    """kl_forward_ref / top1_agree_ref equal a direct computation at the teacher's greedy tokens."""
    from asyncrl import records as R

    teacher, student = _model(0), _model(1)
    ev = _evaluator(teacher, seed=3)
    res = ev(student)
    fwd = agree = tokens = 0.0
    for (ids, mask), (ry, rm) in zip(ev._batches(), ev.teacher_responses()):
        with torch.no_grad():
            q = R.completion_logits(student, ids, mask, ry, rm)
            p = R.completion_logits(teacher, ids, mask, ry, rm)
        for b in range(ry.shape[0]):
            for t in range(ry.shape[1]):
                if not rm[b, t]:
                    continue
                lp, lq = torch.log_softmax(p[b, t].double(), -1), torch.log_softmax(q[b, t].double(), -1)
                fwd += float((lp.exp() * (lp - lq)).sum())
                agree += float(lq.argmax() == ry[b, t])  # the teacher's greedy token is argmax p
                tokens += 1
    assert tokens > 0
    assert res.metrics["kl_forward_ref"] == pytest.approx(fwd / tokens, rel=1e-9)
    assert res.metrics["top1_agree_ref"] == pytest.approx(agree / tokens)
    assert res.metrics["kl_forward_ref"] > 0.01


def test_evaluator_of_another_student_matches_a_direct_computation() -> None:
    teacher, student = _model(0), _model(1)
    ev = _evaluator(teacher, seed=3)
    res = ev(student)
    assert res.metrics["kl_forward"] > 0.01 and res.metrics["kl_reverse"] > 0.01
    assert 0.0 <= res.metrics["top1_agree"] <= 1.0 and 0.0 <= res.metrics["rouge_l"] <= 1.0
    again = ev(student)  # the same draws every call: an unchanged student scores the same
    assert again.metrics == res.metrics
    assert student.training is False
    assert len(res.samples) == 3 and {"prompt", "student", "teacher"} <= set(res.samples[0])


def test_evaluator_restores_train_mode() -> None:
    teacher, student = _model(0), _model(1)
    student.train()
    _evaluator(teacher)(student)
    assert student.training is True


def test_evaluator_needs_prompts() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        AgreementEvaluator(_model(0), TOK, [], max_new_tokens=4)
