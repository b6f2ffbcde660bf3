"""Where a layer-pruned student of a real preset starts: its agreement with the teacher by depth.

    python benchmarks/student_depth.py --preset smollm2 --layers 6 15 20 24 30 --n 16 --healed smollm2-healed

For each depth, the teacher's decoder layers are pruned to ``--layers`` of them (``real.prune_layers``,
evenly spaced, first and last kept; 30 of 30 is the teacher itself) and the untrained student is
evaluated against the teacher on the first ``--n`` held-out prompts (``AgreementEvaluator``, every
metric: on the student's samples, on the teacher's greedy responses (``_ref``), and the distinct-2 of
the student's greedy responses). Why: how far a student starts from answering decides how many
distillation steps it needs before the agreement figures measure a student that answers; the
shipped preset keeps 6 layers. ``--healed P`` adds the student of real preset ``P`` as prepared (a
prune healed by offline distillation, ``asyncrl.workloads.heal``), on the same prompts: where healing
moves the prune before any on-policy step. Needs ``asyncrl prepare <preset>`` once (and ``P``). Every
number printed is measured; ``--json`` appends one line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from asyncrl.workloads import real
from asyncrl.workloads.agreement import METRICS, AgreementEvaluator
from asyncrl.workloads.checkpoints import load_model, read_meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--cache-dir", default=".asyncrl_cache")
    ap.add_argument("--layers", type=int, nargs="+", default=[6, 15, 20, 24])
    ap.add_argument("--n", type=int, default=16, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="append one JSON line per depth here")
    ap.add_argument("--healed", nargs="*", default=[], help="real presets whose prepared student to add")
    args = ap.parse_args()
    for name in [args.preset, *args.healed]:
        if not real.is_real(name):
            raise SystemExit(f"{name!r} is not a real preset (asyncrl ls presets)")
    healed = {name: real.paths(name, args.cache_dir)["student_dir"] for name in args.healed}
    for name, d in healed.items():
        if not Path(d).exists():
            raise SystemExit(f"--healed {name}: not prepared; {real.prepare_hint(name, args.cache_dir)}")
    torch.set_num_threads(1)
    paths = real.paths(args.preset, args.cache_dir)
    if not Path(paths["teacher_dir"]).exists():
        raise SystemExit(f"no prepared {args.preset}: run `asyncrl prepare {args.preset}` once")
    ev = AgreementEvaluator.from_files(
        paths["teacher_dir"], paths["eval_prompts"], n=args.n, max_new_tokens=args.max_new_tokens
    )
    total = int(ev.teacher.config.num_hidden_layers)
    print(
        f"{args.preset}: teacher of {total} layers, {args.n} held-out prompts, "
        f"{args.max_new_tokens} new tokens"
    )
    print("| layers | " + " | ".join(METRICS) + " | first greedy response |")
    print("|---|" + "---|" * (len(METRICS) + 1))
    for keep in args.layers:
        if not 1 <= keep <= total:
            raise SystemExit(f"--layers {keep}: use 1..{total} (the teacher's decoder layers)")
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for keep in args.layers:
            out = Path(tmp) / f"s{keep}"
            real.prune_layers(paths["teacher_dir"], out, keep)
            rows.append((str(keep), {"preset": args.preset, "layers": keep}, out))
        for name, d in healed.items():
            layers = len(read_meta(d).get("layers_kept", []))
            rows.append((f"{layers} healed ({name})", {"preset": name, "layers": layers, "healed": True}, d))
        for label, record, out in rows:
            student, _ = load_model(str(out), role="student")
            res = ev(student)
            text = res.samples[0]["student"][:60].replace("\n", "\\n").replace("|", "/")
            print(f"| {label} | " + " | ".join(f"{res.metrics[k]:.3f}" for k in METRICS) + f" | `{text}` |")
            if args.json:
                with open(args.json, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps({**record, **res.metrics}) + "\n")


if __name__ == "__main__":
    main()
