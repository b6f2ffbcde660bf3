"""LoRA students and version provenance end to end (tiny preset, Ray Data + Ray Train).

- LoRA at max_lag 0 reproduces, step by step, a plain single-process LoRA loop written here
  (through the stage actors, and colocated in the learner).
- LoRA async with 2 generators keeps the staleness contract; every block's fingerprint is checked.
- An engine that drops one weight update (``faults.skip_weight_load``), adapters or full weights,
  fails the run loudly, naming the engine and both versions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import check_contract, tiny_config

from asyncrl import records as R
from asyncrl.pipeline import run
from asyncrl.plan import load_examples, make_plan, prompt_blocks
from asyncrl.telemetry.sinks import read_metrics
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray

LORA = "train.lora={r: 4, alpha: 8.0}"


def plain_lora_losses(cfg) -> list[float]:
    """The same components in one process, no Ray: a peft LoRA student, adapters shipped to an HF
    engine that merges them, generate -> score -> loss -> step on the adapters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.caches import CACHES, score_teacher
    from asyncrl.engines.hf import HFEngine
    from asyncrl.estimators import build
    from asyncrl.lora import adapter_state, apply_lora
    from asyncrl.stages import batch_seed, pad_to

    torch.manual_seed(cfg.seed)
    plan = make_plan(cfg)
    models = plan.models
    estimator = build(cfg.estimator.name, dict(cfg.estimator.options))
    cache = CACHES.get(plan.cache_kind)(**plan.cache_options)
    tok = AutoTokenizer.from_pretrained(models.student_dir)
    base = AutoModelForCausalLM.from_pretrained(models.student_dir, dtype=torch.float32).eval()
    student = apply_lora(base, cfg.train.lora, seed=cfg.seed)
    teacher = AutoModelForCausalLM.from_pretrained(models.teacher_dir, dtype=torch.float32).eval()
    engine = HFEngine.from_pretrained(models.student_dir, lora=cfg.train.lora.options())
    train_ex, _ = load_examples(cfg)
    P = max(len(tok(e.prompt)["input_ids"]) for e in train_ex[:2048])
    blocks = prompt_blocks(cfg, train_ex, tok, P)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    T = cfg.sampling.max_new_tokens
    losses = []
    for step in range(cfg.train.steps):
        b = blocks[step]
        engine.load_weights({k: v.detach().clone() for k, v in adapter_state(student).items()}, step)
        g = engine.generate(
            torch.from_numpy(b[R.PROMPT_IDS]),
            torch.from_numpy(b[R.PROMPT_MASK]),
            cfg.sampling,
            seed=batch_seed(cfg.seed, b[R.SAMPLE_ID]),
        )
        batch = {
            R.PROMPT_IDS: torch.from_numpy(b[R.PROMPT_IDS]),
            R.PROMPT_MASK: torch.from_numpy(b[R.PROMPT_MASK]),
            R.COMPLETION_IDS: pad_to(g[R.COMPLETION_IDS], T, engine.pad_id),
            R.COMPLETION_MASK: pad_to(g[R.COMPLETION_MASK], T, False),
            R.BEHAVIOR_LOGPROBS: pad_to(g[R.BEHAVIOR_LOGPROBS], T, 0.0),
        }
        for k in (R.MC_IDS, R.MC_BEHAVIOR_LOGPROBS):
            if k in g:
                batch[k] = pad_to(g[k], T, engine.pad_id if k == R.MC_IDS else 0.0)
        batch.update(score_teacher(teacher, batch, cache, seed=batch_seed(cfg.seed + 1, b[R.SAMPLE_ID])))
        t_eff = max(int(batch[R.COMPLETION_MASK].sum(1).max()), 1)
        for key, col in R.COLUMNS.items():
            if key in batch and len(col.dims) >= 2 and col.dims[1] == "T":
                batch[key] = batch[key][:, :t_eff]
        logits = R.completion_logits(
            student,
            batch[R.PROMPT_IDS],
            batch[R.PROMPT_MASK],
            batch[R.COMPLETION_IDS],
            batch[R.COMPLETION_MASK],
        )
        out = estimator(logits, batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        warm = cfg.train.warmup_steps
        for group in opt.param_groups:
            group["lr"] = cfg.train.lr * (min(1.0, (step + 1) / warm) if warm > 0 else 1.0)
        opt.step()
        losses.append(float(out.loss.detach()))
    return losses


@pytest.mark.parametrize("colocate", [False, True], ids=["stages", "colocated"])
def test_lora_sync_reproduces_plain_lora_loop(ray_local, tiny_pair, tmp_path, colocate):
    cfg = tiny_config(
        tmp_path / "lora_sync",
        LORA,
        "pipeline.max_lag=0",
        "train.steps=6",
        "train.eval_every=0",
        f"pipeline.colocate={str(colocate).lower()}",
    )
    result = run(cfg)
    samples = read_samples(result.run_dir)
    assert samples["kept"].all() and (samples["lag"] == 0).all()
    metrics = [m for m in read_metrics(result.run_dir) if "loss" in m]
    losses = [m["loss"] for m in metrics]
    np.testing.assert_allclose(losses, plain_lora_losses(cfg), atol=1e-5, rtol=0)
    assert sum(m["provenance/checked"] for m in metrics) == 6 * cfg.train.batch_size
    assert all(m["provenance/mismatches"] == 0 for m in metrics)
    if not colocate:  # only adapters travel: far fewer bytes than the student's weights
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_pretrained(make_plan(cfg).models.student_dir)
        full_bytes = sum(p.numel() * p.element_size() for p in full.state_dict().values())
        assert 0 < metrics[-1]["weights/publish_bytes"] < full_bytes / 2


def test_lora_async_two_generators_keep_the_staleness_contract(ray_local, tiny_pair, tmp_path):
    cfg = tiny_config(
        tmp_path / "lora_async",
        LORA,
        "pipeline.max_lag=1",
        "pipeline.generators=2",
        "train.steps=8",
        "train.eval_every=0",
    )
    result = run(cfg)
    check_contract(result, steps=8)
    metrics = [m for m in read_metrics(result.run_dir) if "loss" in m]
    assert sum(m["provenance/checked"] for m in metrics) == 8 * cfg.train.batch_size
    assert len({e for e in read_samples(result.run_dir).get("gen_engine", [])} or {None}) >= 1


@pytest.mark.parametrize("lora", [True, False], ids=["adapters", "full"])
def test_an_engine_that_drops_a_weight_update_fails_the_run(ray_local, tiny_pair, tmp_path, lora):
    """The 3rd weight load of the generator is skipped (it keeps v1 and stamps v2): the learner's
    provenance check fails the run at that block, naming the engine and both versions."""
    cfg = tiny_config(
        tmp_path / "dropped",
        *([LORA] if lora else []),
        "pipeline.max_lag=0",
        "train.steps=6",
        "train.eval_every=0",
        "faults.skip_weight_load=3",
    )
    with pytest.raises(Exception, match="provenance mismatch") as err:
        run(cfg)
    text = str(err.value)
    assert "stamped v2" in text and "the weights of v1" in text and "engine hf (actor" in text
