"""Every trick example runs on a tiny model with the real tokenizer and data, and gives the same
losses as the plain script (the tricks change memory and speed, not the math)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from generator.cli import cli

REPO = Path(__file__).resolve().parents[2]
EXACT = ("ac", "lce", "optim-in-bwd")  # change memory and speed, not the math
COMBOS = [c for n in range(1, len(EXACT) + 1) for c in itertools.combinations(EXACT, n)]
LOW_BIT = [("adamw8bit",), ("ac", "lce", "optim-in-bwd", "adamw8bit")]


def _losses(script: Path, out: Path, model_dir: Path, data: Path) -> list[float]:
    args = ["--model", str(model_dir), "--dataset", str(data), "--dtype", "fp32", "--max_steps", "2",
            "--warmup_steps", "0", "--lr", "1e-3", "--micro_batch_size", "2", "--max_seq_len", "64",
            "--gradient_accumulation_steps", "2", "--val_fraction", "0", "--sample_max_new_tokens", "0",
            "--out_dir", str(out)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_model_dir, small_dataset):
    out = tmp_path_factory.mktemp("base")
    return _losses(
        REPO / "examples" / "sft_smollm2" / "train.py", out, tiny_model_dir, small_dataset
    )


@pytest.mark.parametrize("tricks", LOW_BIT, ids="+".join)
def test_low_bit_optimizers_track_the_plain_script(
    tricks, baseline, tmp_path, tiny_model_dir, small_dataset
):
    """torchao 8-bit AdamW (alone and under optimizer-in-backward with every exact trick) train:
    step 1 is before any update (identical); after one update the loss differs only by the
    quantization of the moments."""
    result = CliRunner().invoke(
        cli, ["new", "--tricks", ",".join(tricks), "--out", str(tmp_path / "run")]
    )
    assert result.exit_code == 0, result.output
    losses = _losses(tmp_path / "run" / "train.py", tmp_path / "out", tiny_model_dir, small_dataset)
    assert losses[0] == pytest.approx(baseline[0], abs=1e-5)
    assert losses[1] == pytest.approx(baseline[1], abs=2e-3), (tricks, losses, baseline)
    assert losses[1] < losses[0]


@pytest.mark.parametrize("tricks", COMBOS, ids="+".join)
def test_trick_combination_matches_plain_script(
    tricks, baseline, tmp_path, tiny_model_dir, small_dataset
):
    """Every allowed combination renders, runs 2 steps (gradient accumulation 2, clipping on) and
    gives the plain script's losses."""
    result = CliRunner().invoke(
        cli, ["new", "--tricks", ",".join(tricks), "--out", str(tmp_path / "run")]
    )
    assert result.exit_code == 0, result.output
    losses = _losses(tmp_path / "run" / "train.py", tmp_path / "out", tiny_model_dir, small_dataset)
    assert losses == pytest.approx(baseline, abs=1e-5), (tricks, losses, baseline)


def test_activation_checkpointing_saves_less(tiny_model_dir):
    """With "ac" the forward keeps only block inputs for backward: fewer saved activation bytes."""
    import torch

    from tests.conftest import import_script

    script = import_script(
        REPO / "examples" / "sft_smollm2_memory" / "train.py", "sft_memory_train"
    )
    saved = {}
    for enabled in (False, True):
        cfg = script.Config(
            model=str(tiny_model_dir),
            dtype="fp32",
            device="cpu",
            enable_activation_checkpointing=enabled,
        )
        dist_info, mesh = script.setup_distributed(cfg)
        model = script.build_sft_model(cfg, tiny_model_dir, mesh, dist_info.device)
        total, inside = [0], [False]  # count only what the transformer blocks save

        def pack(t, total=total, inside=inside):
            if inside[0]:
                total[0] += t.numel() * t.element_size()
            return t

        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *a, inside=inside: inside.__setitem__(0, True))
            layer.register_forward_hook(lambda *a, inside=inside: inside.__setitem__(0, False))

        batch = {
            "input_ids": torch.randint(0, 1000, (2, 64)),
            "labels": torch.randint(0, 1000, (2, 64)),
        }
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = script.sft_loss(model, batch, cfg)
        loss.backward()  # recomputation works under FSDP2
        saved[enabled] = total[0]
    assert saved[True] < 0.2 * saved[False], saved
