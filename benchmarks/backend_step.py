"""Learner step time of the two backends in one process: torch AdamW vs DeepSpeed ZeRO-1/2.

One step = forward + backward + grad-norm + optimizer step, driven exactly as the learner drives
a ``LearnerBackend``, on a freshly initialised preset student and random tokens (no Ray, no
pretraining). With one process ZeRO partitions nothing, so this measures the engine's own
overhead; the multi-worker comparison comes from pipeline runs (``benchmarks/gpu_check.sh``).

    python benchmarks/backend_step.py --preset small --device cpu --steps 30
    python benchmarks/backend_step.py --preset small --device cuda --batch 64   # GPU machine

Prints the median milliseconds per step and the max |loss difference| to the torch backend.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--steps", type=int, default=30, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (cpu)")
    ap.add_argument("--stages", default="1,2", help="ZeRO stages to time, comma-separated")
    ap.add_argument("--extensions-dir", default=".asyncrl_cache/torch_extensions")
    args = ap.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but torch sees no GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    from asyncrl.backends import make_backend
    from asyncrl.config import TrainConfig
    from asyncrl.lab.presets import build_model, get_preset

    spec = get_preset(args.preset).student
    vocab = 100
    tc = TrainConfig(batch_size=args.batch, lr=1e-3, warmup_steps=0, grad_clip=1.0)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(3, vocab, (args.batch, args.seq), generator=gen)
        for _ in range(args.warmup + args.steps)
    ]

    def time_backend(name: str, **options) -> tuple[list[float], list[float]]:
        model = build_model(spec, vocab, seed=0)
        if name == "ddp":
            model = model.to(device)
        backend = make_backend(name, model, tc, 1, **options)
        dev = getattr(backend, "device", device)
        pos = torch.arange(args.seq, device=dev).expand(args.batch, -1)
        times, losses = [], []
        for i, ids in enumerate(batches):
            ids = ids.to(dev)
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = backend.model(
                input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos, use_cache=False
            )
            logits = out.logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
            backend.backward(loss)
            backend.clip_and_norm(tc.grad_clip)
            backend.step(i, 1.0)
            if args.device == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        return times, losses

    n_params = sum(p.numel() for p in build_model(spec, vocab, seed=0).parameters())
    print(
        f"preset={args.preset} student params={n_params:,} device={args.device} "
        f"B={args.batch} T={args.seq} threads={args.threads} timed steps={args.steps}"
    )
    ref_times, ref_losses = time_backend("ddp")
    print(f"  torch AdamW          {1e3 * statistics.median(ref_times):8.2f} ms/step")
    ext = str(Path(args.extensions_dir).resolve())
    for stage in (int(s) for s in args.stages.split(",")):
        times, losses = time_backend("deepspeed", zero_stage=stage, extensions_dir=ext)
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        print(
            f"  deepspeed ZeRO-{stage}     {1e3 * statistics.median(times):8.2f} ms/step   "
            f"max |loss - torch loss| = {diff:.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
