"""Greedy exact-match evaluation of a model on task examples, through ``HFEngine``.

Batched: one engine call per ``batch_size`` prompts, temperature 0, no per-row Python loop
inside generation. Used by pretraining (stopping rules, reported accuracy) and, through
``Evaluator``, by the learner's ``eval/accuracy`` on the held-out split.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.workloads.tasks import Example, Task, encode_prompts, get_task

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


def greedy_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 256,
) -> list[str]:
    """Greedy (temperature 0) completions as text, special tokens removed."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = list(prompts[i : i + batch_size])
            ids, mask = encode_prompts(
                tokenizer, chunk, max_positions=engine.max_positions, max_new_tokens=max_new_tokens
            )
            res = engine.generate(ids, mask, params, seed=0)
            out.extend(tokenizer.batch_decode(res["completion_ids"].tolist(), skip_special_tokens=True))
    finally:
        model.train(was_training)
    return out


def exact_match(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    examples: Sequence[Example],
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Fraction of ``examples`` whose greedy completion passes ``task.verify``."""
    if not examples:
        raise ValueError("exact_match needs at least one example")
    texts = greedy_completions(model, tokenizer, [e.prompt for e in examples], max_new_tokens, batch_size)
    return sum(task.verify(c, e.answer) for c, e in zip(texts, examples)) / len(examples)


class Evaluator:
    """Greedy exact match on a run's held-out split (learner rank 0), timed."""

    def __init__(self, cfg: RunConfig, tokenizer: Any, prompts: list[tuple[str, str]]) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.task = get_task(cfg.workload.task)
        self.examples = [Example(prompt=p, answer=a, prompt_id=i) for i, (p, a) in enumerate(prompts)]

    def __call__(self, model: torch.nn.Module) -> tuple[float, float]:
        """(accuracy, seconds it took)."""
        t0 = time.perf_counter()
        acc = exact_match(
            model,
            self.tokenizer,
            self.task,
            self.examples,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            batch_size=64,
        )
        return float(acc), time.perf_counter() - t0
