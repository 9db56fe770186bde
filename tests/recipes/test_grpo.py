"""The emitted GRPO script (examples/grpo_smollm2): the loss equals its closed form (clipping on
both sides, k3 KL, truncated importance weight), the reward functions and data checks, and on a
local Ray (2 CPUs) with a tiny random model: sync mode trains only on-policy samples and is
reproducible, async and off-policy never exceed their staleness bound, and a short run raises
the mean reward of an easily learnable reward."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from runtime import (
    Tokenizer,
    resolve_weight_transfer,
    staleness_bound,
    start_rollout,
    sync_weights,
)
from runtime.grpo import collate_rollouts, completion_logprobs
from runtime.rollout import make_reward_workers
from tests.helpers import even_token_reward, import_script, run_grpo, run_math_task

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def grpo_script():
    return import_script(REPO / "examples" / "grpo_smollm2" / "train.py", "grpo_smollm2_train")


def test_import_starts_nothing(grpo_script):
    """Importing the script touches no Ray (and no process group): tests call its functions."""
    import torch.distributed as dist

    ray = sys.modules.get("ray")
    assert (ray is None or not ray.is_initialized()) and not dist.is_initialized()


def test_grpo_loss_equals_closed_form(grpo_script):
    lo, hi, cap = 0.2, 0.28, 2.0
    # two sequences x three tokens; ratios pi / pi_old = 1.5, 0.5, 1.0 per token
    old = torch.log(torch.tensor([[0.2, 0.4, 0.3], [0.2, 0.4, 0.3]]))
    logprobs = (old + torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]]))).requires_grad_()
    sampler = old - torch.log(
        torch.tensor([[3.0, 0.5, 1.0], [1.0, 1.0, 1.0]])
    )  # w = 3 -> 2, 0.5, 1
    ref = logprobs.detach() + torch.tensor([[0.3, -0.2, 0.0], [0.1, 0.0, -0.5]])
    advantages = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    kl_coef = 0.1
    loss, sums = grpo_script.grpo_loss(
        logprobs, old, sampler, advantages, mask, lo, hi, cap, ref_logprobs=ref, kl_coef=kl_coef
    )
    ratios, weights = [1.5, 0.5, 1.0], [[2.0, 0.5, 1.0], [1.0, 1.0, 1.0]]
    deltas = [[0.3, -0.2, 0.0], [0.1, 0.0, -0.5]]
    want, clipped, kl = 0.0, 0, 0.0
    for i, A in enumerate(advantages.tolist()):
        for t, r in enumerate(ratios):
            if not mask[i, t]:
                continue
            surrogate = min(r * A, min(max(r, 1 - lo), 1 + hi) * A)
            k3 = math.exp(deltas[i][t]) - deltas[i][t] - 1
            want += -weights[i][t] * surrogate + kl_coef * k3
            kl += k3
            clipped += (r > 1 + hi and A > 0) or (r < 1 - lo and A < 0)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert sums["clip_ratio/region_mean"].item() == clipped == 2  # 1.5 with A > 0, 0.5 with A < 0
    assert sums["clip_ratio/high_mean"].item() == 1 and sums["clip_ratio/low_mean"].item() == 1
    assert sums["kl"].item() == pytest.approx(kl, rel=1e-5)
    assert sums["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(
        2.0 + 0.5 + 1.0 + 1.0 + 1.0
    )
    # clipped tokens pass no policy gradient, only the KL's
    loss.backward()
    kl_grad = [kl_coef * -(math.exp(d) - 1) for d in (deltas[0][0], deltas[1][1])]
    assert logprobs.grad[0, 0].item() == pytest.approx(kl_grad[0], abs=1e-6)
    assert logprobs.grad[1, 1].item() == pytest.approx(kl_grad[1], abs=1e-6)
    assert logprobs.grad[1, 2].item() == 0.0  # masked
    # is_cap = 0 turns the importance weight off; kl_coef = 0 needs no reference
    loss0, sums0 = grpo_script.grpo_loss(logprobs, old, sampler, advantages, mask, lo, hi, 0.0)
    assert (
        sums0["sampling/importance_sampling_ratio/mean"].item() == mask.sum().item()
        and sums0["kl"].item() == 0.0
    )


def test_reward_functions(grpo_script):
    math_reward, format_reward = grpo_script.math_answer_reward, grpo_script.format_reward
    assert math_reward(completion="4 + 3 = 7", answer="7") == 1.0
    assert math_reward(completion="The answer is -5.", answer="-5") == 1.0
    assert math_reward(completion="7, no wait, 8", answer="7") == 0.0
    assert math_reward(completion="I don't know", answer="7") == 0.0
    assert format_reward(completion=" 7 ") == 1.0 and format_reward(completion="2 - 7 = -5.") == 1.0
    assert format_reward(completion="Let me think.\nIt is 7") == 0.0


def test_bad_rows_name_file_row_and_key(grpo_script, tmp_path, smollm2_dir):
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    cfg = grpo_script.Config()
    for row, key in (
        ({"question": "1 + 1 =", "answer": "two"}, "answer"),
        ({"answer": "2"}, "question"),
    ):
        path = tmp_path / "bad.jsonl"
        path.write_text(
            json.dumps({"question": "2 + 2 =", "answer": 4}) + "\n" + json.dumps(row) + "\n"
        )
        cfg.dataset = str(path)
        with pytest.raises(ValueError, match=rf"bad.jsonl row 1: key '{key}'"):
            grpo_script.load_prompts(cfg, tokenizer)


def test_reward_workers_run_script_functions(grpo_script, ray_session, smollm2_dir):
    """The script's reward functions travel to a Ray actor by value (the script is not importable
    by name there) and score decoded completions."""
    ray, tokenizer = ray_session, Tokenizer.from_dir(smollm2_dir)
    funcs = [grpo_script.math_answer_reward, grpo_script.format_reward]
    (worker,) = make_reward_workers(funcs, [1.0, 0.2], str(smollm2_dir))
    generations = [[(tokenizer.encode("7"), [0.0]), (tokenizer.encode("It is 8\nok"), [0.0])]]
    out = ray.get(worker.score.remote(generations, ["4 + 3 ="], ["7"]))
    assert out["per_func"] == {"math_answer_reward": [1.0, 0.0], "format_reward": [1.0, 0.0]}
    assert out["rewards"] == pytest.approx([1.2, 0.0])
    ray.kill(worker)


def test_rollout_progress_is_printed_before_the_first_step(
    grpo_script, ray_session, even_model_dir, chain_sum_64, tmp_path, capsys
):
    """The first step's wait says what it waits for, on stdout in plain lines: the engine's
    start, then the step's 2 prompts x 4 generations = 8 completions generated and scored, all
    before the step's own log line. The run's metrics.jsonl plots GRPO's panels."""
    import re

    from generator.plot import make_figure, read_metrics

    run_grpo(
        grpo_script, even_model_dir, chain_sum_64, tmp_path, "--rollout", "sync", "--max_steps", "1"
    )
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = [line for line in out.splitlines() if line.startswith(("rollout |", "step "))]
    patterns = [
        r"rollout \| starting 1 engine\(s\)",
        r"rollout \| engine 0 ready \([\d.]+ s\)",
        r"rollout \| step 1: 8/8 completions \([\d.]+ s\)",
        r"rollout \| step 1: scored 8 completions \([\d.]+ s\)",
        r"step +1 \| reward .*",
    ]
    assert len(lines) == len(patterns), lines
    assert all(re.fullmatch(p, line) for p, line in zip(patterns, lines, strict=True)), lines
    fig = make_figure(read_metrics(tmp_path / "metrics.jsonl"))
    assert [ax.get_title().replace("\n", " ") for ax in fig.axes] == [
        "loss", "reward / rewards/even_token_reward/mean", "kl",
        "clip_ratio/region_mean / clip_ratio/low_mean / clip_ratio/high_mean",
        "completions/mean_length / completions/min_length / completions/max_length",
        "dropped_groups / num_refills", "reward_std", "frac_reward_zero_std",
        "completions/clipped_ratio", "sampling/importance_sampling_ratio/mean", "lr",
        "samples_per_s", "grad_norm",
    ]  # fmt: skip


def test_sync_is_on_policy_and_reproducible(
    grpo_script, ray_session, even_model_dir, chain_sum_64, tmp_path
):
    runs = [
        run_grpo(grpo_script, even_model_dir, chain_sum_64, tmp_path / f"run{i}", "--rollout", "sync", "--max_steps", "3")
        for i in range(2)
    ]  # fmt: skip
    for step, metrics in enumerate(runs[0], start=1):
        assert metrics["policy_versions"] == [step - 1] * 8  # every sample from the current policy
    for key in ("reward", "loss", "grad_norm"):
        assert [m[key] for m in runs[0]] == [m[key] for m in runs[1]], key


@pytest.mark.parametrize(
    "rollout, extra, bound",
    [
        ("async", ("--kl_coef", "0.05"), 1),  # also loads and uses the reference model
        # weights pushed every 3rd step only: batches older than 2 versions appear and are dropped
        ("off-policy", ("--max_staleness", "2", "--weight_sync_every_steps", "3"), 2),
    ],
)
def test_staleness_bound(
    grpo_script, ray_session, even_model_dir, chain_sum_64, tmp_path, rollout, extra, bound
):
    history = run_grpo(
        grpo_script,
        even_model_dir,
        chain_sum_64,
        tmp_path,
        "--rollout",
        rollout,
        "--max_steps",
        "5",
        *extra,
    )
    staleness = [
        step - 1 - v for step, m in enumerate(history, start=1) for v in m["policy_versions"]
    ]
    assert max(staleness) <= bound and min(staleness) >= 0
    assert max(staleness) >= 1  # generation really ran ahead of training
    if rollout == "off-policy":  # the 3-step-old batches at step 4 were dropped, not trained on
        assert sum(m["dropped_stale"] for m in history) > 0
    assert all(m["staleness_max"] <= bound for m in history)
    if rollout == "async":  # KL to the reference: 0 at the first step, > 0 once the policy moved
        assert history[0]["kl"] == pytest.approx(0, abs=1e-6) and history[-1]["kl"] > 0


def test_weight_sync_from_fsdp_policy(grpo_script, ray_session, even_model_dir):
    """The script's FSDP2 policy, gathered and pushed as the script does, makes the engine score
    a fixed sequence exactly as the trainer's completion_logprobs do."""
    ray, cfg = ray_session, grpo_script.Config(dtype="fp32", device="cpu")
    _, mesh = grpo_script.setup_distributed(cfg)  # a 1-process group, removed after the test
    model = grpo_script.setup_model(cfg, even_model_dir, mesh, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pipeline = start_rollout(
        cfg, even_model_dir, Tokenizer.from_dir(even_model_dir), [even_token_reward]
    )
    sync_weights(pipeline, model, cfg, version=5)
    pipeline.wait_weight_sync()
    prompt, completion = [1, 2, 3, 4, 5], [10, 11, 12, 13]
    batch = collate_rollouts([prompt], [completion], pad_token_id=0)
    with torch.no_grad():
        want = completion_logprobs(model, batch["input_ids"], batch["labels"])[0, 4:8]
    got = ray.get(pipeline.engines[0].score.remote([prompt + completion], [len(prompt)]))[0]
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)
    assert ray.get(pipeline.engines[0].policy_version.remote()) == 5
    pipeline.shutdown()


def test_importance_weight_is_one_under_top_p_and_top_k(
    grpo_script, ray_session, even_model_dir, chain_sum_64, tmp_path
):
    """Sampler and trainer log-probs follow one convention under truncated sampling: with
    temperature 0.7, top_p 0.9 and top_k 5, completions from the CPU engine (started by the
    script's own pipeline, so the Config reaches the engine) get from the script's
    policy_logprobs an importance weight of 1 within 1e-3 on every token, and a 2-step run at
    lr ~0 logs is_weight 1 within 1e-3 at every step (lr 1e-12: the scripts reject lr 0, and an
    AdamW step that small is below fp32 resolution of these weights, so the policy stays put)."""
    ray = ray_session
    flags = ("--temperature", "0.7", "--top_p", "0.9", "--top_k", "5")
    cfg = grpo_script.Config(dtype="fp32", device="cpu", temperature=0.7, top_p=0.9, top_k=5)
    _, mesh = grpo_script.setup_distributed(cfg)  # a 1-process group, removed after the test
    model = grpo_script.setup_model(cfg, even_model_dir, mesh, torch.device("cpu"))
    pipeline = start_rollout(
        cfg, even_model_dir, Tokenizer.from_dir(even_model_dir), [even_token_reward]
    )
    assert pipeline.sampling["top_k"] == 5 and pipeline.sampling["top_p"] == 0.9
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    sampling = {**pipeline.sampling, "n": 4, "max_new_tokens": 8}
    groups = ray.get(pipeline.engines[0].generate.remote(prompts, seed=0, **sampling))
    pipeline.shutdown()
    rows = [(p, ids, lps) for p, group in zip(prompts, groups, strict=True) for ids, lps in group]
    batch = collate_rollouts([p for p, _, _ in rows], [ids for _, ids, _ in rows], pad_token_id=0)
    with torch.no_grad():
        trainer = grpo_script.policy_logprobs(model, batch["input_ids"], batch["labels"], cfg)
    for i, (p, ids, sampler) in enumerate(rows):
        is_weight = torch.exp(
            trainer[i, len(p) - 1 : len(p) - 1 + len(ids)] - torch.tensor(sampler)
        )
        assert len(ids) > 0 and (is_weight - 1).abs().max() <= 1e-3, (i, is_weight)
    history = run_grpo(
        grpo_script, even_model_dir, chain_sum_64, tmp_path, "--rollout", "sync", "--max_steps",
        "2", "--lr", "1e-12", *flags,
    )  # fmt: skip
    assert [m["sampling/importance_sampling_ratio/mean"] for m in history] == pytest.approx(
        [1.0, 1.0], abs=1e-3
    )


def test_weight_transfer_option_is_checked_alone(grpo_script):
    """A misspelt --weight_transfer gets one error naming the choices, not a second one about
    the collective transfer it did not ask for; 'collective' needs the vLLM engine."""
    s = grpo_script
    with pytest.raises(s.ConfigError) as e:
        s.validate(s.Config(weight_transfer="object_store", device="cpu"))
    message = str(e.value)
    assert (
        "weight_transfer='object_store': choose one of" in message and "needs engine" not in message
    )
    assert resolve_weight_transfer(s.Config(engine="runtime")) == "object-store"
    assert resolve_weight_transfer(s.Config(engine="vllm", device="cpu")) == "collective"
    with pytest.raises(s.ConfigError, match="weight_transfer='collective' needs engine='vllm'"):
        s.validate(s.Config(engine="runtime", weight_transfer="collective", device="cpu"))


def test_bf16_reference_is_stored_in_bf16_with_unchanged_logprobs(
    grpo_script, even_model_dir, monkeypatch
):
    """kl_coef > 0, dtype bf16: the frozen reference (setup_frozen_model) is stored in
    bf16, and its completion log-probs equal those of a reference kept in fp32
    (`cast_frozen_params` disabled): FSDP computes with bf16 weights either way."""
    s = grpo_script
    cfg = s.Config(dtype="bf16", device="cpu", kl_coef=0.05)
    _, mesh = s.setup_distributed(cfg)  # a 1-process group, removed after the test
    batch = collate_rollouts([[1, 2, 3, 4, 5]], [[10, 11, 12, 13]], pad_token_id=0)

    def reference_logprobs():
        reference = s.setup_frozen_model(cfg, even_model_dir, mesh, torch.device("cpu"))
        dtypes = {p.dtype for p in reference.parameters()}  # before a forward leaves some gathered
        with torch.no_grad():
            return dtypes, completion_logprobs(reference, batch["input_ids"], batch["labels"])

    dtypes, got = reference_logprobs()
    with monkeypatch.context() as m:
        m.setattr(s, "cast_frozen_params", lambda model, dtype: 0)
        fp32_dtypes, want = reference_logprobs()
    assert dtypes == {torch.bfloat16} and fp32_dtypes == {torch.float32}
    assert torch.equal(got, want)


def test_short_run_raises_mean_reward(
    grpo_script, ray_session, even_model_dir, chain_sum_64, tmp_path
):
    history = run_grpo(
        grpo_script,
        even_model_dir,
        chain_sum_64,
        tmp_path,
        "--rollout",
        "async",
        "--max_steps",
        "16",
    )
    rewards = [m["reward"] for m in history]
    assert all(math.isfinite(m["loss"]) for m in history)
    assert sum(rewards[-4:]) / 4 > sum(rewards[:3]) / 3 + 0.15, rewards
    assert (tmp_path / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_real_model_format_share_rises_in_four_steps(
    ray_session, smollm2_dir, chain_sum_64, tmp_path
):
    """CI's one real-model GRPO run (each loss type's 16-batch run on the task is the learning
    tier's, test_rl_real_task.py): the emitted script on SmolLM2-135M with its own rewards, the
    first 4 chain_sum prompts x 4 completions every step, lr 1e-4 without warmup. Within 4 steps
    the share of one-line replies ending in an integer (format_reward) rises: measured 0.31,
    0.56, 0.75, 1.00 (mean of the first 2 steps 0.44, of the last 2 0.88), at about 10 s a step
    on one core. The sync round trip is in it: each step samples from the weights of the one
    before."""
    four = tmp_path / "four.jsonl"
    four.write_text("\n".join(chain_sum_64.read_text().splitlines()[:4]) + "\n")
    history = run_math_task(
        "grpo_smollm2", 4, "--prompts_per_step", "4", "--num_generations", "4", "--lr", "1e-4",
        "--warmup_steps", "0", model_dir=smollm2_dir, dataset=four, out_dir=tmp_path / "out",
    )  # fmt: skip
    form = [m["rewards/format_reward/mean"] for m in history]
    assert len(history) == 4 and all(math.isfinite(m["loss"]) for m in history)
    assert history[0]["lr"] == pytest.approx(1e-4)  # the flags on top won
    assert sum(form[-2:]) / 2 > sum(form[:2]) / 2 + 0.2, form


def test_adamw8bit_step_matches_adamw(grpo_script, even_model_dir, tmp_path):
    """`--tricks adamw8bit`: torchao's AdamW8bit is the optimizer class, its moments are 8-bit,
    and one GRPO step on fixed rollouts moves the weights as fp32 AdamW does (Adam's first update
    is lr * m / sqrt(v) = lr * sign(g) up to the moments' quantization)."""
    from torchao.optim import AdamW8bit

    from generator.render import render
    from generator.spec import Spec
    from runtime.grpo import group_advantages
    from runtime.rollout import Rollout

    (tmp_path / "train.py").write_text(render(Spec(algo="grpo", tricks=("adamw8bit",), out="o")))
    script8 = import_script(tmp_path / "train.py", "grpo_adamw8bit_train")
    cfg = grpo_script.Config(
        dtype="fp32", device="cpu", lr=1e-3, warmup_steps=0, micro_batch_size=4
    )
    _, mesh = grpo_script.setup_distributed(cfg)  # a 1-process group, removed after the test
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]
    rollouts = [
        Rollout([1, 2, 3 + i], [10 + i, 20, 30 + 2 * i], [-1.0] * 3, r, {}, 0, i // 4)
        for i, r in enumerate(rewards)
    ]
    advantages, _ = group_advantages(torch.tensor(rewards), 4)
    moved = {}
    for name, script in (("adamw", grpo_script), ("adamw8bit", script8)):
        model = script.setup_model(cfg, even_model_dir, mesh, torch.device("cpu"))
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        optimizer, scheduler = script.build_optimizer(cfg, model)
        metrics = script.train_step(model, None, optimizer, scheduler, rollouts, advantages, 24, 2, cfg, torch.device("cpu"))  # fmt: skip
        assert metrics["grad_norm"] > 0
        moved[name] = {k: (v.detach() - before[k]) for k, v in model.named_parameters()}
        if name == "adamw8bit":
            assert isinstance(optimizer, AdamW8bit)
            exp_avg = optimizer.state[model.model.layers[0].mlp.down_proj.weight]["exp_avg"]
            # a 1-process fp32 run is not FSDP-wrapped (under FSDP2 the state is a DTensor of it)
            local = exp_avg.to_local() if hasattr(exp_avg, "to_local") else exp_avg
            assert type(local).__name__ == "OptimState8bit"
    for k, ref in moved["adamw"].items():
        got = moved["adamw8bit"][k]
        assert ref.abs().max() > 0.5e-3, k  # lr 1e-3: most weights moved by about lr
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=0, msg=k)  # measured 1.2e-7


def test_engines_without_new_weights_fail_instead_of_looping(
    grpo_script, ray_session, even_model_dir, chain_sum_64
):
    """Sync mode trains only samples of the current version; if pushes stop, every batch is too
    old and dropped: a clear error after the batches that could legitimately be stale, not an
    endless loop."""
    cfg = grpo_script.Config(
        model=str(even_model_dir), dataset=str(chain_sum_64), dtype="fp32", device="cpu",
        rollout="sync", num_generations=2, prompts_per_step=2, max_new_tokens=2, reward_weights=[1.0],
    )  # fmt: skip
    tokenizer = Tokenizer.from_dir(even_model_dir)
    pipeline = start_rollout(cfg, even_model_dir, tokenizer, [even_token_reward])
    batches = grpo_script.prompt_batches(grpo_script.load_prompts(cfg, tokenizer), 2, seed=0)
    try:
        with pytest.raises(TimeoutError, match=r"training policy version 3: 8 rollouts in a row"):
            pipeline.next_groups(batches, 2, 3, staleness_bound(cfg), cfg.seed)  # engines at 0
        assert pipeline.buffer.dropped == 8
    finally:
        pipeline.shutdown()


def test_bf16_sr_resume_replays_the_run(ray_session, even_model_dir, chain_sum_64, tmp_path):
    """`--tricks bf16-sr` (bf16 weights rounded stochastically from torch's RNG, seeded per step):
    3 sync steps straight == 2 steps, stop, resume to 3 (checkpoint every step), metric for
    metric; the rounding draws the same bits after a resume."""
    from generator.render import render
    from generator.spec import Spec

    (tmp_path / "train.py").write_text(render(Spec(algo="grpo", tricks=("bf16-sr",), out="o")))
    script = import_script(tmp_path / "train.py", "grpo_bf16_sr_train")
    keys = (
        "reward",
        "loss",
        "grad_norm",
        "clip_ratio/region_mean",
        "sampling/importance_sampling_ratio/mean",
    )

    def run(out: str, steps: int) -> list[dict]:
        return run_grpo(
            script, even_model_dir, chain_sum_64, tmp_path / out, "--dtype", "bf16",
            "--rollout", "sync", "--save_every_steps", "1", "--resume", "auto", "--max_steps", str(steps),
        )  # fmt: skip

    straight, first, resumed = run("a", 3), run("b", 2), run("b", 3)
    assert (len(first), len(resumed)) == (2, 1)
    assert [[m[k] for k in keys] for m in straight] == [
        [m[k] for k in keys] for m in first + resumed
    ]
    assert straight[2]["loss"] != straight[1]["loss"]
