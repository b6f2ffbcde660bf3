"""What not waiting for a block's longest completion would buy a generator: the decode cost by
live rows, measured, and heavy-tailed blocks replayed under several schedules.

A generator decodes a block of B rows until its longest completion ends, so
with heavy-tailed lengths most decode steps carry rows that have finished. The ways out, in
order of engineering cost:

- ``static``: every step runs all B rows (``HFEngine(compact=False)``);
- ``compaction``: drop finished rows from the decode batch (a step with r live rows costs c(r));
  ``HFEngine(compact=True)``, the engine's default;
- ``K blocks at once`` (``--at-once K ...``, default 2): K blocks decode in shared steps, each
  leaving when its own longest row ends and the next joining then (``pipeline.continuous_batching``
  with ``continuous_blocks=K``: a generator's K concurrent calls, one ``ContinuousBatcher``); also
  run for real through the batcher on the check blocks;
- ``continuous``: refill a freed slot with the next prompt (B live rows per step until the
  stream's tail; each refill prefills one prompt);
- ``partial``: partial rollouts (AReaL, verl): a call takes its block's B prompts into a pool
  beside the rows it carries, decodes the pool until at most ``--carry`` rows are unfinished,
  emits the finished ones and carries the rest, whose prompt + prefix is prefilled again at the
  next call (K/V recomputed: the engine keeps no state between calls).

Method. c(r) and the prefill cost are measured with ``HFEngine.generate`` itself (the rollout
path asyncrl runs): EOS is an id outside the vocabulary, so every row decodes its full length;
for each r, calls of n1 and n2 new tokens give c(r) = (t(n2) - t(n1)) / (n2 - n1) and the
prefill time t(n1) - n1 c(r), divided by r x prompt tokens for a per-token prefill cost p
(a recomputed prefix is charged p per token). Median of ``--repeats`` interleaved calls. The
lengths are ``sampling.heavy_tail`` budgets (``SamplingParams.token_budgets``, seeded per
block), which the engine stops each row at. The schedules are replays of those lengths against
the measured costs (projections); the static and the compaction schedules (the engine's
``compact=False`` / ``True``) are also run for real on the first ``--check-blocks`` blocks and
printed beside their projections, which is how far the cost model can be trusted.
With ``--idle X`` (the learner's idle fraction under static batching, measured by
``benchmarks/inflight.py``) each schedule also gets the idle fraction it would leave:
learner time per block = (1 - X) x static generation time, idle = max(0, 1 - learner / generation).
``partial`` also reports how many calls a row spans: each extra call ages its first tokens by
one call, against the per-token staleness bound.

    python benchmarks/batching_headroom.py --real smollm2 --batch 8 --new-tokens 256 --heavy-tail 1.0
    python benchmarks/batching_headroom.py --real smollm2 --idle 0.22     # + the idle it would leave
    python benchmarks/batching_headroom.py --real smollm2 --batch 4 --at-once 2 3 4 --check-blocks 8
    python benchmarks/batching_headroom.py --preset tiny --batch 8 --new-tokens 64   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine


@dataclass(frozen=True)
class Costs:
    """Measured costs: seconds per decode step by live rows (``step[r]``), per prefilled token."""

    step: dict[int, float]
    prefill_per_token: float

    def c(self, rows: int) -> float:
        """Step time at ``rows`` live rows, linear between measured points (0 rows: no step)."""
        if rows <= 0:
            return 0.0
        xs = sorted(self.step)
        return float(np.interp(rows, xs, [self.step[x] for x in xs]))


@dataclass
class Schedule:
    """One schedule's replay: seconds and tokens for all blocks, and rows emitted."""

    name: str
    seconds: float
    tokens: int
    rows: int
    calls_spanned_max: int = 1
    spanning_frac: float = 0.0


def static(blocks: Sequence[np.ndarray], costs: Costs, prompt: int) -> Schedule:
    """Each block prefills its B prompts, then B rows step until its longest row ends."""
    s = sum(len(b) * prompt * costs.prefill_per_token + int(b.max()) * costs.c(len(b)) for b in blocks)
    return Schedule(
        "static (compact=False)", s, int(sum(b.sum() for b in blocks)), sum(len(b) for b in blocks)
    )


def compaction(blocks: Sequence[np.ndarray], costs: Costs, prompt: int) -> Schedule:
    """Finished rows leave the decode batch: step t costs c(#rows longer than t)."""
    s = 0.0
    for b in blocks:
        s += len(b) * prompt * costs.prefill_per_token
        s += sum(costs.c(int((b > t).sum())) for t in range(int(b.max())))
    return Schedule("compaction", s, int(sum(b.sum() for b in blocks)), sum(len(b) for b in blocks))


def blocks_at_once(blocks: Sequence[np.ndarray], costs: Costs, prompt: int, at_once: int = 2) -> Schedule:
    """``pipeline.continuous_batching``: ``at_once`` blocks decode in shared steps (finished rows
    leave); a block leaves when its own longest row ends and the next block joins (its prefill)."""
    queue = [np.asarray(b) for b in blocks]
    running: list[list] = []  # [lengths, steps taken]
    s = 0.0
    while queue or running:
        while queue and len(running) < at_once:
            b = queue.pop(0)
            s += len(b) * prompt * costs.prefill_per_token
            running.append([b, 0])
        s += costs.c(sum(int((b > t).sum()) for b, t in running))
        for r in running:
            r[1] += 1
        running = [r for r in running if r[1] < int(r[0].max())]
    return Schedule(
        f"{at_once} blocks at once", s, int(sum(b.sum() for b in blocks)), sum(len(b) for b in blocks)
    )


def continuous(blocks: Sequence[np.ndarray], costs: Costs, prompt: int) -> Schedule:
    """B slots; a slot freed by a finished row takes the next prompt of the stream (one prefill)."""
    queue = [int(x) for b in blocks for x in b]
    slots = len(blocks[0])
    live: list[int] = []
    s = 0.0
    while queue or live:
        while queue and len(live) < slots:
            live.append(queue.pop(0))
            s += prompt * costs.prefill_per_token
        s += costs.c(len(live))
        live = [x - 1 for x in live if x > 1]
    return Schedule("continuous", s, int(sum(b.sum() for b in blocks)), sum(len(b) for b in blocks))


def partial(blocks: Sequence[np.ndarray], costs: Costs, prompt: int, carry: int) -> Schedule:
    """Partial rollouts with re-prefill (module docstring). The pool's rows stay in the decode
    batch until the call stops; the carried rows left after the last block are not counted."""
    pool: list[list[int]] = []  # [remaining, done, calls spanned]
    s, tokens, rows, spans = 0.0, 0, 0, []
    for b in blocks:
        s += sum(prompt + done for _, done, _ in pool) * costs.prefill_per_token  # carried: re-prefill
        s += len(b) * prompt * costs.prefill_per_token
        pool = [[r, d, k + 1] for r, d, k in pool] + [[int(x), 0, 1] for x in b]
        while sum(r > 0 for r, _, _ in pool) > carry:
            s += costs.c(len(pool))
            for row in pool:
                if row[0] > 0:
                    row[0] -= 1
                    row[1] += 1
        done = [row for row in pool if row[0] == 0]
        pool = [row for row in pool if row[0] > 0]
        rows += len(done)
        tokens += sum(d for _, d, _ in done)
        spans += [k for _, _, k in done]
    return Schedule(
        f"partial (carry {carry})",
        s,
        tokens,
        rows,
        calls_spanned_max=max(spans, default=1),
        spanning_frac=float(np.mean([k > 1 for k in spans])) if spans else 0.0,
    )


def blocks_at_once_run(
    engine: HFEngine,
    blocks: Sequence[np.ndarray],
    vocab: int,
    B: int,
    P: int,
    law: SamplingParams,
    n: int,
    at_once: int = 2,
) -> float:
    """Seconds for the first ``n`` blocks through a ``ContinuousBatcher`` with at most ``at_once``
    in flight, the next submitted as soon as one ends (a generator actor's concurrent calls); the
    prompts and seeds of the static / compaction checks, so the same lengths."""
    from concurrent.futures import FIRST_COMPLETED, wait

    from asyncrl.engines.continuous import ContinuousBatcher

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (B, P), generator=gen) for _ in range(n)]
    batcher = ContinuousBatcher(engine)

    def submit(i: int):
        return batcher.submit(prompts[i], torch.ones_like(prompts[i], dtype=torch.bool), law, seed=i)

    t0 = time.perf_counter()
    running = {submit(i): i for i in range(min(at_once, n))}
    queued = list(range(len(running), n))
    while running:
        done, _ = wait(running, return_when=FIRST_COMPLETED)
        for fut in done:
            i = running.pop(fut)
            got = fut.result().columns["completion_mask"].sum(1).numpy()
            assert (got == blocks[i]).all(), f"batcher lengths {got} != budgets {blocks[i]}"
            if queued:  # a block ended: the actor's freed call takes the next one
                j = queued.pop(0)
                running[submit(j)] = j
    seconds = time.perf_counter() - t0
    batcher.close()
    return seconds


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """The wall time of each of ``repeats`` calls of ``fn`` (the caller takes the median)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_costs(
    engine: HFEngine, vocab: int, rows: Sequence[int], prompt: int, n1: int, n2: int, repeats: int
) -> Costs:
    """c(r) and the per-token prefill cost from two call lengths per row count (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    calls: dict[tuple[int, int], Callable[[], object]] = {}
    for r in rows:
        ids = torch.randint(1, vocab, (r, prompt), generator=gen)
        mask = torch.ones_like(ids, dtype=torch.bool)
        for n in (n1, n2):
            params = SamplingParams(max_new_tokens=n, temperature=1.0)
            calls[(r, n)] = lambda ids=ids, mask=mask, params=params: engine.generate(
                ids, mask, params, seed=0
            )
    for fn in calls.values():  # warm-up
        fn()
    times: dict[tuple[int, int], list[float]] = {k: [] for k in calls}
    for _ in range(repeats):  # interleaved: load affects every point alike
        for key, fn in calls.items():
            times[key] += timed(fn, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    step = {r: max((med[(r, n2)] - med[(r, n1)]) / (n2 - n1), 1e-9) for r in rows}
    prefill = [max(med[(r, n1)] - n1 * step[r], 0.0) / (r * prompt) for r in rows]
    return Costs(step=step, prefill_per_token=float(statistics.median(prefill)))


def load_engine(args: argparse.Namespace) -> tuple[torch.nn.Module, int]:
    """The model under test and its vocabulary size."""
    if args.real:
        from asyncrl.workloads.real import prepare

        args.model_dir = prepare(args.real, args.cache_dir, progress=False).student_dir
    if args.model_dir:
        model = HFEngine.from_pretrained(args.model_dir).model
    else:
        from asyncrl.lab.presets import build_model, get_preset
        from asyncrl.workloads.tokenizer import char_tokenizer

        spec = get_preset(args.preset).student
        need = args.prompt_tokens + args.new_tokens + 1
        spec = type(spec)(**{**spec.__dict__, "max_positions": max(spec.max_positions, need)})
        model = build_model(spec, len(char_tokenizer()), seed=0).eval()
    return model, int(model.config.vocab_size)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model-dir", default=None, help="an HF checkpoint's directory")
    src.add_argument("--real", default=None, help="a real preset's student (asyncrl prepare NAME, reused)")
    src.add_argument("--preset", default="tiny", help="a lab preset's student, freshly initialised")
    ap.add_argument("--cache-dir", default=".asyncrl_cache", help="where --real is prepared")
    ap.add_argument("--batch", type=int, default=8, help="B: rows per block (the generator's batch)")
    ap.add_argument("--new-tokens", type=int, default=256, help="N: the token limit")
    ap.add_argument("--heavy-tail", type=float, default=1.0, help="alpha of sampling.heavy_tail")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=64, help="blocks replayed per schedule")
    ap.add_argument("--carry", type=int, default=None, help="partial: rows carried at most (default B)")
    ap.add_argument("--check-blocks", type=int, default=4, help="static blocks also run for real")
    ap.add_argument(
        "--at-once",
        type=int,
        nargs="+",
        default=[2],
        metavar="K",
        help="blocks decoded at once (pipeline.continuous_blocks), each replayed and run for real",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--idle", type=float, default=None, help="learner idle fraction measured under static")
    ap.add_argument("--json", default=None, help="append one JSON line with the results to this file")
    args = ap.parse_args(argv)
    if args.heavy_tail <= 0:
        ap.error("--heavy-tail must be > 0: with equal lengths every schedule is static")
    if min(args.at_once) < 2:
        ap.error(f"--at-once takes K >= 2 (one block at a time is compaction), got {args.at_once}")
    if args.idle is not None and not 0 <= args.idle < 1:
        ap.error(f"--idle must be in [0, 1), got {args.idle}")
    torch.set_num_threads(args.threads)
    B, N, P = args.batch, args.new_tokens, args.prompt_tokens
    carry = B if args.carry is None else args.carry

    model, vocab = load_engine(args)
    # EOS is an id the model cannot sample: rows end at the token limit or their budget only
    engines = {c: HFEngine(model, {"pad_id": 0, "eos_id": vocab}, compact=c) for c in (False, True)}
    engine = engines[False]
    rows = sorted({1, 2, max(1, B // 2), B, 2 * B})
    n1, n2 = max(2, N // 16), max(4, N // 4)
    costs = measure_costs(engine, vocab, rows, P, n1, n2, args.repeats)

    law = SamplingParams(max_new_tokens=N, heavy_tail=args.heavy_tail)
    blocks = [law.token_budgets(B, seed) for seed in range(args.blocks)]
    schedules = [
        static(blocks, costs, P),
        compaction(blocks, costs, P),
        *(blocks_at_once(blocks, costs, P, at_once=k) for k in args.at_once),
        continuous(blocks, costs, P),
        partial(blocks, costs, P, carry),
    ]

    # the cost model against real runs of the first blocks (same budgets: same lengths), with the
    # engine's static batching and with its compaction (HFEngine(compact=...))
    check: dict[str, tuple[float, float]] = {}
    for compact, replay in ((False, static), (True, compaction)):
        real = 0.0
        gen = torch.Generator().manual_seed(1)
        for seed in range(args.check_blocks):
            ids = torch.randint(1, vocab, (B, P), generator=gen)
            t0 = time.perf_counter()
            out = engines[compact].generate(ids, torch.ones_like(ids, dtype=torch.bool), law, seed=seed)
            real += time.perf_counter() - t0
            got = out["completion_mask"].sum(1).numpy()
            assert (got == blocks[seed]).all(), f"engine lengths {got} != budgets {blocks[seed]}"
        check[replay.__name__] = (real, replay(blocks[: args.check_blocks], costs, P).seconds)
    # pipeline.continuous_batching: the same blocks through a ContinuousBatcher, K in flight at a
    # time (a generator actor's K concurrent calls), against the K blocks at once replay
    for k in args.at_once:
        check[f"{k}_blocks"] = (
            blocks_at_once_run(engines[True], blocks, vocab, B, P, law, args.check_blocks, at_once=k),
            blocks_at_once(blocks[: args.check_blocks], costs, P, at_once=k).seconds,
        )

    lengths = np.concatenate(blocks)
    pad = 1 - lengths.sum() / sum(len(b) * int(b.max()) for b in blocks)
    print(
        f"B {B}, N {N}, heavy_tail {args.heavy_tail}, prompt {P} tokens, {args.blocks} blocks: lengths "
        f"p50 {np.median(lengths):.0f}, p90 {np.quantile(lengths, 0.9):.0f}, max {lengths.max()}; "
        f"static padding {pad:.2f}"
    )
    print("decode step by live rows: " + ", ".join(f"{r}: {costs.step[r] * 1e3:.1f} ms" for r in rows))
    print(f"prefill: {costs.prefill_per_token * 1e3:.3f} ms per token")
    for name, (real, projected) in check.items():
        print(
            f"cost model check, {name}, {args.check_blocks} blocks run by the engine: measured {real:.2f} s, "
            f"projected {projected:.2f} s (ratio {projected / real:.2f})"
        )
    base = schedules[0].seconds / schedules[0].rows
    head = "| schedule | s per B rows | tokens/s | speed-up vs static | rows spanning calls | max calls |"
    if args.idle is not None:
        head += " learner idle |"
    print("\n" + head)
    print("|" + "---|" * (head.count("|") - 1))
    out: dict[str, object] = {
        "batch": B, "new_tokens": N, "heavy_tail": args.heavy_tail, "prompt_tokens": P,
        "blocks": args.blocks, "costs": asdict(costs),
        "check": {k: {"measured_s": r, "projected_s": p} for k, (r, p) in check.items()},
        "schedules": [],
    }  # fmt: skip
    learner = None if args.idle is None else (1 - args.idle) * base * B
    for sch in schedules:
        per_block = sch.seconds / sch.rows * B
        line = (
            f"| {sch.name} | {per_block:.3g} | {sch.tokens / sch.seconds:.1f} | "
            f"{base * B / per_block:.2f}x | {sch.spanning_frac:.0%} | {sch.calls_spanned_max} |"
        )
        rec = {**asdict(sch), "s_per_block": per_block}
        if learner is not None:
            idle = max(0.0, 1 - learner / per_block)
            line += f" {idle:.2f} |"
            rec["learner_idle"] = idle
        print(line)
        out["schedules"].append(rec)  # type: ignore[union-attr]
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    return out


if __name__ == "__main__":
    main()
