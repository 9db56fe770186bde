"""Peak memory per rank of context parallel's two modes, all-gather vs ring (--cp-mode), as the
sequence grows: measured on gloo ranks (CPU) and simulated by `scaffold plan`.

The emitted SFT script (`scaffold new --gpus CP --cp CP --cp-mode MODE`) on a random tiny-hidden
model with many K/V heads (hidden 64, 16 heads and 16 K/V heads of 16: 256 K/V values per token
per layer, so attention's K/V are a large part of the step), bf16 compute (FSDP2 mixed precision,
the default), 1 row of S tokens. Each number is the planner's `measure_step`: two `train_step`s
under PyTorch's MemTracker (tensor bytes at the peak, the larger of the ranks),
the script's own FSDP over dp_shard x cp and its cp sharding of the row.

- measured: real tensors on CP gloo ranks. The CPU's all-gather also keeps, per layer, the
  dense [L, S] bottom-right causal mask SDPA materialises on the CPU (a GPU's flash/efficient
  kernel has none): quadratic in S, so it is reported as measured and as the plan.
- planned: `scaffold plan`'s simulation (fake tensors, fake process group) of the same spec,
  which takes the GPU's path for that mask.

Usage (from the repo root, with the venv):
    python benchmarks/ring_cp_memory.py --cp 2 --seqs 1024,2048,4096,8192,16384 --tricks none,ac --write
    python benchmarks/ring_cp_memory.py --cp 4 --seqs 2048,4096,8192,16384 --tricks none,ac --write
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _sections import write_marked_section  # noqa: E402

WORK = REPO / "benchmarks" / ".work" / "ring_cp"
MODES = ("allgather", "ring")
MARKS = ("<!-- ring_cp_memory cp{}:begin -->", "<!-- ring_cp_memory cp{}:end -->")  # one per --cp
MIB = 2**20
HEADS = {"num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 16}


def model_dir(layers: int) -> Path:
    import torch

    from runtime import ModelArgs, build_model, save_hf_checkpoint
    from tests.helpers import TINY_CONFIG

    out = WORK / f"model_{layers}l"
    if not (out / "config.json").exists():
        config = {**TINY_CONFIG, **HEADS, "num_hidden_layers": layers}
        args = ModelArgs(**config, max_position_embeddings=65536)
        model = build_model(args, device="cpu")
        model.init_weights(generator=torch.Generator().manual_seed(0))
        save_hf_checkpoint(model, out, args.to_hf_config())
    return out


def _measure_rank(rank, world_size, spec_jsons, model, seqs):
    """Every (spec, S) on this gloo rank: measure_step on real tensors."""
    from generator.plan import import_script, measure_step
    from generator.render import render
    from generator.spec import Spec

    out = {}
    for i, spec_json in enumerate(spec_jsons):
        data = json.loads(spec_json)
        spec = Spec(**dict(data, tricks=tuple(data["tricks"])))
        path = WORK / f"rank{rank}_{i}" / "train.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(spec))
        script = import_script(path, f"ring_cp_bench_{rank}_{i}")
        for seq in seqs:
            start = time.perf_counter()
            m = measure_step(script, Path(model), 1, seq, spec, fake=False)
            out[i, seq] = {"peak": m["peak"], "categories": m["categories"],
                           "seconds": time.perf_counter() - start}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    parser.add_argument("--tricks", default="none,ac", help="comma list of trick sets, + inside")
    parser.add_argument("--write", action="store_true", help="write the table into RESULTS.md")
    args = parser.parse_args()
    from generator.plan import simulate
    from generator.spec import Spec
    from tests.helpers import spawn

    seqs = [int(s) for s in args.seqs.split(",")]
    trick_sets = [() if t == "none" else tuple(t.split("+")) for t in args.tricks.split(",")]
    model = model_dir(args.layers)
    specs = [
        Spec(model=str(model), gpus=args.cp, cp=args.cp, cp_mode=mode, tricks=tricks)
        for tricks in trick_sets
        for mode in MODES
    ]
    start = time.perf_counter()
    ranks = spawn(
        _measure_rank, args.cp, args=([json.dumps(asdict(s)) for s in specs], str(model), seqs)
    )
    measured_s = time.perf_counter() - start
    start = time.perf_counter()
    planned = {seq: simulate(specs, 1, seq) for seq in seqs}
    planned_s = time.perf_counter() - start
    rows = []
    for t, tricks in enumerate(trick_sets):
        for seq in seqs:
            row = {"tricks": ",".join(tricks) or "none", "seq": seq}
            for m, mode in enumerate(MODES):
                i = t * len(MODES) + m
                peaks = [r[i, seq]["peak"] for r in ranks]
                row[f"{mode} measured"] = max(peaks) / MIB
                row[f"{mode} spread"] = (max(peaks) - min(peaks)) / max(peaks)
                row[f"{mode} planned"] = planned[seq][i].peak / MIB
                row[f"{mode} seconds"] = ranks[0][i, seq]["seconds"]
            rows.append(row)
    for row in rows:
        print(json.dumps(row))
    text = table(rows, args, measured_s, planned_s)
    print(text)
    if args.write:
        begin, end = (mark.format(args.cp) for mark in MARKS)
        write_marked_section(REPO / "benchmarks" / "RESULTS.md", text, begin, end)


def _slope(rows: list[dict], key: str) -> float:
    """MiB per 1k tokens between the two longest sequences."""
    a, b = rows[-2], rows[-1]
    return (b[key] - a[key]) / ((b["seq"] - a["seq"]) / 1024)


def table(rows: list[dict], args, measured_s: float, planned_s: float) -> str:
    cmd = (
        f"python benchmarks/ring_cp_memory.py --cp {args.cp} --layers {args.layers} "
        f"--seqs {args.seqs} --tricks {args.tricks}"
    )
    lines = [
        MARKS[0].format(args.cp),
        f"Command: `{cmd}` ({measured_s:.0f} s of gloo runs, {planned_s:.0f} s of plans; "
        f"{time.strftime('%Y-%m-%d')}). Peak per rank, MiB (MemTracker's tensor bytes, the "
        "larger rank), 2 train steps of 1 row of S tokens. measured: real tensors on the gloo "
        "ranks (the CPU's all-gather keeps a dense [L, S] causal mask per layer, which a GPU's "
        "kernel does not); planned: `scaffold plan`'s simulation of the same spec (rank 0, the "
        "GPU's path for that mask).",
        "",
        "| tricks | S | all-gather measured | ring measured | ring / all-gather | all-gather planned "
        "| ring planned | ring / all-gather |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tricks']} | {r['seq']} | {r['allgather measured']:.1f} | "
            f"{r['ring measured']:.1f} | {r['ring measured'] / r['allgather measured']:.2f} | "
            f"{r['allgather planned']:.1f} | {r['ring planned']:.1f} | "
            f"{r['ring planned'] / r['allgather planned']:.2f} |"
        )
    lines.append("")
    for tricks in dict.fromkeys(r["tricks"] for r in rows):
        sub = [r for r in rows if r["tricks"] == tricks]
        slopes = ", ".join(
            f"{mode} {kind} {_slope(sub, f'{mode} {kind}'):.2f}"
            for kind in ("measured", "planned")
            for mode in MODES
        )
        lines.append(f"- {tricks}: slope between the two longest, MiB per 1k tokens: {slopes}.")
    lines.append(MARKS[1].format(args.cp))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
