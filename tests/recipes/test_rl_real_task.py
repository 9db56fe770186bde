"""GRPO (its default loss, dapo) and PPO learn the real task on CPU: SmolLM2-135M's real weights,
the real chain_sum prompts (one-digit sums, reasoning-gym) and the scripts' own rewards
(math_answer_reward 1.0: the last integer is the answer; format_reward 0.2: a one-line reply
ending in an integer), sync rollouts, fp32. The mean reward, the answer accuracy and the format
share of the last steps rise above the first steps'. Every loss variant on this task, side by
side: benchmarks/grpo_math_cpu.py (benchmarks/RESULTS.md)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from tests.helpers import import_script

REPO = Path(__file__).resolve().parents[2]
STEPS = 16


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, shape",
    [
        # GRPO: 4 prompts x 4 completions; PPO: the same 16 completions, one per prompt
        ("grpo_smollm2", ("--prompts_per_step", "4", "--num_generations", "4")),
        ("ppo_smollm2", ("--prompts_per_step", "16", "--num_generations", "1")),
    ],
)
def test_real_model_learns_the_math_task(
    recipe, shape, ray_session, smollm2_dir, chain_sum_64, tmp_path
):
    script = import_script(REPO / "examples" / recipe / "train.py", f"{recipe}_real_task")
    history = script.main([
        "--model", str(smollm2_dir), "--dataset", str(chain_sum_64), "--out_dir", str(tmp_path),
        "--dtype", "fp32", "--rollout", "sync", "--max_steps", str(STEPS), "--max_new_tokens", "12",
        "--lr", "2e-5", "--warmup_steps", "2", "--micro_batch_size", "8", "--seed", "0",
        "--save_final_model", "false", "--save_every_steps", "0", "--resume", "none", *shape,
    ])  # fmt: skip
    assert len(history) == STEPS and all(math.isfinite(m["loss"]) for m in history)

    def first_and_last(key: str) -> tuple[float, float]:
        values = [m[key] for m in history]
        return statistics.fmean(values[:4]), statistics.fmean(values[-4:])

    reward = first_and_last("reward")
    accuracy = first_and_last("rewards/math_answer_reward/mean")
    form = first_and_last("rewards/format_reward/mean")
    print(f"{recipe}: reward {reward}, answer accuracy {accuracy}, format share {form}")
    assert reward[1] > reward[0] + 0.2, [m["reward"] for m in history]
    assert accuracy[1] > accuracy[0] and form[1] > form[0], (accuracy, form)
