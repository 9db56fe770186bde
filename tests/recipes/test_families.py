"""An SFT script emitted for each model family (`scaffold new --model <local HF dir>`) trains 3 steps
on a tiny random model of that family with the real SmolLM2 tokenizer and real alpaca rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from generator.cli import cli
from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint
from runtime.testing import TINY_CONFIG

TINY = {**TINY_CONFIG, "vocab_size": 49152, "rope_theta": 100000.0, "max_position_embeddings": 4096}
FAMILIES = {
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False),
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_emitted_script_trains_each_family(family, tmp_path, smollm2_dir, small_dataset):
    model_dir = tmp_path / f"tiny-{family}"
    args = ModelArgs(**TINY, **FAMILIES[family])
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, model_dir, args.to_hf_config())
    copy_tokenizer_files(smollm2_dir, model_dir)

    data = tmp_path / "four.json"  # 4 real rows, micro-batch 4: every step sees the same batch
    data.write_text(json.dumps(json.loads(small_dataset.read_text())[:4]))
    run = tmp_path / "run"
    result = CliRunner().invoke(
        cli, ["new", "--model", str(model_dir), "--dtype", "fp32", "--out", str(run)]
    )
    assert result.exit_code == 0, result.output
    assert f"({family} family)" in (run / "train.py").read_text()
    proc = subprocess.run(
        [sys.executable, str(run / "train.py"), "--max_steps", "3", "--warmup_steps", "0", "--lr", "2e-3",
         "--dataset", str(data), "--micro_batch_size", "4", "--max_seq_len", "64", "--val_fraction", "0",
         "--sample_max_new_tokens", "2", "--out_dir", str(run / "out")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 3 and all(9.0 < x < 12.0 for x in losses), losses  # ~ln(49152) at init
    assert losses[2] < losses[1] < losses[0], losses
    saved = json.loads((run / "out" / "model" / "config.json").read_text())
    assert saved["model_type"] == family
