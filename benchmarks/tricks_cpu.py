"""The paper's memory/speed table on CPU: the emitted SFT script on SmolLM2-135M (real weights, real
alpaca rows), baseline vs each trick alone vs the cumulative stack.

Each variant is rendered with `scaffold new --tricks ...` and measured twice, each time in a fresh
process:
1. PyTorch's own accounting (`torch.distributed._tools.mem_tracker.MemTracker`) over 3 training
   steps: peak bytes by category (parameters, gradients, optimizer state, activations, temporaries).
   This is the honest figure on CPU: it counts tensors, not what glibc keeps mapped. Compiled code
   runs eagerly under the tracker (a dispatch mode dynamo cannot trace through).
2. The unmodified script (`python train.py ...`) for tokens/s (steps 2..N, from metrics.jsonl) and the
   process's peak RSS, with GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072 so freed tensors are
   returned to the OS (without it RSS hides most savings).

Usage (from the repo root, with the venv):
    python benchmarks/tricks_cpu.py --steps 6 --micro_batch_size 2 --max_seq_len 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _sections import write_marked_section

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / ".work" / "tricks"
VARIANTS = [
    ("baseline", ""),
    ("ac", "ac"),
    ("lce", "lce"),
    ("optim-in-bwd", "optim-in-bwd"),
    ("packing", "packing"),
    ("compile", "compile"),
    ("adamw8bit", "adamw8bit"),
    ("adamw4bit", "adamw4bit"),
    ("ac+lce", "ac,lce"),
    ("ac+lce+optim-in-bwd", "ac,lce,optim-in-bwd"),
    ("packing+ac+lce+optim-in-bwd", "packing,ac,lce,optim-in-bwd"),
    ("packing+ac+compile+lce+optim-in-bwd", "packing,ac,compile,lce,optim-in-bwd"),
    (
        "packing+ac+compile+lce+optim-in-bwd+adamw4bit",
        "packing,ac,compile,lce,optim-in-bwd,adamw4bit",
    ),
]
# offload is not measured here: it moves GPU activations to CPU memory and refuses CPU runs.
CATEGORIES = ["Parameter", "Gradient", "Optstate", "Activation", "Temp", "Buffer", "Other"]
MARK_BEGIN = "<!-- tricks_cpu:begin -->"
MARK_END = "<!-- tricks_cpu:end -->"


def render(name: str, tricks: str) -> Path:
    out = WORK / name
    cmd = [str(Path(sys.executable).parent / "scaffold"), "new", "--out", str(out), "--force"]
    if tricks:
        cmd += ["--tricks", tricks]
    subprocess.run(cmd, check=True, capture_output=True)
    return out / "train.py"


def script_args(args, out_dir: Path) -> list[str]:
    return [
        "--max_steps", str(args.steps), "--micro_batch_size", str(args.micro_batch_size),
        "--max_seq_len", str(args.max_seq_len), "--pad_to_max_seq_len", "true", "--dtype", args.dtype,
        "--warmup_steps", "0", "--min_lr_ratio", "1.0", "--val_fraction", "0",
        "--sample_max_new_tokens", "0", "--max_grad_norm", "0", "--out_dir", str(out_dir),
    ]  # fmt: skip


def tracker_child(script: str, argv: list[str]) -> None:
    """Runs in a fresh process: 3 train steps of `script` under MemTracker; prints one JSON line."""
    import importlib.util

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    spec = importlib.util.spec_from_file_location("bench_train", script)
    s = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(s)
    cfg = s.parse_config(s.Config, argv)
    dist_info, mesh = s.setup_distributed(cfg)
    model_dir = s.resolve_model_dir(cfg.model, cfg.hf_repo_id)
    tokenizer = s.Tokenizer.from_dir(model_dir)
    train_set, _ = s.build_datasets(cfg, tokenizer)
    model = s.setup_model(cfg, model_dir, mesh, dist_info.device)
    optimizer, scheduler = s.build_optimizer(cfg, model)
    loader = s.build_dataloader(cfg, train_set, tokenizer.pad_token_id, 0, 1, train=True)
    batches = s.infinite_batches(loader)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    # MemTracker is a dispatch mode, under which dynamo refuses to trace (torchao's compiled
    # low-bit step fails: "frame is in the Dynamo skipfiles list"): run compiled code eagerly here.
    # Compile's own memory effect shows in the peak RSS column (the unmodified script).
    with tracker, torch.compiler.set_stance("force_eager"):
        for step in range(3):
            if step:
                tracker.reset_mod_stats()  # required before every iteration after the first
            micro = [next(batches)[1] for _ in range(cfg.gradient_accumulation_steps)]
            s.train_step(model, optimizer, scheduler, micro, cfg, dist_info.device)
    peak = tracker.get_tracker_snapshot("peak")
    snap = next(v for k, v in peak.items() if torch.device(k).type == "cpu")
    print(json.dumps({getattr(k, "value", str(k)): v for k, v in snap.items()}))


def run_tracker(script: Path, argv: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(script), *argv], capture_output=True, text=True,
        timeout=3600,
    )  # fmt: skip
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    snap = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = {c: snap.get(c, 0) / 2**20 for c in CATEGORIES}
    mib["Total"] = snap.get("Total", sum(snap.get(c, 0) for c in CATEGORIES)) / 2**20
    return mib


def run_timed(script: Path, argv: list[str], out_dir: Path) -> dict:
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}
    shutil.rmtree(out_dir, ignore_errors=True)  # metrics.jsonl appends: start from an empty run
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(script), *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read()
    if status:
        return {"error": (stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    # step 1 includes one-time warm-up (allocator, DTensor dispatch caches, compilation); a
    # 1-step smoke run has nothing else
    timed = rows[1:] or rows
    return {
        "tokens_per_s": sum(r["num_tokens"] for r in timed) / sum(r["step_time_s"] for r in timed),
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "losses": [round(r["loss"], 4) for r in rows],
        "wall_s": time.perf_counter() - start,
    }


def table(results: dict, args) -> str:
    base = results["baseline"]
    lines = [
        MARK_BEGIN,
        "## Memory and speed tricks (SmolLM2-135M, CPU)",
        "",
        f"Command: `python benchmarks/tricks_cpu.py --steps {args.steps} --micro_batch_size "
        f"{args.micro_batch_size} --max_seq_len {args.max_seq_len} --dtype {args.dtype}` "
        f"({time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch threads default). Real SmolLM2-135M-Instruct weights, real "
        f"alpaca rows padded to {args.max_seq_len} tokens, micro-batch {args.micro_batch_size}, "
        "max_grad_norm 0 (so optim-in-bwd runs one backward per step), constant lr. packing fills "
        "each row with several documents (so a step holds more real tokens: compare tokens/s, "
        "and its losses are over different batches); compile's first step (compilation) is "
        "excluded from tokens/s like every variant's. offload is GPU-only (refused on CPU).",
        "",
        "Peak by category = PyTorch's MemTracker over 3 steps (tensor bytes, MiB), at the moment "
        "of the peak (the baseline peaks at the end of the forward, before any gradient exists; "
        "with ac the peak moves into the backward, where gradients are live). A 1-process fp32 "
        "run is not FSDP-wrapped, so gradients are labelled. Peak RSS = the "
        "unmodified script in a fresh process with `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072`"
        " (includes the Python heap, libraries and the tokenized dataset).",
        "",
        "| variant | params | grads | optim state | activations | temp | **tracked peak** | x base |"
        " peak RSS | x base | tokens/s | x base |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        mt, tm = r["tracker"], r["timed"]
        if "error" in mt or "error" in tm:
            lines.append(f"| {name} | failed: {mt.get('error') or tm.get('error')} |")
            continue
        bt, bm = base["tracker"], base["timed"]
        lines.append(
            f"| {name} | {mt['Parameter']:.0f} | {mt['Gradient']:.0f} | {mt['Optstate']:.0f} | "
            f"{mt['Activation']:.0f} | {mt['Temp']:.0f} | **{mt['Total']:.0f}** | "
            f"{mt['Total'] / bt['Total']:.2f} | {tm['peak_rss_mib']:.0f} | "
            f"{tm['peak_rss_mib'] / bm['peak_rss_mib']:.2f} | {tm['tokens_per_s']:.0f} | "
            f"{tm['tokens_per_s'] / bm['tokens_per_s']:.2f} |"
        )
    lines += [
        "",
        "Losses per step (every variant without packing or a low-bit optimizer must match the "
        "baseline's; packed variants match each other):",
        "",
    ]
    lines += [f"- {name}: {r['timed'].get('losses')}" for name, r in results.items()]
    lines += getattr(args, "extra_lines", [])
    lines.append(MARK_END)
    return "\n".join(lines) + "\n"


LOSS_STEP_CODE = r"""
import json, sys, torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from runtime import IGNORE_INDEX, linear_cross_entropy

T, D, V, chunks = (int(x) for x in sys.argv[1:5])
torch.manual_seed(0)
h = torch.randn(T, D, requires_grad=True)
w = (torch.randn(V, D) * 0.02).requires_grad_()
labels = torch.randint(0, V, (T,))
labels[: T // 2] = IGNORE_INDEX  # half the positions are prompt, as in SFT


def plain():
    F.cross_entropy(h @ w.T, labels, ignore_index=IGNORE_INDEX, reduction="sum").backward()


def lce():
    linear_cross_entropy(h, w, labels, num_chunks=chunks).backward()


out = {}
for name, fn in (("plain", plain), ("lce", lce), ("plain", plain), ("lce", lce)):
    h.grad = w.grad = None
    tracker = MemTracker()
    tracker.track_external(h, w, labels)
    with tracker:
        fn()
    inputs = sum(t.numel() * t.element_size() for t in (h, w, labels, h.grad, w.grad))
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    out[name] = {"peak_mib": peak / 2**20, "above_inputs_mib": (peak - inputs) / 2**20}
print(json.dumps(out))
"""


def loss_step_peaks(T: int, D: int = 576, V: int = 49152, chunks: int = 8) -> dict:
    """MemTracker peak of one loss forward + backward, plain CE on [T, V] logits vs LCE (the
    second of two runs each, so lazy allocations are warm); fp32, half the tokens supervised."""
    proc = subprocess.run(
        [sys.executable, "-c", LOSS_STEP_CODE, str(T), str(D), str(V), str(chunks)],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def optim_in_backward_cut(micro_batch_size: int = 1, max_seq_len: int = 512) -> dict:
    """Tracked peak (MiB) of ac+lce with and without optim-in-bwd at one batch shape, and the cut
    as a fraction of the gradient bytes (= parameter bytes): the torchtune paper's setting, where
    activations (checkpointed) are small next to the gradients. Reuses the table's renders."""
    args = argparse.Namespace(
        steps=3, micro_batch_size=micro_batch_size, max_seq_len=max_seq_len, dtype="fp32"
    )
    peaks = {}
    for name, tricks in (("ac+lce", "ac,lce"), ("ac+lce+optim-in-bwd", "ac,lce,optim-in-bwd")):
        script = render(name, tricks)
        peaks[name] = run_tracker(script, script_args(args, WORK / name / "out"))
    grads = peaks["ac+lce"]["Parameter"]  # one fp32 gradient per fp32 parameter
    cut = peaks["ac+lce"]["Total"] - peaks["ac+lce+optim-in-bwd"]["Total"]
    return {**{k: round(v["Total"]) for k, v in peaks.items()}, "cut_mib": round(cut),
            "gradient_mib": round(grads), "cut_x_gradient_bytes": round(cut / grads, 2)}  # fmt: skip


def loss_step_lines(T: int, peaks: dict) -> list[str]:
    p, c = peaks["plain"], peaks["lce"]
    return [
        "",
        f"Loss step alone (hidden [T={T}, D=576] fp32, lm_head [V=49152, 576], half the tokens "
        "supervised, forward + backward under MemTracker; inputs = hidden, weight, labels and "
        f"their gradients, {p['peak_mib'] - p['above_inputs_mib']:.0f} MiB, which both need): "
        f"plain CE peak {p['peak_mib']:.0f} MiB ({p['above_inputs_mib']:.0f} above the inputs), "
        f"LCE {c['peak_mib']:.0f} MiB ({c['above_inputs_mib']:.0f} above the inputs): "
        f"**{c['peak_mib'] / p['peak_mib']:.2f}x** of the total, "
        f"**{c['above_inputs_mib'] / p['above_inputs_mib']:.2f}x** of the loss's own memory.",
    ]


def bar_chart(results: dict, path: Path) -> None:
    """Tracked peak, peak RSS and tokens/s of every variant relative to the baseline, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {
        n: r
        for n, r in results.items()
        if "error" not in r["tracker"] and "error" not in r["timed"]
    }
    base = ok["baseline"]
    names = list(ok)
    series = {
        "tracked peak": [r["tracker"]["Total"] / base["tracker"]["Total"] for r in ok.values()],
        "peak RSS": [
            r["timed"]["peak_rss_mib"] / base["timed"]["peak_rss_mib"] for r in ok.values()
        ],
        "tokens/s": [
            r["timed"]["tokens_per_s"] / base["timed"]["tokens_per_s"] for r in ok.values()
        ],
    }
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(names)), 4.5))
    width = 0.27
    for i, (label, values) in enumerate(series.items()):
        xs = [x + (i - 1) * width for x in range(len(names))]
        ax.bar(xs, values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("x baseline")
    ax.set_title("SmolLM2-135M SFT on CPU: each trick and stack vs the baseline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_section(path: Path, section: str) -> None:
    write_marked_section(path, section, MARK_BEGIN, MARK_END)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        tracker_child(sys.argv[2], sys.argv[3:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--max_seq_len", type=int, default=1024)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--variants", default=",".join(n for n, _ in VARIANTS))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "RESULTS.md"))
    p.add_argument(
        "--loss_step_tokens", type=int, default=2048, help="T of the loss-only row (0 = skip)"
    )
    p.add_argument("--png", default=str(REPO / "benchmarks" / "tricks_cpu.png"))
    args = p.parse_args()
    wanted = args.variants.split(",")
    results = {}
    for name, tricks in VARIANTS:
        if name not in wanted:
            continue
        script = render(name, tricks)
        out_dir = WORK / name / "out"
        argv = script_args(args, out_dir)
        results[name] = {
            "tracker": run_tracker(script, argv),
            "timed": run_timed(script, argv, out_dir),
        }
        print(name, json.dumps(results[name]), flush=True)
    (WORK / "results.json").write_text(json.dumps(results, indent=2))
    args.extra_lines = []
    if args.loss_step_tokens:
        peaks = loss_step_peaks(args.loss_step_tokens)
        print("loss step", json.dumps(peaks), flush=True)
        args.extra_lines = loss_step_lines(args.loss_step_tokens, peaks)
    if "baseline" in results and args.png:
        bar_chart(results, Path(args.png))
        args.extra_lines += [
            "",
            f"Chart: `{Path(args.png).relative_to(REPO)}` (same numbers, x baseline).",
        ]
    write_section(Path(args.out), table(results, args))
    print(
        f"wrote {args.out}; self peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )


if __name__ == "__main__":
    main()
