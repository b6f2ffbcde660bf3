"""Regenerate BENCHMARKS.md: run every benchmark with its default arguments and write what each printed.

    python benchmarks/make_benchmarks_md.py --cache-dir /work/cache                   # the real figures
    python benchmarks/make_benchmarks_md.py --lock /tmp/asyncrl-heavy.lock ...        # shared machine
    python benchmarks/make_benchmarks_md.py --quick --out /tmp/BENCHMARKS.md          # smoke settings
    python benchmarks/make_benchmarks_md.py --only vs_trl_short vs_trl_long           # some sections

Each section gives the machine, the date, the exact command, how long it took and the table the
command produced: the Markdown ``vs_trl.py`` writes, or the benchmark's printed table verbatim.
Nothing in the file is typed by hand. A benchmark that fails gets its error in its section and
the script exits 1. ``benchmarks/scaling.py`` (the scale-out work) is run when it exists.
With ``--lock`` every benchmark runs holding ``flock(LOCK)``, released between benchmarks; the
time a section reports starts once the lock is held.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Bench:
    """One BENCHMARKS.md section: a script, its arguments (default run and ``--quick`` smoke)."""

    key: str
    title: str
    script: str
    args: list[str] = field(default_factory=list)
    quick: list[str] = field(default_factory=list)
    uses_cache: bool = False
    markdown_out: bool = False  # the script writes a Markdown table under --out (vs_trl)
    about: str = ""


def vs_trl(regime: str, what: str) -> Bench:
    return Bench(
        f"vs_trl_{regime}",
        f"asyncrl vs TRL DistillationTrainer, {regime} regime ({what})",
        "vs_trl.py",
        ["--regime", regime],
        ["--regime", regime, "--steps", "10", "--rounds", "1", "--stage-repeats", "3"],
        uses_cache=True,
        markdown_out=True,
    )


def long129(steps: int, stage_repeats: int, systems: list[str]) -> list[str]:
    """``vs_trl.py`` arguments for 129-token completions (``running_sum_long``), one round."""
    task = ["--regime", "long", "--task", "running_sum_long", "--max-new-tokens", "129"]
    rounds = ["--steps", str(steps), "--rounds", "1", "--stage-repeats", str(stage_repeats)]
    return [*task, *rounds, "--systems", *systems]


BENCHES = [
    vs_trl("short", "addition, 6 new tokens"),
    vs_trl("long", "running_sum, 33 new tokens, tiny pair"),
    vs_trl("qwen", "addition, 6 new tokens, qwen-tiny pair: Qwen's 151,936-token vocabulary"),
    Bench(
        "vs_trl_smollm2",
        "asyncrl vs TRL DistillationTrainer, smollm2 regime (real pair and chat prompts, up to 128 new "
        "tokens, fp32 and bf16)",
        "vs_trl.py",
        # the regime's defaults (B 16, 12 steps, one round, 16 held-out prompts, every system)
        ["--regime", "smollm2"],
        [
            "--regime",
            "smollm2",
            "--steps",
            "4",
            "--batch",
            "4",
            "--eval-size",
            "4",
            "--systems",
            "trl",
            "plain",
        ],
        uses_cache=True,
        markdown_out=True,
    ),
    Bench(
        "vs_trl_long129",
        "asyncrl vs TRL DistillationTrainer, 129-token completions (running_sum_long, tiny pair, one round)",
        "vs_trl.py",
        # one round of the systems that answer the questions: 129-token steps take ~4x longer
        long129(
            40,
            3,
            [
                "trl",
                "plain",
                "lag0_dense",
                "lag0_fused",
                "lag0_colocated",
                "lag2_dense",
                "lag2_fused2",
                "lag2_fused2_mb2",
            ],
        ),
        long129(6, 1, ["trl", "lag2_dense"]),
        uses_cache=True,
        markdown_out=True,
    ),
    Bench(
        "overlap_ceiling",
        "Two threads of one process against two processes (the colocated rollout thread's ceiling)",
        "overlap_ceiling.py",
        [],
        ["--batches", "4", "--rounds", "1"],
        uses_cache=True,
    ),
    Bench(
        "async_vs_sync",
        "asyncrl plain loop vs max_lag=0 (stage actors, and colocated) vs max_lag=2",
        "async_vs_sync.py",
        [],
        ["--preset", "tiny", "--steps", "12"],
        uses_cache=True,
    ),
    Bench(
        "scaling",
        "Scale-out (generators, scorers, learner workers)",
        "scaling.py",
        ["--batch", "64"],
        ["--generators", "1", "2", "--lags", "0", "2", "--steps", "24"],
        uses_cache=True,
        about="added by the scale-out work",
    ),
    Bench(
        "scaling_cluster",
        "Scale-out on a simulated 2-node Ray cluster (generators on the second node)",
        "scaling.py",
        ["--batch", "64", "--cluster"],
        ["--generators", "1", "2", "--lags", "2", "--steps", "24", "--cluster"],
        uses_cache=True,
    ),
    Bench(
        "scaling_unpadded",
        "Scale-out with the tiny learner's own step (no learner padding: per-block CPU bound)",
        "scaling.py",
        ["--batch", "64", "--learner-pad-ms", "0", "--lags", "0", "4"],
        ["--generators", "1", "2", "--lags", "2", "--steps", "24", "--learner-pad-ms", "0"],
        uses_cache=True,
    ),
    Bench(
        "estimators",
        "Estimator time and peak memory against dense KL",
        "estimators.py",
        [],
        ["--quick"],
    ),
    Bench(
        "engine_throughput",
        "HFEngine vs model.generate (tokens/s)",
        "engine_throughput.py",
        [],
        ["--preset", "tiny", "--repeats", "3"],
    ),
    Bench(
        "real_demo",
        "The real demo: `asyncrl demo --preset smollm2` (sync and async OPD on SmolLM2-135M-Instruct)",
        "real_demo.py",
        [],
        ["--steps", "4", "train.eval_every=2", "train.eval_size=4"],
        uses_cache=True,
    ),
    Bench(
        "lora_publication",
        "LoRA weight publication (adapters only) vs full weights",
        "lora_publication.py",
        ["--preset", "small", "--r", "8", "--repeats", "20"],
        ["--preset", "tiny", "--r", "8", "--repeats", "3"],
    ),
    Bench(
        "inflight",
        "In-flight weight updates (benchmarks/inflight.py)",
        "inflight.py",
        ["--steps", "16", "--max-lag", "2", "--set", "sampling.max_new_tokens=24"],
        ["--steps", "6", "--max-lag", "2"],
    ),
    Bench(
        "batching_headroom",
        "Batching headroom: decode cost by live rows, heavy-tailed blocks under several schedules",
        "batching_headroom.py",
        ["--real", "smollm2", "--batch", "8", "--new-tokens", "256", "--heavy-tail", "1.0"],
        ["--preset", "tiny", "--batch", "8", "--new-tokens", "64", "--blocks", "8", "--repeats", "1"],
        uses_cache=True,
    ),
    Bench(
        "student_depth",
        "Where a layer-pruned real student starts: agreement with the teacher by depth",
        "student_depth.py",
        ["--preset", "smollm2", "--layers", "6", "15", "20", "24", "--n", "16", "--healed", "smollm2-healed"],
        ["--preset", "smollm2", "--layers", "6", "--n", "2", "--max-new-tokens", "8"],
        uses_cache=True,
    ),
]


def cpu_model() -> str:
    """This machine's CPU model: each section names it, since sections regenerated on different
    days (``--only``) can come from different machines of the same size."""
    if Path("/proc/cpuinfo").exists():
        models = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]
        if models:
            return models[0].split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """CPU model, cores, memory, OS and the versions that matter, in one line."""
    import importlib.metadata as md

    cpu, mem = cpu_model(), ""
    if Path("/proc/meminfo").exists():
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    versions = []
    for pkg in ("torch", "ray", "transformers", "trl"):
        try:
            versions.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            versions.append(f"{pkg} not installed")
    return (
        f"{cpu}, {os.cpu_count()} cores{mem}; {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}; {', '.join(versions)}"
    )


@contextmanager
def held(lock: str | None) -> Iterator[None]:
    """Hold ``flock(lock)`` (the shared machine's convention) for the duration, if a lock is given."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_bench(b: Bench, args: argparse.Namespace, work: Path) -> tuple[str, bool]:
    """Run one benchmark; returns its Markdown section and whether it succeeded."""
    head = f"## {b.title}\n\n"
    if not (HERE / b.script).exists():
        return head + f"`benchmarks/{b.script}` does not exist yet ({b.about}).\n", True
    argv = [*(b.quick if args.quick else b.args), *(["--cache-dir", args.cache_dir] if b.uses_cache else [])]
    shown = shlex.join(["python", f"benchmarks/{b.script}", *argv])
    out_dir = work / b.key
    cmd = [sys.executable, str(HERE / b.script), *argv, *(["--out", str(out_dir)] if b.markdown_out else [])]
    paths = (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    print(f"[benchmarks] {b.key}: {shown}", flush=True)
    log = work / f"{b.key}.log"
    with held(args.lock), open(log, "w") as err:
        date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env, check=False
        )
        took = time.perf_counter() - t0
    meta = f"Date: {date}. CPU: {cpu_model()}. Command: `{shown}`. Took {took:.0f} s.\n\n"
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout.splitlines() + log.read_text().splitlines())[-15:])
        return head + meta + f"**FAILED** (exit {proc.returncode}):\n\n```\n{tail}\n```\n", False
    if b.markdown_out:
        body = (out_dir / "vs_trl.md").read_text()
    else:
        body = "```\n" + proc.stdout.strip() + "\n```\n"
    return head + meta + body, True


def kept_sections(path: Path, replaced: set[str]) -> dict[str, str]:
    """Sections of an existing BENCHMARKS.md by title, except those about to be regenerated.
    A section starts at a ``## `` line outside a code fence: a benchmark's printed output (in a
    fence) has ``## `` headings of its own (estimators.py's ``## V=...``)."""
    if not path.exists():
        return {}
    sections: list[list[str]] = []
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("## ") and not fenced:
            sections.append([])
        if sections:
            sections[-1].append(line)
    out = {}
    for lines in sections:
        title = lines[0][3:].strip()
        body = "\n".join(ln for ln in lines if not ln.startswith("_Regeneration in progress")).rstrip()
        if title not in replaced:
            out[title] = body + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=".asyncrl_cache", help="where the pretrained pairs are")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--quick", action="store_true", help="smoke settings (few steps, one round)")
    ap.add_argument("--lock", default=None, help="run each benchmark under `flock LOCK`")
    ap.add_argument("--only", nargs="*", default=None, choices=[b.key for b in BENCHES])
    args = ap.parse_args(argv)
    args.cache_dir = str(Path(args.cache_dir).resolve())
    benches = [b for b in BENCHES if args.only is None or b.key in args.only]
    work = Path(tempfile.mkdtemp(prefix="asyncrl-benchmarks-"))
    mode = (
        "**smoke settings (`--quick`)**: few steps, one round; not the figures to quote"
        if args.quick
        else "each benchmark's default arguments"
    )
    command = shlex.join(
        ["python", "benchmarks/make_benchmarks_md.py", *(sys.argv[1:] if argv is None else argv)]
    )
    parts = [
        "# Benchmarks\n",
        f"Generated by `{command}` ({mode}); do not edit by hand. Machine of this regeneration: "
        f"{machine()}; each section since 2026-12-05 names the CPU it ran on. "
        "Every figure below is what the command printed; timings on a shared machine are noisy.\n",
    ]
    # every section of the file as it was: with --only, those not regenerated are kept, and until
    # a regenerated one is done its old text stays in the file (an interrupted run loses nothing)
    previous = kept_sections(Path(args.out), set()) if args.only else {}
    ok = True
    todo = [b for b in BENCHES if b in benches or b.title in previous]
    for i, b in enumerate(todo):
        if b in benches:
            section, good = run_bench(b, args, work)
            ok &= good
        else:
            section = previous[b.title]
        parts.append(section)
        left = len(todo) - i - 1  # written after every section: a long regeneration keeps its progress
        more = [f"_Regeneration in progress: {left} more section(s) to come._\n"] if left else []
        rest = [previous[r.title] for r in todo[i + 1 :] if r.title in previous]
        Path(args.out).write_text("\n".join(parts + more + rest))
    print(f"[benchmarks] wrote {args.out}; logs in {work}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
