"""GRPO rollout modes on CPU: samples/s and trainer idle fraction of `--rollout sync` vs `async`
in one run, with generation and training each on one core and of similar duration.

The emitted example (examples/grpo_smollm2/train.py) runs unmodified through its `main()` on a
small random Llama (SmolLM2's tokenizer, --hidden/--layers), prompts from chain_sum.jsonl, in one
local Ray session with 2 CPUs: the runtime engine actor holds one core (OMP_NUM_THREADS=1), the
trainer (the Ray driver, this process) uses one torch thread. Each mode trains --steps steps; the
first --skip steps (engine start, first weight sync) are left out of the numbers; the modes run
--repeats times each, alternating, and their measured steps are pooled.
- samples/s = rollouts trained / wall time of the measured steps;
- trainer idle fraction = 1 - (time in train_step) / (wall time): waiting for rollouts, weight
  gather and push.
sync alternates (generate, then train): idle is the generation time. async generates batch k+1
while batch k trains: with both equally long, samples/s approaches 2x sync.

Usage (from the repo root, with the venv):
    python benchmarks/grpo_cpu.py --steps 10 --skip 2
Smoke test (results elsewhere):
    python benchmarks/grpo_cpu.py --steps 3 --skip 1 --out /tmp/RESULTS.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _sections import write_marked_section  # noqa: E402

MARK_BEGIN = "<!-- grpo_cpu:begin -->"
MARK_END = "<!-- grpo_cpu:end -->"


def build_model_dir(out: Path, hidden: int, layers: int) -> Path:
    import torch

    from generator.assets import ensure_smollm2
    from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint

    args = ModelArgs(
        vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64,
        head_dim=32, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, out, args.to_hf_config())
    copy_tokenizer_files(ensure_smollm2(), out)
    return out


def load_script():
    path = REPO / "examples" / "grpo_smollm2" / "train.py"
    spec = importlib.util.spec_from_file_location("grpo_bench_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def length_reward(completion_ids, **kwargs) -> float:
    """Any cheap reward: the benchmark measures throughput, not learning."""
    return len(completion_ids) / 100


def run_mode(script, mode: str, model_dir: Path, data: Path, out: Path, a) -> list[dict]:
    argv = [
        "--model", str(model_dir), "--dataset", str(data), "--out_dir", str(out), "--dtype", "fp32",
        "--rollout", mode, "--max_steps", str(a.steps), "--num_generations", str(a.num_generations),
        "--prompts_per_step", str(a.prompts_per_step), "--max_new_tokens", str(a.max_new_tokens),
        "--micro_batch_size", str(a.micro_batch_size), "--lr", "1e-5", "--warmup_steps", "0",
        "--reward_weights", "1.0", "--save_final_model", "false", "--resume", "none", "--seed", "0",
    ]  # fmt: skip
    # CPU time of the trainer thread inside train_step: wall above it = waiting for a core
    original, cpu = script.train_step, []

    def timed_train_step(*args, **kwargs):
        start = time.thread_time()
        out = original(*args, **kwargs)
        cpu.append(time.thread_time() - start)
        return out

    script.train_step = timed_train_step
    try:
        history = script.main(argv, reward_funcs=[length_reward])
    finally:
        script.train_step = original
    for m, c in zip(history, cpu, strict=True):
        m["train_cpu_s"] = c
    return history[a.skip :]


def summarize(mode: str, history: list[dict], a) -> dict:
    wall = sum(m["step_time_s"] for m in history)
    train = sum(m["train_s"] for m in history)
    samples = len(history) * a.prompts_per_step * a.num_generations
    return {
        "mode": mode,
        "steps": len(history),
        "samples_per_s": samples / wall,
        "idle_fraction": 1 - train / wall,
        "step_s": wall / len(history),
        "train_s": train / len(history),
        "train_cpu_s": sum(m["train_cpu_s"] for m in history) / len(history),
        "rollout_wait_s": sum(m["rollout_wait_s"] for m in history) / len(history),
        "max_staleness": max(m["staleness_max"] for m in history),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the numbers")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--num_generations", type=int, default=4)
    p.add_argument("--prompts_per_step", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=24)
    p.add_argument("--micro_batch_size", type=int, default=16)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    a = p.parse_args()

    import ray
    import torch

    from generator.assets import ensure_chain_sum

    torch.set_num_threads(1)  # the trainer: one core; the engine actor holds the other
    script = load_script()
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        tmp = Path(tmp)
        model_dir = build_model_dir(tmp / "model", a.hidden, a.layers)
        data = tmp / "prompts.jsonl"
        data.write_text("\n".join(ensure_chain_sum().read_text().splitlines()[:512]) + "\n")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        # alternate the modes (sync, async, sync, ...) so a change in the machine's load hits both
        histories = {"sync": [], "async": []}
        for r in range(a.repeats):
            for mode in histories:
                histories[mode] += run_mode(script, mode, model_dir, data, tmp / f"{mode}{r}", a)
        results = [summarize(mode, h, a) for mode, h in histories.items()]
        total = time.perf_counter() - start
        load_after = os.getloadavg()[0]
        ray.shutdown()
    speedup = results[1]["samples_per_s"] / results[0]["samples_per_s"]
    print(json.dumps({"results": results, "async_speedup": speedup, "wall_s": total}, indent=2))
    cmd = "python benchmarks/grpo_cpu.py " + " ".join(sys.argv[1:])
    rows = "\n".join(
        f"| {r['mode']} | {r['samples_per_s']:.2f} | {100 * r['idle_fraction']:.0f}% | {r['step_s']:.2f} | "
        f"{r['train_s']:.2f} | {r['train_cpu_s']:.2f} | {r['rollout_wait_s']:.2f} | {r['max_staleness']} |"
        for r in results
    )
    section = f"""{MARK_BEGIN}
## GRPO rollout modes (CPU, `benchmarks/grpo_cpu.py`)
`{cmd.strip()}` ({platform.machine()}, {time.strftime("%Y-%m-%d")}, shared 2-core machine: 1-min load average
{load_before:.1f} before, {load_after:.1f} after, with other jobs running). The emitted
examples/grpo_smollm2 script, unmodified, on a random Llama (hidden {a.hidden}, {a.layers} layers, SmolLM2
tokenizer), {a.prompts_per_step} prompts x {a.num_generations} completions x <= {a.max_new_tokens} new tokens per
step, fp32; one runtime engine actor on 1 core, the trainer on 1 torch thread, local Ray with 2 CPUs; {a.repeats}
runs per mode, alternating sync and async; steps {a.skip + 1}..{a.steps} of each run measured.

| rollout | samples/s | trainer idle | s/step | train s/step (wall) | train s/step (CPU) | rollout wait s/step | max staleness |
|---|---|---|---|---|---|---|---|
{rows}

async / sync samples/s: **{speedup:.2f}x** (target >= 1.6x when generation and training take similar time;
the ideal is 2x on two free cores: other jobs on this machine take CPU from whichever phase runs, and
under overlap both phases compete for it: train wall time above its CPU time is time the trainer thread
waited for a core).
{MARK_END}
"""
    write_marked_section(a.out, section, MARK_BEGIN, MARK_END)
    print(f"wrote section to {a.out}")


if __name__ == "__main__":
    main()
