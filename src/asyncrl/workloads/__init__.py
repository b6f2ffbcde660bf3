"""Workloads: tasks, prompt files, tokenizers, model presets, checkpoints, evaluation, real presets.

Any ``AutoModelForCausalLM`` + tokenizer on disk plugs in (``load_pair``); without one, a run
uses a preset pair cached under ``workload.cache_dir``. The built-in synthetic tasks and tiny
model presets, and ``asyncrl pretrain`` that trains them, are the lab's (``asyncrl.lab.tasks``,
``asyncrl.lab.presets``, ``asyncrl.lab.pretrain``): they register into ``TASKS`` and ``PRESETS``
here through the ``asyncrl.task`` and ``asyncrl.preset`` entry points, and this package never
imports them.

Modules: ``tasks`` (Task protocol, TASKS, rewards, prompt encoding through the tokenizer's chat
template, answer token budgets), ``prompts`` (prompt files: Parquet / JSONL / datasets folders,
``prompt`` or chat ``messages``, metadata for the reward), ``tokenizer`` (char and Qwen BPE
tokenizers, TOKENIZERS), ``models`` (PRESETS, the run's tokenizer before any model loads),
``evaluate`` (greedy exact match; the agreement eval's actor), ``agreement`` (evaluation without a
verifier: the student's agreement with its teacher), ``checkpoints`` (save / check / load_pair),
``gguf`` (GGUF files as checkpoints), ``real`` (real presets: a pretrained teacher, a student pruned
from it and chat prompts, from registry packages; ``asyncrl prepare``).
Names are imported lazily so ``import asyncrl.workloads.tasks`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Example": "tasks",
    "Task": "tasks",
    "TASKS": "tasks",
    "get_task": "tasks",
    "reward_function": "tasks",
    "PromptSource": "prompts",
    "load_prompts": "prompts",
    "encode_prompts": "tasks",
    "prompt_token_ids": "tasks",
    "answer_token_budget": "tasks",
    "char_tokenizer": "tokenizer",
    "qwen_tokenizer": "tokenizer",
    "TOKENIZERS": "tokenizer",
    "PRESETS": "models",
    "exact_match": "evaluate",
    "AgreementEvaluator": "agreement",
    "REAL_PRESETS": "real",
    "prepare": "real",
    "gguf_to_checkpoint": "gguf",
    "load_pair": "checkpoints",
    "CheckpointError": "checkpoints",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncrl.workloads' has no attribute {name!r}")
    return getattr(importlib.import_module(f"asyncrl.workloads.{module}"), name)
