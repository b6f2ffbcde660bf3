"""asyncrl's dense forward KL equals TRL DistillationTrainer's loss at beta = 0 (value and gradient).

Same student weights, same teacher, same completions (sampled by the student with EOS at
different positions, so the completion mask matters). Tolerance: relative 1e-5 on the loss
and on the global gradient norm of the difference (float32, two different reductions).
Needs the ``bench`` extra (trl); skipped without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

pytest.importorskip("trl", reason="the TRL parity check needs the bench extra: pip install -e '.[bench]'")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from trl_parity import compare

from asyncrl import records as R
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.stages import pad_rollout
from asyncrl.workloads.tasks import encode_prompts, get_task
from asyncrl.workloads.tokenizer import char_tokenizer

torch.set_num_threads(1)

TOL = 1e-5
TOK = char_tokenizer()


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Random student and teacher with sharpened heads (a fresh init is near-uniform: KL ~ 0)."""
    student = build_model(ModelSpec("llama", hidden=32, layers=2, heads=2, intermediate=64), len(TOK), 1)
    teacher = build_model(ModelSpec("llama", hidden=64, layers=2, heads=4, intermediate=128), len(TOK), 0)
    with torch.no_grad():
        student.get_output_embeddings().weight.mul_(30.0)
        teacher.get_output_embeddings().weight.mul_(30.0)
    return student, teacher.eval()


def _batch(student: torch.nn.Module, prompts: list[str], new_tokens: int = 8) -> dict[str, torch.Tensor]:
    """Completions sampled by the student, then ended with EOS at different lengths per row."""
    width = max(len(TOK(p)["input_ids"]) for p in prompts)
    ids, mask = encode_prompts(TOK, prompts, width)
    out = HFEngine(student, TOK).generate(
        ids, mask, SamplingParams(max_new_tokens=new_tokens, temperature=1.0), seed=3
    )
    student.train()
    rollout = pad_rollout(out, new_tokens, TOK.pad_token_id)
    completion, valid = rollout[R.COMPLETION_IDS].clone(), rollout[R.COMPLETION_MASK].clone()
    for row in range(len(prompts)):
        n = 1 + (3 * row) % new_tokens
        completion[row, n - 1] = TOK.eos_token_id
        completion[row, n:] = TOK.pad_token_id
        valid[row, n:] = False
    return {
        R.PROMPT_IDS: ids,
        R.PROMPT_MASK: mask.bool(),
        R.COMPLETION_IDS: completion,
        R.COMPLETION_MASK: valid,
    }


def _addition_prompts(n: int = 16) -> list[str]:
    return [e.prompt for e in get_task("addition").make_examples("train", n, 0)]


def test_dense_forward_kl_matches_trl_beta0() -> None:
    student, teacher = _pair()
    batch = _batch(student, _addition_prompts())
    assert batch[R.COMPLETION_MASK].sum(1).unique().numel() > 1  # the mask matters
    r = compare(student, teacher, batch)
    assert r["loss_trl"] > 0.1  # random models disagree: a real, non-trivial KL
    assert r["loss_rel_diff"] < TOL, r
    assert r["grad_rel_diff"] < TOL, r


def test_left_padded_prompts_agree_up_to_float_error() -> None:
    # TRL passes no position_ids; with RoPE a per-row shift of all positions cancels in attention
    student, teacher = _pair()
    batch = _batch(student, ["1+2=", "12+34=", "7=", "123+456=", "5+55="])
    assert not batch[R.PROMPT_MASK].all()  # some rows are left-padded
    r = compare(student, teacher, batch)
    assert r["loss_rel_diff"] < 1e-4, r
    assert r["grad_rel_diff"] < 1e-4, r


def test_parity_check_detects_a_different_divergence() -> None:
    # the check can fail: TRL at beta = 1 (reverse KL) is not asyncrl's forward KL
    from trl_parity import asyncrl_forward_kl, trl_forward_kl

    student, teacher = _pair()
    batch = _batch(student, _addition_prompts())
    fkl = float(asyncrl_forward_kl(student, teacher, batch).detach())
    rkl = float(trl_forward_kl(student, teacher, batch, beta=1.0).detach())
    assert abs(fkl - rkl) / fkl > 0.05


def _trl_trainer(tokenizer, rows, tmp_path):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from asyncrl.workloads.tokenizer import QWEN_MODEL_VOCAB

    vocab = QWEN_MODEL_VOCAB if len(tokenizer) > 4096 else len(tokenizer)
    arch = "qwen3" if vocab > 4096 else "llama"
    model = build_model(ModelSpec(arch, hidden=16, layers=1, heads=2, intermediate=32), vocab, 0)
    args = DistillationConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=len(rows), use_cpu=True,
        report_to="none", disable_tqdm=True, activation_checkpointing=False, bf16=False,
    )  # fmt: skip
    return DistillationTrainer(
        model=model, teacher_model=model, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": rows}),
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["char", "qwen"])
def test_vs_trl_prompts_trl_with_asyncrl_prompt_ids(kind: str, tmp_path) -> None:
    """vs_trl's TRL rows make TRL prompt the student with asyncrl's ids: the raw text with <bos>
    (char), ChatML's user turn + assistant header (qwen); raw text at qwen is caught."""
    import vs_trl

    from asyncrl.workloads.tasks import prompt_token_ids
    from asyncrl.workloads.tokenizer import qwen_tokenizer

    tok = TOK if kind == "char" else qwen_tokenizer()
    prompts = _addition_prompts(4)
    rows = vs_trl.trl_rows(tok, prompts)
    ours = prompt_token_ids(tok, prompts)
    vs_trl.check_trl_prompts(_trl_trainer(tok, rows, tmp_path), rows, ours)
    if kind == "qwen":
        assert prompt_token_ids(tok, prompts[:1])[0][0] == tok.convert_tokens_to_ids("<|im_start|>")
        with pytest.raises(SystemExit, match="TRL tokenizes prompt 0"):
            vs_trl.check_trl_prompts(_trl_trainer(tok, prompts, tmp_path), prompts, ours)
