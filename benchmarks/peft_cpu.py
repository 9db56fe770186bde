"""Full SFT vs LoRA vs QLoRA on CPU: the emitted scripts on SmolLM2-135M (real weights, real alpaca
rows), same settings, peak memory and tokens/s.

Each variant is rendered with `scaffold new --algo {sft,lora,qlora}` and run unmodified
(`python train.py ...`) twice, each time in a fresh process:
1. glibc's default malloc: peak RSS of the process (`os.wait4` rusage), tokens/s.
2. `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072`, so freed tensors go back to the OS and RSS
   follows what is really alive (docs/DESIGN.md: default-malloc RSS hides most savings): peak RSS.
Peak RSS includes loading (QLoRA quantizes the base tensor by tensor while loading), the Python
heap, libraries and the tokenized dataset. tokens/s counts real (non-pad) tokens of steps 2..N
from metrics.jsonl (step 1 includes one-time warm-up). LoRA/QLoRA run with --save_merged false
(the adapter is still saved); SFT saves its final model as usual.

Usage (from the repo root, with the venv; nothing else running):
    python benchmarks/peft_cpu.py --steps 5 --micro_batch_size 4 --max_seq_len 512
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _sections import write_marked_section

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / ".work" / "peft"
VARIANTS = ["sft", "lora", "qlora"]
MARK_BEGIN = "<!-- peft_cpu:begin -->"
MARK_END = "<!-- peft_cpu:end -->"
LOW_MMAP = "glibc.malloc.mmap_threshold=131072"


def _env(extra: dict | None = None) -> dict:
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
        **(extra or {}),
    }


def render(algo: str) -> Path:
    out = WORK / algo
    cmd = [
        sys.executable,
        "-m",
        "generator.cli",
        "new",
        "--algo",
        algo,
        "--out",
        str(out),
        "--force",
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, env=_env())
    return out / "train.py"


def script_args(args, algo: str, out_dir: Path) -> list[str]:
    argv = [
        "--model", args.model, "--max_steps", str(args.steps), "--micro_batch_size",
        str(args.micro_batch_size), "--max_seq_len", str(args.max_seq_len), "--pad_to_max_seq_len",
        "true", "--dtype", args.dtype, "--warmup_steps", "0", "--min_lr_ratio", "1.0",
        "--val_fraction", "0", "--sample_max_new_tokens", "0", "--out_dir", str(out_dir),
    ]  # fmt: skip
    if algo != "sft":
        argv += ["--save_merged", "false"]
    return argv


def measure(script: Path, argv: list[str], out_dir: Path, low_mmap: bool) -> dict:
    """Run in a fresh process and take its own peak RSS from wait4 (not the max over children)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    env = _env({"GLIBC_TUNABLES": LOW_MMAP} if low_mmap else None)
    start = time.perf_counter()
    with open(WORK / "stdout.txt", "w") as out, open(WORK / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), *argv], stdout=out, stderr=err, env=env, cwd=REPO
        )
        _, status, usage = os.wait4(proc.pid, 0)
    if status:
        lines = (WORK / "stderr.txt").read_text().strip().splitlines()
        return {"error": (lines or ["?"])[-1]}
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:] or rows  # step 1 includes one-time warm-up (kept only for --steps 1)
    found = re.search(
        r"([\d.]+)M params, ([\d.]+)M trainable \(([\d.]+)%\)", (WORK / "stdout.txt").read_text()
    )
    return {
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "tokens_per_s": sum(r["num_tokens"] for r in timed) / sum(r["step_time_s"] for r in timed),
        "step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
        "losses": [round(r["loss"], 4) for r in rows],
        "trainable": f"{found[2]}M ({found[3]}%)" if found else "?",
        "wall_s": round(time.perf_counter() - start, 1),
    }


def table(results: dict, args) -> str:
    base = results.get("sft", {}).get("default", {})
    lines = [
        MARK_BEGIN,
        "## LoRA and QLoRA vs full SFT (SmolLM2-135M, CPU)",
        "",
        f"Command: `python benchmarks/peft_cpu.py --steps {args.steps} --micro_batch_size "
        f"{args.micro_batch_size} --max_seq_len {args.max_seq_len} --dtype {args.dtype}` "
        f"({time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average at start {args.load_start}). Each variant is the "
        f"unmodified emitted script (`scaffold new --algo <variant>`), real SmolLM2-135M-Instruct "
        f"weights, real alpaca rows padded to {args.max_seq_len} tokens, micro-batch "
        f"{args.micro_batch_size}, each script's default lr (SFT 2e-5, LoRA/QLoRA 2e-4, rank 8, all "
        "7 projections), constant lr. Peak RSS of a fresh process, with glibc's default malloc "
        f"and with `GLIBC_TUNABLES={LOW_MMAP}`; it includes loading (QLoRA quantizes while "
        "loading). tokens/s = real tokens of steps 2..N / their step time. LoRA/QLoRA with "
        "--save_merged false.",
        "",
        "| variant | trainable params | peak RSS MiB (default malloc) | x SFT | peak RSS MiB "
        "(mmap_threshold 128 KiB) | x SFT | tokens/s | x SFT | s/step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    low_base = results.get("sft", {}).get("low_mmap", {})
    for name, r in results.items():
        d, low = r["default"], r["low_mmap"]
        if "error" in d or "error" in low:
            lines.append(f"| {name} | failed: {d.get('error') or low.get('error')} |")
            continue

        def ratio(value, ref):
            return f"{value / ref:.2f}" if ref else "-"

        lines.append(
            f"| {name} | {d['trainable']} | {d['peak_rss_mib']:.0f} | "
            f"{ratio(d['peak_rss_mib'], base.get('peak_rss_mib'))} | {low['peak_rss_mib']:.0f} | "
            f"{ratio(low['peak_rss_mib'], low_base.get('peak_rss_mib'))} | "
            f"{d['tokens_per_s']:.0f} | {ratio(d['tokens_per_s'], base.get('tokens_per_s'))} | "
            f"{d['step_time_s']:.2f} |"
        )
    lines += ["", "Losses per step (default-malloc run):", ""]
    lines += [f"- {name}: {r['default'].get('losses')}" for name, r in results.items()]
    lines.append(MARK_END)
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    write_marked_section(path, section, MARK_BEGIN, MARK_END)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=512)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--model", default="smollm2-135m", help="catalog name or HF directory")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "RESULTS.md"))
    args = p.parse_args()
    args.load_start = f"{os.getloadavg()[0]:.2f}"
    WORK.mkdir(parents=True, exist_ok=True)
    results = {}
    for algo in args.variants.split(","):
        if algo not in VARIANTS:
            raise SystemExit(f"--variants: unknown {algo!r}; valid: {', '.join(VARIANTS)}")
        script = render(algo)
        out_dir = WORK / algo / "out"
        argv = script_args(args, algo, out_dir)
        results[algo] = {
            "default": measure(script, argv, out_dir, low_mmap=False),
            "low_mmap": measure(script, argv, out_dir, low_mmap=True),
        }
        print(algo, json.dumps(results[algo]), flush=True)
    (WORK / "results.json").write_text(json.dumps(results, indent=2))
    write_section(Path(args.out), table(results, args))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
