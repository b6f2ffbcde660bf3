"""OPD learning-signal probe: one process, no Ray, the pipeline's per-batch step (``loss_step``) at a
fixed lag, with exact dense-KL monitors and gradient diagnostics against the dense KL.

Why: a pipeline run costs ~25 s of start-up and a staleness grid costs hours on 2 cores, so
questions like "does reverse-KL OPD learn at all on this workload, and under which teacher
temperature / learning rate / clipping?" are settled here first, with the same estimator,
controller and optimizer code the pipeline runs. The rollout engine generates batch ``i`` with the
weights of version ``max(0, i - S)`` (``pipeline.lag_mode: fixed``).

    python benchmarks/opd_probe.py --steps 100 --lr 1e-3                               # forward KL
    python benchmarks/opd_probe.py --estimator reverse_kl --options '{"dense": true}'  # exact RKL
    python benchmarks/opd_probe.py --estimator reverse_kl_mc \
        --options '{"advantage": "online", "loo_baseline": true}' --mc 8 --teacher-temperature 2
    python benchmarks/opd_probe.py --lag 4 --probe-every 10                            # stale, probed

Prints one line per evaluation: step, greedy exact match on the eval split, the exact dense
reverse and forward KL of the current student to the teacher on the batch (nats/token), and the
mean gradient diagnostics (``asyncrl.telemetry.gradients``) since the last line.
``--teacher-temperature T`` scores with the teacher's ``softmax(z / T)``: a softened teacher (the
estimators then distil towards it; T = 1 is the pretrained teacher).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.backends import TorchBackend
from asyncrl.caches import CACHES
from asyncrl.config import load_config
from asyncrl.controllers import build_chain
from asyncrl.estimators import build as build_estimator
from asyncrl.estimators.functional import forward_kl_dense, reverse_kl_dense
from asyncrl.plan import load_examples, make_plan, prompt_blocks
from asyncrl.stages import batch_seed, pad_rollout
from asyncrl.step import StepOptions, StepParts, loss_step
from asyncrl.telemetry.gradients import GradientProbe

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "opd_async.yaml"


def teacher_logits(
    teacher: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float
) -> torch.Tensor:
    with torch.no_grad():
        z = R.completion_logits(
            teacher,
            batch[R.PROMPT_IDS],
            batch[R.PROMPT_MASK],
            batch[R.COMPLETION_IDS],
            batch[R.COMPLETION_MASK],
        )
    return z / temperature if temperature != 1.0 else z


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.engines.hf import HFEngine
    from asyncrl.workloads.evaluate import exact_match
    from asyncrl.workloads.tasks import get_task

    overrides = [
        f"workload.preset={args.preset}",
        f"workload.task={args.task}",
        f"workload.cache_dir={args.cache_dir}",
        f"estimator.name={args.estimator}",
        f"estimator.options={args.options}",
        f"sampling.mc_samples={args.mc}",
        f"cache.k={args.k}",
        f"cache.m={max(args.mc, 1)}",
        f"train.lr={args.lr}",
        f"train.warmup_steps={args.warmup}",
        f"train.grad_clip={args.clip}",
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch}",
        f"seed={args.seed}",
        f"pipeline.max_lag={args.lag}",
        "pipeline.lag_mode=fixed",
        *args.extra,
    ]
    cfg = load_config(CONFIG, overrides)
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.seed)
    plan = make_plan(cfg)
    estimator = build_estimator(cfg.estimator.name, dict(cfg.estimator.options))
    cache = CACHES.get(plan.cache_kind)(**plan.cache_options)
    dense = CACHES.get("dense")()
    tok = AutoTokenizer.from_pretrained(plan.models.student_dir)
    student = AutoModelForCausalLM.from_pretrained(plan.models.student_dir, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(plan.models.teacher_dir, dtype=torch.float32).eval()
    engine = HFEngine.from_pretrained(plan.models.student_dir)
    train_ex, eval_ex = load_examples(cfg)
    eval_ex = eval_ex[: args.eval_size]
    task = get_task(cfg.workload.task)
    P = max(len(tok(e.prompt)["input_ids"]) for e in train_ex[:2048])
    blocks = prompt_blocks(cfg, train_ex, tok, P)
    parts = StepParts(
        backend=TorchBackend(student, cfg.train, world=1),
        estimator=estimator,
        controllers=build_chain(plan.controller_specs),
        options=StepOptions(grad_clip=cfg.train.grad_clip, temperature=cfg.sampling.temperature),
    )
    probe = GradientProbe(student, estimator, cfg.sampling.temperature) if args.probe_every else None

    def evaluate() -> float:
        return exact_match(
            student, tok, task, eval_ex, max_new_tokens=cfg.sampling.max_new_tokens, batch_size=128
        )

    history: collections.deque = collections.deque(maxlen=args.lag + 1)  # weights of versions v-S .. v
    lines: list[dict[str, Any]] = []
    window: dict[str, list[float]] = collections.defaultdict(list)
    version, t0 = 0, time.perf_counter()
    acc0 = evaluate()
    lines.append({"step": 0, "accuracy": acc0})
    print(json.dumps(lines[-1]), flush=True)
    for step in range(cfg.train.steps):
        history.append((version, {k: v.detach().clone() for k, v in student.state_dict().items()}))
        behavior_version, state = history[0]  # exactly S versions back once S steps have run
        if engine.version != behavior_version:
            engine.load_weights(state, behavior_version)
        b = blocks[step]
        g = engine.generate(
            torch.from_numpy(b[R.PROMPT_IDS]),
            torch.from_numpy(b[R.PROMPT_MASK]).bool(),
            cfg.sampling,
            seed=batch_seed(cfg.seed, b[R.SAMPLE_ID]),
        )
        batch: dict[str, Any] = {
            R.PROMPT_IDS: torch.from_numpy(b[R.PROMPT_IDS]),
            R.PROMPT_MASK: torch.from_numpy(b[R.PROMPT_MASK]).bool(),
        }
        batch.update(pad_rollout(g, cfg.sampling.max_new_tokens, engine.pad_id))
        batch = R.trim_to_longest(batch)
        z = teacher_logits(teacher, batch, args.teacher_temperature)
        batch.update(cache.build(z, batch, seed=batch_seed(cfg.seed + 1, b[R.SAMPLE_ID])))
        n = len(b[R.SAMPLE_ID])
        vf = batch[R.TOKEN_VERSIONS].max(1).values.long()
        batch |= {
            R.SAMPLE_ID: torch.from_numpy(b[R.SAMPLE_ID]),
            R.GROUP_ID: torch.from_numpy(b[R.GROUP_ID]),
            R.VERSION_FIRST: vf,
            R.VERSION_LAST: vf,
        }
        mask = batch[R.COMPLETION_MASK]
        with torch.no_grad():  # exact KLs of the current student on this batch, before the step
            zs = R.completion_logits(
                student, batch[R.PROMPT_IDS], batch[R.PROMPT_MASK], batch[R.COMPLETION_IDS], mask
            )
            zs = zs / cfg.sampling.temperature
            for name, fn in (("rkl", reverse_kl_dense), ("fkl", forward_kl_dense)):
                window[name].append(float(fn(zs, z)[mask].mean()))
        if probe is not None and step % args.probe_every == 0:
            full = dict(batch)
            full.update(dense.build(z, batch))
            for key, value in probe(full).items():
                window[key].append(value)
        result = loss_step(batch, parts, version)
        version = result.version
        window["grad_norm"].append(result.grad_norm)
        window["loss"].append(result.loss)
        del n
        if (step + 1) % args.eval_every == 0 or step + 1 == cfg.train.steps:
            line = {"step": step + 1, "accuracy": evaluate(), "wall_s": round(time.perf_counter() - t0, 1)}
            line.update({k: round(float(np.mean(v)), 4) for k, v in window.items()})
            window.clear()
            lines.append(line)
            print(json.dumps(line), flush=True)
    return lines


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--task", default="addition")
    ap.add_argument("--cache-dir", default=".asyncrl_cache")
    ap.add_argument("--estimator", default="forward_kl")
    ap.add_argument("--options", default="{}", help="estimator options as a JSON/YAML mapping")
    ap.add_argument("--mc", type=int, default=0, help="sampling.mc_samples (m) for the MC estimators")
    ap.add_argument("--k", type=int, default=16, help="cache.k (top-k size)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lag", type=int, default=0, help="fixed lag S: batch i is generated by version i - S")
    ap.add_argument("--teacher-temperature", type=float, default=1.0)
    ap.add_argument("--probe-every", type=int, default=0, help="gradient diagnostics every N steps; 0 = off")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--extra", nargs="*", default=[], help="more config overrides KEY=VALUE")
    ap.add_argument("--json", default=None, help="write the lines to this JSON file")
    args = ap.parse_args(argv)
    lines = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "lines": lines}, indent=1))
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
