"""A real BPE vocabulary end to end: the `qwen-tiny` pair (Qwen3 blocks, Qwen's 151,646-token
tokenizer, 151,936 logits, ChatML prompts) through OPD (forward KL on a top-16 cache) and GRPO in
the whole pipeline, with chunked log-softmax gathers, and `asyncrl eval` on the pretrained pair.

What this catches that the char-tokenizer tests cannot: pad != 0 and no BOS, EOS = <|im_end|>,
chat-templated prompts (the pipeline, the pretraining and the evaluator must agree on them),
answers of several characters per token position decoded through the BPE, and a [B, T, V] at
V ~ 151k (top-k cache ids must fit int32 and stay below V; gathers are chunked).
"""

from __future__ import annotations

import json

import pytest
from conftest import tiny_config

from asyncrl.cli import main
from asyncrl.pipeline import run
from asyncrl.plan import load_examples, prompt_blocks
from asyncrl.telemetry.sinks import read_metrics
from asyncrl.telemetry.summary import read_samples
from asyncrl.workloads.tokenizer import QWEN_MODEL_VOCAB

pytestmark = pytest.mark.ray

QWEN = ["workload.preset=qwen-tiny", "workload.task=addition", "train.logits_chunk=2"]


def _check_run(result, cfg, steps: int) -> None:
    samples = read_samples(result.run_dir)
    kept = samples[samples["kept"]]
    assert len(kept) == steps * cfg.train.batch_size
    # answers are 3 digits + <|im_end|>: generation is sized in tokens, and EOS stops rows
    assert cfg.sampling.max_new_tokens == 4
    assert kept["completion_len"].between(1, 4).all() and (kept["completion_len"] == 4).mean() > 0.5
    metrics = read_metrics(result.run_dir)
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == steps and all(loss == loss for loss in losses)  # finite, one per step
    # greedy eval decodes answers through the BPE and checks them: the pretrained student (~0.27)
    accuracy = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    assert accuracy and accuracy[0] > 0.05


def test_qwen_vocab_opd_forward_kl_topk(ray_local, qwen_pair, tmp_path):
    assert qwen_pair.teacher_accuracy > qwen_pair.student_accuracy + 0.2
    cfg = tiny_config(
        tmp_path / "opd",
        *QWEN,
        "estimator.name=forward_kl",
        "estimator.options={tail: bucket, chunk_size: 2}",
        "cache.k=16",
        "sampling.mc_samples=0",
        "train.steps=3",
        "train.batch_size=8",
        "train.eval_every=3",
        "train.eval_size=32",
        "pipeline.max_lag=1",
    )
    # the prompts the generators get are ChatML turns, left-padded with <|endoftext|>
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_pair.student_dir)
    train, _ = load_examples(cfg)
    block = prompt_blocks(cfg, train[:64], tok, 16)[0]
    first = block["prompt_ids"][0][block["prompt_mask"][0]].tolist()
    assert tok.decode(first).startswith("<|im_start|>user\n") and first[-3:] == [151_644, 77_091, 198]
    assert (block["prompt_ids"][~block["prompt_mask"]] == tok.pad_token_id).all()

    result = run(cfg)
    _check_run(result, cfg, 3)
    mass = [m["est/teacher_mass"] for m in read_metrics(result.run_dir) if "est/teacher_mass" in m]
    assert mass and all(0.5 < x <= 1.0 + 1e-6 for x in mass)  # top-16 of 151,936 holds the teacher's mass


def test_qwen_vocab_grpo(ray_local, qwen_pair, tmp_path):
    cfg = tiny_config(
        tmp_path / "grpo",
        *QWEN,
        "estimator.options.chunk_size=2",  # the shipped options (anchor: proximal) plus chunking
        "train.steps=2",
        "train.batch_size=8",
        "train.group_size=4",
        "train.eval_every=2",
        "train.eval_size=32",
        "pipeline.max_lag=0",
        config="grpo.yaml",
    )
    result = run(cfg)
    _check_run(result, cfg, 2)
    samples = read_samples(result.run_dir)
    assert set(samples["reward"]) <= {0.0, 1.0}  # exact-match rewards, sampled at tau=1
    # lock-step: step 2's rollouts came from the weights step 1 published, whose tied embedding / LM
    # head travel as one tensor (asyncrl.tied); the engine must sample as the learner scores
    assert (samples["lag"] == 0).all() and (samples["version_first"] == samples["learner_version"]).all()
    assert sorted(samples["learner_version"].unique()) == [0, 1]
    assert samples["kl_behavior_current"].abs().max() < 1e-4


def test_qwen_pair_eval_cli_matches_pretraining(qwen_pair, capsys):
    """`asyncrl eval` prompts through the chat template and decodes through the BPE, as pretraining did."""
    meta = json.loads((qwen_pair.teacher_dir / "asyncrl_meta.json").read_text())
    assert meta["tokenizer"] == "qwen" and meta["preset"] == "qwen-tiny"
    for path, acc in ((qwen_pair.teacher_dir, qwen_pair.teacher_accuracy),):
        argv = ["eval", "--model", str(path), "--task", "addition", "--n", "256", "--batch-size", "256"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert f"exact match {acc:.4f} on 256 addition" in out
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(qwen_pair.student_dir).vocab_size == QWEN_MODEL_VOCAB
