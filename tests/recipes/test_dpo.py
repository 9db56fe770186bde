"""The emitted DPO scripts (examples/dpo_smollm2: all parameters; examples/dpo_lora_smollm2: LoRA):
the loss equals its closed form, the three reference modes give identical reference log-probs on the
same weights, the adapters-off reference stays fixed while the policy trains, and a few LoRA DPO
steps on real preference data (SmolLM2-135M, dpo_en_demo.json) rank the chosen replies higher."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch

from generator.assets import ensure_dataset
from runtime import Tokenizer, precompute_reference_logprobs, reference_logprobs
from tests.helpers import first_short_pairs, import_script

REPO = Path(__file__).resolve().parents[2]
TRL_METRICS = (
    "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
    "logps/chosen", "logps/rejected",
)  # fmt: skip


@pytest.fixture(scope="module")
def dpo_script():
    return import_script(REPO / "examples" / "dpo_smollm2" / "train.py", "dpo_smollm2_train")


@pytest.fixture(scope="module")
def dpo_lora_script():
    return import_script(
        REPO / "examples" / "dpo_lora_smollm2" / "train.py", "dpo_lora_smollm2_train"
    )


@pytest.fixture(scope="module")
def real_short_pairs(tmp_path_factory, smollm2_dir) -> Path:
    """For the real SmolLM2: 4 pairs within 128 tokens of its tokenizer."""
    return first_short_pairs(tmp_path_factory.mktemp("real_pairs"), smollm2_dir, 128)


@pytest.mark.fast
def test_dpo_loss_equals_closed_form(dpo_script):
    pc, pr = torch.tensor([-10.0, -4.0, -7.5]), torch.tensor([-12.0, -3.0, -7.5])
    rc, rr = torch.tensor([-11.0, -5.0, -6.0]), torch.tensor([-11.5, -2.0, -8.0])
    beta = 0.1
    h = [((a - c) - (b - d)) for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True)]  # fmt: skip

    def softplus(x):
        return math.log1p(math.exp(x))

    cases = {
        ("sigmoid", 0.0): [softplus(-beta * x) for x in h],  # -log sigmoid(beta h)
        ("sigmoid", 0.2): [0.8 * softplus(-beta * x) + 0.2 * softplus(beta * x) for x in h],
        ("ipo", 0.0): [(x - 1 / (2 * beta)) ** 2 for x in h],
    }
    for (loss_type, eps), want in cases.items():
        losses, chosen, rejected = dpo_script.dpo_loss(pc, pr, rc, rr, beta, eps, loss_type)
        torch.testing.assert_close(losses, torch.tensor(want), msg=f"{loss_type} eps={eps}")
        torch.testing.assert_close(chosen, beta * (pc - rc))
        torch.testing.assert_close(rejected, beta * (pr - rr))


def _setup(script, model_dir, data, **overrides):
    """Config, process group, pairs and the policy, in main's order."""
    settings = dict(
        model=str(model_dir), dataset=str(data), dtype="fp32", device="cpu", max_seq_len=96,
        micro_batch_size=2, warmup_steps=0, val_fraction=0.0, lr=1e-2,
    )  # fmt: skip
    cfg = script.Config(**{**settings, **overrides})
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    tokenizer = Tokenizer.from_dir(model_dir)
    train_set, _ = script.build_datasets(cfg, tokenizer)
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    batch = script.collate(train_set[:2], tokenizer.pad_token_id)
    return cfg, mesh, tokenizer, train_set, model, batch, dist_info.device


def test_batch_holds_chosen_then_rejected_with_the_prompt_masked(
    dpo_script, tiny_model_dir, short_pairs
):
    cfg, _, tokenizer, train_set, _, batch, _ = _setup(dpo_script, tiny_model_dir, short_pairs)
    P = 2
    assert batch["input_ids"].shape[0] == 2 * P and batch["sample_ids"].tolist() == [0, 1]
    for i in range(P):
        chosen, rejected = train_set[i]["chosen"], train_set[i]["rejected"]
        assert batch["input_ids"][i, : len(chosen["input_ids"])].tolist() == chosen["input_ids"]
        n = len(rejected["input_ids"])
        assert batch["input_ids"][P + i, :n].tolist() == rejected["input_ids"]
        # the first supervised target is the reply's first token: the prompt (incl. the
        # "<|im_start|>assistant\n" generation prompt) is masked, and both share that prompt
        first = next(t for t, y in enumerate(chosen["labels"]) if y != -100)
        assert chosen["input_ids"][: first + 1] == rejected["input_ids"][: first + 1]
        assert tokenizer.decode(
            chosen["input_ids"][: first + 1], skip_special_tokens=False
        ).endswith("<|im_start|>assistant\n")


def _logprob_fn(script, cfg):
    """The script's reference forward: (model, batch) -> sequence log-probs [2P]."""
    return lambda model, batch: script.sequence_logprobs(model, batch, cfg)[0]


def _precompute(script, model, pairs, cfg, logprob_fn, pad_token_id, device):
    """The precomputed table as main() computes it, on one rank."""
    collate_fn = functools.partial(script.collate, pad_token_id=pad_token_id)
    return precompute_reference_logprobs(
        model, pairs, logprob_fn, collate_fn, cfg.micro_batch_size, 0, 1, device
    )


def test_reference_logprobs_identical_across_the_three_modes(
    dpo_script, dpo_lora_script, tiny_model_dir, short_pairs
):
    s = dpo_lora_script
    cfg, mesh, tok, train_set, model, batch, device = _setup(s, tiny_model_dir, short_pairs)
    with torch.no_grad():  # move the policy away from its base: the reference must not follow
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
        policy = s.sequence_logprobs(model, batch, cfg)[0]
    adapters_off = s.base_logprobs(model, batch, cfg)
    sep_cfg = dataclasses.replace(cfg, ref_mode="separate")
    reference = s.build_reference(sep_cfg, Path(tiny_model_dir), mesh, device)
    separate = reference_logprobs(reference, None, batch, _logprob_fn(s, sep_cfg))
    pre_cfg = dataclasses.replace(cfg, ref_mode="precomputed")
    base_fn = functools.partial(s.base_logprobs, cfg=pre_cfg)  # as main(): the adapters off
    table = _precompute(s, model, train_set, pre_cfg, base_fn, tok.pad_token_id, device)
    precomputed = reference_logprobs(None, table, batch, base_fn)
    assert (policy - adapters_off).abs().max() > 1e-3
    torch.testing.assert_close(adapters_off, separate, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(precomputed, separate, atol=1e-5, rtol=1e-6)
    # the full-parameter script: its untrained policy is the reference of the precomputed pass
    d = dpo_script
    cfg, mesh, tok, train_set, model, batch, device = _setup(d, tiny_model_dir, short_pairs)
    table = _precompute(d, model, train_set, cfg, _logprob_fn(d, cfg), tok.pad_token_id, device)
    full_precomputed = reference_logprobs(None, table, batch, _logprob_fn(d, cfg))
    torch.testing.assert_close(full_precomputed, separate, atol=1e-5, rtol=1e-6)


def test_bf16_separate_reference_is_stored_in_bf16_with_unchanged_logprobs(
    dpo_script, tiny_model_dir, short_pairs, monkeypatch
):
    """ref_mode=separate, dtype bf16: the frozen reference is stored in bf16 (half its memory);
    FSDP computes with bf16 weights either way, so its log-probs equal those of the reference
    kept in fp32 (`cast_frozen_params` disabled) exactly."""
    s = dpo_script
    cfg, mesh, _, _, model, batch, device = _setup(
        s, tiny_model_dir, short_pairs, dtype="bf16", ref_mode="separate"
    )
    reference = s.build_reference(cfg, Path(tiny_model_dir), mesh, device)
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    got = reference_logprobs(reference, None, batch, _logprob_fn(s, cfg))
    with monkeypatch.context() as m:
        m.setattr(s, "cast_frozen_params", lambda model, dtype: 0)
        fp32_reference = s.build_reference(cfg, Path(tiny_model_dir), mesh, device)
    assert {p.dtype for p in fp32_reference.parameters()} == {torch.float32}
    assert torch.equal(got, reference_logprobs(fp32_reference, None, batch, _logprob_fn(s, cfg)))


def test_cpu_reference_is_a_plain_frozen_copy_with_the_same_logprobs(
    dpo_script, tiny_model_dir, short_pairs
):
    """ref_device=cpu: a plain bf16 module in host memory (`frozen_cpu_copy`), where the reference
    on the policy's device is FSDP-wrapped; both compute with the same bf16 weights, so their
    log-probs are equal."""
    s = dpo_script
    cfg, mesh, _, _, _, batch, device = _setup(
        s, tiny_model_dir, short_pairs, ref_mode="separate", dtype="bf16"
    )
    on_device = s.build_reference(cfg, Path(tiny_model_dir), mesh, device)
    cpu_cfg = dataclasses.replace(cfg, ref_device="cpu")
    s.validate(cpu_cfg)
    cpu = s.build_reference(cpu_cfg, Path(tiny_model_dir), mesh, device)
    assert hasattr(on_device, "reshard") and not hasattr(cpu, "reshard") and not cpu.training
    assert {(p.dtype, p.device.type, p.requires_grad) for p in cpu.parameters()} == {
        (torch.bfloat16, "cpu", False)
    }
    want = reference_logprobs(on_device, None, batch, _logprob_fn(s, cfg))
    assert torch.equal(reference_logprobs(cpu, None, batch, _logprob_fn(s, cpu_cfg)), want)


def test_adapters_off_reference_is_constant_while_the_policy_trains(
    dpo_lora_script, tiny_model_dir, short_pairs
):
    s = dpo_lora_script
    cfg, _, _, _, model, batch, device = _setup(s, tiny_model_dir, short_pairs)
    optimizer, scheduler = s.build_optimizer(cfg, model)
    first_ref = s.base_logprobs(model, batch, cfg)
    losses = []
    for _ in range(3):
        metrics = s.train_step(model, None, None, optimizer, scheduler, [batch], cfg, device)
        assert set(TRL_METRICS) <= set(metrics) and metrics["num_pairs"] == 2
        losses.append(metrics["loss"])
        torch.testing.assert_close(s.base_logprobs(model, batch, cfg), first_ref)
    with torch.no_grad():
        policy = s.sequence_logprobs(model, batch, cfg)[0]
    assert (policy - first_ref).abs().max() > 1e-3  # the policy moved, the reference did not
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    assert losses[-1] < losses[0]


def test_lora_dpo_on_real_preference_data_ranks_chosen_higher(
    dpo_lora_script, smollm2_dir, real_short_pairs, tmp_path
):
    """SmolLM2-135M, 4 real pairs (2 micro-batches of 2, so each pair comes back every 2 steps),
    6 steps: the reward accuracy of the later steps is above chance and the margins grow."""
    out = tmp_path / "out"
    argv = [
        "--model", str(smollm2_dir), "--dataset", str(real_short_pairs), "--out_dir", str(out),
        "--device", "cpu", "--dtype", "fp32", "--max_seq_len", "128", "--micro_batch_size", "2",
        "--max_steps", "6", "--warmup_steps", "0", "--lr", "1e-3", "--val_fraction", "0",
        "--eval_every_steps", "0", "--sample_max_new_tokens", "0", "--save_merged", "false",
    ]  # fmt: skip
    dpo_lora_script.main(argv)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "rewards/accuracies" in r]
    assert len(rows) == 6
    acc = [r["rewards/accuracies"] for r in rows]
    margins = [r["rewards/margins"] for r in rows]
    assert acc[0] == 0.0 and margins[0] == 0.0  # step 1: policy == reference
    assert sum(acc[-4:]) / 4 > 0.5, acc
    assert sum(margins[-3:]) / 3 > max(margins[:2]), margins
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.parametrize("ref_mode", ["precomputed", "separate"])
def test_resume_continues_exactly_and_keeps_the_precomputed_reference(
    dpo_script, tiny_model_dir, short_pairs, tmp_path, ref_mode
):
    """4 steps straight == 2 steps, stop, resume to 4 (constant lr, so the schedule does not
    depend on max_steps; the resumed run reads the cached reference log-probs back instead of
    scoring with the moved policy)."""
    common = [
        "--model", str(tiny_model_dir), "--dataset", str(short_pairs), "--device", "cpu",
        "--dtype", "fp32", "--max_seq_len", "96", "--micro_batch_size", "1", "--warmup_steps",
        "0", "--lr", "1e-2", "--min_lr_ratio", "1.0", "--val_fraction", "0",
        "--eval_every_steps", "0", "--sample_max_new_tokens", "0", "--save_every_steps", "2", "--ref_mode", ref_mode,
    ]  # fmt: skip

    def losses(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    dpo_script.main([*common, "--out_dir", str(straight), "--max_steps", "4"])
    dpo_script.main([*common, "--out_dir", str(resumed), "--max_steps", "2"])
    dpo_script.main([*common, "--out_dir", str(resumed), "--max_steps", "4"])
    want, got = losses(straight), losses(resumed)
    assert got[3] == pytest.approx(want[3], abs=1e-6) and got[4] == pytest.approx(want[4], abs=1e-6)
    assert want[3] != pytest.approx(math.log(2), abs=1e-3)  # the policy did move
    if ref_mode == "precomputed":
        # a resume on other data (or tokens) cannot use the cached table: refused, naming what changed
        with pytest.raises(ValueError, match=r"computed for other data: max_seq_len 96 \(now 64\)"):
            dpo_script.main(
                [*common, "--out_dir", str(resumed), "--max_steps", "6", "--max_seq_len", "64"]
            )
        (resumed / "reference_logps.pt").unlink()
        with pytest.raises(ValueError, match="reference_logps.pt is missing"):
            dpo_script.main([*common, "--out_dir", str(resumed), "--max_steps", "6"])


def test_precomputed_reference_takes_a_trainable_embedding(
    dpo_lora_script, tiny_model_dir, short_pairs, tmp_path, monkeypatch
):
    """A dpo-lora script edited to train embed_tokens beside the adapters: ref_mode precomputed
    scores every pair before the first step, while that weight has not moved, so it is accepted
    (step 1's loss is ln 2: the policy equals the reference) and the embedding trains; the
    per-step adapters-off reference would drift with it, and is still refused, naming that
    parameter."""
    s = dpo_lora_script
    setup_model = s.setup_model

    def with_trainable_embedding(*args, **kwargs):
        model = setup_model(*args, **kwargs)
        model.model.embed_tokens.weight.requires_grad_(True)
        return model

    monkeypatch.setattr(s, "setup_model", with_trainable_embedding)
    common = [
        "--model", str(tiny_model_dir), "--dataset", str(short_pairs), "--device", "cpu",
        "--dtype", "fp32", "--max_seq_len", "96", "--micro_batch_size", "2", "--warmup_steps",
        "0", "--lr", "1e-2", "--val_fraction", "0", "--eval_every_steps", "0",
        "--sample_max_new_tokens", "0", "--max_steps", "2", "--save_merged", "false",
    ]  # fmt: skip
    out = tmp_path / "precomputed"
    s.main([*common, "--ref_mode", "precomputed", "--out_dir", str(out)])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses[1] != pytest.approx(math.log(2), abs=1e-4)  # trained, against the fixed table
    with pytest.raises(
        ValueError, match=r"non-adapter parameters are trainable \(e\.g\. model\.embed_tokens"
    ):
        s.main([*common, "--ref_mode", "adapters-off", "--out_dir", str(tmp_path / "off")])


def test_ipo_compares_per_token_means(dpo_lora_script, tiny_model_dir, short_pairs):
    s = dpo_lora_script
    cfg, _, _, _, model, batch, _ = _setup(s, tiny_model_dir, short_pairs, loss_type="ipo")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
        losses, sums = s.pair_losses(model, None, None, batch, cfg)
        logps, counts = s.sequence_logprobs(model, batch, cfg)
        ref = s.base_logprobs(model, batch, cfg)
    mean, ref_mean = logps / counts, ref / counts  # [2P]
    want, _, _ = s.dpo_loss(mean[:2], mean[2:], ref_mean[:2], ref_mean[2:], cfg.beta, 0.0, "ipo")
    torch.testing.assert_close(losses, want)
    torch.testing.assert_close(sums["logps/chosen"], mean[:2].sum())


def test_pairs_whose_prompt_fills_max_seq_len_are_dropped_and_counted(
    dpo_script, smollm2_dir, capsys
):
    """Real dpo_en_demo at max_seq_len 256: the pairs whose prompt leaves no reply token are dropped,
    and the startup output says how many (the startup line alone showed only what was kept)."""
    from runtime import Tokenizer

    cfg = dpo_script.Config(
        model=str(smollm2_dir), dataset="dpo_en_demo.json", max_seq_len=256, val_fraction=0.0
    )
    train, val = dpo_script.build_datasets(cfg, Tokenizer.from_dir(smollm2_dir))
    rows = json.loads(ensure_dataset("dpo_en_demo.json").read_text())
    dropped = len(rows) - len(train) - len(val)
    assert dropped > 0
    out = capsys.readouterr().out
    assert f"{dropped} of {len(rows)} pairs dropped" in out and "raise --max_seq_len" in out
