"""The emitted PPO script (examples/ppo_smollm2): GAE, the per-token rewards, the clipped value
and policy losses and the explained variance against closed forms or hand loops in Python floats
(one-token and fully truncated completions included), the value head kept out of the engines'
weight sync and the HF save but in the training checkpoint, and on a local Ray with a tiny model:
a short run raises the mean reward. Resume after kill -9: tests/recipes/test_resume.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from runtime.rollout import Rollout
from tests.helpers import import_script, run_grpo, run_math_task, safetensors_keys

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ppo():
    return import_script(REPO / "examples" / "ppo_smollm2" / "train.py", "ppo_smollm2_train")


def hand_gae(rewards: list, values: list, gamma: float, lam: float) -> tuple[list, list]:
    """GAE over one completion's tokens (lists of floats): the textbook backward recursion."""
    advantages, next_a, next_v = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_v - values[t]
        next_a = delta + gamma * lam * next_a
        advantages[t], next_v = next_a, values[t]
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


# rows: 2 prompt positions, then the completion's positions, then padding; lengths 4, 1 (a
# one-token completion) and 3
LENGTHS = (4, 1, 3)


def gae_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    S = 2 + max(LENGTHS) + 1
    mask = torch.zeros(len(LENGTHS), S, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, 2 : 2 + n] = True
    rewards = torch.randn(len(LENGTHS), S, generator=g) * mask
    values = torch.randn(len(LENGTHS), S, generator=g)  # garbage off the mask must not leak in
    return rewards, values, mask


@pytest.mark.fast
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.7, 0.0)])
def test_gae_equals_the_hand_recursion(ppo, gamma, lam):
    rewards, values, mask = gae_case()
    advantages, returns = ppo.gae_advantages(rewards, values, mask, gamma, lam)
    for i, n in enumerate(LENGTHS):
        r, v = rewards[i, 2 : 2 + n].tolist(), values[i, 2 : 2 + n].tolist()
        want_a, want_r = hand_gae(r, v, gamma, lam)
        assert advantages[i, 2 : 2 + n].tolist() == pytest.approx(want_a, abs=1e-6)
        assert returns[i, 2 : 2 + n].tolist() == pytest.approx(want_r, abs=1e-6)
        if gamma == 1.0 and lam == 1.0:  # Monte Carlo: the reward-to-go less the value
            to_go = [sum(r[t:]) for t in range(n)]
            assert returns[i, 2 : 2 + n].tolist() == pytest.approx(to_go, abs=1e-6)
        if lam == 0.0:  # one-step TD error
            nxt = v[1:] + [0.0]
            td = [r[t] + gamma * nxt[t] - v[t] for t in range(n)]
            assert advantages[i, 2 : 2 + n].tolist() == pytest.approx(td, abs=1e-6)
    assert advantages[~mask].abs().max() == 0 and returns[~mask].abs().max() == 0
    # the one-token completion: A = r - V, R = r
    assert advantages[1, 2].item() == pytest.approx((rewards[1, 2] - values[1, 2]).item(), abs=1e-6)


@pytest.mark.fast
def test_token_rewards_put_the_score_last_and_the_kl_everywhere(ppo):
    _, _, mask = gae_case()
    logprobs = torch.log(torch.full(mask.shape, 0.5)) * mask
    ref = torch.log(torch.full(mask.shape, 0.25)) * mask
    scores = torch.tensor([1.0, -2.0, 0.5])
    rewards, kl = ppo.token_rewards(scores, logprobs, ref, mask, kl_coef=0.1)
    for i, n in enumerate(LENGTHS):
        want = [-0.1 * math.log(2)] * n  # k1: log 0.5 - log 0.25
        want[-1] += scores[i].item()
        assert rewards[i, 2 : 2 + n].tolist() == pytest.approx(want, abs=1e-6)
        assert kl[i, 2 : 2 + n].tolist() == pytest.approx([math.log(2)] * n, abs=1e-6)
    assert rewards[~mask].abs().max() == 0 and kl[~mask].abs().max() == 0
    no_ref, _ = ppo.token_rewards(scores, logprobs, None, mask, kl_coef=0.1)
    assert no_ref.sum(1).tolist() == pytest.approx(scores.tolist())


@pytest.mark.fast
def test_value_loss_equals_closed_form(ppo):
    """0.5 max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, +-0.2): clipped on
    both sides, unclipped inside the range, and a masked-out token that contributes nothing;
    gradient as the closed form (the clipped branch has none when it is the larger)."""
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, 9.0]])
    values = torch.tensor([[0.5, -0.5, 0.1, 0.5, 3.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 0.0, 0.3, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    weights = mask / 4
    loss, sums = ppo.value_loss(values, old, returns, mask, 0.2, weights)
    # token by token: (V, V_clip, R) -> 0.5 * max((V-R)^2, (Vc-R)^2), clipped term larger?
    cases = [(0.5, 0.2, 1.0), (-0.5, -0.2, 0.0), (0.1, 0.1, 0.3), (0.5, 0.2, 0.0)]
    per = [0.5 * max((v - r) ** 2, (c - r) ** 2) for v, c, r in cases]
    assert loss.item() == pytest.approx(sum(per) / 4, abs=1e-6)
    assert sums["val/clipfrac_avg"].item() == 1  # token 0: (0.2 - 1)^2 > (0.5 - 1)^2
    loss.backward()
    # d/dV: the unclipped branch when it is the larger (tokens 1, 2, 3), 0 for token 0 (clipped
    # branch larger, V outside the range: no gradient), 0 off the mask
    grad = [0.0, (-0.5 - 0.0) / 4, (0.1 - 0.3) / 4, (0.5 - 0.0) / 4, 0.0]
    assert values.grad[0].tolist() == pytest.approx(grad, abs=1e-6)


@pytest.mark.fast
def test_fully_truncated_batch_under_overlong_mask_gives_zero_loss(ppo):
    """overlong="mask" with every completion truncated: no loss token, so policy and value
    losses are 0 and finite, with zero gradients (the step's token count is clamped to 1)."""
    values = torch.tensor([[0.3, -0.2]], requires_grad=True)
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.zeros(1, 2, dtype=torch.bool)
    weights = mask / 1
    v_loss, _ = ppo.value_loss(values, torch.zeros(1, 2), torch.ones(1, 2), mask, 0.2, weights)
    p_loss, _ = ppo.grpo_loss(
        logprobs, logprobs.detach(), logprobs.detach(), torch.ones(1, 2), mask, 0.2, 0.2, 2.0,
        weights=weights,
    )  # fmt: skip
    (p_loss + 0.1 * v_loss).backward()
    assert p_loss.item() == 0 and v_loss.item() == 0
    assert values.grad.abs().max() == 0 and logprobs.grad.abs().max() == 0


@pytest.mark.fast
def test_policy_loss_with_token_advantages_equals_closed_form(ppo):
    """PPO's policy term is `grpo_loss` with one advantage per token: -min(r A_t, clip(r) A_t)
    per token, weight 1/T (dapo), clip range [0.8, 1.2] (TRL's cliprange on both sides)."""
    old = torch.log(torch.tensor([[0.2, 0.4, 0.3]]))
    ratios = [1.5, 0.5, 1.1]
    logprobs = (old + torch.log(torch.tensor([ratios]))).requires_grad_()
    advantages = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, sums = ppo.grpo_loss(
        logprobs, old, old, advantages, mask, 0.2, 0.2, 0.0, weights=mask / 3
    )
    clip = [min(max(r, 0.8), 1.2) for r in ratios]
    want = [-min(r * a, c * a) for r, c, a in zip(ratios, clip, [1.0, -2.0, 0.5], strict=True)]
    assert loss.item() == pytest.approx(sum(want) / 3, abs=1e-6)
    # token 0 clipped above (r > 1.2, A > 0), token 1 below (r < 0.8, A < 0)
    assert [sums[f"clip_ratio/{k}_mean"].item() for k in ("low", "high", "region")] == [1, 1, 2]


def fixed_rollouts() -> list:
    """4 rollouts of completions of 3, 1, 2 and 3 tokens (one group each, G = 1)."""
    completions = [[10, 20, 30], [11], [12, 22], [13, 23, 33]]
    return [
        Rollout([1, 2, 3 + i], c, [-1.0] * len(c), float(i % 2), {}, 0, i)
        for i, c in enumerate(completions)
    ]


def test_ppo_targets_explained_variance_whitening_and_old_policy(ppo, even_model_dir):
    """`ppo_targets` on the tiny model with a random value head: pi_old is the policy's own
    log-probs, V_old the value head's, advantages whitened to mean 0 / variance 1 over the
    completion tokens, and val/explained_variance = 1 - Var(R - V) / Var(R) computed here with
    torch.var over the same tokens; with the head at its zero init V = 0 and the explained
    variance is exactly 0."""
    cfg = ppo.Config(
        model=str(even_model_dir), dtype="fp32", device="cpu", micro_batch_size=2, kl_coef=0.0,
        max_prompt_len=8, max_new_tokens=8,
    )  # fmt: skip
    _, mesh = ppo.setup_distributed(cfg)
    device = torch.device("cpu")
    model = ppo.setup_model(cfg, even_model_dir, mesh, device)
    rollouts = fixed_rollouts()
    scores = torch.tensor([r.reward for r in rollouts])
    split = ppo.split_micro_batches(rollouts, scores, 2, cfg)
    _, _, metrics = ppo.ppo_targets(model, None, split, cfg, device)
    assert metrics["val/explained_variance"] == 0.0  # zero-initialised head: V = 0
    ppo.init_value_head(model, seed=1, std=0.5)
    olds, critic, metrics = ppo.ppo_targets(model, None, split, cfg, device)
    values, returns, advantages = [], [], []
    for (mb, s), old, c in zip(split, olds, critic, strict=True):
        x = ppo.microbatch_inputs(mb, s, cfg, device)
        mask = x["labels"] != -100
        with torch.no_grad():
            want = ppo.policy_logprobs(model, x["input_ids"], x["labels"], cfg)
            v = ppo.token_values(model, model.forward_hidden(x["input_ids"]))
        assert torch.equal(old, want)  # the ratio starts at exactly 1
        assert torch.allclose(c["values"][mask], v[mask], atol=1e-6)
        values.append(c["values"][mask])
        returns.append(c["returns"][mask])
        advantages.append(c["advantages"][mask])
    values, returns, advantages = torch.cat(values), torch.cat(returns), torch.cat(advantages)
    assert values.abs().min() > 0
    want_ev = 1 - torch.var(returns - values) / torch.var(returns)
    assert metrics["val/explained_variance"] == pytest.approx(want_ev.item(), abs=1e-5)
    assert advantages.mean().item() == pytest.approx(0, abs=1e-6)
    assert torch.var(advantages).item() == pytest.approx(1, abs=1e-5)
    ppo.destroy_distributed()


def test_value_head_stays_out_of_weight_sync_and_hf_save(ppo, even_model_dir, tmp_path):
    """The value head is a trained parameter of the policy, but what the engines receive (both
    transfers) and what the HF save writes are exactly the checkpoint's tensors; the training
    checkpoint holds the head (a fresh model, zero head, gets it back from there)."""
    from runtime import TrainState, load_train_state, save_hf_model, save_train_state
    from runtime.rollout import HFWeightSource, gather_hf_state_dict

    cfg = ppo.Config(model=str(even_model_dir), dtype="fp32", device="cpu")
    _, mesh = ppo.setup_distributed(cfg)
    model = ppo.setup_model(cfg, even_model_dir, mesh, torch.device("cpu"))
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= names
    hf_keys = safetensors_keys(even_model_dir)
    assert set(gather_hf_state_dict(model)) == hf_keys
    # the collective source also sends the tied lm_head, right after the embedding
    sent = {m.name for m in HFWeightSource(model, torch.float32, "cpu").metadata()}
    assert sent == hf_keys | {"lm_head.weight"}
    save_hf_model(model, even_model_dir, tmp_path / "hf", {}, is_main=True)
    assert safetensors_keys(tmp_path / "hf") == hf_keys
    optimizer, scheduler = ppo.build_optimizer(cfg, model)
    assert any(p is model.value_head.weight for g in optimizer.param_groups for p in g["params"])
    ppo.init_value_head(model, seed=3, std=0.5)
    trained = model.value_head.weight.detach().clone()
    path = save_train_state(
        tmp_path / "ckpt", TrainState(step=1), model, optimizer, scheduler, {}, 1
    )
    fresh = ppo.setup_model(cfg, even_model_dir, mesh, torch.device("cpu"))
    assert fresh.value_head.weight.abs().max() == 0  # the zero init
    load_train_state(path, fresh, *ppo.build_optimizer(cfg, fresh))
    ppo.destroy_distributed()
    assert torch.equal(fresh.value_head.weight, trained)


@pytest.mark.slow
def test_real_model_losses_fall_on_one_batch(ray_session, smollm2_dir, chain_sum_64, tmp_path):
    """CI's one real-model PPO run (its 24-step run on the task is the learning tier's,
    test_rl_real_task.py): the emitted script on SmolLM2-135M, one rollout batch of the first 16
    chain_sum prompts x 1 completion with the script's own rewards, then 4 optimizer steps on
    that batch (--num_iterations 4) at lr 2e-5, no KL term. The clipped policy loss starts at 0
    (ratio 1, whitened advantages) and falls as the policy moves toward the better completions,
    and the critic's value loss falls: measured policy 0.000, -0.068, -0.086, -0.096; value
    0.0476, 0.0465, 0.0456, 0.0447 (about 40 s on one core)."""
    history = run_math_task(
        "ppo_smollm2", 4, "--prompts_per_step", "16", "--num_generations", "1",
        "--num_iterations", "4", "--kl_coef", "0", "--warmup_steps", "0",
        model_dir=smollm2_dir, dataset=chain_sum_64, out_dir=tmp_path / "out",
    )  # fmt: skip
    policy = [m["loss/policy_avg"] for m in history]
    value = [m["loss/value_avg"] for m in history]
    assert len(history) == 4 and len({m["reward"] for m in history}) == 1  # one batch
    assert abs(policy[0]) < 1e-3 and policy[-1] < policy[0] - 0.03, policy
    assert all(b < a for a, b in zip(value, value[1:])), value


def test_short_run_raises_mean_reward(ppo, ray_session, even_model_dir, chain_sum_64, tmp_path):
    """12 sync steps of 16 single completions (G = 1) on the even-token reward raise the mean
    reward, and the critic learns its baseline: the value loss of the last 3 steps is under 60%
    of the first 3's (the head starts at V = 0, explained variance exactly 0)."""
    history = run_grpo(
        ppo, even_model_dir, chain_sum_64, tmp_path, "--rollout", "sync", "--max_steps", "12",
        "--num_generations", "1", "--prompts_per_step", "16", "--micro_batch_size", "16",
        "--kl_coef", "0", "--vf_coef", "0.5",
    )  # fmt: skip
    rewards = [m["reward"] for m in history]
    value_losses = [m["loss/value_avg"] for m in history]
    assert all(math.isfinite(m["loss"]) for m in history)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    assert history[0]["val/explained_variance"] == 0.0
    assert sum(value_losses[-3:]) < 0.6 * sum(value_losses[:3]), value_losses


@pytest.mark.parametrize(
    "rollout, extra, bound",
    [
        ("async", (), 1),
        # weights pushed every 3rd step only: batches older than 2 versions appear and are dropped
        ("off-policy", ("--max_staleness", "2", "--weight_sync_every_steps", "3"), 2),
    ],
)
def test_async_and_off_policy_keep_their_staleness_bound(
    ppo, ray_session, even_model_dir, chain_sum_64, tmp_path, rollout, extra, bound
):
    """PPO on the GRPO pipeline's other modes: no trained sample older than the mode's bound,
    generation really ran ahead, the importance weight to the sampler moves off 1 on the steps
    that train stale samples (pi_old is the trainer's pass, not the sampler) and every loss is
    finite."""
    history = run_grpo(
        ppo, even_model_dir, chain_sum_64, tmp_path, "--rollout", rollout, "--max_steps", "5",
        "--num_generations", "1", "--prompts_per_step", "8", "--kl_coef", "0", *extra,
    )  # fmt: skip
    staleness = [s - 1 - v for s, m in enumerate(history, start=1) for v in m["policy_versions"]]
    assert 1 <= max(staleness) <= bound and min(staleness) >= 0
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["loss/value_avg"]) for m in history)
    weights = [
        m["sampling/importance_sampling_ratio/mean"] for m in history if m["staleness_max"] >= 1
    ]
    assert any(abs(w - 1) > 1e-4 for w in weights), weights
    if rollout == "off-policy":  # the 3-step-old batches at step 4 were dropped, not trained on
        assert sum(m["dropped_stale"] for m in history) > 0
