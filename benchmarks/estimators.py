"""Time and peak memory of every estimator (forward + backward) against dense KL, plus cache sizes.

    python benchmarks/estimators.py            # V in {64, 32k, 128k, Qwen's 151,936}, B*T = 8*512 = 4096
    python benchmarks/estimators.py --quick    # V in {64, 32k} (CI smoke)
    python benchmarks/estimators.py --qwen --T 128   # only the real Qwen vocabulary (qwen-tiny's logits)

Method. Each case runs in a fresh subprocess (so no allocator state or earlier peak leaks
between cases). The child allocates the inputs (student logits [B, T, V] fp32 with
requires_grad, and the cache columns the estimator reads), runs one small warm-up, then
resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``; if that is not
permitted, the baseline is the current RSS and the peak is ``ru_maxrss``), runs one
forward + backward, and reports ``peak RSS − RSS before the step``: the extra memory the
step needed, including the logits' gradient [B, T, V] that every case must produce.
Time is the median of ``--reps`` further steps. torch's CPU allocator returns large blocks
to the OS, so RSS tracks tensor memory closely. All numbers printed are measured.

Ratios printed: each estimator's peak against "student log-softmax alone" (the naive
``log_softmax(z).gather(ids)`` an LM loss would do; goal ≤ 1.2x for top-k and MC
estimators), and the chunked gather against that naive gather at the largest V
(goal ≥ 3x lower forward peak; forward+backward is also shown, where the [B, T, V] gradient
both must produce bounds the ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

#: (label, estimator name or special case, options, which of k/m applies)
CASES: list[tuple[str, str, dict, str]] = [
    ("log_softmax+gather (naive)", "naive", {}, ""),
    ("gather_logprobs (chunked)", "gather", {}, ""),
    ("forward_kl dense", "forward_kl", {"dense": True}, ""),
    ("reverse_kl dense", "reverse_kl", {"dense": True}, ""),
    ("forward_kl topk bucket", "forward_kl", {}, "k"),
    ("reverse_kl topk bucket", "reverse_kl", {}, "k"),
    ("reverse_kl_mc pg online", "reverse_kl_mc", {}, "m"),
    ("forward_kl_mc", "forward_kl_mc", {}, "m"),
    ("reverse_kl_stratified", "reverse_kl_stratified", {}, "m"),
    ("grpo", "grpo", {}, ""),
]


# --- child: one case ---------------------------------------------------------------------------------
def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _inputs(kind: str, B: int, T: int, V: int, k: int, m: int, seed: int = 0, dense: bool = False):
    import torch

    from asyncrl import records as R

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g).requires_grad_(True)
    mask = torch.ones(B, T, dtype=torch.bool)

    def lp(*shape):  # valid log-probabilities, normalised with one extra "tail" bin
        return torch.log_softmax(torch.randn(*shape[:-1], shape[-1] + 1, generator=g), -1)[
            ..., :-1
        ].contiguous()

    batch = {R.COMPLETION_MASK: mask}
    if kind in ("naive", "gather", "grpo"):
        batch[R.COMPLETION_IDS] = torch.randint(0, V, (B, T), generator=g)
        batch[R.BEHAVIOR_LOGPROBS] = lp(B, T, 1)[..., 0]
        batch[R.REWARD] = torch.randint(0, 2, (B,), generator=g).float()
        batch[R.GROUP_ID] = torch.arange(B) // 2
    if kind in ("forward_kl", "reverse_kl", "reverse_kl_stratified"):
        base = torch.randint(0, V, (B, T, 1), generator=g)
        batch[R.TEACHER_TOPK_IDS] = ((base + torch.arange(k)) % V).to(torch.int32)  # distinct ids
        head_and_tail = torch.log_softmax(torch.randn(B, T, k + 1, generator=g), -1)  # sums to 1
        batch[R.TEACHER_TOPK_LOGPROBS] = head_and_tail[..., :-1].contiguous()
        batch[R.TEACHER_TOPK_LOG_TAIL] = head_and_tail[..., -1].contiguous()  # the cache's tail bin
    if kind in ("reverse_kl_mc", "reverse_kl_stratified"):
        batch[R.MC_IDS] = torch.randint(0, V, (B, T, m), generator=g, dtype=torch.int32)
        batch[R.MC_BEHAVIOR_LOGPROBS] = -(torch.rand(B, T, m, generator=g) * 4 + 0.5)
        batch[R.TEACHER_MC_LOGPROBS] = -(torch.rand(B, T, m, generator=g) * 4 + 0.5)
    if kind == "forward_kl_mc":
        batch[R.TEACHER_MC_IDS] = torch.randint(0, V, (B, T, m), generator=g, dtype=torch.int32)
        batch[R.TEACHER_MC_LOGPROBS] = -(torch.rand(B, T, m, generator=g) * 4 + 0.5)
    if dense:  # the dense cache: the teacher's full logits
        batch[R.TEACHER_LOGITS] = torch.randn(B, T, V, generator=g)
    return z, batch


def _step_fn(kind: str, options: dict, chunk: int):
    import torch

    from asyncrl import records as R
    from asyncrl.estimators import build
    from asyncrl.estimators.functional import gather_logprobs

    if kind == "naive":

        def step(z, batch):
            ids = batch[R.COMPLETION_IDS].unsqueeze(-1)
            torch.log_softmax(z, -1).gather(-1, ids).mean().backward()

    elif kind == "gather":

        def step(z, batch):
            gather_logprobs(z, batch[R.COMPLETION_IDS], chunk_size=chunk).mean().backward()

    else:
        est = build(kind, {**options, "chunk_size": chunk})

        def step(z, batch):
            est(z, batch).loss.backward()

    return step


def _forward_fn(kind: str, chunk: int):
    import torch

    from asyncrl import records as R
    from asyncrl.estimators.functional import gather_logprobs

    if kind == "naive":
        return lambda z, b: torch.log_softmax(z, -1).gather(-1, b[R.COMPLETION_IDS].unsqueeze(-1))
    return lambda z, b: gather_logprobs(z, b[R.COMPLETION_IDS], chunk_size=chunk)


def child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    kind, options = spec["kind"], spec["options"]
    B, T, V, k, m, chunk = spec["B"], spec["T"], spec["V"], spec["k"], spec["m"], spec["chunk"]
    dense = options.get("dense", False)
    step = _step_fn(kind, options, chunk)
    # warm-up on a tiny problem: kernels, lazy imports
    zw, bw = _inputs(kind, 2, 4, min(V, 64), min(k, 8), min(m, 8), dense=dense)
    step(zw, bw)
    del zw, bw
    z, batch = _inputs(kind, B, T, V, k, m, dense=dense)
    out = {}
    if spec.get("forward_only"):
        fwd = _forward_fn(kind, chunk)
        with torch.no_grad():
            base = _rss_kib()
            exact = _reset_peak()
            r = fwd(z, batch)
            out["peak_mib"] = (_hwm_kib() - base) / 1024
            del r
        out["exact_peak"] = exact
        return out
    base = _rss_kib()
    exact = _reset_peak()
    step(z, batch)
    out["peak_mib"] = (_hwm_kib() - base) / 1024
    out["exact_peak"] = exact
    times = []
    for _ in range(spec["reps"]):
        z.grad = None
        t0 = time.perf_counter()
        step(z, batch)
        times.append(time.perf_counter() - t0)
    out["time_ms"] = statistics.median(times) * 1000 if times else float("nan")
    return out


# --- parent -------------------------------------------------------------------------------------------
def _available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def _run_child(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only V in {64, 32768}")
    ap.add_argument("--vocab", type=int, nargs="*", default=None, help="override the vocabulary sizes")
    ap.add_argument(
        "--qwen", action="store_true", help="only V = the qwen-tiny preset's logits (Qwen's 151,936)"
    )
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--km", type=int, nargs="*", default=[8, 64], help="k (top-k) and m (MC) values")
    ap.add_argument("--chunk", type=int, default=32, help="estimator chunk_size (sequence positions)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per case (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each case")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    ap.add_argument("--child", type=str, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return

    from asyncrl.caches import bytes_table
    from asyncrl.workloads.tokenizer import QWEN_MODEL_VOCAB

    if args.qwen:
        vocabs = [QWEN_MODEL_VOCAB]
    else:
        vocabs = args.vocab or ([64, 32_768] if args.quick else [64, 32_768, 131_072, QWEN_MODEL_VOCAB])
    B, T = args.B, args.T
    print(
        f"# estimators forward+backward, B={B} T={T} (B*T={B * T}), fp32 logits, chunk_size={args.chunk}, "
        f"torch threads={args.threads}, reps={args.reps}"
    )
    print("# peak = extra RSS of one forward+backward over the inputs (incl. the [B,T,V] logit gradient)")
    failed: list[str] = []  # a case that raised fails the benchmark (after the whole table)
    for V in vocabs:
        btv_mib = B * T * V * 4 / 2**20
        reps = args.reps if V <= 32_768 else max(1, min(args.reps, 2))
        print(f"\n## V={V}  (one fp32 [B,T,V] tensor = {btv_mib:.1f} MiB)")
        print(f"{'case':34s} {'k/m':>4s} {'time ms':>10s} {'peak MiB':>10s} {'x naive':>8s}")
        naive_peak = None
        for label, kind, options, which in CASES:
            for km in args.km if which else [0]:
                dense = options.get("dense", False)
                need = btv_mib * (9 if dense else 4)  # rough upper bound, to skip what cannot fit
                if need > 0.8 * _available_mib():
                    print(
                        f"{label:34s} {km or '':>4} skipped: needs ~{need:.0f} MiB, "
                        f"{_available_mib():.0f} MiB available"
                    )
                    continue
                spec = {
                    "kind": kind, "options": options, "B": B, "T": T, "V": V,
                    "k": km or 8, "m": km or 8, "chunk": args.chunk, "reps": reps, "threads": args.threads,
                }  # fmt: skip
                res = _run_child(spec, args.timeout)
                if "error" in res:
                    print(f"{label:34s} {km or '':>4} error: {res['error']}")
                    failed.append(f"{label} k/m={km} V={V}")
                    continue
                if kind == "naive":
                    naive_peak = res["peak_mib"]
                ratio = res["peak_mib"] / naive_peak if naive_peak else float("nan")
                flag = "" if res["exact_peak"] else " (ru_maxrss)"
                cells = f"{res['time_ms']:10.1f} {res['peak_mib']:10.1f} {ratio:8.2f}"
                print(f"{label:34s} {km or '':>4} {cells}{flag}")
                sys.stdout.flush()
        if max(vocabs) == V:
            fw = {}
            for kind in ("naive", "gather"):
                spec = dict(kind=kind, options={}, B=B, T=T, V=V, k=8, m=8, chunk=args.chunk, reps=0,
                            threads=args.threads, forward_only=True)  # fmt: skip
                fw[kind] = _run_child(spec, args.timeout).get("peak_mib", float("nan"))
            ratio = (
                f"{fw['naive'] / fw['gather']:.1f}x lower peak"
                if fw["gather"] >= 1.0
                else "no ratio: the chunked peak is below 1 MiB, RSS's resolution here"
            )
            print(
                f"\nchunked gather vs naive log_softmax+gather at V={V}, forward only: "
                f"naive {fw['naive']:.1f} MiB, chunked {fw['gather']:.1f} MiB -> {ratio}"
            )

    print(
        "\n## cache bytes per completion token (ids int32, log-probs fp32; "
        "+inputs = with the engine's mc_ids/mc_behavior_logprobs that exist only for the cache)"
    )
    kinds = None
    for V in sorted(set(vocabs) | {QWEN_MODEL_VOCAB}):
        for km in args.km:
            table = bytes_table(V, km, km)
            full = bytes_table(V, km, km, include_inputs=True)
            if kinds is None:
                kinds = list(table)
                print(f"{'V':>7s} {'k=m':>4s} " + " ".join(f"{n:>18s}" for n in kinds))
            cells = [f"{table[n]}" + (f" ({full[n]})" if full[n] != table[n] else "") for n in kinds]
            print(f"{V:7d} {km:4d} " + " ".join(f"{c:>18s}" for c in cells))

    if failed:
        raise SystemExit(f"estimators: {len(failed)} case(s) raised: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
