"""How much two threads of one process overlap on this machine, against two processes: the
ceiling of the colocated rollout thread (``pipeline.colocate=true``, ``max_lag >= 1``).

    python benchmarks/overlap_ceiling.py --cache-dir .asyncrl_cache            # short regime (vs_trl's)
    python benchmarks/overlap_ceiling.py --task running_sum --preset tiny --max-new-tokens 33

The stages are ``stage_times.Stages`` (the plain loop's parts: the HF engine, the teacher and its
dense cache, the student's AdamW step), one torch thread each, on the same B-sample prompt blocks:

  serial      generate -> score -> learn, one batch after the other (the plain single-process loop)
  threads     a rollout thread generates and scores batch k+1 while the caller learns batch k
              (``asyncrl.rollouts.RunAhead``, depth 1: the colocated rollout thread's own mechanism,
              without Ray, admission or telemetry)
  processes   the rollout loop and the learning loop in two processes at once, with no hand-off
              between them: what a process split could reach at best (samples/s of the slower one)

Per layout: samples/s, the ratio to serial, and per batch the minor page faults and the voluntary
context switches of the process (``getrusage``: the threads hand the GIL and the queue over by
sleeping and waking). For the threads, Linux's ``/proc/thread-self/schedstat`` gives each thread's
share of the wall clock on a core and runnable but waiting for one (a thread blocked on
the GIL or the queue is neither). On a machine where threads
overlap far below processes, a layout that splits rollouts into another process gains; where
they match, the rollout thread (no Ray hand-off per block) is the faster layout. Rounds are
interleaved; the table shows medians. Every number printed is measured.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def make_stages(spec: dict[str, Any]) -> Any:
    """``stage_times.Stages`` of ``vs_trl``'s config for ``spec`` (dense forward KL, one thread)."""
    sys.path.insert(0, str(HERE))
    import vs_trl
    from stage_times import Stages

    torch.set_num_threads(1)
    return Stages(vs_trl.run_config(spec, ["pipeline.torch_threads=1", *vs_trl.DENSE]))


def _thread_sched() -> tuple[int, int]:
    """(ns on a core, ns runnable-waiting) of the calling thread; (0, 0) where /proc lacks it."""
    try:
        run, wait, _ = map(int, Path("/proc/thread-self/schedstat").read_text().split())
    except (OSError, ValueError):
        return 0, 0
    return run, wait


class _Shares:
    """A thread's share of the wall clock on a core and runnable-waiting, between ``start`` and ``stop``."""

    def start(self) -> None:
        self.t0, self.s0 = time.perf_counter(), _thread_sched()

    def stop(self) -> tuple[float, float]:
        wall, (run, wait) = time.perf_counter() - self.t0, _thread_sched()
        return (run - self.s0[0]) / 1e9 / wall, (wait - self.s0[1]) / 1e9 / wall


def _timed(fn: Any, n: int) -> dict[str, float]:
    """Run ``fn()`` (n batches; it returns its threads' shares, or nothing). Page faults and voluntary
    context switches of the process per batch."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    shares = fn() or {}
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall_s": wall,
        "minflt_per_batch": (r1.ru_minflt - r0.ru_minflt) / n,
        "vcsw_per_batch": (r1.ru_nvcsw - r0.ru_nvcsw) / n,
        **shares,
    }


def serial(st: Any, first: int, n: int) -> dict[str, float]:
    def loop() -> None:
        for i in range(first, first + n):
            st.learn(st.score(st.generate(i)), i)

    return _timed(loop, n)


def threads(st: Any, first: int, n: int) -> dict[str, float]:
    """The rollout thread as the colocated learner runs it: ``asyncrl.rollouts.RunAhead`` (depth 1)."""
    from asyncrl.rollouts import RunAhead

    def loop() -> dict[str, float]:
        shares: dict[str, float] = {}

        def rollouts() -> Any:  # runs in RunAhead's thread, to its end before the stream ends
            mine = _Shares()
            mine.start()
            for i in range(first, first + n):
                yield i, st.score(st.generate(i))
            shares["rollouts_on_core"], shares["rollouts_waiting"] = mine.stop()

        learner = _Shares()
        learner.start()
        for i, batch in RunAhead(rollouts(), depth=1, name="rollouts"):
            st.learn(batch, i)
        shares["learner_on_core"], shares["learner_waiting"] = learner.stop()
        return shares

    return _timed(loop, n)


def _process_loop(args: tuple[dict[str, Any], str, int, int, Any]) -> float:
    """One side of the two-process layout: seconds for n batches, started at the barrier."""
    spec, side, first, n, barrier = args
    st = make_stages(spec)
    batch = st.score(st.generate(first))
    st.learn(batch, first)  # warm
    barrier.wait()
    t0 = time.perf_counter()
    for i in range(first, first + n):
        if side == "rollouts":
            st.score(st.generate(i))
        else:
            st.learn(batch, i)
    return time.perf_counter() - t0


def processes(spec: dict[str, Any], first: int, n: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(2)
        with ctx.Pool(2) as pool:
            jobs = [
                pool.apply_async(_process_loop, ((spec, side, first, n, barrier),))
                for side in ("rollouts", "learn")
            ]
            rollout_s, learn_s = (j.get() for j in jobs)
    return {"wall_s": max(rollout_s, learn_s), "rollouts_s": rollout_s, "learn_s": learn_s}


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=".asyncrl_cache", help="where the pretrained pairs are")
    ap.add_argument("--task", default="addition")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=30, help="batches per layout and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.batches < 2 or args.rounds < 1:
        ap.error("--batches must be >= 2 and --rounds >= 1")
    steps = 3 + args.rounds * 2 * args.batches + args.batches  # prompt blocks for every round's batches
    spec = {
        "task": args.task,
        "preset": args.preset,
        "cache_dir": str(Path(args.cache_dir).resolve()),
        "seed": 0,
        "steps": steps,
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "run_dir": str(Path(os.environ.get("TMPDIR", "/tmp"), "overlap_ceiling")),
    }
    st = make_stages(spec)
    for i in range(3):  # warm: allocator, caches
        st.learn(st.score(st.generate(i)), i)
    rows: dict[str, list[dict[str, float]]] = {"serial": [], "threads": [], "processes": []}
    first = 3
    for r in range(args.rounds):
        for name in ("serial", "threads", "processes")[r % 3 :] + ("serial", "threads", "processes")[: r % 3]:
            if name == "processes":
                res = processes(spec, first, args.batches)
            else:
                res = (serial if name == "serial" else threads)(st, first, args.batches)
                first += args.batches
            res["samples_per_s"] = args.batch * args.batches / res["wall_s"]
            rows[name].append(res)
            print(
                f"[overlap] round {r + 1}/{args.rounds} {name:9s} {res['samples_per_s']:7.1f} samples/s",
                flush=True,
            )
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in rows.items()}
    base = med["serial"]["samples_per_s"]
    print(
        f"\n{args.task}, preset {args.preset}, B={args.batch}, {args.max_new_tokens} new tokens, "
        f"dense forward KL, {args.batches} batches x {args.rounds} rounds (medians), {os.cpu_count()} CPUs "
        f"({cpu_model()})\n"
    )
    print(
        "| layout | samples/s | x serial | page faults / batch | voluntary switches / batch | "
        "share of the wall clock on a core / runnable-waiting |"
    )
    print("|---|---|---|---|---|---|")
    for name, m in med.items():
        faults = f"{m['minflt_per_batch']:.0f}" if "minflt_per_batch" in m else "-"
        switches = f"{m['vcsw_per_batch']:.0f}" if "vcsw_per_batch" in m else "-"
        if name == "threads" and "learner_on_core" in m:
            share = (
                f"learner {m['learner_on_core']:.2f} / {m['learner_waiting']:.2f}, "
                f"rollouts {m['rollouts_on_core']:.2f} / {m['rollouts_waiting']:.2f}"
            )
        elif name == "processes":
            per = {k: m[f"{k}_s"] / args.batches * 1e3 for k in ("rollouts", "learn")}
            share = f"alone at once: rollouts {per['rollouts']:.1f} ms, learn {per['learn']:.1f} ms per batch"
        else:
            share = "-"
        ratio = m["samples_per_s"] / base
        print(f"| {name} | {m['samples_per_s']:.1f} | {ratio:.2f} | {faults} | {switches} | {share} |")
    return {"medians": med, "rounds": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
