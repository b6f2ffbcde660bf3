"""Weight publication with a LoRA student against full weights: bytes, publish and load time,
fingerprint cost, and the HF engine's decode with adapters merged (fast path) or unmerged.

    python benchmarks/lora_publication.py --preset small --r 8 --repeats 20
    python benchmarks/lora_publication.py --preset qwen-tiny --json out.jsonl

Rows, per mode (``full``: the student's state dict; ``lora``: its adapters only, ``train.lora``
with ``--r`` / ``--alpha`` on every linear layer but the LM head):
  bytes             what one publication ships (``publishable_state``; tied tensors once)
  snapshot_ms       ``publishable_state`` in the learner's thread (the CPU copy)
  wire_ms           ``pack_weights`` + pickle protocol 5 round trip + ``unpack_weights``: the
                    object-store path without Ray (what ``ray.put`` / ``ray.get`` copy out of band)
  load_ms           ``HFEngine.load_weights`` (lora: adapters set, merged weights rebuilt from the
                    base; both: the engine's fingerprint of what it now holds)
  fingerprint_ms    ``weights_fingerprint`` alone (every engine after a load, the learner per step)
Decode (``HFEngine.generate``, B x new tokens, fixed length): ``full`` (fast path), ``lora merged``
(fast path on merged weights), ``lora unmerged`` (peft's forward, decode path ``hf``).

Method: the preset's student, freshly initialised; adapters with random B (as after training).
One warm-up, then ``--repeats`` timed calls interleaved across rows; medians. Every number
printed is measured.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from asyncrl.coordinator import pack_weights, publishable_state, unpack_weights
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.lab.presets import build_model, get_preset
from asyncrl.lora import LoRAConfig, apply_lora, state_bytes
from asyncrl.provenance import weights_fingerprint
from asyncrl.workloads.tasks import encode_prompts, get_task
from asyncrl.workloads.tokenizer import char_tokenizer


def wire_round_trip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(pack_weights(state), protocol=5, buffer_callback=buffers.append)
    copies = [bytearray(b.raw()) for b in buffers]  # the object store's copy in
    return unpack_weights(pickle.loads(blob, buffers=copies))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="append one JSON line with the results to this file")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    tok = char_tokenizer()
    spec = get_preset(args.preset).student
    spec = type(spec)(**{**spec.__dict__, "max_positions": max(spec.max_positions, 16 + args.new_tokens)})
    base = build_model(spec, len(tok), seed=args.seed).eval()
    lora = LoRAConfig(r=args.r, alpha=args.alpha)
    learner = apply_lora(copy.deepcopy(base), lora, seed=args.seed)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    ids_ = {"pad_id": tok.pad_token_id, "eos_id": len(tok)}  # EOS never sampled: fixed length
    engines = {
        "full": HFEngine(copy.deepcopy(base), ids_),
        "lora merged": HFEngine(copy.deepcopy(base), ids_, lora=lora, lora_merge=True),
        "lora unmerged": HFEngine(copy.deepcopy(base), ids_, lora=lora, lora_merge=False),
    }
    sources = {"full": base, "lora": learner}
    prompts = [e.prompt for e in get_task("addition").make_examples("eval", args.batch, args.seed)]
    ids, mask = encode_prompts(tok, prompts, max(len(p) for p in prompts) + 1)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)

    pub_rows = {
        f"{mode} {what}": fn
        for mode, model in sources.items()
        for what, fn in {
            "snapshot_ms": lambda m=model: publishable_state(m),
            "wire_ms": lambda m=model: wire_round_trip(publishable_state(m)),
            "load_ms": (
                lambda m=model, e=engines["full" if mode == "full" else "lora merged"]: e.load_weights(
                    publishable_state(m), 1
                )
            ),
            "fingerprint_ms": lambda m=model: weights_fingerprint(publishable_state(m)),
        }.items()
    }
    decode_rows = {
        f"decode {name}": (lambda e=e: e.generate(ids, mask, params, seed=args.seed))
        for name, e in engines.items()
    }
    rows = {**pub_rows, **decode_rows}
    times: dict[str, list[float]] = {k: [] for k in rows}
    for fn in rows.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    snap_only = {k: statistics.median(v) for k, v in times.items()}
    # wire, load and fingerprint rows include a snapshot: report them net of it
    for mode in sources:
        for what in ("wire_ms", "load_ms", "fingerprint_ms"):
            snap_only[f"{mode} {what}"] -= snap_only[f"{mode} snapshot_ms"]
    result = {
        "preset": args.preset,
        "r": args.r,
        "params": sum(p.numel() for p in base.parameters()),
        "bytes": {mode: state_bytes(publishable_state(m)) for mode, m in sources.items()},
        "ms": {k: round(1e3 * v, 3) for k, v in snap_only.items()},
        "decode_tok_s": {k: round(args.batch * args.new_tokens / snap_only[k]) for k in decode_rows},
        "decode_paths": {name: e.decode_path for name, e in engines.items()},
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    b = result["bytes"]
    print(
        f"preset {args.preset} student ({result['params']:,} parameters), "
        f"LoRA r={args.r} on all linear layers"
    )
    print(
        f"bytes per publication: full {b['full']:,}  lora {b['lora']:,}  ({b['full'] / b['lora']:.1f}x fewer)"
    )
    for what in ("snapshot_ms", "wire_ms", "load_ms", "fingerprint_ms"):
        f, lo = result["ms"][f"full {what}"], result["ms"][f"lora {what}"]
        print(f"{what:15s} full {f:8.3f}  lora {lo:8.3f}")
    for k, v in result["decode_tok_s"].items():
        print(f"{k:22s} {v:8d} tok/s  (B={args.batch}, {args.new_tokens} new tokens)")
    print(
        f"date {result['date']}, cpu {result['cpu']}, {args.threads} torch thread(s), {args.repeats} repeats"
    )
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
