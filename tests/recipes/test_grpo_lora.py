"""The emitted LoRA GRPO script (examples/grpo_lora_smollm2): a step trains the adapters only (the
base stays bit-identical), the engines receive the merged policy (their log-probs equal the
trainer's), the KL reference is the base with the adapters off, the saved adapter loads in peft and
the merged save is what the engines got, a sync run resumed from a checkpoint replays the
uninterrupted one, and a short run raises the mean reward of an easily learnable reward. Also the
generator side of `--algo grpo-lora` (render, DoRA, refused combinations)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from generator.render import render
from generator.spec import Spec, SpecError
from runtime import (
    HFWeightSource,
    Rollout,
    RuntimeEngine,
    Tokenizer,
    gather_merged_hf_state_dict,
    start_rollout,
    sync_weights,
)
from runtime.grpo import collate_rollouts, completion_logprobs
from runtime.lora import is_adapter_param
from tests.helpers import SMALL_VOCAB, even_token_reward, import_script, run_grpo, spawn

REPO = Path(__file__).resolve().parents[2]
# fixed sequences the trainer and the engine both score: (prompt ids, completion ids)
SEQUENCES = [([1, 2, 3, 4, 5], [10, 11, 12, 13]), ([6, 7, 8], [20, 21, 22, 23, 24, 25])]


@pytest.fixture(scope="module")
def grpo_lora_script():
    path = REPO / "examples" / "grpo_lora_smollm2" / "train.py"
    return import_script(path, "grpo_lora_smollm2_train")


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _groups(cfg, version: int = 0) -> list[list[Rollout]]:
    """2 groups of num_generations fixed completions: even-indexed ones all even token ids
    (reward 1), odd-indexed ones all odd (reward 0), so every group has a learning signal."""
    g = torch.Generator().manual_seed(0)
    groups = []
    for i, prompt in enumerate([[1, 2, 3, 4, 5], [6, 7, 8]]):
        group = []
        for j in range(cfg.num_generations):
            drawn = torch.randint(2, SMALL_VOCAB - 2, (3 + j,), generator=g).tolist()
            ids = [t - t % 2 + j % 2 for t in drawn]  # parity of j
            r = even_token_reward(ids)
            group.append(Rollout(prompt, ids, [0.0] * len(ids), r, {"even": r}, version, i))
        groups.append(group)
    return groups


def _train(script, model_dir: Path, steps: int = 3, **overrides):
    """The script's policy and optimizer (FSDP2, 1 process) after `steps` train_steps on the fixed
    groups at a large lr (the adapters move visibly). Returns (cfg, model, base weights before
    training by name, per-step metrics, the groups)."""
    settings = dict(
        model=str(model_dir), dtype="fp32", device="cpu", lr=5e-2, warmup_steps=0,
        num_generations=4, prompts_per_step=2, micro_batch_size=4, is_cap=0.0, reward_weights=[1.0],
    )  # fmt: skip
    cfg = script.Config(**{**settings, **overrides})
    script.validate(cfg, [even_token_reward])
    _, mesh = script.setup_distributed(cfg)  # a 1-process group, removed after the test
    model = script.setup_model(cfg, model_dir, mesh, torch.device("cpu"))
    optimizer, scheduler = script.build_optimizer(cfg, model)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for n, p in model.named_parameters() if is_adapter_param(n)}
    assert optimized == adapters == {id(p) for p in model.parameters() if p.requires_grad}
    base = {n: _full(p) for n, p in model.named_parameters() if not is_adapter_param(n)}
    groups, history = _groups(cfg), []
    rollouts = [r for g in groups for r in g]
    num_tokens = sum(len(r.completion_ids) for r in rollouts)
    for step in range(steps):
        advantages, _ = script.rollout_metrics(groups, cfg, step)
        history.append(
            script.train_step(
                model, None, optimizer, scheduler, rollouts, advantages, num_tokens, 2, cfg, "cpu"
            )
        )
    return cfg, model, base, history, groups


def _trainer_logprobs(model) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for prompt, completion in SEQUENCES:
            batch = collate_rollouts([prompt], [completion], pad_token_id=0)
            logps = completion_logprobs(model, batch["input_ids"], batch["labels"])[0]
            out.append(logps[len(prompt) - 1 : len(prompt) - 1 + len(completion)])
    return out


def _engine_logprobs(score) -> list[torch.Tensor]:
    got = score([p + c for p, c in SEQUENCES], [len(p) for p, _ in SEQUENCES])
    return [torch.tensor(x) for x in got]


def test_step_trains_only_adapters_and_the_kl_reference_is_the_base(
    grpo_lora_script, even_model_dir
):
    s = grpo_lora_script
    cfg, model, base, history, groups = _train(s, even_model_dir, kl_coef=0.1)
    for name, param in model.named_parameters():
        if not is_adapter_param(name):
            assert torch.equal(_full(param), base[name]), name  # bit-identical
    lora_b = [_full(p) for n, p in model.named_parameters() if n.endswith("lora_B.weight")]
    assert len(lora_b) == 2 * 7 and min(b.abs().max().item() for b in lora_b) > 1e-3
    # step 1: B = 0, so policy == reference exactly; then the adapters move away from the base
    assert history[0]["kl"] == 0.0 and history[-1]["kl"] > 1e-4, [m["kl"] for m in history]
    # the script's reference (adapters off) is the checkpoint loaded on its own: its k3 KL
    # equals the one computed from a separately loaded base model's log-probs
    mb = groups[0]
    advantages, _ = s.rollout_metrics(groups, cfg, 3)
    with torch.no_grad():
        totals = s.step_totals([mb], cfg)  # the loss's counts (only the KL sum is read here)
        _, sums = s.microbatch_loss(model, None, mb, advantages[:4], cfg, "cpu", *totals)
        batch = collate_rollouts([r.prompt_ids for r in mb], [r.completion_ids for r in mb], 0)
        policy = completion_logprobs(model, batch["input_ids"], batch["labels"])
    engine = RuntimeEngine(str(even_model_dir), "float32")
    ref = engine.score(
        [r.prompt_ids + r.completion_ids for r in mb], [len(mb[0].prompt_ids)] * len(mb)
    )
    want = 0.0
    for i, r in enumerate(mb):
        start = len(r.prompt_ids) - 1
        for t, ref_logp in enumerate(ref[i]):
            delta = ref_logp - policy[i, start + t].item()
            want += math.exp(delta) - delta - 1
    assert want > 1e-3 and sums["kl"].item() == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_engines_get_the_merged_policy_and_the_saves_agree(
    grpo_lora_script, ray_session, even_model_dir, tmp_path
):
    """After 3 steps the pushed merged weights make the engine score fixed sequences exactly as
    the trainer does (and not as the base does); the PEFT adapter loads in peft with our logits;
    the merged save holds exactly the tensors the engines were sent."""
    s, ray = grpo_lora_script, ray_session
    cfg, model, _, _, _ = _train(s, even_model_dir)
    tokenizer = Tokenizer.from_dir(even_model_dir)
    pipeline = start_rollout(cfg, even_model_dir, tokenizer, [even_token_reward])
    engine = pipeline.engines[0]
    try:
        before = _engine_logprobs(lambda *a: ray.get(engine.score.remote(*a)))  # the base
        sync_weights(pipeline, model, cfg, version=3, merged=True)  # as the script's main
        pipeline.wait_weight_sync()
        after = _engine_logprobs(lambda *a: ray.get(engine.score.remote(*a)))
        assert ray.get(engine.policy_version.remote()) == 3
    finally:
        pipeline.shutdown()
    trainer = _trainer_logprobs(model)
    for got, want, old in zip(after, trainer, before, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert (want - old).abs().max() > 1e-2  # the step changed the policy
    # save: PEFT layout (adapter_config.json + adapter_model.safetensors) and the merged model
    s.save(
        model,
        tokenizer,
        even_model_dir,
        cfg,
        dataclasses.asdict(cfg),
        tmp_path / "model",
        is_main=True,
    )
    config = json.loads((tmp_path / "model" / "adapter_config.json").read_text())
    assert config["r"] == cfg.lora_rank and config["target_modules"] == sorted(
        cfg.lora_target_modules
    )
    merged = load_file(tmp_path / "model" / "merged" / "model.safetensors")
    sent = gather_merged_hf_state_dict(model, torch.float32)
    assert merged.keys() == sent.keys() and not any(is_adapter_param(k) for k in sent)
    assert all(torch.equal(merged[k], sent[k]) for k in sent)
    # an engine started from the merged save scores as the trainer (the save is loadable as is)
    merged_engine = RuntimeEngine(str(tmp_path / "model" / "merged"), "float32")
    for got, want in zip(_engine_logprobs(merged_engine.score), trainer, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    ids = torch.tensor([SEQUENCES[0][0] + SEQUENCES[0][1]])
    with torch.no_grad():
        ours = model(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(even_model_dir)
        peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "model").eval()
        torch.testing.assert_close(peft_model(ids).logits, ours, atol=1e-5, rtol=1e-5)


def _merged_state(rank, world_size, model_dir: str, dp_replicate: int = 1) -> dict:
    """The grpo-lora script's DoRA policy on `world_size` FSDP2 ranks with fixed nonzero adapters
    (the same full values on every rank, each keeping its shard), gathered merged as
    sync_weights does (every rank takes part, only rank 0 keeps the tensors), and as the
    collective transfer's source yields them on rank 0 (every rank iterates it). dp_replicate > 1:
    HSDP, the shards of a 2-D mesh."""
    from runtime.dtensors import copy_into as _copy_into

    path = REPO / "examples" / "grpo_lora_smollm2" / "train.py"
    s = import_script(path, "grpo_lora_smollm2_dist")
    cfg = s.Config(
        model=model_dir, dtype="fp32", device="cpu", use_dora=True, dp_replicate=dp_replicate
    )
    _, mesh = s.setup_distributed(cfg)
    model = s.setup_model(cfg, Path(model_dir), mesh, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_param(name):
                noise = 0.05 * torch.randn(param.shape, generator=g)
                _copy_into(param, _full(param) + noise)
    gathered = gather_merged_hf_state_dict(model, torch.float32, keep=rank == 0)
    source = HFWeightSource(model, torch.float32, torch.device("cpu"), merged=True)
    sourced = {name: t.clone() for name, t in source}
    return gathered, sourced if rank == 0 else {}


@pytest.mark.parametrize(("world_size", "dp_replicate"), [(2, 1), (4, 2)], ids=["fsdp2", "hsdp2x2"])
def test_merged_gather_on_several_ranks_equals_one(even_model_dir, world_size, dp_replicate):
    """The weight-sync gather is a collective over FSDP2 shards (DoRA magnitudes sharded too):
    rank 0 of 2 (FSDP) or of 4 (HSDP 2 x 2) gets the 1-process merged tensors, the others keep
    nothing. The collective transfer's HFWeightSource yields the same tensors on rank 0, plus the
    tied head."""
    one, one_sourced = _merged_state(0, 1, str(even_model_dir))  # in this process: 1 process
    args = (str(even_model_dir), dp_replicate)
    (two, two_sourced), *others = spawn(_merged_state, world_size=world_size, args=args)
    assert others == [({}, {})] * (world_size - 1) and two.keys() == one.keys()
    assert "model.layers.0.self_attn.q_proj.weight" in one and not any("lora" in k for k in one)
    for key, tensor in one.items():  # measured equal; 1e-5 leaves room for fp32 reduction order
        torch.testing.assert_close(two[key], tensor, atol=1e-5, rtol=1e-5)
    assert two_sourced.keys() == one_sourced.keys() == one.keys() | {"lm_head.weight"}
    for key, tensor in one_sourced.items():
        torch.testing.assert_close(two_sourced[key], tensor, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(one.get(key, one["model.embed_tokens.weight"]), tensor)


def test_sync_resume_replays_the_uninterrupted_run(
    grpo_lora_script, ray_session, even_model_dir, chain_sum_64, tmp_path
):
    """4 sync steps straight == 2 steps, stop, resume to 4: the checkpoint holds the adapters and
    their optimizer state, the resumed run pushes the restored merged policy before sampling, and
    the rollouts, losses and final adapters equal the uninterrupted run's, bit for bit."""
    s = grpo_lora_script
    common = ("--rollout", "sync", "--save_every_steps", "2", "--resume", "auto",
              "--save_final_model", "true", "--save_merged", "false")  # fmt: skip

    def run(out: str, steps: int) -> list[dict]:
        return run_grpo(
            s, even_model_dir, chain_sum_64, tmp_path / out, *common, "--max_steps", str(steps)
        )

    straight, first, resumed = run("a", 4), run("b", 2), run("b", 4)
    assert len(first) == len(resumed) == 2
    keys = ("reward", "loss", "grad_norm", "completions/mean_length")
    for a, b in zip(straight, first + resumed, strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys]
    assert straight[2]["loss"] != straight[0]["loss"]  # the policy and its samples did change
    wa = load_file(tmp_path / "a" / "model" / "adapter_model.safetensors")
    wb = load_file(tmp_path / "b" / "model" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_short_run_raises_mean_reward(
    grpo_lora_script, ray_session, even_model_dir, chain_sum_64, tmp_path
):
    """12 async steps of 4 prompts x 4 completions on the tiny reward, lr 1e-2, rank 8: the mean
    reward rises from about 0.55 (the base) toward the ~0.83 the model's final norm allows.
    Measured on seeds 0-4: last 4 steps - first 3 = 0.17 to 0.32."""
    history = run_grpo(
        grpo_lora_script, even_model_dir, chain_sum_64, tmp_path, "--rollout", "async",
        "--max_steps", "12", "--prompts_per_step", "4", "--micro_batch_size", "16",
    )  # fmt: skip
    rewards = [m["reward"] for m in history]
    assert all(math.isfinite(m["loss"]) for m in history)
    assert sum(rewards[-4:]) / 4 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert sum(rewards[-4:]) / 4 > 0.7, rewards


def test_generator_renders_grpo_lora_and_refuses_bad_combinations(tmp_path):
    import torch.distributed as dist

    from generator.cli import cli

    def started() -> tuple[bool, bool]:  # (Ray, a process group)
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized(), dist.is_initialized()

    text = render(Spec(algo="grpo-lora", dataset="chain_sum.jsonl", out="o"))
    assert text.startswith('"""GRPO of LoRA adapters on a frozen smollm2-135m (llama family)')
    for line in (
        "arXiv:2106.09685", "lr: float = 1e-05", "use_dora: bool = False",
        "pipeline, model, cfg, version + 1, source, merged=True",
        "source = weight_source(cfg, model, device, merged=True)",
        "with torch.no_grad(), adapters_disabled(model):", "save_adapter(",
    ):  # fmt: skip
        assert line in text, line
    # no frozen copy (the reference is the policy with its adapters off), no plain-weight sync
    assert "def setup_frozen_model(" not in text and "gather_hf_state_dict(" not in text
    assert text.count("sync_weights(") + 1 == text.count("merged=True")  # every sync, the source
    dora = render(Spec(algo="grpo-lora", peft="dora", tricks=("ac",), out="o"))
    assert dora.startswith('"""GRPO of LoRA adapters (DoRA) on a frozen')
    assert "use_dora: bool = True" in dora and "arXiv:2402.09353" in dora
    assert "checkpoint(layer)" in dora
    for spec, message in [
        (Spec(algo="grpo-lora", peft="ia3", out="o"), "--peft 'ia3'; valid: lora, dora"),
        (Spec(algo="grpo", peft="dora", out="o"), "--algo lora or qlora or dpo-lora or grpo-lora"),
        (Spec(algo="grpo-lora", model="qwen3-0.6b", gpus=4, engine_gpus=0, cp=2, tricks=("packing",), out="o"),
         "--tricks packing with --cp 2 --cp-mode allgather: packed rows need a block-causal"),
    ]:  # fmt: skip
        with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
            render(spec)
    # `scaffold new` picks the GRPO prompts; the emitted script imports with no side effects
    result = CliRunner().invoke(cli, ["new", "--algo", "grpo-lora", "--out", str(tmp_path / "g")])
    assert result.exit_code == 0, result.output
    assert 'dataset: str = "chain_sum.jsonl"' in (tmp_path / "g" / "train.py").read_text()
    before = started()
    import_script(tmp_path / "g" / "train.py", "grpo_lora_rendered")
    assert started() == before  # importing starts no Ray and no process group
