"""In-flight weight updates (``pipeline.inflight_updates``): throughput, learner idle fraction,
token-lag distribution and KL(behavior || current), with and without them, and with the HF
engine's two KV-cache policies for the generated prefix (``engine_options.inflight_kv``).

Per variant one pipeline run (same seed, same config otherwise); figures come from what the run
wrote (metrics.jsonl, samples.parquet), steady state = steps after the first two:

- ``samples/s``, ``tokens/s``: trained samples / completion tokens per second of learner time;
- ``idle``: the learner's mean idle fraction (``throughput/learner_idle_frac``: waiting for data);
- ``span``: the fraction of trained samples whose tokens come from more than one version;
- ``blocks_at_once``: the blocks a generator runs at once (``pipeline.continuous_blocks`` with
  ``continuous``, else 1);
- ``shared``: with ``continuous`` (``pipeline.continuous_batching``), the mean fraction of a
  block's decode steps that another block's rows shared;
- ``tok_lag``: trained tokens per lag bucket (``token_lag_counts``);
- ``kl_all`` / ``kl_span``: mean per-sample KL(behavior || current) (k3, ``kl_behavior_current``)
  over all trained samples / over those spanning versions: the spanning samples are where the
  KV-cache policy can make a difference (keep: later tokens sampled on a prefix K/V of older
  weights; recompute: exactly the new version's distribution);
- with ``--agreement N``: the final student's agreement with the teacher on N held-out prompts
  (``AgreementEvaluator``: ``kl_reverse``, ``kl_forward``, ``top1_agree``), measured after the run
  from its last checkpoint so that the evaluation does not share the cores with the run it measures.

    python benchmarks/inflight.py --preset tiny --steps 16 --max-lag 2            # quick (CPU)
    python benchmarks/inflight.py --config examples/configs/opd_smollm2.yaml --steps 8 --max-lag 1 2 4 \
        --variants off recompute --agreement 16
    python benchmarks/inflight.py --config examples/configs/opd_smollm2.yaml --steps 8 --max-lag 2 \
        --generators 1 --variants off recompute --set sampling.max_new_tokens=256 train.batch_size=8 \
        sampling.heavy_tail=1.0                                   # heavy-tailed lengths (Pareto budgets)
    python benchmarks/inflight.py --config examples/configs/opd_smollm2.yaml --steps 12 --max-lag 2 \
        --generators 1 --variants off continuous --set sampling.max_new_tokens=256 train.batch_size=4 \
        sampling.heavy_tail=1.0 pipeline.fuse_scoring=true pipeline.continuous_blocks=3   # 3 blocks at once

Writes a JSON line per variant to ``--out`` (default: print only). ``--summarize FILE [FILE ...]``
runs nothing: it reads such JSON lines and prints them as a table, then every non-``off``
configuration against every ``off`` one (any ``max_lag``) over the seeds both have, seed-paired
(``asyncrl.lab.stats.paired_difference``: mean and 95 % Student-t interval). The idle change is
relative per seed (``idle_A / idle_off - 1``: -0.5 is the halving issue 42 asks for); the lag is the
token-weighted mean lag of the trained tokens (``tok_lag_mean``, or from ``tok_lag`` for rows
written before it existed, exact where every bucket is a single lag). Two columns read issue 42's
goal off the intervals (``goal_verdicts``): is the wait halved, and is held-out agreement per step
worse, better, or not detectably different.

    python benchmarks/inflight.py --summarize runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl import checkpoint
from asyncrl.config import RunConfig, load_config
from asyncrl.lab.stats import GREATER, LESS, Interval, decide, paired_difference
from asyncrl.pipeline import run
from asyncrl.telemetry import names as N
from asyncrl.telemetry.sinks import read_metrics
from asyncrl.telemetry.staleness import LAG_BUCKETS
from asyncrl.telemetry.summary import read_samples

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    # the engine's decode batch keeps finished rows (HFEngine(compact=False)): the engine before compaction
    "static": ["pipeline.inflight_updates=false", "pipeline.engine_options.compact=false"],
    "off": ["pipeline.inflight_updates=false"],
    "recompute": ["pipeline.inflight_updates=true", "pipeline.engine_options.inflight_kv=recompute"],
    "keep": ["pipeline.inflight_updates=true", "pipeline.engine_options.inflight_kv=keep"],
    # two blocks per generator at once, their rows in shared decode steps (in-flight recompute)
    "continuous": [
        "pipeline.inflight_updates=true",
        "pipeline.engine_options.inflight_kv=recompute",
        "pipeline.continuous_batching=true",
    ],
}


def figures(run_dir: Path, warmup: int = 2) -> dict[str, object]:
    """The variant's figures (module docstring) from its run directory."""
    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    steady = steps[warmup:] or steps
    wall = sum(m["time/step_s"] for m in steady)
    s = read_samples(run_dir)
    kept = s[s["kept"]]
    late = kept[kept["learner_version"] >= steady[0]["step"] - 1]
    span = kept["version_last"] > kept["version_first"]
    counts = np.stack(kept["token_lag_counts"].to_numpy()).sum(0)
    lens = kept["completion_len"].to_numpy(float)
    return {
        "samples_per_s": len(late) / wall,
        "tokens_per_s": float(late["completion_len"].sum()) / wall,
        "idle": float(np.mean([m[N.LEARNER_IDLE_FRAC] for m in steady])),
        "span": float(span.mean()),
        "tok_lag": {b: int(c) for b, c in zip(LAG_BUCKETS, counts) if c},
        # token-weighted: sum over samples of (mean lag x tokens) / tokens
        "tok_lag_mean": float(np.nansum(kept["token_lag_mean"].to_numpy(float) * lens) / lens.sum()),
        "kl_all": float(kept["kl_behavior_current"].mean()),
        "kl_span": float(kept.loc[span, "kl_behavior_current"].mean()) if span.any() else None,
        "token_lag_max": int(kept["token_lag_max"].max()),
        "len_p50": float(kept["completion_len"].median()),
        "len_p90": float(kept["completion_len"].quantile(0.9)),
        "len_max": int(kept["completion_len"].max()),
        "padding_frac": float(np.mean([m[N.PADDING_FRAC] for m in steady])),
        # continuous batching: mean over blocks of the fraction of decode steps shared with another block
        "shared": float(s.groupby("block_index")["gen_shared_frac"].first().mean())
        if "gen_shared_frac" in s
        else 0.0,
        "final_loss": steps[-1]["loss"],
    }


def agreement(cfg: RunConfig, run_dir: Path, n: int) -> dict[str, float]:
    """The run's final student (its last checkpoint) against the teacher on ``n`` held-out prompts."""
    from asyncrl.plan import resolve_models
    from asyncrl.workloads import real
    from asyncrl.workloads.agreement import AgreementEvaluator
    from asyncrl.workloads.checkpoints import load_model

    w = cfg.workload
    prompts = w.eval_prompts_path or (
        real.paths(w.preset, w.cache_dir)["eval_prompts"] if real.is_real(w.preset) else None
    )
    if prompts is None:
        raise SystemExit("--agreement needs held-out prompts: workload.eval_prompts_path or a real preset")
    ev = AgreementEvaluator.from_files(
        resolve_models(cfg, rl=False).teacher_dir, prompts, n=n, max_new_tokens=cfg.sampling.max_new_tokens
    )
    student, _ = load_model(str(checkpoint.latest(run_dir) / checkpoint.MODEL_DIR), role="student")
    m = ev(student).metrics
    return {f"eval_{k}": m[k] for k in ("kl_reverse", "kl_forward", "top1_agree")}


def mean_token_lag(row: dict[str, Any]) -> float:
    """A row's token-weighted mean lag: ``tok_lag_mean``, or (older rows) from its lag buckets where
    each is a single lag; NaN where a bucket spans several lags (``3-4`` ...)."""
    if row.get("tok_lag_mean") is not None:
        return float(row["tok_lag_mean"])
    counts = row["tok_lag"]
    if not all(k.isdigit() for k in counts):
        return math.nan
    return sum(int(k) * c for k, c in counts.items()) / sum(counts.values())


def _fmt(x: float) -> str:
    """A table cell: three decimals, an en dash for a missing (NaN) figure."""
    return "–" if math.isnan(x) else f"{x:.3f}"


def _held_out(row: dict[str, Any], name: str) -> float:
    """A held-out agreement figure of a row (``--agreement``), NaN where the run had none."""
    return float(row.get(f"eval_{name}", math.nan))


def goal_verdicts(intervals: dict[str, Interval]) -> tuple[str, str]:
    """Issue 42's goal read from a pair's seed-paired intervals: is the learner's wait halved
    (``yes``: the relative change's interval lies below -0.5, ``no``: above it, else ``undecided``),
    and is held-out agreement per step ``worse`` (KL up or top-1 down, decided), ``better`` (KL
    down or top-1 up, decided, and neither worse), or ``no difference detected``."""
    idle = intervals["idle change (relative)"]
    shifted = decide(Interval(idle.estimate + 0.5, idle.lo + 0.5, idle.hi + 0.5, idle.n))
    halved = {LESS: "yes", GREATER: "no"}.get(shifted, "undecided")
    kl, top1 = decide(intervals["Δ held-out KL"]), decide(intervals["Δ held-out top-1"])
    if kl == GREATER or top1 == LESS:
        return halved, "worse"
    if kl == LESS or top1 == GREATER:
        return halved, "better"
    return halved, "no difference detected"


def config_key(row: dict[str, Any]) -> tuple[int, str, int]:
    """What a row's run was, apart from its seed: max_lag, variant, blocks at once (the rows given
    to ``--summarize`` share every other setting: keep one file per setting)."""
    return (int(row["max_lag"]), str(row["variant"]), int(row.get("blocks_at_once", 1)))


def config_label(key: tuple[int, str, int]) -> str:
    S, variant, blocks = key
    return f"S={S} {variant}" + (f", {blocks} blocks at once" if blocks != 1 else "")


def summarize(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per run, then every non-``off`` configuration paired by seed with every
    ``off`` one (module docstring)."""
    out = [
        "| max_lag | seed | variant | blocks at once | samples/s | learner idle | mean token lag | trained "
        "tokens per lag | KL(b‖c) all | held-out KL(student‖teacher) | held-out top-1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (config_key(r), r["seed"])):
        S, variant, blocks = config_key(r)
        lags = " / ".join(f"{k}: {v}" for k, v in r["tok_lag"].items())
        out.append(
            f"| {S} | {r['seed']} | {variant} | {blocks} | {_fmt(r['samples_per_s'])} | {_fmt(r['idle'])} | "
            f"{_fmt(mean_token_lag(r))} | {lags} | {_fmt(r['kl_all'])} | "
            f"{_fmt(_held_out(r, 'kl_reverse'))} | {_fmt(_held_out(r, 'top1_agree'))} |"
        )
    by: dict[tuple[int, str, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by[config_key(r)][int(r["seed"])] = r  # a seed run twice: the later line wins
    measures = {  # (not ``figures``: that is the function reading a run directory)
        "idle change (relative)": lambda a, b: a["idle"] / b["idle"] - 1 if b["idle"] > 0 else math.nan,
        "Δ samples/s": lambda a, b: a["samples_per_s"] - b["samples_per_s"],
        "Δ mean token lag": lambda a, b: mean_token_lag(a) - mean_token_lag(b),
        "Δ held-out KL": lambda a, b: _held_out(a, "kl_reverse") - _held_out(b, "kl_reverse"),
        "Δ held-out top-1": lambda a, b: _held_out(a, "top1_agree") - _held_out(b, "top1_agree"),
    }
    pairs = [
        (a, b)
        for a in sorted(by)
        for b in sorted(by)
        if a[1] != "off" and b[1] == "off" and len(by[a].keys() & by[b].keys()) >= 2
    ]
    if pairs:
        out += [
            "",
            "| configuration | against | seeds | " + " | ".join(measures) + " | wait halved | agreement |",
        ]
        out.append("|---|---|---|" + "---|" * (len(measures) + 2))
        for a, b in pairs:
            seeds = sorted(by[a].keys() & by[b].keys())
            intervals = {
                name: paired_difference({s: f(by[a][s], by[b][s]) for s in seeds}, dict.fromkeys(seeds, 0.0))
                for name, f in measures.items()
            }
            cells = [str(i).replace(f" (n={len(seeds)})", "") for i in intervals.values()]
            cells += goal_verdicts(intervals)
            head = f"| {config_label(a)} | {config_label(b)} | {','.join(map(str, seeds))} | "
            out.append(head + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "examples" / "configs" / "opd_tiny.yaml"))
    ap.add_argument("--preset", default=None, help="workload.preset override (e.g. tiny)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--max-lag", type=int, nargs="+", default=[2])
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["off", "recompute", "keep"], choices=list(VARIANTS))
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides")
    ap.add_argument(
        "--agreement",
        type=int,
        default=0,
        metavar="N",
        help="evaluate each final student on N held-out prompts (after its run)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--summarize", nargs="+", default=None, metavar="FILE", help="tabulate JSON lines; run nothing"
    )
    args = ap.parse_args()
    if args.summarize:
        rows = [json.loads(x) for f in args.summarize for x in Path(f).read_text().splitlines() if x.strip()]
        print(summarize(rows))
        return
    root = Path(tempfile.mkdtemp(prefix="asyncrl-inflight-"))
    for S in args.max_lag:
        for name in args.variants:
            overrides = [
                f"run_dir={root / f'S{S}-{name}'}",
                f"train.steps={args.steps}",
                f"pipeline.max_lag={S}",
                f"pipeline.generators={args.generators}",
                "train.eval_every=0",
                f"train.checkpoint_every={args.steps if args.agreement else 0}",
                "telemetry.progress=false",
                "telemetry.tensorboard=false",
                *(["workload.preset=" + args.preset] if args.preset else []),
                *VARIANTS[name],
                *args.set,
            ]
            result = run(load_config(args.config, overrides))
            pc = result.config.pipeline
            blocks = pc.continuous_blocks if pc.continuous_batching else 1
            row = {"max_lag": S, "variant": name, "seed": result.config.seed, "blocks_at_once": blocks}
            row |= figures(result.run_dir)
            if args.agreement:
                row |= agreement(result.config, result.run_dir, args.agreement)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
