#!/usr/bin/env bash
# GPU check for a lent GPU machine: one short, prepared script (a few minutes, no network).
#
#   1. preflight: torch sees a GPU; ray, transformers and deepspeed import (prints versions)
#   2. learner backends on CUDA in one process: torch AdamW vs DeepSpeed ZeRO-1/2 (NCCL, world 1),
#      ms/step and loss agreement (benchmarks/backend_step.py)
#   3. the pipeline on one GPU (pipeline.device=cuda: learner, HF engine and teacher on CUDA, NCCL),
#      DDP vs DeepSpeed ZeRO-2 learner, 1 worker each (NCCL allows one rank per GPU), GPU shares
#      0.5 learner + 0.25 generator + 0.25 teacher scorer: samples/s from summary.json
#
# Environment knobs: PYTHON (default .venv/bin/python if present, else python3), PRESET (tiny;
# `small` if its pair is cached or you can afford pretraining it), STEPS (20), RUN_TIMEOUT (s per
# pipeline run, 180), OUT (where run dirs and logs go; the device tool's $OUT when set),
# DEVICE (cuda; DEVICE=cpu runs the same script on a CPU machine to check the script itself).
#
# The python needs a CUDA torch plus the asyncrl dependencies (ray 2.60, transformers, deepspeed
# installed with DS_BUILD_OPS=0); a CPU-only .venv cannot pass step 1 with DEVICE=cuda.
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PRESET=${PRESET:-tiny}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-20}
RUN_TIMEOUT=${RUN_TIMEOUT:-180}
OUT_DIR=${OUT:-/tmp/asyncrl_gpu_check}
CACHE=$(realpath -m "${ASYNCRL_CACHE:-.asyncrl_cache}")  # absolute: Train workers do not share our cwd
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export TORCH_EXTENSIONS_DIR="$CACHE/torch_extensions"

echo "== 1. preflight ($PYTHON, device $DEVICE)"
timeout 120 "$PYTHON" - "$DEVICE" <<'EOF'
import sys

import torch

if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no GPU: this check needs a CUDA build of torch")
import deepspeed
import ray
import transformers

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"torch {torch.__version__} ({gpu}); ray {ray.__version__}; "
      f"transformers {transformers.__version__}; deepspeed {deepspeed.__version__}")
EOF

echo "== 2. learner backends on $DEVICE (one process)"
DS_ACCELERATOR=$DEVICE timeout 240 "$PYTHON" benchmarks/backend_step.py \
  --device "$DEVICE" --preset "$PRESET" --batch 64 --seq 48 --steps 30 --extensions-dir "$CACHE/torch_extensions"

echo "== 3. pipeline on $DEVICE: DDP vs DeepSpeed ZeRO-2 learner (preset $PRESET, $STEPS steps)"
timeout 600 "$PYTHON" -m asyncrl.cli -q pretrain --preset "$PRESET" --cache-dir "$CACHE"
for backend in ddp deepspeed; do
  run_dir="$OUT_DIR/run_$backend"
  rm -rf "$run_dir"
  t0=$(date +%s)
  timeout "$RUN_TIMEOUT" "$PYTHON" -m asyncrl.cli -q run examples/configs/opd_tiny.yaml \
    "run_dir=$run_dir" "workload.preset=$PRESET" "workload.cache_dir=$CACHE" \
    "pipeline.device=$DEVICE" pipeline.gpus_per_worker=0.5 pipeline.gpus_per_actor=0.25 \
    "pipeline.backend=$backend" pipeline.zero_stage=2 \
    pipeline.learner_workers=1 pipeline.max_lag=2 "train.steps=$STEPS" train.eval_every=0 \
    telemetry.progress=false >"$OUT_DIR/$backend.log" 2>&1 \
    || { echo "$backend run failed (exit $?); last lines of $OUT_DIR/$backend.log:"; tail -30 "$OUT_DIR/$backend.log"; exit 1; }
  "$PYTHON" - "$run_dir" "$backend" "$(($(date +%s) - t0))" <<'EOF'
import json
import sys

s = json.load(open(f"{sys.argv[1]}/summary.json"))
sps = s["samples_per_s"]
print(f"  {sys.argv[2]:9s} steady {sps:.1f} samples/s" if sps else f"  {sys.argv[2]:9s} steady n/a", end="")
print(f", {s['samples_trained']} trained in {s['steps']} steps, wall {sys.argv[3]} s")
EOF
done
echo "== done"
