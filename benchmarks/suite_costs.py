"""Where the test suite's largest costs come from, measured one at a time: the real-SmolLM2
precision curves (tests/recipes/test_precision.py) per recipe, split into the first step (which
compiles torchao's optimizer step where the recipe has one) and the later steps; torchao's
low-bit AdamW step alone on SmolLM2-135M's parameter shapes (nanoseconds per parameter); and
the first step's compile with an empty inductor cache against a warm one (what a fresh CI
machine pays against a machine that ran the suite before).

    python benchmarks/suite_costs.py [--steps 4] [--threads 2]

The precision curves run in this process with its inductor cache (`TORCHINDUCTOR_CACHE_DIR`, else
torch's default directory: warm on a machine that ran them before); the optimizer rows each use
a new empty cache, then the same cache again. Prints markdown tables; the figures go in
benchmarks/RESULTS.md ("Test suite and CI") with the
fp32 matmul rate printed first (a loaded machine is slower at everything)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from process_start import matmul_gflops  # benchmarks/ is this script's sys.path[0]

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# SmolLM2-135M's trained parameters: the tied embedding, then 30 blocks of q, k, v, o, gate,
# up, down and 2 norms (the final norm is one more 576-vector)
SMOLLM2_SHAPES = [(49152, 576)] + [
    (576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536),
    (576,), (576,),
] * 30 + [(576,)]  # fmt: skip

_STEP = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from runtime.optim import torchao_adamw
shapes, bits, steps = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
optimizer = torchao_adamw(bits)(params, lr=1e-5)
times = []
for _ in range(steps):
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    start = time.perf_counter()
    optimizer.step()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def optimizer_steps(shapes, bits: int, steps: int, cache: str, threads: int) -> list[float]:
    """Step times of torchao's AdamW (`bits`-bit state) over fresh parameters of `shapes`, in a
    new process whose inductor cache is `cache`."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, "-c", _STEP, str(REPO), json.dumps(shapes), str(bits), str(steps)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def precision_curve(name: str, steps: int) -> list[float]:
    """The precision test's recipe `name` on the real SmolLM2 for `steps` steps: each step's
    `step_time_s` from its metrics."""
    from generator.assets import ensure_dataset, ensure_smollm2
    from tests.helpers import read_metrics
    from tests.recipes import test_precision

    test_precision.LEARNING_STEPS = steps
    tmp = Path(tempfile.mkdtemp(prefix="suite-costs-"))
    with contextlib.redirect_stdout(io.StringIO()):  # the script's own log lines
        test_precision._real_curve(
            name, ensure_smollm2(), ensure_dataset("alpaca_en_demo.json"), tmp
        )
    run = tmp / name.replace(" ", "_").replace(",", "_").replace("-", "_")
    return [row["step_time_s"] for row in read_metrics(run / "out")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"fp32 torch.mm 2048x2048 at {args.threads} threads: {matmul_gflops():.1f} GFLOP/s\n")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    print(f"| precision recipe ({args.steps} steps) | first step s | later steps s (mean) |")
    print("|---|---:|---:|")
    for name in ("fp32", "bf16-sr", "adamw8bit", "bf16-sr,adamw8bit", "pure bf16"):
        times = precision_curve(name, args.steps)
        print(f"| {name} | {times[0]:.2f} | {sum(times[1:]) / (len(times) - 1):.2f} |", flush=True)

    numel = sum(torch.Size(s).numel() for s in SMOLLM2_SHAPES)
    print(f"\n| torchao AdamW step, SmolLM2-135M shapes ({numel / 1e6:.1f} M parameters) "
          f"| first step s, empty inductor cache | first step s, warm cache | later steps, ns per parameter |")  # fmt: skip
    print("|---|---:|---:|---:|")
    for bits in (8, 4):
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            cold = optimizer_steps(SMOLLM2_SHAPES, bits, 3, cache, args.threads)
            warm = optimizer_steps(SMOLLM2_SHAPES, bits, 3, cache, args.threads)
        later = sum(cold[1:] + warm[1:]) / len(cold[1:] + warm[1:])
        print(f"| {bits}-bit state | {cold[0]:.2f} | {warm[0]:.2f} | {later / numel * 1e9:.1f} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
