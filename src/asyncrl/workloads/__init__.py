"""Workloads: real presets, synthetic tasks, built-in tokenizers, tiny model presets, pretraining.

No model hub is reachable, so ``asyncrl pretrain`` trains a small teacher and a weaker
student (``transformers`` Llama/GPT-2 built from a config) on a built-in task and caches
them as ordinary HF checkpoints; any ``AutoModelForCausalLM`` + tokenizer on disk plugs in
the same way (``load_pair``).

Modules: ``tasks`` (Task protocol, TASKS, rewards, prompt encoding through the tokenizer's chat
template, answer token budgets), ``prompts`` (prompt files: Parquet / JSONL / datasets folders,
``prompt`` or chat ``messages``, metadata for the reward), ``tokenizer`` (char and Qwen BPE
tokenizers, TOKENIZERS), ``presets`` (PRESETS, per-task overrides, build_model), ``pretrain``,
``evaluate`` (greedy exact match; the agreement eval's actor), ``agreement`` (evaluation without a
verifier: the student's agreement with its teacher), ``checkpoints`` (save / check / load_pair),
``gguf`` (GGUF files as checkpoints), ``real`` (real presets: a pretrained teacher, a student pruned
from it and chat prompts, from registry packages; ``asyncrl prepare``).
Names are imported lazily so ``import asyncrl.workloads.tasks`` stays light. The
``pretrain`` function lives in (and is not re-exported over) the ``pretrain`` submodule:
``from asyncrl.workloads.pretrain import pretrain``.
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
    "load_prompts": "tasks",
    "encode_prompts": "tasks",
    "prompt_token_ids": "tasks",
    "answer_token_budget": "tasks",
    "char_tokenizer": "tokenizer",
    "qwen_tokenizer": "tokenizer",
    "TOKENIZERS": "tokenizer",
    "PRESETS": "presets",
    "Preset": "presets",
    "ModelSpec": "presets",
    "build_model": "presets",
    "get_preset": "presets",
    "PretrainResult": "pretrain",
    "PretrainError": "pretrain",
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
