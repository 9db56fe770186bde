"""The PPO script on 2 trainer processes (forked gloo ranks, FSDP2) against 1 process: with sync
rollouts (the same in both runs), 5 prompts per batch split 3 / 2 over the ranks, so rank 1 runs
an empty micro-batch (a zero gradient through lm_head and the value head) in the no-grad pass and
in each step; the advantages are whitened and the explained variance taken over both ranks'
tokens, so rewards, losses (policy and value), gradient norms and the critic's metrics equal the
1-process run's. The same under HSDP 2 x 2 on 4 processes."""

from __future__ import annotations

import pytest

from tests.helpers import EXAMPLES, joined_ray, run_script, write_reward_driver

KEYS = ("loss", "loss/policy_avg", "loss/value_avg", "val/explained_variance", "objective/kl")


def _args(model_dir, data) -> list[str]:
    return [
        "--model", str(model_dir), "--dataset", str(data), "--dtype", "fp32",
        "--rollout", "sync", "--num_generations", "1", "--prompts_per_step", "5",
        "--max_new_tokens", "6", "--micro_batch_size", "2", "--lr", "1e-2", "--warmup_steps", "0",
        "--num_iterations", "2", "--max_steps", "4", "--kl_coef", "0.05", "--reward_weights", "1.0",
        "--save_final_model", "false", "--resume", "none", "--ray_num_cpus", "2", "--num_engines", "1",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(
    even_model_dir, chain_sum_64, tmp_path_factory, run_once, ray_session
) -> list[dict]:
    """The 1-process run of `_args`: the reference of both tests, run once."""

    def compute() -> list[dict]:
        tmp = tmp_path_factory.mktemp("ppo_one")
        driver = tmp / "driver.py"
        write_reward_driver(driver, EXAMPLES / "ppo_smollm2" / "train.py", "ppo_ranks")
        args = [*_args(even_model_dir, chain_sum_64), *joined_ray(ray_session)]
        return run_script(tmp, args, nproc=1, script=driver, launcher="fork")

    return run_once("ppo_one_process", compute)


@pytest.mark.parametrize(
    ("nproc", "plan"), [(2, []), (4, ["--dp_replicate", "2"])], ids=["fsdp2", "hsdp2x2"]
)
def test_trainer_processes_equal_one(
    even_model_dir, chain_sum_64, one_process, tmp_path, nproc, plan, ray_session
):
    """2 ranks (FSDP2) or 4 (HSDP 2 x 2: 5 prompts over 4 dp ranks, 2 / 1 / 1 / 1) = 1 process."""
    driver = tmp_path / "driver.py"
    write_reward_driver(driver, EXAMPLES / "ppo_smollm2" / "train.py", "ppo_ranks")
    one = one_process
    two = run_script(
        tmp_path,
        [*_args(even_model_dir, chain_sum_64), *plan, *joined_ray(ray_session)],
        nproc=nproc,
        script=driver,
    )
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two, strict=True):
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)  # the same rollouts
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert all(r["grad_norm"] > 0.01 for r in one) and one[2]["objective/kl"] > 0
