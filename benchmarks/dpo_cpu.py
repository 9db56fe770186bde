"""DPO reference modes on CPU: the emitted DPO scripts on SmolLM2-135M (real weights, real
preference pairs from dpo_en_demo.json), peak memory and tokens/s of each reference mode side by side.

Variants (script / ref_mode): `dpo` (all parameters) with `separate` (a second, frozen copy) and
`precomputed` (one pass caches the reference log-probs, then only the policy is resident);
`dpo-lora` with `adapters-off` (the frozen base under the adapters is the reference, no copy),
`separate` and `precomputed`. Each is rendered with `scaffold new --algo {dpo,dpo-lora}` and run
unmodified (`python train.py --ref_mode ...`) twice, each time in a fresh process:
1. glibc's default malloc: peak RSS of the process (`os.wait4` rusage), tokens/s.
2. `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072` (freed tensors go back to the OS, so RSS
   follows what is alive): peak RSS.
Peak RSS includes loading and, for `precomputed`, the caching pass. tokens/s = real (non-pad)
tokens of steps 2..N / their step time (the caching pass is not in it; its cost is in wall_s).
The first --max_pairs pairs of the data are used (the caching pass reads every one of them).

Usage (from the repo root, with the venv; nothing else running):
    python benchmarks/dpo_cpu.py --steps 5 --micro_batch_size 2 --max_seq_len 512
Smoke test (tiny model, one step, results elsewhere):
    python benchmarks/dpo_cpu.py --model DIR --steps 1 --max_pairs 8 --max_seq_len 128 \\
        --variants dpo-lora:adapters-off --out /tmp/RESULTS.md
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
WORK = REPO / "benchmarks" / ".work" / "dpo"
VARIANTS = [
    "dpo:separate", "dpo:precomputed",
    "dpo-lora:adapters-off", "dpo-lora:separate", "dpo-lora:precomputed",
]  # fmt: skip
MARK_BEGIN = "<!-- dpo_cpu:begin -->"
MARK_END = "<!-- dpo_cpu:end -->"
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


def pairs_file(max_pairs: int) -> Path:
    """The first max_pairs rows of the real dpo_en_demo.json (ShareGPT preference layout)."""
    sys.path.insert(0, str(REPO))
    from generator.assets import ensure_dataset

    rows = json.loads(ensure_dataset("dpo_en_demo.json").read_text())[:max_pairs]
    path = WORK / f"dpo_en_demo_{max_pairs}.json"
    path.write_text(json.dumps(rows))
    return path


def script_args(args, algo: str, ref_mode: str, data: Path, out_dir: Path) -> list[str]:
    argv = [
        "--model", args.model, "--dataset", str(data), "--ref_mode", ref_mode, "--max_steps",
        str(args.steps), "--micro_batch_size", str(args.micro_batch_size), "--max_seq_len",
        str(args.max_seq_len), "--pad_to_max_seq_len", "true", "--dtype", args.dtype,
        "--warmup_steps", "0", "--min_lr_ratio", "1.0", "--val_fraction", "0",
        "--sample_max_new_tokens", "0", "--out_dir", str(out_dir),
    ]  # fmt: skip
    if algo == "dpo-lora":
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
        "accuracies": [round(r["rewards/accuracies"], 2) for r in rows],
        "trainable": f"{found[2]}M ({found[3]}%)" if found else "?",
        "wall_s": round(time.perf_counter() - start, 1),
    }


def command(args) -> str:
    return (
        f"python benchmarks/dpo_cpu.py --steps {args.steps} --micro_batch_size "
        f"{args.micro_batch_size} --max_seq_len {args.max_seq_len} --dtype {args.dtype} "
        f"--max_pairs {args.max_pairs}"
        + (f" --variants {args.variants}" if args.variants != ",".join(VARIANTS) else "")
    )


def table(results: dict, args) -> str:
    lines = [
        MARK_BEGIN,
        f"## DPO reference modes ({Path(args.model).name}, CPU)",
        "",
        f"Command: `{command(args)}` ({time.strftime('%Y-%m-%d')}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average at "
        f"start {args.load_start}). The unmodified emitted scripts (`scaffold new --algo dpo` and "
        f"`--algo dpo-lora`) with `--ref_mode <mode>`, model {args.model} (real weights), the "
        f"first {args.max_pairs} real dpo_en_demo.json pairs padded to {args.max_seq_len} tokens "
        f"per sequence, micro-batch {args.micro_batch_size} pairs ({2 * args.micro_batch_size} "
        "sequences), each script's default lr (DPO 1e-6, LoRA DPO 5e-5), constant lr. Peak RSS of "
        f"a fresh process, with glibc's default malloc and with `GLIBC_TUNABLES={LOW_MMAP}`; it "
        "includes loading and the precomputed mode's caching pass (in wall s). tokens/s = real "
        "tokens of steps 2..N / their step time.",
        "",
        "| script | ref_mode | trainable params | peak RSS MiB (default malloc) | peak RSS MiB "
        "(mmap_threshold 128 KiB) | tokens/s | s/step | wall s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        algo, mode = name.split(":")
        d, low = r["default"], r["low_mmap"]
        if "error" in d or "error" in low:
            lines.append(f"| {algo} | {mode} | failed: {d.get('error') or low.get('error')} |")
            continue
        lines.append(
            f"| {algo} | {mode} | {d['trainable']} | {d['peak_rss_mib']:.0f} | "
            f"{low['peak_rss_mib']:.0f} | {d['tokens_per_s']:.0f} | {d['step_time_s']:.2f} | "
            f"{d['wall_s']:.0f} |"
        )
    lines += ["", "Losses and rewards/accuracies per step (default-malloc run):", ""]
    lines += [
        f"- {name}: loss {r['default'].get('losses')}, accuracies {r['default'].get('accuracies')}"
        for name, r in results.items()
    ]
    lines.append(MARK_END)
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    write_marked_section(path, section, MARK_BEGIN, MARK_END)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro_batch_size", type=int, default=2, help="pairs per step")
    p.add_argument("--max_seq_len", type=int, default=512)
    p.add_argument("--max_pairs", type=int, default=64, help="the first N pairs of the data")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--model", default="smollm2-135m", help="catalog name or HF directory")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="script:ref_mode, comma-separated"
    )
    p.add_argument("--out", default=str(REPO / "benchmarks" / "RESULTS.md"))
    args = p.parse_args()
    args.load_start = f"{os.getloadavg()[0]:.2f}"
    WORK.mkdir(parents=True, exist_ok=True)
    data = pairs_file(args.max_pairs)
    results, scripts = {}, {}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown {name!r}; valid: {', '.join(VARIANTS)}")
        algo, ref_mode = name.split(":")
        script = scripts.get(algo) or scripts.setdefault(algo, render(algo))
        out_dir = WORK / algo / f"out-{ref_mode}"
        argv = script_args(args, algo, ref_mode, data, out_dir)
        results[name] = {
            "default": measure(script, argv, out_dir, low_mmap=False),
            "low_mmap": measure(script, argv, out_dir, low_mmap=True),
        }
        print(name, json.dumps(results[name]), flush=True)
    (WORK / "results.json").write_text(json.dumps(results, indent=2))
    write_section(Path(args.out), table(results, args))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
