"""How fast `scaffold plan` answers "does it fit, and if not, what does?", and what it answers,
for the default recipes (no --tricks: what `scaffold new` chooses) of the flagship sizes; writes the `plan_speed` section of
benchmarks/RESULTS.md.

Each row runs the real CLI in a fresh process (`python -m generator.cli plan ...`, the
suggestion search on) and times it end to end; beside it, the arithmetic estimate that
`scaffold new` prints (`generator.plan_estimate`, timed in this process).

Usage (from the repo root, with the venv):
    python benchmarks/plan_speed.py            # every row
    python benchmarks/plan_speed.py --rows 2   # the first two (the 70B fit questions)
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from _sections import write_marked_section

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from generator.options import spec_from_options  # noqa: E402
from generator.plan import GIB, estimate  # noqa: E402
from generator.plan_report import GPU_MEMORY_GIB  # noqa: E402
from generator.render import render  # noqa: E402

MARK_BEGIN = "<!-- plan_speed:begin -->"
MARK_END = "<!-- plan_speed:end -->"
GPU = "h100-80"
# (label, algorithm, model, GPUs per node, nodes): the flagship sizes, no --tricks (the default
# recipe `scaffold new` writes for h100-80, `generator.recipe`)
ROWS = [
    ("llama3.3-70b sft, 8 GPUs", "sft", "llama3.3-70b", 8, 1),
    ("llama3.3-70b lora, 8 GPUs", "lora", "llama3.3-70b", 8, 1),
    ("llama3.3-70b dpo, 8 GPUs", "dpo", "llama3.3-70b", 8, 1),
    ("llama3.3-70b dpo-lora, 8 GPUs", "dpo-lora", "llama3.3-70b", 8, 1),
    ("llama3.3-70b grpo, 8 GPUs", "grpo", "llama3.3-70b", 8, 1),
    ("llama3.1-8b sft, 1 GPU", "sft", "llama3.1-8b", 1, 1),
    ("llama3.1-8b grpo, 1 GPU (engine shares it)", "grpo", "llama3.1-8b", 1, 1),
    ("llama3.1-405b lora, 32 GPUs (4 nodes x 8)", "lora", "llama3.1-405b", 8, 4),
    ("llama3.1-405b grpo-lora, 32 GPUs (4 nodes x 8)", "grpo-lora", "llama3.1-405b", 8, 4),
]


def options_of(algo: str, model: str, gpus: int, nodes: int) -> str:
    return f"--algo {algo} --model {model} --gpus {gpus}" + (
        f" --nodes {nodes}" if nodes > 1 else ""
    )


def run_plan(options: str) -> tuple[float, str]:
    """(wall seconds, stdout) of `scaffold plan OPTIONS --gpu-memory GPU`, suggestions on."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "generator.cli", "plan", *options.split(), "--gpu-memory", GPU]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=True)
    return time.perf_counter() - start, out.stdout


def parse(stdout: str) -> dict:
    """The simulated peak (GiB; with the engine on the trainer's GPU where one shares it), the
    verdict and the suggestion line of a `scaffold plan` output."""
    # the last of: the trainer's peak, the trainer + engine sharing its GPU, colocated's max phase
    peaks = re.findall(r"^  (?:peak|trainer step \+ engine|max)\s+([\d.]+) GiB", stdout, re.M)
    verdict = "yes" if re.search(r"^verdict[^:]*: fits", stdout, re.M) else "no"
    suggestion = next(
        (line for line in stdout.splitlines() if line.startswith(("fits with", "nothing tried"))),
        "",
    )
    engines = next((line for line in stdout.splitlines() if line.startswith("rollout engines")), "")
    if not engines:
        engine_fit = ""
    elif "does NOT fit" in engines:
        engine_fit = "engines do NOT fit"
    elif ": fits:" in engines:
        engine_fit = "engines fit"
    else:  # the runtime's sampler on the trainer's GPU: counted in the peak above
        engine_fit = "the runtime sampler on the trainer's GPU, in the peak"
    return {
        "peak": float(peaks[-1]),
        "fits": verdict,
        "suggestion": suggestion,
        "engines": engine_fit,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=len(ROWS))
    args = parser.parse_args()
    gpu_gib = GPU_MEMORY_GIB[GPU]
    lines = []
    for label, algo, model, gpus, nodes in ROWS[: args.rows]:
        options = options_of(algo, model, gpus, nodes)
        start = time.perf_counter()  # what `scaffold new` does: choose the recipe, estimate it
        spec = spec_from_options(
            algo, "lora", model, None, gpus, nodes, 1, 1, 1, 1, "bf16", fit_gpu=(GPU, gpu_gib)
        )
        e = estimate(spec, render(spec), gpu_gib=gpu_gib)
        estimate_s = time.perf_counter() - start
        recipe = ",".join(spec.tricks) or "none (plain)"
        if spec.layout == "colocated":
            recipe += f"; colocated, engine_tp {spec.engine_tp}"
        if 'ref_mode: str = "precomputed"' in render(spec):
            recipe += "; precomputed reference"
        seconds, stdout = run_plan(options)
        p = parse(stdout)
        print(f"{label}: {p} in {seconds:.0f} s; estimate {e.peak / GIB:.1f} GiB", flush=True)
        suggestion = p["suggestion"].replace("|", "/")
        lines.append(
            f"| {label} | `scaffold plan {options} --gpu-memory {GPU}` | {recipe} | {p['peak']:.2f} | "
            f"{e.peak / GIB:.1f} ({estimate_s:.2f} s) | {p['fits']} | "
            f"{suggestion or '-'}{'; ' + p['engines'] if p['engines'] else ''} | "
            f"{seconds:.0f} s |"
        )
    section = "\n".join(
        [
            MARK_BEGIN,
            f"### Default recipes and planner speed on {GPU} (`benchmarks/plan_speed.py`)",
            "",
            f"Command: `python benchmarks/plan_speed.py` ({time.strftime('%Y-%m-%d %H:%M')} UTC, "
            f"{platform.machine()}, {os.cpu_count()} CPUs shared, load "
            f"{os.getloadavg()[0]:.1f} at the end). Planned peak = `scaffold plan`'s simulated "
            "peak per (trainer) GPU of the default recipe (no --tricks: the recipe `scaffold new` "
            "chooses for the GPU, `generator.recipe`; GRPO: the largest phase of its layout); "
            "estimate = the arithmetic estimate `scaffold new` prints (its time in brackets, the "
            "recipe choice included); planner time = the whole `scaffold plan` command, "
            "suggestion search included (it runs only when the recipe does not fit), wall clock.",
            "",
            "| run | command | chosen recipe | planned peak GiB | estimate GiB | fits | suggestion | planner time |",
            "|---|---|---|---|---|---|---|---|",
            *lines,
            MARK_END,
        ]
    )
    write_marked_section(REPO / "benchmarks" / "RESULTS.md", section + "\n", MARK_BEGIN, MARK_END)


if __name__ == "__main__":
    main()
