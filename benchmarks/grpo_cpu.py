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

--loss_types grpo,dapo,dr_grpo,gspo,cispo runs the loss-type sweep instead (its own section):
each loss type (and each --variants entry: extra flags, e.g. "dapo --advantage_baseline rloo")
trains --steps sync steps from the same start, --repeats seeds each, on the learning tests' task:
chain_sum prompts, the tiny 2-layer random Llama (512-token cut of SmolLM2's tokenizer) whose
embedding's first coordinate is +0.1 for even and -0.1 for odd ids, and the reward "share of even
ids among the completion's non-stop tokens" (0 when it stops at once). The stop token (<|im_end|>,
id 2, even) gets --stop_even_weight on that coordinate, so learning "even" also makes stopping
likelier and completion lengths vary: the normalisers (per token, per sequence, constant) then
weigh the completions differently. Reported per variant: mean reward of the first 3 and the last 5
steps, the step at which the 3-step mean reward first reaches 0.9 (per seed), completion length,
completion tokens trained per second of step wall time, clip fraction.
    python benchmarks/grpo_cpu.py --loss_types grpo,dapo,dr_grpo,gspo,cispo --steps 30 --repeats 2

--ppo runs PPO against GRPO on that task instead (its own section): the emitted
examples/ppo_smollm2 and examples/grpo_smollm2 scripts, the same number of rollouts per step
(GRPO: --prompts_per_step x --num_generations; PPO: that many prompts x 1 completion), sync, the
same lr, kl_coef 0 for both (no reference model in either), PPO's own defaults otherwise (GAE
gamma 1, lam 0.95, vf_coef 0.1, one optimizer step per batch). Reported per algorithm: the
rewards as above, rollouts per second of step wall time (step 1 left out), train s/step, the
mean completion length and PPO's critic metrics. Memory is not measured here (peak_mem_mib on CPU
is the process's peak RSS, monotone over the runs of one process): `scaffold plan --algo ppo`
simulates it (benchmarks/RESULTS.md gives both plans beside this section).
    python benchmarks/grpo_cpu.py --ppo --steps 30 --repeats 2
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

PPO_BEGIN = "<!-- grpo_cpu_ppo:begin -->"
PPO_END = "<!-- grpo_cpu_ppo:end -->"
MARK_BEGIN = "<!-- grpo_cpu:begin -->"
MARK_END = "<!-- grpo_cpu:end -->"
LOSS_BEGIN = "<!-- grpo_cpu_loss_types:begin -->"
LOSS_END = "<!-- grpo_cpu_loss_types:end -->"
STOP_ID = 2  # <|im_end|> in SmolLM2's tokenizer and its 512-token cut


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


def load_script(example: str = "grpo_smollm2"):
    path = REPO / "examples" / example / "train.py"
    spec = importlib.util.spec_from_file_location(f"{example}_bench_train", path)
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


def build_even_model_dir(out: Path, stop_even_weight: float) -> Path:
    """The learning tests' tiny model (tests/conftest.py `even_model_dir`: TINY_CONFIG at vocab
    512, seed 0, embedding[:, 0] = +0.1 even / -0.1 odd), its stop token's coordinate set to
    stop_even_weight."""
    import torch

    from generator.assets import ensure_smollm2
    from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint
    from tests.helpers import SMALL_VOCAB, TINY_CONFIG, small_tokenizer_files

    args = ModelArgs(
        **{**TINY_CONFIG, "vocab_size": SMALL_VOCAB}, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        even = torch.arange(args.vocab_size) % 2 == 0
        model.model.embed_tokens.weight[:, 0] = torch.where(even, 0.1, -0.1)
        model.model.embed_tokens.weight[STOP_ID, 0] = stop_even_weight
    save_hf_checkpoint(model, out, args.to_hf_config())
    small_tokenizer_files(ensure_smollm2(), out.parent / "tokenizer")
    copy_tokenizer_files(out.parent / "tokenizer", out)
    return out


def even_share_reward(completion_ids, **kwargs) -> float:
    """Share of even ids among the completion's tokens before its stop token (0 if none)."""
    ids = [t for t in completion_ids if t != STOP_ID]
    return sum(t % 2 == 0 for t in ids) / len(ids) if ids else 0.0


def run_variant(script, flags: list[str], seed: int, model_dir: Path, data: Path, out: Path, a):
    argv = [
        "--model", str(model_dir), "--dataset", str(data), "--out_dir", str(out), "--dtype", "fp32",
        "--rollout", "sync", "--max_steps", str(a.steps), "--num_generations", str(a.num_generations),
        "--prompts_per_step", str(a.prompts_per_step), "--max_new_tokens", str(a.max_new_tokens),
        "--micro_batch_size", str(a.micro_batch_size), "--lr", str(a.lr), "--warmup_steps", "0",
        "--reward_weights", "1.0", "--save_final_model", "false", "--resume", "none",
        "--seed", str(seed), *flags,
    ]  # fmt: skip
    return script.main(argv, reward_funcs=[even_share_reward])


def summarize_variant(name: str, runs: list[list[dict]], a) -> dict:
    def mean(xs):
        return sum(xs) / len(xs)

    def steps_to(h, level):  # the first step whose 3-step trailing mean reward reaches level
        r = [m["reward"] for m in h]
        hits = [i + 1 for i in range(2, len(r)) if sum(r[i - 2 : i + 1]) / 3 >= level]
        return hits[0] if hits else None

    rows = [m for h in runs for m in h]
    tokens = [m["completions/mean_length"] * a.prompts_per_step * a.num_generations for m in rows]
    return {
        "variant": name,
        "first3": mean([mean([m["reward"] for m in h[:3]]) for h in runs]),
        "last5": mean([mean([m["reward"] for m in h[-5:]]) for h in runs]),
        "last5_per_seed": [mean([m["reward"] for m in h[-5:]]) for h in runs],
        "steps_to_0.9": [steps_to(h, 0.9) for h in runs],
        "len_first3": mean([mean([m["completions/mean_length"] for m in h[:3]]) for h in runs]),
        "len_last5": mean([mean([m["completions/mean_length"] for m in h[-5:]]) for h in runs]),
        # the first step (engine warm-up, first weight sync) is left out of the rate
        "tokens_per_s": sum(tokens[1:]) / sum(m["step_time_s"] for m in rows[1:]),
        "clip_frac": mean([m["clip_ratio/region_mean"] for m in rows]),
        "train_s": mean([m["train_s"] for m in rows]),
    }


def loss_type_sweep(a) -> None:
    import ray
    import torch

    from generator.assets import ensure_chain_sum

    torch.set_num_threads(1)  # the trainer: one core; the engine actor holds the other
    script = load_script()
    variants = [
        (t, ["--loss_type", t, "--scale_rewards", str(t != "dr_grpo").lower()])
        for t in a.loss_types.split(",")
    ]
    for v in a.variants:
        loss_type, *flags = v.split()
        variants.append((v, ["--loss_type", loss_type, *flags]))
    with tempfile.TemporaryDirectory(prefix="grpo-loss-bench-") as tmp:
        tmp = Path(tmp)
        model_dir = build_even_model_dir(tmp / "model", a.stop_even_weight)
        data = tmp / "prompts.jsonl"
        data.write_text("\n".join(ensure_chain_sum().read_text().splitlines()[:512]) + "\n")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        load_before, start = os.getloadavg()[0], time.perf_counter()
        histories = {name: [] for name, _ in variants}
        for seed in range(
            a.repeats
        ):  # seed by seed, so a change in the machine's load hits every variant
            for name, flags in variants:
                out = tmp / f"{len(histories[name])}_{name.replace(' ', '_')}"
                histories[name].append(run_variant(script, flags, seed, model_dir, data, out, a))
        total, load_after = time.perf_counter() - start, os.getloadavg()[0]
        ray.shutdown()
    results = [summarize_variant(name, runs, a) for name, runs in histories.items()]
    print(json.dumps({"results": results, "wall_s": total}, indent=2))
    cmd = "python benchmarks/grpo_cpu.py " + " ".join(
        f"'{x}'" if " " in x else x for x in sys.argv[1:]
    )
    rows = "\n".join(
        f"| {r['variant']} | {r['first3']:.3f} | **{r['last5']:.3f}** ({', '.join(f'{x:.3f}' for x in r['last5_per_seed'])}) | "
        f"{', '.join('-' if x is None else str(x) for x in r['steps_to_0.9'])} | "
        f"{r['len_first3']:.1f} -> {r['len_last5']:.1f} | {r['tokens_per_s']:.0f} | {r['clip_frac']:.3f} | {r['train_s']:.2f} |"
        for r in results
    )
    section = f"""{LOSS_BEGIN}
## GRPO loss types side by side (CPU, `benchmarks/grpo_cpu.py --loss_types`)
`{cmd.strip()}` ({platform.machine()}, {time.strftime("%Y-%m-%d")}, shared 2-core machine: 1-min load average
{load_before:.1f} before, {load_after:.1f} after; {total / 60:.1f} min). The emitted examples/grpo_smollm2 script,
unmodified except `--loss_type` and the flags shown, through its `main()`: {a.steps} sync steps of
{a.prompts_per_step} chain_sum prompts x {a.num_generations} completions of <= {a.max_new_tokens} tokens, lr {a.lr}, fp32, seeds
0..{a.repeats - 1} (the mean over seeds, and each seed's, in the last-5 column). The task is the learning tests' (tiny
random Llama, "even" = one embedding direction; reward: share of even ids before the stop token), with the stop token's
even coordinate at {a.stop_even_weight}, so that completion lengths vary and the normalisers differ (see the module
docstring). tokens/s: completion tokens trained per second of step wall time (generation, training, weight sync), step 1 left out.

| variant | reward, steps 1-3 | reward, last 5 steps | step the 3-step mean reward reaches 0.9, per seed | completion length, first 3 -> last 5 | tokens/s | clip fraction | train s/step |
|---|---|---|---|---|---|---|---|
{rows}
{LOSS_END}
"""
    write_marked_section(a.out, section, LOSS_BEGIN, LOSS_END)
    print(f"wrote section to {a.out}")


def ppo_vs_grpo(a) -> None:
    import ray
    import torch

    from generator.assets import ensure_chain_sum

    torch.set_num_threads(1)  # the trainer: one core; the engine actor holds the other
    scripts = {"grpo": load_script("grpo_smollm2"), "ppo": load_script("ppo_smollm2")}
    rollouts = a.prompts_per_step * a.num_generations
    flags = {
        "grpo": ["--num_generations", str(a.num_generations), "--prompts_per_step", str(a.prompts_per_step)],
        "ppo": ["--num_generations", "1", "--prompts_per_step", str(rollouts), "--kl_coef", "0"],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ppo-bench-") as tmp:
        tmp = Path(tmp)
        model_dir = build_even_model_dir(tmp / "model", a.stop_even_weight)
        data = tmp / "prompts.jsonl"
        data.write_text("\n".join(ensure_chain_sum().read_text().splitlines()[:512]) + "\n")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        load_before, start = os.getloadavg()[0], time.perf_counter()
        histories = {name: [] for name in scripts}
        for seed in range(a.repeats):  # seed by seed: a change in the load hits both
            for name, script in scripts.items():
                out = tmp / f"{name}{seed}"
                histories[name].append(
                    run_variant(script, flags[name], seed, model_dir, data, out, a)
                )
        total, load_after = time.perf_counter() - start, os.getloadavg()[0]
        ray.shutdown()
    results = []
    for name, runs in histories.items():
        r = summarize_variant(name, runs, a)
        rows = [m for h in runs for m in h]
        r["samples_per_s"] = rollouts * (len(rows) - 1) / sum(m["step_time_s"] for m in rows[1:])
        r["length"] = sum(m["completions/mean_length"] for m in rows) / len(rows)
        if name == "ppo":
            r["value_loss"] = [sum(m["loss/value_avg"] for m in h[:3]) / 3 for h in runs] + [
                sum(m["loss/value_avg"] for m in h[-5:]) / 5 for h in runs
            ]
            r["explained_variance_last5"] = sum(
                m["val/explained_variance"] for h in runs for m in h[-5:]
            ) / (5 * len(runs))
        results.append(r)
    print(json.dumps({"results": results, "wall_s": total}, indent=2))
    cmd = "python benchmarks/grpo_cpu.py " + " ".join(sys.argv[1:])
    rows = "\n".join(
        f"| {r['variant']} | {r['first3']:.3f} | **{r['last5']:.3f}** ({', '.join(f'{x:.3f}' for x in r['last5_per_seed'])}) | "
        f"{', '.join('-' if x is None else str(x) for x in r['steps_to_0.9'])} | {r['samples_per_s']:.1f} | "
        f"{r['train_s']:.3f} | {r['length']:.1f} |"
        for r in results
    )
    ppo = results[-1]
    n = a.repeats
    critic = (
        f"PPO's critic: value loss (loss/value_avg) of steps 1-3 per seed "
        f"{', '.join(f'{x:.4f}' for x in ppo['value_loss'][:n])} -> last 5 steps "
        f"{', '.join(f'{x:.4f}' for x in ppo['value_loss'][n:])}; mean explained variance of the last 5 steps "
        f"{ppo['explained_variance_last5']:.3f}."
    )
    section = f"""{PPO_BEGIN}
## PPO vs GRPO (CPU, `benchmarks/grpo_cpu.py --ppo`)
`{cmd.strip()}` ({platform.machine()}, {time.strftime("%Y-%m-%d")}, shared 2-core machine: 1-min load average
{load_before:.1f} before, {load_after:.1f} after; {total / 60:.1f} min). The emitted examples/grpo_smollm2 and
examples/ppo_smollm2 scripts through their `main()`: {a.steps} sync steps of {rollouts} rollouts each (GRPO: {a.prompts_per_step}
prompts x {a.num_generations}; PPO: {rollouts} prompts x 1) of <= {a.max_new_tokens} tokens, lr {a.lr}, fp32, kl_coef 0, seeds
0..{n - 1}; the loss-type sweep's task (tiny random Llama, reward: share of even ids before the stop token).
samples/s: rollouts per second of step wall time (generation, PPO's no-grad pass, training, weight
sync), step 1 left out; length: mean completion tokens over every step.

| algorithm | reward, steps 1-3 | reward, last 5 steps | step the 3-step mean reward reaches 0.9, per seed | samples/s | train s/step | length |
|---|---|---|---|---|---|---|
{rows}

{critic}
{PPO_END}
"""
    write_marked_section(a.out, section, PPO_BEGIN, PPO_END)
    print(f"wrote section to {a.out}")


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
    p.add_argument("--loss_types", default="", help="comma list: run the loss-type sweep instead")
    p.add_argument("--variants", nargs="*", default=[], help='sweep rows "LOSS_TYPE FLAGS..."')
    p.add_argument("--lr", type=float, default=1e-2, help="the sweep's learning rate")
    p.add_argument(
        "--stop_even_weight", type=float, default=0.6, help="the sweep model's stop token"
    )
    p.add_argument("--ppo", action="store_true", help="PPO against GRPO on the sweep's task")
    a = p.parse_args()
    if a.ppo:
        return ppo_vs_grpo(a)
    if a.loss_types or a.variants:
        return loss_type_sweep(a)

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
