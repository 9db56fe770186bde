"""`scaffold plan` for Llama 3.3 70B on 8 x H200 (141 GB), with and without the memory tricks,
beside the published torchtune anchor; writes the `plan` section of benchmarks/RESULTS.md.

Each variant is one fake-tensor simulation of the emitted SFT script (generator/plan_harness.py): the
model build and two training steps of rank 0 of a fake 8-rank process group, PyTorch's
MemTracker counting the bytes. Nothing is allocated, so this runs on a CPU-only machine; the
time per variant is printed (it is the Python cost of dispatching every op of an 80-layer step).

Usage (from the repo root, with the venv):
    python benchmarks/plan.py --model llama3.3-70b --gpus 8 --micro_batch_size 2 --max_seq_len 2048
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from _sections import write_marked_section

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from generator.plan import GIB, HEADROOM, fits, parse_gpu_memory, simulate  # noqa: E402
from generator.spec import Spec  # noqa: E402

MARK_BEGIN = "<!-- plan:begin -->"
MARK_END = "<!-- plan:end -->"
# tricks, optionally "/tpN" for tensor parallel N x FSDP gpus/N (sequence + loss parallel)
VARIANTS = ["", "ac", "lce", "ac,lce", "ac,lce,optim-in-bwd", "ac,lce/tp2", "ac,lce/tp8"]
ANCHOR = (
    'torchtune README, "Memory and training speed" table: Llama 3.1 70B full fine-tune on '
    '8 x A100, 13.9 GiB peak per GPU, "uses CPU offload with fused optimizer"; all rows there '
    "at batch size 2, packed to sequence length 2048, torch.compile on"
)


def write_section(path: Path, section: str) -> None:
    write_marked_section(path, section, MARK_BEGIN, MARK_END)


def render_section(args, rows, command: str, gpu_label: str, gpu_gib: float) -> str:
    cols = ["parameters", "gradients", "optimizer state", "activations", "temporaries"]
    lines = [
        MARK_BEGIN,
        f"## `scaffold plan`: {args.model} on {args.gpus} x {gpu_label} (simulated, fake tensors)",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; the same numbers as "
        f"`scaffold plan --model {args.model} --gpus {args.gpus} --dtype {args.dtype} "
        f"--micro-batch-size {args.micro_batch_size} --max-seq-len {args.max_seq_len} "
        f"--tricks ... --gpu-memory {args.gpu_memory}`).",
        "",
        f"Per rank (rank 0 of {args.gpus}), GiB, at the peak of two simulated steps; dtype "
        f"{args.dtype} (bf16 compute over fp32 master weights and fp32 AdamW state, FSDP2 "
        f"`MixedPrecisionPolicy`), micro-batch {args.micro_batch_size} x {args.max_seq_len} "
        "tokens, every position supervised, max_grad_norm 1.0. Verdict: peak <= "
        f"{1 - HEADROOM:.0%} of {gpu_gib:g} GiB.",
        "",
        "| tricks | plan | " + " | ".join(cols) + " | logits | peak | verdict | sim time |",
        "|---|---|" + "---:|" * (len(cols) + 2) + "---|---:|",
    ]
    for tricks, r in rows:
        tp = r.spec.tp
        plan = f"TP {tp} x FSDP {args.gpus // tp}" if tp > 1 else f"FSDP {args.gpus}"
        cells = [f"{r.categories[c] / GIB:.1f}" for c in cols]
        verdict = "fits" if fits(r, gpu_gib) else "does not fit"
        lines.append(
            f"| {tricks or 'none'} | {plan} | " + " | ".join(cells)
            + f" | {r.logits / GIB:.2f} | **{r.peak / GIB:.1f}** | {verdict} | {r.seconds:.0f} s |"
        )  # fmt: skip
    lines += [
        "",
        f"Anchor: {ANCHOR}. What differs: torchtune's recipe keeps its bf16 parameters, "
        "gradients and optimizer state in CPU memory (FSDP CPU offload) and steps the optimizer "
        "inside backward, so its GPU holds the gathered weights of the blocks in flight plus "
        "activations; the FSDP rows above keep fp32 master weights and fp32 AdamW state on the GPU "
        "(pure bf16 learns badly at fine-tuning learning rates), sharded 8 ways, "
        "with no FSDP CPU offload (the script's `offload` trick moves activations only and is not "
        "simulated), and no compile (not simulated). "
        "Arithmetic check: 70.55 B fp32 parameters / 8 = 32.9 GiB per rank, "
        "fp32 AdamW states 65.7 GiB per rank. The TP rows split each block's matmuls over "
        "TP ranks (sequence parallel between them, vocab-sharded lm_head and loss) and shard "
        "what TP leaves over the remaining FSDP ranks: the same parameter bytes per rank, "
        "activations divided by TP.",
        "",
        "Not simulated: the CUDA context, NCCL buffers and allocator fragmentation (hence the "
        f"{HEADROOM:.0%} headroom); tensors are placed on a fake CPU device (FSDP2's CUDA "
        "streams need a GPU), so per-tensor bytes are exact but stream-ordered buffer reuse is "
        "not modelled. No GPU was lent to this task, so no real-GPU comparison.",
        MARK_END,
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3.3-70b")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--micro_batch_size", type=int, default=2)  # the anchor's batch
    p.add_argument("--max_seq_len", type=int, default=2048)
    p.add_argument("--gpu_memory", default="h200-141")
    p.add_argument(
        "--variants", default=";".join(VARIANTS), help="';'-separated TRICKS[/tpN] variants"
    )
    p.add_argument("--out", default=str(REPO / "benchmarks" / "RESULTS.md"))
    args = p.parse_args()
    gpu_label, gpu_gib = parse_gpu_memory(args.gpu_memory)
    rows = []
    for variant in args.variants.split(";"):
        tricks, _, tp = variant.partition("/tp")
        spec = Spec(
            model=args.model, gpus=args.gpus, dtype=args.dtype, tp=int(tp or 1),
            tricks=tuple(t for t in tricks.split(",") if t),
        )  # fmt: skip
        start = time.perf_counter()
        (result,) = simulate([spec], args.micro_batch_size, args.max_seq_len)
        print(
            f"{variant or 'none':24} peak {result.peak / GIB:7.1f} GiB "
            f"({time.perf_counter() - start:.0f} s)", flush=True,
        )  # fmt: skip
        rows.append((tricks, result))
    command = "python benchmarks/plan.py " + " ".join(sys.argv[1:])
    write_section(Path(args.out), render_section(args, rows, command.strip(), gpu_label, gpu_gib))
    print(f"wrote the plan section of {args.out}")


if __name__ == "__main__":
    main()
