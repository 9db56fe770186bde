"""Peak memory of DPO and GRPO on SmolLM2-135M (real weights), plain vs the memory tricks that now
reach them (ac, lce, optim-in-bwd), with PyTorch's MemTracker, as the SFT tricks table does.

Each variant is rendered with `scaffold new --algo A --tricks ...` and run in a fresh process for
3 `train_step`s under `torch.distributed._tools.mem_tracker.MemTracker` (tensor bytes by category
at the peak: CPU-honest, it counts tensors, not what glibc keeps mapped).
- DPO: real dpo_en_demo pairs padded to --max_seq_len, --micro_batch_size pairs per micro-batch
  (2x sequences), the separate frozen reference (ref_mode="separate"), fp32.
- GRPO: --rollouts fixed rollouts of --prompt_len prompt and --completion_len completion tokens
  (random ids: memory does not depend on their values), all in one micro-batch (MemTracker
  refuses a module called twice in one tracked iteration), kl_coef 0.04 (so the frozen reference
  runs too), fp32.
max_grad_norm 0 in both, so optimizer-in-backward runs one backward per step (as the SFT table).

Usage (from the repo root, with the venv):
    python benchmarks/compose_memory.py --max_seq_len 512 --micro_batch_size 2
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from pathlib import Path

from _sections import write_marked_section

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / ".work" / "compose"
VARIANTS = [
    ("plain", ""),
    ("ac", "ac"),
    ("lce", "lce"),
    ("ac+lce+optim-in-bwd", "ac,lce,optim-in-bwd"),
]
CATEGORIES = ["Parameter", "Gradient", "Optstate", "Activation", "Temp", "Buffer", "Other"]
MARK_BEGIN = "<!-- compose_memory:begin -->"
MARK_END = "<!-- compose_memory:end -->"


def render(algo: str, name: str, tricks: str) -> Path:
    out = WORK / f"{algo}_{name}"
    cmd = [str(Path(sys.executable).parent / "scaffold"), "new", "--algo", algo, "--out", str(out)]
    cmd += ["--force"] + (["--tricks", tricks] if tricks else [])
    subprocess.run(cmd, check=True, capture_output=True)
    return out / "train.py"


def _load(script: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train", script)
    s = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(s)
    return s


def _dpo_steps(s, args):
    """The DPO script's model, reference, optimizer and 3 train_step closures on real pairs."""
    argv = ["--dtype", "fp32", "--max_seq_len", str(args.max_seq_len), "--pad_to_max_seq_len", "true",
            "--micro_batch_size", str(args.micro_batch_size), "--max_grad_norm", "0", "--val_fraction", "0"]  # fmt: skip
    cfg = s.parse_config(s.Config, argv)
    dist_info, mesh = s.setup_distributed(cfg)
    model_dir = s.resolve_model_dir(cfg.model, cfg.hf_repo_id)
    tokenizer = s.Tokenizer.from_dir(model_dir)
    train_set, _ = s.build_datasets(cfg, tokenizer)
    model = s.setup_model(cfg, model_dir, mesh, dist_info.device)
    reference = s.build_reference(cfg, model_dir, mesh, dist_info.device)
    optimizer, scheduler = s.build_optimizer(cfg, model)
    collate_fn = functools.partial(
        s.collate, pad_token_id=tokenizer.pad_token_id, pad_to=cfg.max_seq_len
    )
    loader = s.build_dataloader(train_set, collate_fn, cfg.micro_batch_size, 0, 1, cfg.seed, True)
    batches = s.infinite_batches(loader)

    def step():
        micro = [next(batches)[1] for _ in range(cfg.gradient_accumulation_steps)]
        s.train_step(model, reference, None, optimizer, scheduler, micro, cfg, dist_info.device)

    return model, optimizer, step, reference


def _grpo_steps(s, args):
    """The GRPO script's policy, reference, optimizer and a train_step closure on fixed rollouts."""
    import torch

    from runtime.rollout import Rollout

    cfg = s.Config(
        dtype="fp32", device="cpu", micro_batch_size=args.rollouts, max_grad_norm=0.0,
        kl_coef=0.04, max_prompt_len=args.prompt_len, max_new_tokens=args.completion_len,
    )  # fmt: skip
    dist_info, mesh = s.setup_distributed(cfg)
    model_dir = s.resolve_model_dir(cfg.model, cfg.hf_repo_id)
    model = s.setup_model(cfg, model_dir, mesh, dist_info.device)
    reference = s.setup_frozen_model(cfg, model_dir, mesh, dist_info.device)
    optimizer, scheduler = s.build_optimizer(cfg, model)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 49152, (n,), generator=g).tolist()  # noqa: E731
    rollouts = [
        Rollout(
            ids(args.prompt_len),
            ids(args.completion_len),
            [-1.0] * args.completion_len,
            float(i % 2),
            {},
            0,
            i // 4,
        )  # fmt: skip
        for i in range(args.rollouts)
    ]
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(args.rollouts)])
    num_tokens = args.rollouts * args.completion_len
    num_micro = 1

    def step():
        s.train_step(model, reference, optimizer, scheduler, rollouts, advantages, num_tokens, num_micro, cfg, dist_info.device)  # fmt: skip

    return model, optimizer, step, reference


def tracker_child(algo: str, script: str, args) -> None:
    """Runs in a fresh process: 3 train steps under MemTracker; prints one JSON line."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    s = _load(script)
    model, optimizer, step, reference = (_dpo_steps if algo == "dpo" else _grpo_steps)(s, args)
    # MemTracker hooks every parameter of a module it sees run, which fails on frozen ones; the
    # reference only runs under no_grad, so marking its weights trainable changes no byte
    reference.requires_grad_(True)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for i in range(3):
            if i:
                tracker.reset_mod_stats()  # required before every iteration after the first
            step()
    peak = tracker.get_tracker_snapshot("peak")
    snap = next(v for k, v in peak.items() if torch.device(k).type == "cpu")
    print(json.dumps({getattr(k, "value", str(k)): v for k, v in snap.items()}))


def run_tracker(algo: str, script: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", algo, str(script), *_flags(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    snap = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = {c: snap.get(c, 0) / 2**20 for c in CATEGORIES}
    mib["Total"] = snap.get("Total", sum(snap.get(c, 0) for c in CATEGORIES)) / 2**20
    return mib


def _flags(args) -> list[str]:
    return [f"--{k}={v}" for k, v in vars(args).items() if k not in ("child", "write")]


def table(results: dict, args) -> str:
    lines = [
        "## DPO and GRPO with the memory tricks (SmolLM2-135M, CPU)",
        "",
        f"Command: `python benchmarks/compose_memory.py {' '.join(_flags(args))}`. Peak by category = "
        "PyTorch's MemTracker over 3 train_steps (tensor bytes, MiB, at the moment of the peak), "
        "real SmolLM2-135M weights, fp32, max_grad_norm 0. DPO: real dpo_en_demo pairs padded to "
        f"{args.max_seq_len} tokens, {args.micro_batch_size} pairs per micro-batch, the separate "
        f"frozen reference. GRPO: {args.rollouts} rollouts of {args.prompt_len} + "
        f"{args.completion_len} tokens in one micro-batch, kl_coef 0.04 (the "
        "frozen reference runs). Parameters include the reference's.",
        "",
        "| algo | variant | params | grads | optim state | activations | temp | **tracked peak** | x plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for algo, rows in results.items():
        base = rows["plain"].get("Total")
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {algo} | {name} | error: {r['error']} |||||||")
                continue
            cells = [
                f"{r[c]:.0f}" for c in ("Parameter", "Gradient", "Optstate", "Activation", "Temp")
            ]
            lines.append(
                f"| {algo} | {name} | {' | '.join(cells)} | **{r['Total']:.0f}** | {r['Total'] / base:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max_seq_len", type=int, default=512)
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--completion_len", type=int, default=448)
    p.add_argument(
        "--write", action="store_true", help="write the table into benchmarks/RESULTS.md"
    )
    p.add_argument("--child", nargs=2, metavar=("ALGO", "SCRIPT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        tracker_child(args.child[0], args.child[1], args)
        return
    results = {}
    for algo in ("dpo", "grpo"):
        results[algo] = {}
        for name, tricks in VARIANTS:
            results[algo][name] = run_tracker(algo, render(algo, name, tricks), args)
            print(algo, name, results[algo][name], flush=True)
    text = table(results, args)
    print(text)
    if args.write:
        section = f"{MARK_BEGIN}\n{text}{MARK_END}\n"
        write_marked_section(REPO / "benchmarks" / "RESULTS.md", section, MARK_BEGIN, MARK_END)


if __name__ == "__main__":
    main()
