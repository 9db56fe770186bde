"""Saved models, adapters, merged exports and checkpoints get the modes the user's umask gives any
file they write (0o644 / 0o755 under 0o022), not the 0o600 / 0o700 of the temporary files and
directories they are written through."""

from __future__ import annotations

import contextlib
import os
import stat

import pytest
import torch

from runtime import TrainState, cosine_schedule_with_warmup, save_train_state
from runtime.checkpoint import (
    apply_umask_modes,
    copy_tokenizer_files,
    current_umask,
    save_hf_checkpoint,
)
from runtime.lora import add_lora, init_lora, merged_hf_tensors, save_adapter
from runtime.models.llama import ModelArgs, build_model
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root) -> dict[str, int]:
    """Permission bits of root and of every path under it, by path relative to root."""
    found = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for path in sorted(root.rglob("*")):
        found[str(path.relative_to(root))] = stat.S_IMODE(os.stat(path).st_mode)
    return found


def lora_model():
    args = ModelArgs(**TINY_CONFIG)
    model = build_model(args, device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    add_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8)
    init_lora(model, seed=0)
    return model


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_saves_follow_the_umask(mask, process_group, tmp_path):
    """A full model (new directory and into an existing one), a PEFT adapter, the merged export
    and a resumable checkpoint, each saved under `mask`: files 0o666 & ~mask, dirs 0o777 & ~mask.
    """
    model = lora_model()
    hf_config = model.args.to_hf_config()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = cosine_schedule_with_warmup(optimizer, 0, 4, 0.0)
    tokenizer_src = tmp_path / "cache"  # a cache written under another umask
    tokenizer_src.mkdir()
    for name, mode in (("tokenizer.json", 0o644), ("tokenizer_config.json", 0o600)):
        (tokenizer_src / name).write_text("{}")
        os.chmod(tokenizer_src / name, mode)
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o750)  # the user's own directory keeps the mode they gave it
    os.chmod(existing, 0o750)  # mkdir's mode is masked too
    with umask(mask):
        assert current_umask() == mask
        save_hf_checkpoint(model, tmp_path / "model", hf_config)
        copy_tokenizer_files(tokenizer_src, tmp_path / "model")
        save_hf_checkpoint(model, existing, hf_config)
        save_adapter(model, tmp_path / "adapter", "base")
        tensors = merged_hf_tensors(model, hf_config)
        save_hf_checkpoint(model, tmp_path / "adapter" / "merged", hf_config, tensors=tensors)
        save_train_state(tmp_path / "ckpt", TrainState(1), model, optimizer, scheduler, {})
        assert os.umask(mask) == mask  # the saves left the umask as they found it
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    saved = {
        "model": {
            ".",
            "model.safetensors",
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        },
        "adapter": {".", "adapter_model.safetensors", "adapter_config.json", "merged"},
        "adapter/merged": {".", "model.safetensors", "config.json"},
        "ckpt/step_000001": {".", "dcp", "COMPLETE", "scheduler.pt", "rng_rank0.pt"},
    }
    for where, names in saved.items():
        found = modes(tmp_path / where)
        assert names <= set(found), (where, sorted(found))
        for name, mode in found.items():
            is_dir = (tmp_path / where / name).is_dir()
            expected = dir_mode if is_dir else file_mode
            assert mode == expected, f"{where}/{name}: {oct(mode)}, expected {oct(expected)}"
    assert modes(existing)["."] == 0o750
    assert modes(existing)["model.safetensors"] == file_mode
    assert not list(tmp_path.glob(".*tmp-*"))  # no temporary directory left behind


def test_apply_umask_modes_leaves_symlinks_and_their_targets_alone(tmp_path):
    """A link inside the tree is not followed: the file it points to outside keeps its mode."""
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    os.chmod(outside, 0o600)
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    os.chmod(tree / "sub", 0o700)
    (tree / "sub" / "f").write_text("y")
    os.chmod(tree / "sub" / "f", 0o600)
    (tree / "link").symlink_to(outside)
    with umask(0o027):
        apply_umask_modes(tree)
    assert modes(tree) == {".": 0o750, "sub": 0o750, "sub/f": 0o640, "link": 0o600}
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o600
