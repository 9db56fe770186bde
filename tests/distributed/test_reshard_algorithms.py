"""Resume across plans for every skeleton: a train state saved by 2 FSDP2 ranks resumes on 1
process, and the resumed steps and the saved model equal the uninterrupted 2-rank run's.

SFT's own resharding (1 and 4 ranks, the loaded state compared tensor by tensor) is
test_reshard.py; here each other algorithm's script runs its own main() end to end: DPO (the
reference's precomputed log-probs rebuilt on the new world), DPO-LoRA (its reference the base
with the adapters off), LoRA and QLoRA (the adapters and their AdamW state as DTensor shards, over
a bf16 or NF4 base; the merged export), KD (the teacher whole on each rank), RM (the score head
and the pooled last token), and the GRPO skeleton's GRPO, GRPO-LoRA and PPO (rank 0's Ray
pipeline, sync mode: the same rollouts after the resume; PPO's trainer-only value head). The
global batch stays the same (micro_batch_size 2 x 2 ranks = 4 x 1 process), so only the float
summation order differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    EXAMPLES,
    SMALL_VOCAB,
    TINY_CONFIG,
    joined_ray,
    run_script,
    spawn,
    write_reward_driver,
)

# tolerances of test_reshard.py: losses rel 1e-5, weights abs 1e-5 (10x what was measured)
LOSS_REL, WEIGHT_ABS = 1e-5, 1e-5


def _main(rank, world_size, script_name, argv):
    from tests.helpers import import_script

    return import_script(EXAMPLES / script_name / "train.py", f"{script_name}_reshard").main(argv)


def _teacher(out: Path, tokenizer_dir: Path) -> Path:
    """A tiny random teacher (seed 1) of the student's small vocabulary: KL is not 0."""
    from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint

    args = ModelArgs(**{**TINY_CONFIG, "vocab_size": SMALL_VOCAB}, max_position_embeddings=512)
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(1))
    save_hf_checkpoint(model, out, args.to_hf_config())
    copy_tokenizer_files(tokenizer_dir, out)
    return out


def _logged(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


def _assert_same_model(a_dir: Path, b_dir: Path, name: str) -> None:
    a, b = load_file(a_dir / name), load_file(b_dir / name)
    assert a.keys() == b.keys() and len(a) > 5
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=WEIGHT_ABS, rtol=0, msg=key)


# algo -> (example script, its extra flags, the saved files compared); the data: pairs for the
# preference skeletons, the small SFT set for the others
_SFT_LIKE = {
    "dpo": ("dpo_smollm2", ["--ref_mode", "precomputed", "--max_seq_len", "192"], []),
    "dpo-lora": (
        "dpo_lora_smollm2",
        ["--max_seq_len", "192"],  # the default reference: the base with the adapters off
        ["adapter_model.safetensors", "merged/model.safetensors"],
    ),
    "lora": (
        "lora_smollm2",
        ["--max_seq_len", "64"],
        ["adapter_model.safetensors", "merged/model.safetensors"],
    ),
    # the NF4 base: sharded by 2 ranks where FSDP2 can split it, whole on 1 process
    "qlora": (
        "qlora_smollm2",
        ["--max_seq_len", "64"],
        ["adapter_model.safetensors", "merged/model.safetensors"],
    ),
    "kd": ("kd_smollm2", ["--max_seq_len", "64"], []),
    # the score head (sharded on 2 ranks like any weight) and the pooled last token
    "rm": ("rm_smollm2", ["--max_seq_len", "192"], []),
}
_PAIRS = ("dpo", "dpo-lora", "rm")


@pytest.mark.parametrize("algo", list(_SFT_LIKE))
def test_two_rank_checkpoint_resumes_on_one_process(
    algo, tiny_model_dir, small_dataset, short_pairs, tmp_path
):
    script, extra, names = _SFT_LIKE[algo]
    data = short_pairs if algo in _PAIRS else small_dataset
    if algo == "kd":
        extra = [*extra, "--teacher", str(_teacher(tmp_path / "teacher", tiny_model_dir))]

    def argv(out: Path, micro_batch_size: int) -> list[str]:
        return [
            "--model", str(tiny_model_dir), "--dataset", str(data), "--out_dir", str(out),
            "--device", "cpu", "--dtype", "fp32", "--max_steps", "4", "--lr", "1e-3",
            "--warmup_steps", "1", "--micro_batch_size", str(micro_batch_size),
            "--val_fraction", "0", "--eval_every_steps", "0", "--save_every_steps", "2",
            *([] if algo == "rm" else ["--sample_max_new_tokens", "0"]), *extra,
        ]  # fmt: skip

    ref = tmp_path / "ref"
    spawn(_main, world_size=2, args=(script, argv(ref, 2)))
    checkpoint = ref / "checkpoints" / "step_000002"
    assert len(list((checkpoint / "dcp").glob("*.distcp"))) == 2  # really sharded by 2 ranks
    out = tmp_path / "resumed"
    spawn(_main, world_size=1, args=(script, [*argv(out, 4), "--resume", str(checkpoint)]))
    want, got = _logged(ref), _logged(out)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=LOSS_REL), step
    # the adapter algorithms save their adapters (PEFT's file) and the merged model
    for name in names or ["model.safetensors"]:
        _assert_same_model(ref / "model", out / "model", name)


# the GRPO skeleton's algorithms: example script, extra flags, the logged keys compared besides
# reward, loss and grad_norm
_RL = {
    "grpo": ("grpo_smollm2", [], ()),
    # the adapters and their AdamW state; the KL reference is the base with the adapters off
    "grpo-lora": ("grpo_lora_smollm2", ["--kl_coef", "0.05"], ("kl",)),
    # the value head (trainer-only, not in the HF checkpoint): step 3's values and its value loss
    # come from the head trained in steps 1-2; a separate frozen reference for the KL reward
    "ppo": (
        "ppo_smollm2",
        ["--kl_coef", "0.05"],
        ("loss/value_avg", "val/explained_variance", "objective/kl"),
    ),
}


@pytest.mark.parametrize("algo", list(_RL))
def test_rl_two_rank_checkpoint_resumes_on_one_process(
    algo, even_model_dir, chain_sum_64, tmp_path, ray_session
):
    """Sync mode, 3 steps on 2 trainer processes (checkpoint at step 2); step 3 again on 1
    process from that checkpoint: the same rollouts (rank 0's pipeline restarts at the saved
    data position with the saved policy), reward, loss and gradient norm."""
    script, extra, keys = _RL[algo]
    driver = tmp_path / "driver.py"
    write_reward_driver(driver, EXAMPLES / script / "train.py", f"{script}_reshard")
    args = [
        "--model", str(even_model_dir), "--dataset", str(chain_sum_64), "--dtype", "fp32",
        "--rollout", "sync", "--num_generations", "4", "--prompts_per_step", "2",
        "--max_new_tokens", "6", "--micro_batch_size", "2", "--lr", "1e-2", "--warmup_steps", "0",
        "--max_steps", "3", "--reward_weights", "1.0", "--save_final_model", "false",
        "--ray_num_cpus", "2", "--num_engines", "1", "--save_every_steps", "2", *extra,
        *joined_ray(ray_session),
    ]  # fmt: skip
    (tmp_path / "two").mkdir()
    two = run_script(tmp_path / "two", [*args, "--resume", "none"], nproc=2, script=driver)
    checkpoint = tmp_path / "two" / "out_2" / "checkpoints" / "step_000002"
    assert len(list((checkpoint / "dcp").glob("*.distcp"))) == 2
    (tmp_path / "one").mkdir()
    one = run_script(
        tmp_path / "one", [*args, "--resume", str(checkpoint)], script=driver, launcher="fork"
    )
    assert [r["step"] for r in one] == [3]
    a, b = two[-1], one[0]
    assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)  # the same rollouts
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    for key in keys:
        assert abs(a[key]) > 1e-6, key  # a value the resumed state decides, not a 0 either way
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
