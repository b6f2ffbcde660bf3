"""One asyncrl estimator in a plain PyTorch loop: no Ray, no pipeline, no pretrained checkpoints.

The parts are a library: this is the whole on-policy distillation step written out by hand,

    sample with the student (HFEngine, versioned weights)
      -> score the completions with the teacher (caches.score_teacher, top-k cache)
      -> student logits aligned to the completion tokens (records.completion_logits)
      -> forward KL(p || pi_theta) on the teacher's top-k (estimators.ForwardKL)
      -> backward, optimizer step, publish the new weights to the engine

with a tiny random Llama teacher and a smaller random student built from ``transformers``
configs and the character tokenizer. The student learns to imitate the teacher on its own
samples, so the printed loss goes down.

    python examples/estimator_plain_loop.py
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl import records as R
from asyncrl.caches import CACHES, score_teacher
from asyncrl.engines import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.estimators import build
from asyncrl.workloads.tasks import encode_prompts, get_task
from asyncrl.workloads.tokenizer import char_tokenizer


def tiny_llama(vocab_size: int, hidden: int, layers: int, tokenizer, seed: int) -> LlamaForCausalLM:
    """A random float32 Llama from a config (no hub), with the tokenizer's special ids."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).float()


def main(steps: int = 30, batch_size: int = 32, seed: int = 0, verbose: bool = True) -> list[float]:
    """Run ``steps`` distillation steps; returns the loss of each step."""
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    vocab = len(tokenizer)
    teacher = tiny_llama(vocab, hidden=64, layers=2, tokenizer=tokenizer, seed=seed + 1).eval()
    with torch.no_grad():  # a random net is near-uniform; a sharper output head gives it opinions
        teacher.lm_head.weight.mul_(40.0)
    student = tiny_llama(vocab, hidden=32, layers=1, tokenizer=tokenizer, seed=seed)

    # The engine holds its own copy of the weights, like a Ray generator actor: after every
    # optimizer step the learner "publishes" version v+1 into it with load_weights.
    engine = HFEngine(copy.deepcopy(student), tokenizer, version=0)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    estimator = build("forward_kl", {"tail": "bucket"})  # cache_kind == "topk"
    cache = CACHES.get(estimator.cache_kind)(k=8)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)

    task = get_task("addition")
    prompts = [e.prompt for e in task.make_examples("train", steps * batch_size, seed)]
    width = max(len(ids) for ids in tokenizer(prompts)["input_ids"])

    losses = []
    for step in range(steps):
        chunk = prompts[step * batch_size : (step + 1) * batch_size]
        prompt_ids, prompt_mask = encode_prompts(tokenizer, chunk, width)  # [B, P] left-padded
        batch = {R.PROMPT_IDS: prompt_ids, R.PROMPT_MASK: prompt_mask}
        rollout = engine.generate(prompt_ids, prompt_mask, sampling, seed=seed * 100_003 + step)  # [B, T]
        batch |= {k: v.clone() for k, v in rollout.items()}  # generate runs in inference mode
        batch |= score_teacher(teacher, batch, cache)  # teacher_topk_ids / _logprobs [B, T, k]

        logits = R.completion_logits(  # [B, T, V], logits[b, t] scored completion token t
            student, prompt_ids, prompt_mask, batch[R.COMPLETION_IDS], batch[R.COMPLETION_MASK]
        )
        out = estimator(logits, batch)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        engine.load_weights(student.state_dict(), version=step + 1)

        losses.append(float(out.loss.detach()))
        if verbose and (step % 5 == 0 or step == steps - 1):
            mass = out.metrics.get("est/teacher_mass", float("nan"))
            print(f"step {step:3d}  forward KL (top-8) {losses[-1]:.4f}  teacher mass kept {mass:.3f}")
    if verbose:
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(f"loss over the first 5 steps {first:.4f} -> last 5 steps {last:.4f}")
    return losses


if __name__ == "__main__":
    main()
