"""The emitted distillation script (examples/kd_smollm2): at kd_ratio=0 its loss is the SFT
cross-entropy, and a tiny random student distilled from the real SmolLM2-135M teacher on real
alpaca rows lowers its loss within a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime import Tokenizer, cross_entropy_sum
from tests.helpers import import_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kd_script():
    return import_script(REPO / "examples" / "kd_smollm2" / "train.py", "kd_smollm2_train")


def _cfg(script, model_dir, teacher, data, **overrides):
    settings = dict(
        model=str(model_dir), teacher=str(teacher), dataset=str(data), dtype="fp32",
        device="cpu", max_seq_len=64, micro_batch_size=2, warmup_steps=0, val_fraction=0.0,
    )  # fmt: skip
    cfg = script.Config(**{**settings, **overrides})
    script.validate(cfg)
    return cfg


@pytest.mark.fast
@pytest.mark.parametrize("kd_loss", ["forward", "reverse"])
def test_kd_loss_mixes_ce_and_kl(kd_script, tiny_model_dir, small_dataset, kd_loss):
    """kd_ratio=0: plain CE; the student as its own teacher: KL = 0, so any kd_ratio gives
    (1 - kd_ratio) * CE."""
    s = kd_script
    cfg = _cfg(s, tiny_model_dir, tiny_model_dir, small_dataset, kd_loss=kd_loss, kd_ratio=0.0)
    dist_info, mesh = s.setup_distributed(cfg)
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    train_set, _ = s.build_datasets(cfg, tokenizer)
    model = s.setup_model(cfg, Path(tiny_model_dir), mesh, dist_info.device)
    batch = s.collate(train_set[:2], tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(batch["input_ids"])  # [B, S, V] dense reference
        ce = cross_entropy_sum(logits, batch["labels"])
        torch.testing.assert_close(s.sft_loss(model, batch, cfg), ce)
        cfg.kd_ratio, cfg.kd_temperature = 0.7, 2.0
        torch.testing.assert_close(s.sft_loss(model, batch, cfg), 0.3 * ce, atol=1e-4, rtol=1e-5)
        # the teacher is built once (in setup_model) and reused by every loss call
        teacher = s.load_teacher(cfg.teacher, s.teacher_repo_id(cfg), cfg.dtype, "cpu")
        assert teacher is s.load_teacher(cfg.teacher, s.teacher_repo_id(cfg), cfg.dtype, "cpu")
        assert not any(p.requires_grad for p in teacher.parameters())


def test_tiny_student_distilled_from_smollm2_on_real_data(
    kd_script, tiny_real_vocab_dir, smollm2_dir, small_dataset, tmp_path
):
    """4 real alpaca rows in 2 micro-batches, so each comes back every 2 steps: the student's
    loss (KL to the teacher only, kd_ratio=1) on the same rows falls."""
    rows = json.loads(small_dataset.read_text())[:4]
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(rows))
    out = tmp_path / "out"
    argv = [
        "--model", str(tiny_real_vocab_dir), "--teacher", str(smollm2_dir), "--dataset",
        str(data), "--out_dir", str(out), "--device", "cpu", "--dtype", "fp32",
        "--max_seq_len", "64", "--micro_batch_size", "2", "--max_steps", "8",
        "--warmup_steps", "0", "--lr", "1e-2", "--min_lr_ratio", "1.0", "--kd_ratio", "1.0",
        "--kd_temperature", "1.0",
        "--val_fraction", "0", "--eval_every_steps", "0", "--sample_max_new_tokens", "0",
    ]  # fmt: skip
    kd_script.main(argv)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 8
    assert sum(losses[-2:]) < 0.85 * sum(losses[:2]), losses  # the same 2 batches, later


def test_scaffold_new_teacher_option_and_the_hub_id_it_brings(kd_script):
    """`scaffold new --algo kd --teacher NAME` renders the teacher and its catalog Hub id; the
    default teacher is the student's checkpoint; the script downloads the default id only for the
    default teacher (another --teacher needs its own --teacher_hf_repo_id)."""
    from generator.render import render
    from generator.spec import Spec, SpecError, validate_spec

    text = render(Spec(algo="kd", teacher="smollm2-360m", out="o"))
    assert 'teacher: str = "smollm2-360m"' in text
    assert 'teacher_hf_repo_id: str = "HuggingFaceTB/SmolLM2-360M-Instruct"' in text
    spec = Spec(algo="kd", teacher="smollm2-360m", out="o")
    assert "--teacher smollm2-360m" in spec.command()
    assert Spec.from_json(spec.to_json()) == spec
    with pytest.raises(SpecError, match="--teacher smollm2-360m is for --algo kd"):
        validate_spec(Spec(teacher="smollm2-360m"))
    with pytest.raises(SpecError, match="--teacher 'gpt-5': neither a catalog model"):
        validate_spec(Spec(algo="kd", teacher="gpt-5"))
    from generator.regen import parse_settings

    kd = Spec(algo="kd", out="o")
    assert parse_settings(["teacher=smollm2-360m"], kd).teacher == "smollm2-360m"
    assert parse_settings(["algo=sft"], spec).teacher == ""  # leaving kd drops the teacher
    s = kd_script  # rendered with the default teacher: the student's smollm2-135m
    assert (s.Config.teacher, s.Config.teacher_hf_repo_id) == (
        "smollm2-135m",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    )
    assert s.teacher_repo_id(s.Config()) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert s.teacher_repo_id(s.Config(teacher="smollm2-1.7b")) == ""
    other = s.Config(
        teacher="smollm2-1.7b", teacher_hf_repo_id="HuggingFaceTB/SmolLM2-1.7B-Instruct"
    )
    assert s.teacher_repo_id(other) == "HuggingFaceTB/SmolLM2-1.7B-Instruct"
