"""GRPO and PPO learn the real task on CPU: SmolLM2-135M's real weights, the real chain_sum
prompts (one-digit sums, reasoning-gym) and the script's own rewards (math_answer_reward 1.0: the
last integer is the answer; format_reward 0.2: a one-line reply ending in an integer), sync
rollouts, fp32. Every GRPO loss type (`--loss_type`) is run, each as the emitted example with its
flags: the mean reward and the format share of the last 4 of 16 rollout batches rise above
the first 4 batches' (the answer accuracy is printed). gspo and cispo run at `--num_iterations 2`,
the one setting where they differ from grpo and dapo: with one optimizer step per batch gspo's
gradient is grpo's and cispo's is dapo's (`test_grpo_losses.py` checks that), so at 1 their runs
would repeat those rows. The same variants over 25 batches, side by side:
benchmarks/grpo_math_cpu.py (benchmarks/RESULTS.md). PPO (`test_ppo_learns_the_math_task`) learns
this task more slowly (no group baseline, a critic that starts at zero): 16 steps with its default
KL penalty raised its mean reward by 0.06 only (0.20 -> 0.26), so its test runs 24 steps of 16
prompts x 1 completion without the KL term (kl_coef 0, TRL's PPO setting without a reference)."""

from __future__ import annotations

import math
import statistics

import pytest

from tests.helpers import run_math_task

# the learning tier (`make test-learning`, tests/README.md): minutes of real-model rollouts each
pytestmark = pytest.mark.learning

BATCHES = 16  # rollout batches of 4 prompts x 4 completions

# --loss_type -> its flags (the benchmark's variants); gspo and cispo also take NUM_ITERATIONS.
# Measured here (2026-12-05, first 4 -> last 4 batches): dapo reward 0.18 -> 0.54, format share
# 0.38 -> 0.97, answer accuracy 0.11 -> 0.34; the others in their test's print (tests/CHECKS.md).
LOSS_TYPES = {
    "dapo": (),
    "grpo": (),
    "dr_grpo": ("--scale_rewards", "false"),  # Dr. GRPO: no std scaling, a constant normaliser
    "gspo": (),
    "cispo": (),
}
NUM_ITERATIONS = {"gspo": 2, "cispo": 2}  # optimizer steps per rollout batch (default 1)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_grpo_loss_type_learns_the_math_task(
    loss_type, ray_session, smollm2_dir, chain_sum_64, tmp_path, learning
):
    mu = NUM_ITERATIONS.get(loss_type, 1)
    history = run_math_task(
        "grpo_smollm2", BATCHES * mu, "--prompts_per_step", "4", "--num_generations", "4",
        "--loss_type", loss_type, "--num_iterations", str(mu), *LOSS_TYPES[loss_type],
        model_dir=smollm2_dir, dataset=chain_sum_64, out_dir=tmp_path,
    )  # fmt: skip
    assert len(history) == BATCHES * mu and all(math.isfinite(m["loss"]) for m in history)
    # each of a batch's mu optimizer steps logs that batch's rewards: one row per batch
    batches = history[mu - 1 :: mu]
    if mu > 1:  # the clip acts from a batch's second optimizer step on
        assert max(m["clip_ratio/region_mean"] for m in history) > 0, loss_type

    def first_and_last(key: str) -> tuple[float, float]:
        values = [m[key] for m in batches]
        return statistics.fmean(values[:4]), statistics.fmean(values[-4:])

    reward = first_and_last("reward")
    accuracy = first_and_last("rewards/math_answer_reward/mean")
    form = first_and_last("rewards/format_reward/mean")
    print(f"{loss_type}: reward {reward}, answer accuracy {accuracy}, format share {form}")
    learning("reward, first 4 -> last 4 batches", len(history), *reward, "rise > 0.1")
    learning("format share", len(history), *form, "rise > 0.2")
    assert reward[1] > reward[0] + 0.1, [m["reward"] for m in batches]
    assert form[1] > form[0] + 0.2, [m["rewards/format_reward/mean"] for m in batches]


PPO_STEPS = 24


@pytest.mark.slow
def test_ppo_learns_the_math_task(ray_session, smollm2_dir, chain_sum_64, tmp_path, learning):
    """PPO (value head on the policy, GAE, clipped policy and value losses) on the same real task:
    16 prompts x 1 completion per step (the same 16 completions as GRPO's 4 x 4), 24 steps, no KL
    term. Measured here (2026-12-05, one process on a quiet machine): reward 0.21 -> 0.40 (first 4
    -> last 4 steps), format share 0.48 -> 1.00, answer accuracy 0.11 -> 0.20; the completions
    shrink to the bare number (10.1 -> 2.0 tokens)."""
    history = run_math_task(
        "ppo_smollm2", PPO_STEPS, "--prompts_per_step", "16", "--num_generations", "1",
        "--kl_coef", "0", model_dir=smollm2_dir, dataset=chain_sum_64, out_dir=tmp_path,
    )  # fmt: skip
    assert len(history) == PPO_STEPS and all(math.isfinite(m["loss"]) for m in history)
    reward = [m["reward"] for m in history]
    form = [m["rewards/format_reward/mean"] for m in history]
    first, last = statistics.fmean(reward[:4]), statistics.fmean(reward[-4:])
    learning("reward, first 4 -> last 4 steps", PPO_STEPS, first, last, "rise > 0.1")
    learning("format share", PPO_STEPS, statistics.fmean(form[:4]), statistics.fmean(form[-4:]),
             "rise > 0.2")  # fmt: skip
    print(
        f"ppo reward {first} -> {last}, format {statistics.fmean(form[:4])} -> {statistics.fmean(form[-4:])}"
    )
    assert last > first + 0.1, reward
    assert statistics.fmean(form[-4:]) > statistics.fmean(form[:4]) + 0.2, form
