"""An SFT script emitted for each model family (`scaffold new --model <local HF dir>`) trains 3 steps
on a tiny random model of that family with the small tokenizer and real alpaca rows (in this
process: the script's main())."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from generator.cli import cli
from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint
from tests.helpers import SMALL_VOCAB, TINY_CONFIG, import_script, read_metrics

TINY = {
    **TINY_CONFIG,
    "vocab_size": SMALL_VOCAB,
    "rope_theta": 100000.0,
    "max_position_embeddings": 4096,
}
FAMILIES = {
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False),
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_emitted_script_trains_each_family(family, tmp_path, small_tokenizer_dir, small_dataset):
    model_dir = tmp_path / f"tiny-{family}"
    args = ModelArgs(**TINY, **FAMILIES[family])
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, model_dir, args.to_hf_config())
    copy_tokenizer_files(small_tokenizer_dir, model_dir)

    data = tmp_path / "four.json"  # 4 real rows, micro-batch 4: every step sees the same batch
    data.write_text(json.dumps(json.loads(small_dataset.read_text())[:4]))
    run = tmp_path / "run"
    result = CliRunner().invoke(
        cli, ["new", "--model", str(model_dir), "--dtype", "fp32", "--out", str(run)]
    )
    assert result.exit_code == 0, result.output
    assert f"({family} family)" in (run / "train.py").read_text()
    script = import_script(run / "train.py", f"family_{family}_train")
    script.main(
        ["--max_steps", "3", "--warmup_steps", "0", "--lr", "2e-3",
         "--dataset", str(data), "--micro_batch_size", "4", "--max_seq_len", "64", "--val_fraction", "0",
         "--sample_max_new_tokens", "2", "--out_dir", str(run / "out")]
    )  # fmt: skip
    losses = [r["loss"] for r in read_metrics(run / "out")]
    # ~ln(vocab) at init, a random model's uniform guess: the same window relative to ln(vocab)
    # as the 9..12 that was used around ln(49152) = 10.8
    low, high = 0.83 * math.log(SMALL_VOCAB), 1.11 * math.log(SMALL_VOCAB)
    assert len(losses) == 3 and all(low < x < high for x in losses), losses
    assert losses[2] < losses[1] < losses[0], losses
    saved = json.loads((run / "out" / "model" / "config.json").read_text())
    assert saved["model_type"] == family
