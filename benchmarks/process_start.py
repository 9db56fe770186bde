"""What a test pays to start processes: 2 gloo-ready ranks started with `spawn` (a new
interpreter each, importing torch and the runtime) against forks of a preloaded forkserver (what
`tests/helpers.spawn` does), and `simulate` of one tiny spec at a process's first call (the
planner's server starts) against its later calls (the server forks).

    python benchmarks/process_start.py [--repeats 3]

Prints one markdown table (wall seconds, each repeat); the figures go in benchmarks/RESULTS.md
with the machine's fp32 matmul rate of the same moment (a loaded machine is slower at both)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "runtime"]


def _rank(rank: int, queue) -> None:
    import runtime  # noqa: F401  (what a test's rank imports before its first line)

    queue.put(rank)


def start_ranks(method: str, repeats: int) -> list[float]:
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, queue)) for r in range(2)]
        for p in procs:
            p.start()
        for _ in procs:
            queue.get()
        for p in procs:
            p.join()
        times.append(time.perf_counter() - start)
    return times


def simulate_calls(repeats: int) -> list[float]:
    from generator.plan import simulate
    from generator.spec import Spec

    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=512,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            (result,) = simulate([Spec(model=tmp)], 2, 64)
            times.append(time.perf_counter() - start - result.seconds)  # the call less the spec
        return times


def matmul_gflops() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(3):
        a @ b
    start, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    return 2 * 2048**3 * n / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rate = matmul_gflops()
    rows = [
        ("2 ranks, spawn (new interpreters)", start_ranks("spawn", args.repeats)),
        ("2 ranks, forkserver (first start included)", start_ranks("forkserver", args.repeats)),
        ("simulate() overhead (first call starts the server)", simulate_calls(args.repeats)),
    ]
    print(f"fp32 torch.mm 2048x2048, 2 threads: {rate:.1f} GFLOP/s\n")
    print("| what | wall seconds per start (in order) |\n|---|---|")
    for name, times in rows:
        print(f"| {name} | {', '.join(f'{t:.2f}' for t in times)} |")


if __name__ == "__main__":
    main()
