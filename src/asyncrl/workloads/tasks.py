"""Where prompts come from: a task (prompts with a verifier), or a user's file.

A ``Task`` makes ``Example(prompt, answer, prompt_id)`` lists for a ``"train"`` or ``"eval"``
split, deterministically from a seed, and scores completions: ``verify`` is exact match after
stripping whitespace, ``reward`` is 1.0 / 0.0 (optionally partial credit). The built-in
synthetic tasks (``addition``, ``running_sum``, ``running_sum_long``, ``reverse``) are the lab's,
``asyncrl.lab.tasks``, registered in ``TASKS`` as a plugin registers its own
(``asyncrl.registry.load_plugins``).

Train and eval are disjoint by construction: a prompt belongs to the eval split iff
``crc32(prompt) % 10 == 0`` (about 10 % of all prompts), independent of the seed. Eval
examples are distinct prompts; train examples are i.i.d. draws (repeats allowed).

Prompt files (``workload.prompts_path``) replace a task's train split: ``asyncrl.workloads.prompts``
reads them and ``asyncrl.stream`` streams them; the task still scores completions (its
``reward`` may take the rows' metadata) and supplies the eval split.

Users add a task by satisfying the ``Task`` protocol (no inheritance needed) and registering
an instance in ``TASKS`` or naming it by dotted path; ``get_task`` accepts either.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from asyncrl.registry import Registry

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")
EVAL_MODULUS = 10  # a prompt is in "eval" iff crc32(prompt) % EVAL_MODULUS == 0


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer. ``prompt_id`` is its index in its source list."""

    prompt: str
    answer: str
    prompt_id: int


@runtime_checkable
class Task(Protocol):
    """A prompt source with a verifier. Anything with these attributes is a task."""

    name: str
    #: longest prompt / answer in characters (what context a model needs)
    max_prompt_chars: int
    max_answer_chars: int

    def make_examples(self, split: Split, n: int, seed: int) -> list[Example]: ...

    def verify(self, completion: str, answer: str) -> bool: ...

    def reward(self, completion: str, answer: str, metadata: Mapping[str, Any] | None = None) -> float:
        """Score of ``completion``; ``metadata`` is the prompt row's other columns (prompt files;
        optional: a reward without the parameter is called without it, see ``reward_function``)."""
        ...


TASKS: Registry[Task] = Registry("task")


def split_of(prompt: str) -> Split:
    """The split a prompt belongs to: a fixed hash, so train and eval never share a prompt."""
    return "eval" if zlib.crc32(prompt.encode("utf-8")) % EVAL_MODULUS == 0 else "train"


def is_exact_match(completion: str, answer: str) -> bool:
    """Exact string match after stripping surrounding whitespace."""
    return completion.strip() == answer.strip()


def char_overlap(completion: str, answer: str) -> float:
    """Partial credit in [0, 1]: matching characters at equal positions / the longer length."""
    c, a = completion.strip(), answer.strip()
    n = max(len(c), len(a))
    if n == 0:
        return 1.0
    return sum(x == y for x, y in zip(c, a)) / n


def get_task(task: str | Task | type) -> Task:
    """A ``Task`` from a registered name, a dotted path, a task object, or a task class."""
    obj: Any = TASKS.get(task) if isinstance(task, str) else task
    if isinstance(obj, type):
        obj = obj()
    missing = [a for a in ("name", "make_examples", "verify", "reward") if not hasattr(obj, a)]
    if missing:
        raise TypeError(f"{task!r} is not a Task: it lacks {missing} (see asyncrl.workloads.tasks.Task)")
    return obj


# --- rewards ---------------------------------------------------------------------------------
def reward_function(task: Task) -> Callable[[str, str, Mapping[str, Any]], float]:
    """``task.reward`` as ``f(completion, answer, metadata)``: the prompt row's metadata (its other
    columns, ``asyncrl.workloads.prompts``) is passed as ``metadata=`` when the reward takes a
    ``metadata`` parameter (or ``**kwargs``); a two-argument reward is called without it."""
    reward = task.reward
    try:
        params = inspect.signature(reward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no introspection, no metadata
        params = []
    takes = any(p.name == "metadata" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if takes:
        return lambda completion, answer, metadata: float(reward(completion, answer, metadata=dict(metadata)))
    return lambda completion, answer, metadata: float(reward(completion, answer))


def prompt_token_ids(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt as a model is prompted with it, everywhere (pretraining, rollouts,
    eval): a tokenizer with a chat template gets one user turn plus the assistant header
    (``apply_chat_template(..., add_generation_prompt=True)``, no further special tokens); one
    without gets the raw text with its own special tokens (the char tokenizer's ``<bos>``).

    Why decided by the tokenizer: a checkpoint's tokenizer travels with it, so a chat model is
    always prompted the way it was trained, and a base model never gets a template it lacks.
    """
    if isinstance(prompts, str):
        raise TypeError("expected a list of prompts, got a single string; wrap it in a list")
    if getattr(tokenizer, "chat_template", None):
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return tokenizer(list(prompts), add_special_tokens=True)["input_ids"]


def answer_token_budget(task: Task, tokenizer: Any, *, n: int = 4096, seed: int = 0) -> int:
    """``max_new_tokens`` that fits the task's answers: the longest in tokens, + 1 for EOS.

    Measured through ``tokenizer`` (a BPE packs several characters into one token; a character
    tokenizer gives exactly ``task.max_answer_chars``) over ``n`` train draws (the eval split
    has the same answer distribution): the built-in tasks have fixed-width answers, or
    (``reverse``) lengths uniform over a short range that 4096 draws cover.
    """
    examples = task.make_examples("train", n, seed)
    if not examples:
        raise ValueError(f"task {task.name!r} made no examples; cannot size generation from its answers")
    answers = tokenizer([e.answer for e in examples], add_special_tokens=False)["input_ids"]
    return max(map(len, answers)) + 1


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[str],
    max_prompt_len: int | None = None,
    *,
    max_positions: int | None = None,
    max_new_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompts (``prompt_token_ids``: chat template or the tokenizer's special tokens,
    e.g. ``<bos>``) and left-pad them to P.

    Returns ``prompt_ids`` [B, P] int64 and ``prompt_mask`` [B, P] bool with
    ``P = max_prompt_len`` (a fixed width, so batches concatenate; None = the longest prompt).
    Raises ``ValueError`` naming the prompt when it is longer than ``max_prompt_len`` tokens or
    when ``len(prompt) + max_new_tokens`` exceeds ``max_positions`` (the model's
    ``max_position_embeddings``). Padding uses the tokenizer's pad id (else its EOS id).
    """
    if isinstance(prompts, str):
        raise TypeError("encode_prompts expects a list of prompts, got a single string; wrap it in a list")
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token")
    encoded = prompt_token_ids(tokenizer, prompts)
    B = len(encoded)
    P = max_prompt_len if max_prompt_len is not None else max((len(t) for t in encoded), default=1)
    ids = torch.full((B, P), int(pad_id), dtype=torch.int64)
    mask = torch.zeros((B, P), dtype=torch.bool)
    for b, (text, toks) in enumerate(zip(prompts, encoded)):
        n = len(toks)
        if n == 0:
            raise ValueError(f"prompt {b} ({text!r}) encodes to no tokens; prompts must be non-empty")
        if n > P:
            raise ValueError(
                f"prompt {b} ({_short(text)}) has {n} tokens, longer than the context max_prompt_len={P}; "
                f"shorten the prompt or raise max_prompt_len"
            )
        if max_positions is not None and n + max_new_tokens > max_positions:
            raise ValueError(
                f"prompt {b} ({_short(text)}) has {n} tokens + max_new_tokens={max_new_tokens} > the "
                f"model's max_position_embeddings={max_positions}; shorten the prompt or max_new_tokens"
            )
        ids[b, P - n :] = torch.tensor(toks, dtype=torch.int64)
        mask[b, P - n :] = True
    return ids, mask


def _one_line(err: BaseException, limit: int = 120) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
