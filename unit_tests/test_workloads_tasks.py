"""Built-in tasks, verifiers, user prompt files and prompt encoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.lab.tasks import Addition, Reverse, RunningSum
from asyncrl.registry import RegistryError
from asyncrl.workloads.tasks import (
    TASKS,
    Task,
    char_overlap,
    encode_prompts,
    get_task,
    split_of,
)
from asyncrl.workloads.tokenizer import BOS_ID, PAD_ID, char_tokenizer

TOK = char_tokenizer()


@pytest.mark.parametrize("name", ["addition", "reverse"])
def test_examples_are_deterministic_and_splits_disjoint(name: str) -> None:
    task = get_task(name)
    assert isinstance(task, Task) and task.name == name
    a = task.make_examples("train", 300, seed=7)
    assert a == task.make_examples("train", 300, seed=7)
    assert a != task.make_examples("train", 300, seed=8)
    ev = task.make_examples("eval", 200, seed=7)
    assert len({e.prompt for e in ev}) == 200, "eval prompts are distinct"
    assert not {e.prompt for e in a} & {e.prompt for e in ev}
    assert all(split_of(e.prompt) == "train" for e in a) and all(split_of(e.prompt) == "eval" for e in ev)
    assert [e.prompt_id for e in ev] == list(range(200))
    for e in a + ev:
        assert len(e.prompt) <= task.max_prompt_chars and len(e.answer) <= task.max_answer_chars
        assert task.verify(e.answer, e.answer) and task.reward(e.answer, e.answer) == 1.0
        assert all(ch in TOK.get_vocab() for ch in e.prompt + e.answer), "tokenizer covers the task"


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), i=st.integers(0, 19), pos=st.integers(0, 10), delta=st.integers(1, 9))
def test_addition_answers_verify_and_perturbed_ones_do_not(seed: int, i: int, pos: int, delta: int) -> None:
    task = Addition()
    ex = task.make_examples("train", 20, seed)[i]
    a, b = ex.prompt.rstrip("=").split("+")
    assert int(ex.answer) == int(a) + int(b)
    assert len(ex.answer) == task.digits + 1 and len(a) == len(b) == task.digits
    assert task.verify(f"  {ex.answer}\n", ex.answer)
    j = pos % len(ex.answer)
    wrong = ex.answer[:j] + str((int(ex.answer[j]) + delta) % 10) + ex.answer[j + 1 :]
    assert not task.verify(wrong, ex.answer) and task.reward(wrong, ex.answer) == 0.0
    assert not task.verify(ex.answer + "0", ex.answer)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_reverse_is_long_output_and_verifies(seed: int) -> None:
    task = Reverse()
    for ex in task.make_examples("eval", 5, seed):
        s = ex.prompt.rstrip("=")
        assert 32 <= len(ex.answer) <= 40 and ex.answer == s[::-1]
        assert task.verify(ex.answer, ex.answer) and not task.verify(s, ex.answer)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), pos=st.integers(0, 31))
def test_running_sum_is_long_output_and_verifies(seed: int, pos: int) -> None:
    task = RunningSum()
    ex = task.make_examples("train", 1, seed)[0]
    digits = [int(c) for c in ex.prompt.rstrip("=")]
    assert len(digits) == len(ex.answer) == 32
    assert all(int(ex.answer[j]) == sum(digits[: j + 1]) % 10 for j in range(32))
    wrong = ex.answer[:pos] + str((int(ex.answer[pos]) + 1) % 10) + ex.answer[pos + 1 :]
    assert task.verify(ex.answer, ex.answer) and not task.verify(wrong, ex.answer)


def test_reverse_answer_option_and_partial_credit() -> None:
    ex = Addition(reverse_answer=True).make_examples("train", 5, 0)
    for e in ex:
        a, b = e.prompt.rstrip("=").split("+")
        assert int(e.answer[::-1]) == int(a) + int(b)
    partial = Addition(partial_credit=True)
    assert partial.reward("124", "123") == pytest.approx(2 / 3)
    assert partial.reward("123", "123") == 1.0
    assert char_overlap("", "") == 1.0 and char_overlap("ab", "") == 0.0


def test_task_option_errors_and_unknown_task_suggestion() -> None:
    with pytest.raises(ValueError, match="digits"):
        Addition(digits=0)
    with pytest.raises(ValueError, match="min_len"):
        Reverse(min_len=5, max_len=3)
    with pytest.raises(ValueError, match="distinct=False"):
        Reverse(max_len=40, alphabet="abc", distinct=True)
    ex = Reverse(min_len=8, max_len=8, alphabet="abcdefgh", distinct=True).make_examples("train", 3, 0)
    assert all(sorted(e.answer) == list("abcdefgh") for e in ex)
    with pytest.raises(ValueError, match="length"):
        RunningSum(length=0)
    with pytest.raises(RegistryError, match="did you mean 'addition'"):
        TASKS.get("adition")
    with pytest.raises(ValueError, match="split"):
        Addition().make_examples("test", 3, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="distinct 'eval' prompts"):
        Addition(digits=1).make_examples("eval", 50, 0)  # only ~10 distinct eval prompts exist
    with pytest.raises(TypeError, match="not a Task"):
        get_task(object())  # type: ignore[arg-type]


def test_get_task_accepts_dotted_path_class_and_instance() -> None:
    assert isinstance(get_task("asyncrl.lab.tasks:Reverse"), Reverse)
    t = Addition(digits=3)
    assert get_task(t) is t
    assert get_task(Reverse).name == "reverse"


def test_encode_prompts_left_pads_with_bos() -> None:
    ids, mask = encode_prompts(TOK, ["12+3=", "7="], 8)
    assert ids.shape == mask.shape == (2, 8) and ids.dtype == torch.int64 and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [6, 3]
    assert ids[1, :5].tolist() == [PAD_ID] * 5 and not bool(mask[1, :5].any())
    assert ids[0, 2].item() == BOS_ID and ids[1, 5].item() == BOS_ID
    assert TOK.decode(ids[0, 3:].tolist()) == "12+3="


def test_encode_prompts_errors_name_the_prompt() -> None:
    with pytest.raises(ValueError, match=r"prompt 1 \('a long prompt'\) has 14 tokens.*max_prompt_len=8"):
        encode_prompts(TOK, ["ok", "a long prompt"], 8)
    with pytest.raises(ValueError, match="max_position_embeddings=10"):
        encode_prompts(TOK, ["12345"], 8, max_positions=10, max_new_tokens=5)
    with pytest.raises(TypeError, match="list of prompts"):
        encode_prompts(TOK, "12+3=", 8)


@pytest.mark.parametrize("name", ["addition", "running_sum", "running_sum_long", "reverse"])
def test_answer_token_budget_is_the_longest_answer_plus_eos(name: str) -> None:
    """Through the char tokenizer a token is a character, so the budget is max_answer_chars + 1."""
    from asyncrl.workloads.tasks import answer_token_budget

    task = get_task(name)
    assert answer_token_budget(task, char_tokenizer()) == task.max_answer_chars + 1


def test_answer_token_budget_counts_bpe_tokens_not_characters() -> None:
    from asyncrl.lab.tasks import Reverse
    from asyncrl.workloads.tasks import answer_token_budget
    from asyncrl.workloads.tokenizer import qwen_tokenizer

    qwen = qwen_tokenizer()
    assert answer_token_budget(get_task("running_sum_long"), qwen) == 129  # digits: one token each
    words = Reverse(min_len=12, max_len=12, alphabet="ab")  # "abab..." merges into fewer tokens
    assert answer_token_budget(words, qwen) < 13 == answer_token_budget(words, char_tokenizer())


def test_running_sum_long_is_its_own_task() -> None:
    long, short = get_task("running_sum_long"), get_task("running_sum")
    assert (long.name, long.length, long.max_answer_chars) == ("running_sum_long", 128, 128)
    ex = long.make_examples("train", 3, 0)
    assert all(len(e.answer) == 128 and long.verify(e.answer, e.answer) for e in ex)
    assert ex[0].prompt[:32] != short.make_examples("train", 1, 0)[0].prompt[:32]
