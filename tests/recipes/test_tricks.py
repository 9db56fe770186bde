"""Every trick example runs on a tiny model with the real tokenizer and data, and gives the same
losses as the plain script (the tricks change memory and speed, not the math)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRICK_EXAMPLES = sorted(p.parent.name for p in (REPO / "examples").glob("sft_smollm2_*/train.py"))


def _losses(example: str, tmp: Path, model_dir: Path, data: Path) -> list[float]:
    out = tmp / example
    args = [
        "--model",
        str(model_dir),
        "--dataset",
        str(data),
        "--dtype",
        "fp32",
        "--max_steps",
        "2",
        "--warmup_steps",
        "0",
        "--lr",
        "1e-3",
        "--micro_batch_size",
        "2",
        "--max_seq_len",
        "64",
        "--val_fraction",
        "0",
        "--sample_max_new_tokens",
        "0",
        "--out_dir",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / example / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_model_dir, small_dataset):
    return _losses("sft_smollm2", tmp_path_factory.mktemp("base"), tiny_model_dir, small_dataset)


@pytest.mark.parametrize("example", TRICK_EXAMPLES)
def test_trick_matches_plain_script(example, baseline, tmp_path, tiny_model_dir, small_dataset):
    losses = _losses(example, tmp_path, tiny_model_dir, small_dataset)
    assert losses == pytest.approx(baseline, abs=1e-5), (example, losses, baseline)


def test_activation_checkpointing_saves_less(tiny_model_dir):
    """With "ac" the forward keeps only block inputs for backward: fewer saved activation bytes."""
    import torch

    from tests.conftest import import_script

    script = import_script(REPO / "examples" / "sft_smollm2_ac" / "train.py", "sft_ac_train")
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
            loss = script.sft_loss(model, batch)
        loss.backward()  # recomputation works under FSDP2
        saved[enabled] = total[0]
    assert saved[True] < 0.2 * saved[False], saved
