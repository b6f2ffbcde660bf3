"""Samples/s of (a) a plain single-process loop, (b) asyncrl max_lag=0, (c) asyncrl max_lag=S, in one run.

The plain loop uses the same components (HF engine, teacher cache, estimator, AdamW) with no
Ray, one torch thread, in one process: generate -> score -> step. The pipeline runs every
stage in its own process with one torch thread each. Throughput is steady state: samples
trained between the first and the last optimizer step, excluding start-up (Ray, Train
workers, model loading) and evaluation; the start-up cost is printed separately.

    python benchmarks/async_vs_sync.py --preset small --steps 30
    python benchmarks/async_vs_sync.py --preset tiny --steps 12             # quick smoke
    python benchmarks/async_vs_sync.py --deepspeed                          # + DeepSpeed learner
    .venv-vllm/bin/python benchmarks/async_vs_sync.py --vllm                # + vLLM engine (vllm env)

Goals (issue #5): (b)/(a) >= 0.85 (the framework costs little), (c)/(b) >= 1.5 on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncrl import records as R
from asyncrl.config import load_config
from asyncrl.estimators import build as build_estimator
from asyncrl.pipeline import run
from asyncrl.plan import load_examples, make_plan, prompt_blocks
from asyncrl.stages import batch_seed, pad_rollout

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "opd_async.yaml"


def plain_loop(cfg, warmup: int = 2) -> dict[str, float]:
    """Generate, score and train in one process; returns steady-state samples/s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.caches import CACHES, score_teacher
    from asyncrl.engines import ENGINES

    torch.set_num_threads(cfg.pipeline.torch_threads)
    torch.manual_seed(cfg.seed)
    plan = make_plan(cfg)
    models = plan.models
    estimator = build_estimator(cfg.estimator.name, dict(cfg.estimator.options))
    cache = CACHES.get(plan.cache_kind)(**plan.cache_options)
    tok = AutoTokenizer.from_pretrained(models.student_dir)
    student = AutoModelForCausalLM.from_pretrained(models.student_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(models.teacher_dir, dtype=torch.float32).eval()
    engine = ENGINES.get(cfg.pipeline.engine).from_pretrained(models.student_dir)
    train_ex, _ = load_examples(cfg)
    P = max(len(tok(e.prompt)["input_ids"]) for e in train_ex[:2048])
    blocks = prompt_blocks(cfg, train_ex, tok, P)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.train.lr, fused=True)  # as the learner's backend
    T = cfg.sampling.max_new_tokens
    t_start = None
    for step in range(cfg.train.steps):
        if step == warmup:
            t_start = time.perf_counter()
        b = blocks[step]
        engine.load_weights({k: v.detach().clone() for k, v in student.state_dict().items()}, step)
        g = engine.generate(
            torch.from_numpy(b[R.PROMPT_IDS]),
            torch.from_numpy(b[R.PROMPT_MASK]).bool(),
            cfg.sampling,
            seed=batch_seed(cfg.seed, b[R.SAMPLE_ID]),
        )
        batch = {
            R.PROMPT_IDS: torch.from_numpy(b[R.PROMPT_IDS]),
            R.PROMPT_MASK: torch.from_numpy(b[R.PROMPT_MASK]).bool(),
        }
        batch.update(pad_rollout(g, T, engine.pad_id))
        batch.update(score_teacher(teacher, batch, cache, seed=batch_seed(cfg.seed + 1, b[R.SAMPLE_ID])))
        batch = R.trim_to_longest(batch)
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
        torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.train.grad_clip)
        opt.step()
    dt = time.perf_counter() - t_start
    n = (cfg.train.steps - warmup) * cfg.train.batch_size
    return {"samples_per_s": n / dt, "step_s": dt / (cfg.train.steps - warmup)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--task", default="addition")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-lag", type=int, default=2)
    ap.add_argument("--estimator", default="forward_kl")
    ap.add_argument("--cache-dir", default=".asyncrl_cache")
    ap.add_argument("--extra", nargs="*", default=[], help="extra key=value overrides for every run")
    ap.add_argument(
        "--deepspeed", action="store_true", help="also run (b') max_lag=0 with the DeepSpeed learner"
    )
    ap.add_argument(
        "--vllm",
        action="store_true",
        help="also run (c') max_lag=S with the vLLM engine (run from the vllm env: scripts/vllm_cpu_env.sh)",
    )
    ap.add_argument("--json", default=None, help="write the measured figures to this JSON file")
    args = ap.parse_args(argv)

    from asyncrl.workloads.pretrain import pretrain

    pretrain(task=args.task, preset=args.preset, cache_dir=args.cache_dir, progress=False)
    root = Path(tempfile.mkdtemp(prefix="asyncrl-bench-"))
    base = [
        f"workload.task={args.task}",
        f"workload.preset={args.preset}",
        f"workload.cache_dir={args.cache_dir}",
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch}",
        f"estimator.name={args.estimator}",
        *([] if args.estimator == "forward_kl" else ["estimator.options={}"]),  # config options: FKL
        "train.eval_every=0",
        "telemetry.progress=false",
        "telemetry.tensorboard=false",
        f"sampling.mc_samples={8 if args.estimator.endswith('_mc') else 0}",
        *args.extra,
    ]

    def cfg_for(name: str, *more: str):
        # the demo's config (examples/configs/opd_async.yaml) with the overrides above
        return load_config(CONFIG, [*base, f"run_dir={root / name}", *more])

    figures: dict[str, float] = {}
    a = plain_loop(cfg_for("plain", "pipeline.max_lag=0"))
    figures["plain_samples_per_s"] = a["samples_per_s"]
    rows = [("(a) plain loop, 1 process", a["samples_per_s"], None)]
    runs = [("sync", "(b) asyncrl max_lag=0", ["pipeline.max_lag=0"])]
    if args.deepspeed:
        runs.append(
            (
                "sync_ds",
                "(b') asyncrl max_lag=0, DeepSpeed ZeRO-2",
                ["pipeline.max_lag=0", "pipeline.backend=deepspeed"],
            )
        )
    runs.append(("async", f"(c) asyncrl max_lag={args.max_lag}", [f"pipeline.max_lag={args.max_lag}"]))
    if args.vllm:
        runs.append(
            (
                "async_vllm",
                f"(c') asyncrl max_lag={args.max_lag}, vLLM engine",
                [f"pipeline.max_lag={args.max_lag}", "pipeline.engine=vllm"],
            )
        )
    for key, label, more in runs:
        res = run(cfg_for(key, *more))
        s = res.summary
        figures[f"{key}_samples_per_s"] = s["samples_per_s"]
        figures[f"{key}_wall_s"] = s["wall_time_s"]
        figures[f"{key}_lag_max"] = s["lag_max"]
        rows.append((label, s["samples_per_s"], s["wall_time_s"]))
    figures["ratio_sync_over_plain"] = figures["sync_samples_per_s"] / figures["plain_samples_per_s"]
    figures["ratio_async_over_sync"] = figures["async_samples_per_s"] / figures["sync_samples_per_s"]
    if args.deepspeed:
        figures["ratio_deepspeed_over_ddp"] = figures["sync_ds_samples_per_s"] / figures["sync_samples_per_s"]
    if args.vllm:
        figures["ratio_vllm_over_hf"] = figures["async_vllm_samples_per_s"] / figures["async_samples_per_s"]

    print(
        f"\npreset={args.preset} task={args.task} steps={args.steps} batch={args.batch} "
        f"estimator={args.estimator} torch_threads=1 per process"
    )
    print(f"{'configuration':45s} {'samples/s':>10s} {'wall s (incl. start-up)':>24s}")
    for label, sps, wall in rows:
        print(f"{label:45s} {sps:10.1f} {('' if wall is None else f'{wall:.1f}'):>24s}")
    print(f"(b)/(a) = {figures['ratio_sync_over_plain']:.2f}   (goal >= 0.85)")
    print(f"(c)/(b) = {figures['ratio_async_over_sync']:.2f}   (goal >= 1.5)")
    if args.deepspeed:
        print(f"(b')/(b) = {figures['ratio_deepspeed_over_ddp']:.2f}   (DeepSpeed vs DDP learner)")
    if args.vllm:
        print(f"(c')/(c) = {figures['ratio_vllm_over_hf']:.2f}   (vLLM vs HF rollout engine)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
