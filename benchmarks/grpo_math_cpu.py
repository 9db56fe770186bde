"""The GRPO loss variants and PPO on the real task: SmolLM2-135M on chain_sum, on CPU.

Each variant runs the emitted example unmodified (examples/grpo_smollm2/train.py, or
examples/ppo_smollm2/train.py for "ppo ...") in its own process, from the same real weights
(`scaffold assets`), on the same chain_sum prompts, with the script's own reward functions
(math_answer_reward, weight 1.0: the last integer equals the answer; format_reward, weight 0.2:
a one-line reply that ends in an integer), sync rollouts (every sample on-policy), fp32, and
the same seed, lr and rollouts per step. GRPO: --prompts_per_step x --num_generations
completions per step; PPO: prompts_per_step x num_generations prompts, one completion each (its
critic needs no group), so both train on the same number of completions per step.

Reported per variant, from its metrics.jsonl, over rollout batches (--steps of them; a variant
with --num_iterations N trains N optimizer steps on each): mean reward (0..1.2) of the first 3
and the last 5 batches, the answer accuracy (math_answer_reward) and format share of the same
batches, the mean completion length, the clip fraction (over every optimizer step), completion
tokens sampled per second of wall time (batch 1 left out), and seconds per batch.

Usage (from the repo root, with the venv; about 4 s per step per variant on 2 quiet cores):
    python benchmarks/grpo_math_cpu.py --steps 25 --out benchmarks/RESULTS.md
    python benchmarks/grpo_math_cpu.py --steps 3 --variants dapo 'ppo' --out /tmp/RESULTS.md  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = [
    "dapo",
    "grpo",
    "dr_grpo --scale_rewards false",
    "gspo --num_iterations 2",
    "cispo --num_iterations 2",
    "ppo",
]


def run_variant(variant: str, args: argparse.Namespace, out_dir: Path) -> list[dict]:
    """One variant's run in its own process; returns its metrics.jsonl rows (one per step)."""
    name, *extra = shlex.split(variant)
    common = [
        "--rollout", "sync", "--dtype", "fp32",
        "--max_steps", str(args.steps * iterations(variant)),
        "--max_new_tokens", str(args.max_new_tokens), "--lr", str(args.lr),
        "--warmup_steps", str(args.warmup_steps), "--micro_batch_size", str(args.micro_batch_size),
        "--seed", str(args.seed), "--save_final_model", "false", "--save_every_steps", "0",
        "--out_dir", str(out_dir), "--resume", "none",
    ]  # fmt: skip
    rollouts = args.prompts_per_step * args.num_generations
    if name == "ppo":
        script = REPO / "examples" / "ppo_smollm2" / "train.py"
        shape = ["--prompts_per_step", str(rollouts), "--num_generations", "1"]
    else:
        script = REPO / "examples" / "grpo_smollm2" / "train.py"
        shape = ["--loss_type", name, "--prompts_per_step", str(args.prompts_per_step),
                 "--num_generations", str(args.num_generations)]  # fmt: skip
    cmd = [sys.executable, str(script), *common, *shape, *extra]
    print(f"$ {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"{variant}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "reward" in row]


def iterations(variant: str) -> int:
    """The variant's num_iterations: optimizer steps per rollout batch (1 unless it sets it)."""
    flags = shlex.split(variant)
    return int(flags[flags.index("--num_iterations") + 1]) if "--num_iterations" in flags else 1


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(row[key] for row in rows)


def summarise(variant: str, rows: list[dict], rollouts: int) -> str:
    """One table row over rollout batches (a batch's num_iterations optimizer steps log its
    rewards each; its last step's row stands for it); `rollouts` = completions per batch. The
    clip fraction is the mean over every optimizer step."""
    mu = iterations(variant)
    batches = rows[mu - 1 :: mu]
    first, last = batches[:3], batches[-5:]
    math_key, format_key = "rewards/math_answer_reward/mean", "rewards/format_reward/mean"
    timed = batches[1:]  # batch 1 carries the engine's start and first weight sync
    tokens = sum(row["completions/mean_length"] * rollouts for row in timed)
    seconds = sum(row["step_time_s"] for row in rows[mu:])
    return (
        f"| {variant} | {mean(first, 'reward'):.3f} | **{mean(last, 'reward'):.3f}** | "
        f"{mean(first, math_key):.2f} -> {mean(last, math_key):.2f} | "
        f"{mean(first, format_key):.2f} -> {mean(last, format_key):.2f} | "
        f"{mean(first, 'completions/mean_length'):.1f} -> {mean(last, 'completions/mean_length'):.1f} | "
        f"{mean(rows, 'clip_ratio/region_mean'):.3f} | {tokens / seconds:.0f} | {seconds / len(timed):.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--prompts_per_step", type=int, default=4)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=12)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument(
        "--out", default="", help="append the table to this file (default: print only)"
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))

    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(args.variants):
            start = time.perf_counter()
            rows = run_variant(variant, args, Path(tmp) / f"v{i}")
            lines.append(summarise(variant, rows, args.prompts_per_step * args.num_generations))
            print(lines[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)

    command = "python benchmarks/grpo_math_cpu.py " + shlex.join(sys.argv[1:])
    table = "\n".join([
        f"`{command.strip()}`",
        "",
        f"SmolLM2-135M (real weights), chain_sum prompts, {args.prompts_per_step} x "
        f"{args.num_generations} completions of <= {args.max_new_tokens} tokens per batch, "
        f"{args.steps} sync rollout batches, lr {args.lr:g} (warmup {args.warmup_steps}), fp32, seed {args.seed}.",
        "",
        "| variant | reward, batches 1-3 | reward, last 5 batches | answer accuracy, first 3 -> last 5 "
        "| format share, first 3 -> last 5 | completion length | clip fraction | tokens/s | s/batch |",
        "|---|---|---|---|---|---|---|---|---|",
        *lines,
    ])  # fmt: skip
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + table + "\n")


if __name__ == "__main__":
    main()
