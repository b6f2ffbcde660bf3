"""Cache finiteness at frozen θ: bias and variance of every cache size at one θ and fixed states.

At each saved checkpoint of each run (and at the run's starting student, step 0), sample fixed states
once (``--rows`` completions of the run's first training prompts, from the checkpoint's own student),
score them with the teacher, then measure each estimator's gradient error against the exact dense KL
with ``asyncrl.telemetry.gradients.frozen_theta``: top-k caches once (deterministic given the states),
Monte Carlo caches over ``--redraws`` redraws of their m columns. So k and m are compared at equal θ and
equal states, and at the bytes per token each cache stores.

    asyncrl sweep examples/sweeps/cache_finiteness_frozen.yaml        # the checkpoints (5 seeds)
    python scripts/frozen_theta.py runs/sweeps/cache_finiteness_frozen/runs/* --redraws 64 \\
        --out experiments/data/cache_finiteness_frozen/frozen.csv
    python scripts/gen_experiments.py                                 # section 9 reads frozen.csv

Writes one CSV row per (run, checkpoint, family, size): ``seed``, ``step``, ``family``
(``forward_topk_k``, ``reverse_topk_k``, ``reverse_mc_m``, ``forward_mc_m``), ``size`` (k or m),
``bytes_per_token``, ``bias_sq``, ``var``, ``ref_sq``, ``redraws``, ``cos`` (``FrozenTheta``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.caches import CACHES
from asyncrl.estimators import build as build_estimator
from asyncrl.lab.evidence import write_csv
from asyncrl.telemetry.gradients import frozen_theta, mc_redraw

COLUMNS = ("seed", "step", "family", "size", "bytes_per_token", "bias_sq", "var", "ref_sq", "redraws", "cos")
FAMILIES = {  # family -> (estimator, options, cache kind, MC source or None)
    "forward_topk_k": ("forward_kl", {"tail": "bucket"}, "topk", None),
    "reverse_topk_k": ("reverse_kl", {"tail": "bucket"}, "topk", None),
    "reverse_mc_m": ("reverse_kl_mc", {"advantage": "online"}, "behavior_mc", "behavior"),
    "forward_mc_m": ("forward_kl_mc", {}, "teacher_mc", "teacher"),
}


def checkpoints(run_dir: Path, student_dir: str, which: str) -> list[tuple[int, Path]]:
    """(step, model directory): step 0 is the run's starting student, then its complete checkpoints."""
    from asyncrl.checkpoint import MODEL_DIR, scan

    found = [(step, path / MODEL_DIR) for step, path, bad in scan(run_dir) if not bad]
    if which == "latest":
        found = found[-1:]
    elif which != "all":
        wanted = {int(s) for s in which.split(",")}
        found = [c for c in found if c[0] in wanted]
    return [(0, Path(student_dir)), *found]


def fixed_states(
    cfg: Any, plan: Any, student: torch.nn.Module, rows: int, seed: int
) -> dict[str, torch.Tensor]:
    """``rows`` completions sampled by ``student`` for the run's first training prompts."""
    from transformers import AutoTokenizer

    from asyncrl.engines.hf import HFEngine
    from asyncrl.plan import load_examples, prompt_blocks
    from asyncrl.stages import pad_rollout

    tok = AutoTokenizer.from_pretrained(plan.models.student_dir)
    train_ex, _ = load_examples(cfg)
    P = max(len(tok(e.prompt)["input_ids"]) for e in train_ex[:2048])
    blocks = prompt_blocks(cfg, train_ex, tok, P)
    ids = np.concatenate([b[R.PROMPT_IDS] for b in blocks])[:rows]
    mask = np.concatenate([b[R.PROMPT_MASK] for b in blocks])[:rows]
    engine = HFEngine.from_pretrained(plan.models.student_dir)
    engine.load_weights(student.state_dict(), 0)
    params = cfg.sampling
    out = engine.generate(torch.from_numpy(ids), torch.from_numpy(mask).bool(), params, seed=seed)
    batch = {R.PROMPT_IDS: torch.from_numpy(ids), R.PROMPT_MASK: torch.from_numpy(mask).bool()}
    batch.update(pad_rollout(out, params.max_new_tokens, engine.pad_id))
    return R.trim_to_longest(batch)


def measure(run_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from asyncrl.config import load_config
    from asyncrl.plan import make_plan

    cfg = load_config(run_dir / "config.yaml")
    plan = make_plan(cfg)
    teacher = AutoModelForCausalLM.from_pretrained(plan.models.teacher_dir, dtype=torch.float64).eval()
    tau = cfg.sampling.temperature
    out = []
    for step, model_dir in checkpoints(run_dir, plan.models.student_dir, args.checkpoints):
        student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
        states = fixed_states(cfg, plan, student, args.rows, args.states_seed)
        cols = (
            states[R.PROMPT_IDS],
            states[R.PROMPT_MASK],
            states[R.COMPLETION_IDS],
            states[R.COMPLETION_MASK],
        )
        with torch.no_grad():
            z = R.completion_logits(teacher, *cols) / tau
            proposal = torch.log_softmax(R.completion_logits(student, *cols) / tau, -1)
        states[R.TEACHER_LOGITS] = z
        vocab = z.shape[-1]
        for family, (name, options, kind, source) in FAMILIES.items():
            sizes = args.ks if source is None else args.ms
            for size in sizes:
                est = build_estimator(name, options)
                cache = CACHES.get(kind)(
                    **({"k": size} if source is None else {"m": size} if kind == "teacher_mc" else {})
                )
                if source is None:
                    cols_k = dict(states) | cache.build(z, states)
                    res = frozen_theta(student, est, cols_k, temperature=tau)
                else:
                    redraw = mc_redraw(proposal, z, size, source=source, seed=args.states_seed)
                    res = frozen_theta(student, est, states, redraw, redraws=args.redraws, temperature=tau)
                row = {"seed": cfg.seed, "step": step, "family": family, "size": size}
                # what each cache costs per token, the rollout columns it alone needs included (mc_ids ...)
                row["bytes_per_token"] = cache.bytes_per_token(vocab_size=vocab, m=size, include_inputs=True)
                out.append(row | {k: v for k, v in res.as_dict().items() if k in COLUMNS})
                rel = f"bias² {res.bias_sq_rel:.4f} var {res.var_rel:.4f}"
                print(f"{run_dir.name} step {step} {family}{size}: {rel}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (each with config.yaml and checkpoints/)")
    ap.add_argument("--out", required=True, help="CSV to write (e.g. experiments/data/<name>/frozen.csv)")
    ap.add_argument("--checkpoints", default="all", help="all, latest, or steps (e.g. 50,100)")
    ap.add_argument("--ks", default="1,2,4,8,16,32,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--ms", default="1,2,4,8,16,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--redraws", type=int, default=8, help="redraws of the MC columns per cache size")
    ap.add_argument("--rows", type=int, default=64, help="fixed states: completions per checkpoint")
    ap.add_argument("--states-seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [r for run in sorted(args.runs) for r in measure(Path(run), args)]
    out = Path(args.out)
    write_csv(out, COLUMNS, rows)
    print(f"{len(rows)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
