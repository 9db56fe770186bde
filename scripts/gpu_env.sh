#!/usr/bin/env bash
# The CUDA environment of the GPU path in one command: a venv with torch's CUDA build, vLLM (CUDA),
# Ray, torchao and this package (editable), pinned to versions that resolve together (docs/GPU.md
# says how that was checked). launch/slurm.sbatch activates it when it is .venv-gpu in or above the
# run directory, or $SCAFFOLD_GPU_ENV.
#
# Usage: scripts/gpu_env.sh [DIR]     (make gpu-env; DIR defaults to .venv-gpu in the repo root)
#
# Versions: vllm 0.32.0 pins torch 2.13.0 (PyPI's default Linux build, CUDA 13.0 wheels, which
# need an NVIDIA driver for CUDA 13), so torch is not pinned separately; ray and torchao are the
# versions pyproject.toml pins for the CPU path. Idempotent: a finished venv (stamp file) is left
# alone; delete DIR to rebuild.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.venv-gpu}"
PY="${PY:-python3}"
STAMP="$DIR/.scaffold-gpu-ready"
if [[ -f "$STAMP" ]]; then
    echo "gpu env: $DIR is ready (delete it to rebuild)"
    exit 0
fi
[[ -x "$DIR/bin/python" ]] || "$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip
# one resolution for everything, so pip never trades one pin for another
"$DIR/bin/python" -m pip install --quiet \
    vllm==0.32.0 torch==2.13.0 ray==2.60.0 torchao==0.18.0 -e "$ROOT[plot]"
# a CPU torch here (a local wheel directory or index that serves one) would run nothing on the GPUs
"$DIR/bin/python" - <<'PY'
import sys

import torch
import vllm

if torch.version.cuda is None:
    sys.exit(f"gpu env: torch {torch.__version__} is a CPU build; point pip at PyPI or a CUDA index and rerun")
print(f"gpu env: torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}")
PY
touch "$STAMP"
echo "gpu env: ready; activate with . $DIR/bin/activate"
