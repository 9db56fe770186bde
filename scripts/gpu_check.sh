#!/bin/bash
# The prepared GPU check (docs/GPU.md): SFT bf16 (plain, compile + packing, offload, cpu-offload, the low-memory
# recipe), DPO and GRPO for a few steps on one CUDA GPU, each run's CUDA peak against `scaffold
# plan`, the table appended to benchmarks/RESULTS.md (and written to $OUT when set).
# Needs .gpu-check/ from `python benchmarks/gpu_check.py --prepare` (run where there is a network);
# the device reaches none, so the wheels it lacks (torchao, ruff, merge3) come in that folder.
#   bash scripts/gpu_check.sh                 # every case, under 8 minutes
#   bash scripts/gpu_check.sh --cases dpo     # extra arguments go to benchmarks/gpu_check.py
set -euo pipefail
cd "$(dirname "$0")/.."
# the venv of make gpu-env when there is one, else the machine's python (the lent GPU's has torch)
PYTHON="${PYTHON:-$( [ -x .venv-gpu/bin/python ] && echo .venv-gpu/bin/python || command -v python3 )}"
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    # a machine's bare python3, or a venv without torch: say which and how to get one
    echo "gpu_check: $PYTHON has no torch: build the GPU environment with make gpu-env, or name a python that has a CUDA torch: PYTHON=/path/to/python bash scripts/gpu_check.sh" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU visible to $PYTHON's torch; on CPU run: python benchmarks/gpu_check.py --smoke" >&2
    exit 1
fi
if [ ! -d .gpu-check/wheels ]; then
    echo "gpu_check: .gpu-check/ is missing: run python benchmarks/gpu_check.py --prepare where there is a network and carry it" >&2
    exit 1
fi
# the wheels this python lacks, unpacked beside the tree (no network, maybe no pip)
site=runs/gpu-check-site
missing=$("$PYTHON" -c 'import importlib.util as u; print(" ".join(m for m in ("torchao", "ruff", "merge3") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
    echo "gpu_check: $missing not installed; unpacking the prepared wheels into $site"
    rm -rf "$site"
    "$PYTHON" benchmarks/gpu_check.py --install-wheels "$site"
    export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# the runtime and generator import from the checkout (the device's python has no editable install)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu_check.py --results benchmarks/RESULTS.md "$@"
