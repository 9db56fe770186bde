"""GRPO's num_iterations (TRL's name, DeepSeekMath's mu) in the emitted script
(examples/grpo_smollm2): pi_old is one no-grad pass before a batch's steps, the ratio clips from
the second step on (against a closed form of the clip fraction), gspo leaves grpo there, the
first step equals a num_iterations=1 step, and a sync run of 2 iterations per batch resumes
exactly from a checkpoint taken between batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import grpo_fixed_rollouts, import_script, run_grpo

REPO = Path(__file__).resolve().parents[2]
KEYS = (
    "reward",
    "loss",
    "grad_norm",
    "clip_ratio/region_mean",
    "sampling/importance_sampling_ratio/mean",
)


@pytest.fixture(scope="module")
def grpo_script():
    return import_script(REPO / "examples" / "grpo_smollm2" / "train.py", "grpo_iter_train")


def two_iterations(script, model_dir: Path, loss_type: str, use_old: bool = True) -> tuple:
    """2 train_steps (lr 1e-2) on the 8 fixed rollouts in 2 micro-batches of 4, as one batch of
    num_iterations=2: pi_old from `old_policy_logprobs` before the first (None if not use_old:
    the num_iterations=1 step), and the policy's own log-probs before the second.

    Returns:
        (metrics of both steps, the micro-batches, pi_old's and step 2's pre-update log-probs per
        micro-batch ([4, S] fp32 each))."""
    cfg = script.Config(
        model=str(model_dir), dtype="fp32", device="cpu", lr=1e-2, warmup_steps=0, max_steps=2,
        micro_batch_size=4, max_prompt_len=8, max_new_tokens=8, loss_type=loss_type, num_iterations=2,
    )  # fmt: skip
    script.validate(cfg)
    _, mesh = script.setup_distributed(cfg)
    device = torch.device("cpu")
    model = script.setup_model(cfg, model_dir, mesh, device)
    optimizer, scheduler = script.build_optimizer(cfg, model)
    rollouts, advantages = grpo_fixed_rollouts()
    num_tokens = sum(len(r.completion_ids) for r in rollouts)
    split = script.split_micro_batches(rollouts, advantages, 2, cfg)
    old = script.old_policy_logprobs(model, split, cfg, device) if use_old else None
    metrics, before = [], []
    for _ in range(2):
        with torch.no_grad():
            before.append([
                script.policy_logprobs(model, x["input_ids"], x["labels"], cfg)
                for x in (script.microbatch_inputs(mb, a, cfg, device) for mb, a in split)
            ])  # fmt: skip
        metrics.append(script.train_step(
            model, None, optimizer, scheduler, rollouts, advantages, num_tokens, 2, cfg, device, old_logprobs=old,
        ))  # fmt: skip
    script.destroy_distributed()
    return metrics, split, old, before[1]


def test_second_iteration_clips_as_the_closed_form_says(grpo_script, even_model_dir):
    """pi_old is the policy before the batch's first step; at the second step the ratio
    r = pi / pi_old has moved, and the logged clip ratios equal the shares of completion tokens
    with r < 1 - 0.2 and A < 0 (low), r > 1 + 0.28 and A > 0 (high) and either (region),
    computed here from a fresh pass."""
    metrics, split, old, before = two_iterations(grpo_script, even_model_dir, "dapo")
    assert metrics[0]["clip_ratio/region_mean"] == 0.0  # the first step's ratio is 1 in value
    low, high, tokens = 0, 0, 0
    for (mb, adv), o, new in zip(split, old, before, strict=True):
        x = grpo_script.microbatch_inputs(mb, adv, grpo_script.Config(), torch.device("cpu"))
        mask = x["labels"] != -100
        r = torch.exp(new - o)
        A = adv[:, None].expand_as(r)
        low += int(((r < 0.8) & (A < 0))[mask].sum())
        high += int(((r > 1.28) & (A > 0))[mask].sum())
        tokens += int(mask.sum())
    assert low + high > 0  # lr 1e-2 moves the tiny policy past the clip range on some tokens
    got = [metrics[1][f"clip_ratio/{k}_mean"] for k in ("low", "high", "region")]
    assert got == pytest.approx([low / tokens, high / tokens, (low + high) / tokens], abs=1e-7)


def test_first_iteration_is_the_one_iteration_step_and_gspo_leaves_grpo(
    grpo_script, even_model_dir
):
    """With pi_old from the no-grad pass, the batch's first step equals the num_iterations=1 step
    (pi_old = the policy, detached) in loss and gradient norm; gspo equals grpo there (ratio 1 in
    value) and differs at the second step, where the ratio is not 1."""
    grpo, _, _, _ = two_iterations(grpo_script, even_model_dir, "grpo")
    one, _, _, _ = two_iterations(grpo_script, even_model_dir, "grpo", use_old=False)
    gspo, _, _, _ = two_iterations(grpo_script, even_model_dir, "gspo")
    for key in ("loss", "grad_norm"):
        assert grpo[0][key] == pytest.approx(one[0][key], rel=1e-6, abs=1e-7), key
        assert gspo[0][key] == pytest.approx(grpo[0][key], rel=1e-5, abs=1e-7), key
    assert (
        one[1]["clip_ratio/region_mean"] == 0.0
    )  # without pi_old every step is its own batch: ratio 1
    assert abs(gspo[1]["grad_norm"] - grpo[1]["grad_norm"]) > 1e-4 * grpo[1]["grad_norm"]


def test_two_iterations_resume_between_batches_replays_the_run(
    grpo_script, ray_session, even_model_dir, chain_sum_64, tmp_path
):
    """Sync rollouts, num_iterations 2: the policy version counts rollout batches (steps 1-2
    train version-0 samples, steps 3-4 version-1 samples, all on-policy), each batch's second
    step clips some tokens, and 4 steps straight == 2 steps, stop, resume to 4 (checkpoints every
    2 steps, between batches), metric for metric."""

    def run(out: str, steps: int) -> list[dict]:
        return run_grpo(
            grpo_script, even_model_dir, chain_sum_64, tmp_path / out, "--rollout", "sync", "--num_iterations", "2",
            "--save_every_steps", "2", "--resume", "auto", "--max_steps", str(steps),
        )  # fmt: skip

    straight, first, resumed = run("a", 4), run("b", 2), run("b", 4)
    assert [m["policy_versions"] for m in straight] == [[0] * 8, [0] * 8, [1] * 8, [1] * 8]
    assert straight[0]["reward"] == straight[1]["reward"]  # one batch, two steps
    assert (
        straight[0]["clip_ratio/region_mean"] == 0.0 and straight[1]["clip_ratio/region_mean"] > 0
    )
    assert (len(first), len(resumed)) == (2, 2)
    assert [[m[k] for k in KEYS] for m in straight] == [
        [m[k] for k in KEYS] for m in first + resumed
    ]
