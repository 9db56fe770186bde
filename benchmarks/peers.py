"""Virtual environments for the peer tools the benchmarks compare Scaffold against.

Each peer (TRL, torchtune) lives in its own virtualenv under `benchmarks/.venvs/<name>` (gitignored),
created on first use. The first install step of every venv is always `torch==2.13.0`: any other torch
would pull a multi-GB CUDA build, and pinning it first keeps pip from replacing it later.

The library versions shared with the main environment (transformers, datasets, tokenizers,
safetensors) are pinned to the main stack's resolved versions, so that a TRL run differs from the
main environment only by the peer's own packages (trl, accelerate, psutil).

Importing this module has no side effects; call `ensure_venv(name)` to build a venv.

    from benchmarks.peers import ensure_venv, peer_versions
    python = ensure_venv("trl")          # Path to benchmarks/.venvs/trl/bin/python
    peer_versions("trl")                 # {"torch": "2.13.0+cpu", "trl": "1.16.0", ...}
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VENVS_DIR = REPO_ROOT / "benchmarks" / ".venvs"
TORCH_PIN = "torch==2.13.0"

# Install steps per peer, run in order. Step 1 is always torch alone (see module docstring).
PEER_REQUIREMENTS: dict[str, list[list[str]]] = {
    "trl": [
        [TORCH_PIN],
        [
            "trl==1.16.0",
            "transformers==5.24.0",
            "datasets==5.2.0",
            "tokenizers==0.23.3",
            "safetensors==0.8.0",
            "accelerate",
            "psutil",
        ],
    ],
    "torchtune": [
        [TORCH_PIN],
        # torchao > 0.15 breaks torchtune 0.6.1's import (docs/DESIGN.md). torchtune's own
        # requirements already list datasets, sentencepiece, tiktoken, blobfile, omegaconf, psutil
        # and torchdata; `tokenizers` is needed by its HuggingFaceBaseTokenizer.
        ["torchtune==0.6.1", "torchao==0.15.0", "tokenizers==0.23.3", "jinja2"],
    ],
}

# Distributions whose versions `peer_versions` reports.
REPORTED_PACKAGES: dict[str, list[str]] = {
    "trl": ["torch", "trl", "transformers", "accelerate", "datasets"],
    "torchtune": ["torch", "torchtune", "torchao", "tokenizers"],
}

MARKER = "scaffold-bench.json"


def venv_dir(name: str) -> Path:
    """Return the directory of the peer venv `name` (it may not exist yet)."""
    if name not in PEER_REQUIREMENTS:
        raise KeyError(f"unknown peer {name!r}; known: {sorted(PEER_REQUIREMENTS)}")
    return VENVS_DIR / name


def venv_python(name: str) -> Path:
    """Return the Python interpreter of the peer venv `name`."""
    return venv_dir(name) / "bin" / "python"


def venv_bin(name: str, program: str) -> Path:
    """Return an executable (e.g. `tune`) installed in the peer venv `name`."""
    return venv_dir(name) / "bin" / program


def _read_marker(name: str) -> dict | None:
    path = venv_dir(name) / MARKER
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def is_ready(name: str) -> bool:
    """True when the venv exists and was built from the current requirement list."""
    marker = _read_marker(name)
    return (
        marker is not None
        and marker.get("requirements") == PEER_REQUIREMENTS[name]
        and venv_python(name).is_file()
    )


def _base_python() -> str:
    """The interpreter new venvs are built from: the base install behind the current venv."""
    return getattr(sys, "_base_executable", None) or sys.executable


def ensure_venv(name: str, log: Callable[[str], None] = print) -> Path:
    """Create the peer venv `name` if missing or outdated, and return its Python.

    Runs `python -m venv`, then one `pip install` per step in `PEER_REQUIREMENTS[name]`. On
    success writes a marker with the requirements, the install time and the venv size.

    Raises:
        RuntimeError: a pip step failed (the message has the last lines of pip's output).
    """
    vdir = venv_dir(name)
    if is_ready(name):
        return venv_python(name)
    if vdir.exists():
        log(f"[peers] {name}: venv outdated or incomplete, rebuilding {vdir}")
        shutil.rmtree(vdir)
    vdir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log(f"[peers] {name}: creating venv {vdir}")
    subprocess.run([_base_python(), "-m", "venv", str(vdir)], check=True)
    python = str(venv_python(name))
    for step in PEER_REQUIREMENTS[name]:
        log(f"[peers] {name}: pip install {' '.join(step)}")
        proc = subprocess.run(
            [python, "-m", "pip", "install", "--quiet", *step], capture_output=True, text=True
        )
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"pip install {' '.join(step)} failed in {vdir}:\n{tail}")
    seconds = time.perf_counter() - start
    size_mib = dir_size_mib(vdir)
    marker = {
        "requirements": PEER_REQUIREMENTS[name],
        "install_seconds": round(seconds, 1),
        "size_mib": round(size_mib, 1),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (vdir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    log(f"[peers] {name}: ready in {seconds:.0f} s, {size_mib:.0f} MiB")
    return venv_python(name)


def install_info(name: str) -> dict | None:
    """Return the marker written by `ensure_venv` (install time, size), or None."""
    return _read_marker(name)


def dir_size_mib(path: Path) -> float:
    """Total size of the regular files under `path`, in MiB (symlinks not followed)."""
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total / 2**20


def peer_versions(name: str) -> dict[str, str]:
    """Return {distribution: version} for the packages listed in `REPORTED_PACKAGES[name]`."""
    code = (
        "import json, sys\n"
        "from importlib.metadata import version, PackageNotFoundError\n"
        "out = {}\n"
        "for d in sys.argv[1:]:\n"
        "    try:\n"
        "        out[d] = version(d)\n"
        "    except PackageNotFoundError:\n"
        "        out[d] = 'missing'\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [str(venv_python(name)), "-c", code, *REPORTED_PACKAGES[name]],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {d: "unknown" for d in REPORTED_PACKAGES[name]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    # `python benchmarks/peers.py [trl] [torchtune]` builds the named venvs (default: all).
    for peer in sys.argv[1:] or list(PEER_REQUIREMENTS):
        ensure_venv(peer)
        print(peer, json.dumps(peer_versions(peer)), json.dumps(install_info(peer)))
