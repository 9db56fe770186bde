"""The GRPO loss family of the emitted script (examples/grpo_smollm2, `--loss_type`): each
objective (grpo, dapo, dr_grpo, gspo, cispo) and its normaliser against closed forms written out
with Python floats, the edge cases (all-equal groups, one-token completions, every completion
truncated under overlong="mask"), gradients that do not depend on the micro-batching, the
advantage options (scale_rewards, the RLOO baseline) and DAPO's overlong penalty against closed
forms, the Config's one-line errors, and on a local Ray with the tiny model: dynamic sampling drops
and counts zero-variance groups, and a short run of each loss type raises the mean reward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from runtime.grpo import group_advantages
from runtime.rollout import Rollout
from tests.helpers import import_script, run_grpo

REPO = Path(__file__).resolve().parents[2]
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
LO, HI, CAP, KL_COEF = 0.2, 0.28, 2.0, 0.1

# three completions of 3, 1 and 2 tokens (rows of 4 positions): per-token ratios pi / pi_old,
# raw importance weights pi_old / pi_sampler, ref - pi log-prob gaps, and the advantages
RATIOS = [[1.5, 0.9, 1.1], [0.5], [1.2, 0.7]]
RAW_WEIGHTS = [[3.0, 0.5, 1.0], [1.0], [1.0, 1.5]]  # 3.0 is truncated at CAP
DELTAS = [[0.3, -0.2, 0.0], [0.1], [-0.5, 0.2]]
OLD_PROBS = [[0.2, 0.4, 0.3], [0.25], [0.1, 0.6]]
ADVANTAGES = [1.0, -0.5, 2.0]
MAX_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def grpo_script():
    return import_script(REPO / "examples" / "grpo_smollm2" / "train.py", "grpo_losses_train")


def _tensors():
    """The hand-made rows as [3, 4] tensors (0 off the completions), logprobs with grad."""
    shape = (3, MAX_NEW_TOKENS)
    old, logprobs, sampler, ref = (torch.zeros(shape) for _ in range(4))
    mask = torch.zeros(shape, dtype=torch.bool)
    for i, ratios in enumerate(RATIOS):
        for t, r in enumerate(ratios):
            old[i, t] = math.log(OLD_PROBS[i][t])
            logprobs[i, t] = old[i, t] + math.log(r)
            sampler[i, t] = old[i, t] - math.log(RAW_WEIGHTS[i][t])
            ref[i, t] = logprobs[i, t] + DELTAS[i][t]
            mask[i, t] = True
    return logprobs.requires_grad_(), old, sampler, ref, mask


def _clip(x: float) -> float:
    return min(max(x, 1 - LO), 1 + HI)


def _reference(loss_type: str, kl_coef: float) -> tuple[float, list[list[float]]]:
    """The step loss and its gradient wrt each token's log-prob, written out token by token."""
    T = sum(len(r) for r in RATIOS)  # 6 loss tokens
    M = len(RATIOS)  # 3 sequences
    loss, grads = 0.0, []
    for i, ratios in enumerate(RATIOS):
        A, n = ADVANTAGES[i], len(ratios)
        weight = {  # each token's share of the step: the normaliser
            "dapo": 1 / T, "cispo": 1 / T, "grpo": 1 / (M * n), "gspo": 1 / (M * n),
            "dr_grpo": 1 / (M * MAX_NEW_TOKENS),
        }[loss_type]  # fmt: skip
        seq_ratio = math.exp(sum(math.log(r) for r in ratios) / n)  # gspo's s_i
        row = []
        for t, r in enumerate(ratios):
            w = min(RAW_WEIGHTS[i][t], CAP)
            logp = math.log(OLD_PROBS[i][t]) + math.log(r)
            if loss_type == "cispo":  # -w sg(clip(r)) A log pi: the gradient is never dropped
                token, grad = -w * _clip(r) * A * logp, -w * _clip(r) * A
            else:
                x = seq_ratio if loss_type == "gspo" else r  # d x / d logp = x (GSPO-token)
                clipped = (x > 1 + HI and A > 0) or (x < 1 - LO and A < 0)
                token = -w * min(x * A, _clip(x) * A)
                grad = 0.0 if clipped else -w * A * x
            d = DELTAS[i][t]
            token += kl_coef * (math.exp(d) - d - 1)
            grad += kl_coef * (1 - math.exp(d))
            loss += weight * token
            row.append(weight * grad)
        grads.append(row)
    return loss, grads


def _weighted_loss(s, loss_type: str, kl_coef: float):
    logprobs, old, sampler, ref, mask = _tensors()
    cfg = s.Config(loss_type=loss_type, max_new_tokens=MAX_NEW_TOKENS)
    sequence_ids = torch.arange(3)[:, None].expand(mask.shape)
    T, M = int(mask.sum()), 3
    weights = s.loss_weights(mask, sequence_ids, 3, cfg, T, M)
    loss, sums = s.grpo_loss(
        logprobs, old, sampler, torch.tensor(ADVANTAGES), mask, LO, HI, CAP, ref, kl_coef,
        loss_type, weights, sequence_ids,
    )  # fmt: skip
    loss.backward()
    return loss, sums, logprobs.grad, mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_equals_its_closed_form(grpo_script, loss_type):
    """Value and gradient of every loss type, normaliser included, against the token-by-token
    formula; one completion has a single token, and clipping is hit on both sides."""
    loss, sums, grad, mask = _weighted_loss(grpo_script, loss_type, KL_COEF)
    want, want_grads = _reference(loss_type, KL_COEF)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    for i, row in enumerate(want_grads):
        assert grad[i, : len(row)].tolist() == pytest.approx(row, rel=1e-5, abs=1e-7), (i, row)
    assert grad[~mask].abs().max() == 0  # padding gets nothing
    clipped = {  # tokens: 1.5 with A > 0 and 0.5 with A < 0; gspo: sequence 1 (s = 0.5, A < 0);
        # cispo: every ratio outside [0.8, 1.28] (1.5, 0.5, 0.7)
        "grpo": 2, "dapo": 2, "dr_grpo": 2, "gspo": 1, "cispo": 3,
    }[loss_type]  # fmt: skip
    assert sums["clip_ratio/region_mean"].item() == clipped
    low = {"grpo": 1, "dapo": 1, "dr_grpo": 1, "gspo": clipped, "cispo": 2}[
        loss_type
    ]  # 0.5 (and 0.7)
    assert sums["clip_ratio/low_mean"].item() == low
    assert sums["clip_ratio/high_mean"].item() == clipped - low
    kl = sum(math.exp(d) - d - 1 for row in DELTAS for d in row)
    assert sums["kl"].item() == pytest.approx(kl, rel=1e-5)
    assert sums["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(
        2.0 + 0.5 + 1.0 + 1.0 + 1.0 + 1.5
    )


def test_gspo_token_form_equals_the_sequence_form(grpo_script):
    """GSPO-token (the gradient through each token) has the value of the sequence-level objective
    -1/M sum_i min(s_i A_i, clip(s_i) A_i) and its gradient d/d logp_t = s_i A_i / (M |o_i|)."""
    s = grpo_script
    logprobs, old, sampler, _, mask = _tensors()
    cfg = s.Config(loss_type="gspo", max_new_tokens=MAX_NEW_TOKENS)
    sequence_ids = torch.arange(3)[:, None].expand(mask.shape)
    weights = s.loss_weights(mask, sequence_ids, 3, cfg, 6, 3)
    loss, _ = s.grpo_loss(
        logprobs, old, old, torch.tensor(ADVANTAGES), mask, LO, HI, 0.0, None, 0.0, "gspo", weights
    )  # sampler = old and is_cap 0: w = 1; sequence_ids None: rows are sequences
    loss.backward()
    want, M = 0.0, 3
    for i, ratios in enumerate(RATIOS):
        A = ADVANTAGES[i]
        s_i = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        want += -min(s_i * A, _clip(s_i) * A) / M
        clipped = (s_i > 1 + HI and A > 0) or (s_i < 1 - LO and A < 0)
        for t in range(len(ratios)):
            g = 0.0 if clipped else -s_i * A / (M * len(ratios))
            assert logprobs.grad[i, t].item() == pytest.approx(g, rel=1e-5, abs=1e-8)
    assert loss.item() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_equal_group_has_no_policy_gradient(grpo_script, loss_type):
    """An all-equal group's advantages are exactly 0, so its loss and gradient are 0 (no KL)."""
    advantages, frac_zero = group_advantages(torch.full((3,), 0.7), 3)
    assert advantages.tolist() == [0.0] * 3 and frac_zero == 1.0
    logprobs, old, sampler, _, mask = _tensors()
    s = grpo_script
    weights = s.loss_weights(
        mask, torch.arange(3)[:, None].expand(mask.shape), 3, s.Config(loss_type=loss_type), 6, 3
    )
    loss, _ = s.grpo_loss(
        logprobs, old, sampler, advantages, mask, LO, HI, CAP, loss_type=loss_type, weights=weights
    )
    loss.backward()
    assert loss.item() == 0.0 and logprobs.grad.abs().max() == 0


def test_one_token_completions_make_grpo_and_dapo_agree(grpo_script):
    """With every completion one token long, the per-sequence mean is the token itself and
    T = M: grpo's and dapo's normalisers coincide (and dr_grpo's is L times smaller)."""
    s = grpo_script
    values = {}
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        logprobs = torch.tensor([[-1.0, 0.0], [-2.0, 0.0], [-0.5, 0.0]], requires_grad=True)
        mask = torch.tensor([[True, False]] * 3)
        cfg = s.Config(loss_type=loss_type, max_new_tokens=MAX_NEW_TOKENS)
        weights = s.loss_weights(mask, torch.arange(3)[:, None].expand(mask.shape), 3, cfg, 3, 3)
        loss, _ = s.grpo_loss(
            logprobs, logprobs.detach() + 0.1, logprobs.detach() + 0.1, torch.tensor([1.0, -1.0, 0.5]),
            mask, LO, HI, CAP, loss_type=loss_type, weights=weights,
        )  # fmt: skip
        values[loss_type] = loss.item()
    # ratio exp(-0.1) in [0.8, 1.28]: -1/3 sum_i exp(-0.1) A_i
    want = -math.exp(-0.1) * (1.0 - 1.0 + 0.5) / 3
    assert values["grpo"] == pytest.approx(want) and values["dapo"] == pytest.approx(want)
    assert values["dr_grpo"] == pytest.approx(want / MAX_NEW_TOKENS)


def test_advantage_options_equal_closed_forms(grpo_script):
    """scale_rewards (group std on/off) and the leave-one-out baseline, in the runtime and as the
    script's Config selects them (rollout_metrics)."""
    rewards = [1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 2.0, 2.0]  # G = 4: one varied group, one all equal
    g = rewards[:4]
    mean = sum(g) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in g) / 3)  # unbiased
    loo = [r - (sum(g) - r) / 3 for r in g]  # r_i - mean of the other 3
    want = {
        (True, "group_mean"): [(r - mean) / (std + 1e-4) for r in g],
        (False, "group_mean"): [r - mean for r in g],
        (False, "rloo"): loo,
        (True, "rloo"): [a / (std + 1e-4) for a in loo],
    }
    assert loo == pytest.approx([4 / 3 * (r - mean) for r in g])  # G / (G - 1) (r - mean)
    s = grpo_script
    groups = [
        [Rollout([1], [2], [0.0], r, {}, 0, k) for r in rewards[4 * k : 4 * k + 4]]
        for k in range(2)
    ]
    for (scale, baseline), values in want.items():
        adv, frac_zero = group_advantages(torch.tensor(rewards), 4, scale=scale, baseline=baseline)
        assert adv[:4].tolist() == pytest.approx(values, rel=1e-5)
        assert adv[4:].tolist() == [0.0] * 4 and frac_zero == 0.5
        cfg = s.Config(num_generations=4, scale_rewards=scale, advantage_baseline=baseline)
        script_adv, metrics = s.rollout_metrics(groups, cfg, version=0)
        assert torch.equal(script_adv, adv) and metrics["frac_reward_zero_std"] == 0.5
    with pytest.raises(ValueError, match="baseline='loo'"):
        group_advantages(torch.tensor(rewards), 4, baseline="loo")


def test_overlong_shape_penalty_and_metrics(grpo_script):
    """DAPO eq. 13 with L_max = 8, L_cache = 4: 0 up to 4 tokens, then -(len - 4) / 4; the
    advantages see the shaped reward, `reward` stays the reward functions'."""
    s = grpo_script
    cfg = s.Config(max_new_tokens=8, overlong="shape", overlong_buffer=4, num_generations=4)
    assert [s.overlong_penalty(n, cfg) for n in (1, 4, 5, 6, 8, 9)] == [
        0.0, 0.0, -0.25, -0.5, -1.0, -1.0,
    ]  # fmt: skip
    lengths = [2, 5, 8, 3]  # the same task reward 1: only the penalty differs
    group = [Rollout([1], [2] * n, [0.0] * n, 1.0, {}, 0, 0, truncated=n == 8) for n in lengths]
    adv, metrics = s.rollout_metrics([group], cfg, version=0)
    shaped = [1.0, 0.75, 0.0, 1.0]
    want, _ = group_advantages(torch.tensor(shaped), 4)
    assert torch.equal(adv, want) and metrics["reward"] == 1.0
    assert metrics["rewards/overlong_penalty/mean"] == pytest.approx(-1.25 / 4)
    assert metrics["completions/clipped_ratio"] == 0.25
    assert s.rewards_differ(group, cfg) and not s.rewards_differ(group, s.Config())


def test_validate_names_each_bad_option(grpo_script):
    """Each bad value gets one line naming the option and what is expected."""
    s = grpo_script
    cases = [
        (dict(loss_type="ppo"), "loss_type='ppo': choose one of ('dapo', 'grpo', 'dr_grpo', 'gspo', 'cispo')"),
        (dict(loss_type="dr_grpo"), "loss_type='dr_grpo' with scale_rewards=True: Dr. GRPO does not divide"),
        (dict(advantage_baseline="mean"), "advantage_baseline='mean': choose one of ('group_mean', 'rloo')"),
        (dict(num_generations=1), "num_generations=1: GRPO's advantage is a completion's reward relative to the other"),
        (dict(dynamic_sampling=True, num_generations=1), "so a group of one has advantage 0 and trains nothing"),
        (dict(advantage_baseline="rloo", num_generations=1), "(use num_generations >= 2)"),
        (dict(dynamic_sampling=True, max_refill_rounds=-1), "max_refill_rounds=-1: must be >= 0"),
        (dict(overlong="cut"), "overlong='cut': choose one of ('none', 'mask', 'shape')"),
        (dict(overlong="shape", overlong_buffer=0), "overlong_buffer=0 with overlong='shape': must be in [1, max_new_tokens=64]"),
    ]  # fmt: skip
    for fields, message in cases:
        with pytest.raises(s.ConfigError) as e:
            s.validate(s.Config(device="cpu", **fields))
        assert message in str(e.value) and str(e.value).count(";") == 0, str(e.value)
    s.validate(s.Config(device="cpu", loss_type="dr_grpo", scale_rewards=False))
    s.validate(s.Config(device="cpu", dynamic_sampling=True, overlong="mask"))


# --- on the tiny model: micro-batching and masking --------------------------------------------
def _rollouts() -> list[Rollout]:
    """8 rollouts of 2 groups, completions of 1 to 6 tokens, the 6-token ones truncated."""
    lengths = [3, 1, 6, 2, 6, 4, 1, 5]
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]
    return [
        Rollout(
            [1, 2, 3 + i],
            [10 + (7 * i + 3 * t) % 40 for t in range(n)],
            [-3.5 + 0.1 * t for t in range(n)],
            r,
            {},
            0,
            i // 4,
            truncated=n == 6,
        )  # fmt: skip
        for i, (n, r) in enumerate(zip(lengths, rewards, strict=True))
    ]


@pytest.fixture(scope="module")
def tiny_policy(grpo_script, even_model_dir):
    """The script's policy on the tiny model: a 1-process fp32 run is not FSDP-wrapped, so it
    outlives the process group it was built in (removed here: later tests start their own)."""
    s = grpo_script
    cfg = s.Config(dtype="fp32", device="cpu", max_prompt_len=8, max_new_tokens=6)
    _, mesh = s.setup_distributed(cfg)
    model = s.setup_model(cfg, even_model_dir, mesh, torch.device("cpu"))
    s.destroy_distributed()
    return model


def _grads(s, model, cfg, rollouts, advantages, splits, totals) -> tuple[float, dict]:
    """The step's loss and summed gradients over micro-batches of the given sizes."""
    model.zero_grad(set_to_none=True)
    total, start = 0.0, 0
    for size in splits:
        mb = rollouts[start : start + size]
        loss, _ = s.microbatch_loss(
            model, None, mb, advantages[start : start + size], cfg, torch.device("cpu"), *totals
        )
        loss.backward()
        total, start = total + loss.item(), start + size
    return total, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize(
    "loss_type, overlong",
    [(t, "none") for t in LOSS_TYPES] + [("grpo", "mask"), ("dapo", "mask")],
)
def test_gradient_does_not_depend_on_the_micro_batching(
    grpo_script, tiny_policy, loss_type, overlong
):
    """One micro-batch of 8 == 2 of 4 == 3 + 5, loss and every gradient within 1e-6: the
    normalisers count the whole step, each micro-batch adds its share."""
    s = grpo_script
    cfg = s.Config(
        dtype="fp32", device="cpu", loss_type=loss_type, overlong=overlong, max_new_tokens=6,
        scale_rewards=loss_type != "dr_grpo",
    )  # fmt: skip
    rollouts = _rollouts()
    advantages, _ = group_advantages(torch.tensor([r.reward for r in rollouts]), 4)
    totals = s.step_totals([rollouts[:4], rollouts[4:]], cfg)
    assert totals == ((28 - 12, 8) if overlong == "mask" else (28, 8))
    one_loss, one = _grads(s, tiny_policy, cfg, rollouts, advantages, [8], totals)
    assert max(g.abs().max().item() for g in one.values()) > 1e-4
    for splits in ([4, 4], [3, 5]):
        loss, grads = _grads(s, tiny_policy, cfg, rollouts, advantages, splits, totals)
        assert loss == pytest.approx(one_loss, abs=1e-6)
        for k, g in grads.items():
            torch.testing.assert_close(g, one[k], atol=1e-6, rtol=0, msg=k)


def test_truncated_completions_contribute_nothing_under_mask(grpo_script, tiny_policy):
    """overlong="mask": the batch's gradient equals that of the batch without its truncated
    completions (same counts); with every completion truncated the loss and gradient are 0,
    finite, and the step's token count is 1 (no division by 0)."""
    s = grpo_script
    for loss_type in LOSS_TYPES:
        cfg = s.Config(
            dtype="fp32", device="cpu", loss_type=loss_type, overlong="mask", max_new_tokens=6,
            scale_rewards=loss_type != "dr_grpo",
        )  # fmt: skip
        rollouts = _rollouts()
        advantages = torch.linspace(-1, 1, 8)
        totals = s.step_totals([rollouts], cfg)
        _, masked = _grads(s, tiny_policy, cfg, rollouts, advantages, [8], totals)
        keep = [i for i, r in enumerate(rollouts) if not r.truncated]
        _, without = _grads(
            s, tiny_policy, cfg, [rollouts[i] for i in keep], advantages[keep], [len(keep)], totals
        )
        for k, g in masked.items():
            torch.testing.assert_close(g, without[k], atol=1e-7, rtol=0, msg=(loss_type, k))
        everything = [Rollout(r.prompt_ids, r.completion_ids, r.sampler_logprobs, r.reward, {}, 0, 0, truncated=True) for r in rollouts]  # fmt: skip
        totals = s.step_totals([everything], cfg)
        assert totals == (1, 8)
        loss, grads = _grads(s, tiny_policy, cfg, everything, advantages, [8], totals)
        assert loss == 0.0 and all(g.abs().max() == 0 for g in grads.values()), loss_type


def test_packed_rows_give_the_unpacked_gradient(grpo_script, even_model_dir, tmp_path):
    """`--tricks packing` (several rollouts per row): every loss type's sequence-level parts
    (gspo's ratio, grpo's |o_i|, overlong="mask") find each rollout's tokens by sequence_ids, so
    the loss and gradients equal the unpacked script's (1e-6)."""
    from generator.render import render
    from generator.spec import Spec

    (tmp_path / "train.py").write_text(render(Spec(algo="grpo", tricks=("packing",), out="o")))
    packed = import_script(tmp_path / "train.py", "grpo_losses_packed_train")
    rollouts = _rollouts()
    advantages = torch.linspace(-1, 1, 8)
    for loss_type, overlong in [(t, "none") for t in LOSS_TYPES] + [("gspo", "mask")]:
        results = []
        for s in (grpo_script, packed):
            cfg = s.Config(
                dtype="fp32", device="cpu", loss_type=loss_type, overlong=overlong,
                max_prompt_len=8, max_new_tokens=6, scale_rewards=loss_type != "dr_grpo",
            )  # fmt: skip
            _, mesh = s.setup_distributed(cfg)
            model = s.setup_model(cfg, even_model_dir, mesh, torch.device("cpu"))
            s.destroy_distributed()
            totals = s.step_totals([rollouts], cfg)
            results.append(_grads(s, model, cfg, rollouts, advantages, [8], totals))
        (loss, grads), (packed_loss, packed_grads) = results
        assert packed_loss == pytest.approx(loss, abs=1e-6), loss_type
        for k, g in grads.items():
            torch.testing.assert_close(packed_grads[k], g, atol=1e-6, rtol=0, msg=(loss_type, k))


# --- on a local Ray: dynamic sampling and learning ---------------------------------------------
def _constant_reward(completion_ids, **kwargs) -> float:
    return 1.0


def test_dynamic_sampling_drops_and_counts_zero_variance_groups(
    grpo_script, ray_session, even_model_dir, chain_sum_64, tmp_path
):
    """A constant reward makes every group zero-variance: each step refills max_refill_rounds
    times, drops what it cannot use and fills the step with dropped groups (advantage 0)."""
    history = grpo_script.main(
        [
            "--model", str(even_model_dir), "--dataset", str(chain_sum_64), "--out_dir", str(tmp_path),
            "--dtype", "fp32", "--num_generations", "2", "--prompts_per_step", "2", "--max_new_tokens", "2",
            "--reward_weights", "1.0", "--save_final_model", "false", "--resume", "none", "--rollout", "sync",
            "--max_steps", "2", "--dynamic_sampling", "true", "--max_refill_rounds", "2",
        ],
        reward_funcs=[_constant_reward],
    )  # fmt: skip
    for m in history:
        # 1 batch + 2 refills of 2 groups: 6 rejected, 2 of them fill the step
        assert (m["num_refills"], m["dropped_groups"], m["frac_reward_zero_std"]) == (2, 4, 1.0)
        assert m["grad_norm"] == 0.0 and m["loss"] == 0.0
    assert history[1]["dropped_stale"] == 0  # sync: nothing of step 1's batches was left over


@pytest.mark.parametrize(
    "loss_type",
    [
        "grpo",
        "dr_grpo",
        # at one optimizer step per batch the ratio is 1 in value, so gspo's gradient is grpo's
        # and cispo's is dapo's (measured: identical reward curves): the slow tier only
        pytest.param("gspo", marks=pytest.mark.slow),
        pytest.param("cispo", marks=pytest.mark.slow),
    ],
)
def test_each_loss_type_raises_mean_reward(
    grpo_script, ray_session, even_model_dir, chain_sum_64, tmp_path, loss_type
):
    """12 sync steps of each loss type on the even-token reward raise the mean reward (dapo, the
    default, is tests/recipes/test_grpo.py's short run). Each run's cost is mostly its engine's
    start."""
    history = run_grpo(
        grpo_script, even_model_dir, chain_sum_64, tmp_path, "--rollout", "sync", "--max_steps",
        "12", "--loss_type", loss_type, "--scale_rewards", str(loss_type != "dr_grpo").lower(),
    )  # fmt: skip
    rewards = [m["reward"] for m in history]
    assert all(math.isfinite(m["loss"]) for m in history)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards


@pytest.mark.fast
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"overlong": "mask", "overlong_buffer": 8},
            "overlong_buffer=8 applies to overlong='shape' only",
        ),
        ({"max_refill_rounds": 3}, "max_refill_rounds=3 applies to dynamic_sampling only"),
        (
            {"rollout": "async", "max_staleness": 3},
            r"max_staleness=3 applies to rollout='off-policy' only \(rollout='async' trains samples at most 1",
        ),
    ],
)
def test_options_that_act_only_with_another_are_refused(grpo_script, overrides, message):
    """An option that only acts with another one is refused in one line rather than ignored."""
    cfg = grpo_script.Config(engine="runtime", **overrides)
    with pytest.raises(grpo_script.ConfigError, match=message):
        grpo_script.validate(cfg)
