"""torchtune peer for the CPU SFT benchmark: runs `tune run` and reports one JSON line.

    benchmarks/.venvs/torchtune/bin/python benchmarks/peers/torchtune_run.py --max_steps 12 --dtype bf16

Runs, from this directory (so that `tune run` finds the custom recipe and components):

    tune run torchtune_recipe.py --config torchtune_sft.yaml output_dir=<tmp> epochs=1 \\
        max_steps_per_epoch=N batch_size=4 tokenizer.max_seq_len=256 optimizer.lr=2e-5 dtype=... \\
        [optimizer_in_bwd=True clip_grad_norm=null]

then parses the recipe's DiskLogger file (`Step N | loss:... tokens_per_second_per_gpu:...
real_tokens:... label_tokens:...`). torchtune's own `tokens_per_second_per_gpu` counts label tokens
(labels != -100) per step; the step time is recovered as `label_tokens / tokens_per_second_per_gpu`
(the recipe's timer: from the previous step's log to this step's, which includes fetching the
batch). Step 1 is a warm-up and is excluded; tokens/s = real tokens / seconds over steps 2..N.
Peak RSS is the `tune` process's maximum resident set (`getrusage(RUSAGE_CHILDREN)`; it runs with no
dataloader workers, so it is the whole process tree).

Prints one final JSON line:
{"tool": "torchtune", "dtype", "steps", "losses", "real_tokens", "seconds", "tokens_per_s",
 "peak_rss_mib"}
This file uses only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from sft_data import check_inputs, scaffold_home  # noqa: E402

METRIC_RE = re.compile(r"(\w+):(\S+)")
# Scaffold trick name -> torchtune 0.6.1 config overrides with the same effect.
TRICKS = {
    "ac": ["enable_activation_checkpointing=True"],
    "optim-in-bwd": ["optimizer_in_bwd=True", "clip_grad_norm=null"],  # torchtune refuses clipping
    "adamw8bit": ["optimizer._component_=torchao.optim.AdamW8bit"],
    # the config's default loss is torchtune's chunked CE (CEWithChunkedOutputLoss); this is plain CE
    "plain-ce": ["loss._component_=torch.nn.CrossEntropyLoss"],
}


def default_tune() -> str:
    """The `tune` executable next to this interpreter, else the one in the torchtune peer venv."""
    sibling = Path(sys.executable).parent / "tune"
    if sibling.is_file():
        return str(sibling)
    return str(REPO_ROOT / "benchmarks" / ".venvs" / "torchtune" / "bin" / "tune")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--optimizer_in_bwd",
        action="store_true",
        help="step AdamW per parameter inside backward (disables grad clipping)",
    )
    p.add_argument(
        "--tricks",
        default="",
        help="comma-separated torchtune flags named like Scaffold's tricks: " + ", ".join(TRICKS),
    )
    p.add_argument("--tune", default=default_tune(), help="path to the `tune` executable")
    p.add_argument(
        "--config", default=str(HERE / "torchtune_sft.yaml"), help="torchtune YAML config"
    )
    return p.parse_args(argv)


def tune_command(args: argparse.Namespace, output_dir: str) -> list[str]:
    """The `tune run` command line with the benchmark's overrides."""
    cmd = [
        args.tune,
        "run",
        "torchtune_recipe.py",
        "--config",
        args.config,
        f"scaffold_home={scaffold_home()}",
        f"output_dir={output_dir}",
        "epochs=1",
        f"max_steps_per_epoch={args.max_steps}",
        f"batch_size={args.micro_batch_size}",
        f"tokenizer.max_seq_len={args.max_seq_len}",
        f"optimizer.lr={args.lr}",
        f"dtype={args.dtype}",
        f"seed={args.seed}",
    ]
    if args.optimizer_in_bwd:
        cmd += TRICKS["optim-in-bwd"]
    for trick in filter(None, args.tricks.split(",")):
        if trick not in TRICKS:
            raise SystemExit(f"--tricks: unknown {trick!r}; valid: {', '.join(TRICKS)}")
        cmd += TRICKS[trick]
    return cmd


def parse_metrics(text: str) -> dict[int, dict[str, float]]:
    """DiskLogger lines `Step N | key:value ...` -> {step: {key: float}} (non-numbers skipped)."""
    steps: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        head, sep, rest = line.partition(" | ")
        if not sep or not head.startswith("Step "):
            continue
        values = steps.setdefault(int(head.split()[1]), {})
        for key, raw in METRIC_RE.findall(rest):
            try:
                values[key] = float(raw)
            except ValueError:
                pass
    return steps


def summarize(steps: dict[int, dict[str, float]], dtype: str, n_steps: int) -> dict:
    """The benchmark's result record; step 1 (warm-up) is excluded from tokens and seconds."""
    timed = [s for s in sorted(steps) if s >= 2]
    seconds = sum(steps[s]["label_tokens"] / steps[s]["tokens_per_second_per_gpu"] for s in timed)
    real_tokens = int(sum(steps[s]["real_tokens"] for s in timed))
    return {
        "tool": "torchtune",
        "dtype": dtype,
        "steps": n_steps,
        "losses": [steps[s]["loss"] for s in sorted(steps)],
        "real_tokens": real_tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(real_tokens / seconds, 2) if seconds > 0 else 0.0,
        # ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN = the largest waited-for child.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_inputs()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="torchtune-bench-") as tmp:
        cmd = tune_command(args, tmp)
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        # The child's output goes to our stderr; our stdout carries only the JSON line.
        proc = subprocess.run(cmd, cwd=HERE, env=env, stdout=sys.stderr, stderr=sys.stderr)
        log_file = Path(tmp) / "logs" / "metrics.txt"
        if proc.returncode != 0:
            raise SystemExit(f"tune run failed with exit code {proc.returncode}")
        if not log_file.is_file():
            raise SystemExit(f"tune run wrote no metrics file at {log_file}")
        steps = parse_metrics(log_file.read_text())
    if len(steps) != args.max_steps:
        raise SystemExit(f"expected {args.max_steps} logged steps, found {len(steps)}")
    print(json.dumps(summarize(steps, args.dtype, args.max_steps)), flush=True)


if __name__ == "__main__":
    main()
