"""The SFT skeleton's other algorithms on gloo processes equal 1 process, on the same global batch:
- LoRA under HSDP (dp_replicate 2 x dp_shard 2) on 4 ranks, QLoRA+DoRA under FSDP2 on 2 and HSDP
  on 4: the same losses over two optimizer steps; the merged HF export gathered from DTensor
  shards (NF4 shards too) and the adapters equal the 1-process ones;
- KD (a student distilled from a tiny random teacher, which each rank holds whole) under HSDP on 4
  ranks: the same losses and the same saved student.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import SMALL_VOCAB, TINY_CONFIG, spawn

REPO = Path(__file__).resolve().parents[2]


def _train(rank, world_size, script_name, model_dir, data_path, out_dir, overrides):
    from torch.distributed.tensor import DTensor

    from runtime import Tokenizer
    from tests.helpers import import_script

    script = import_script(REPO / "examples" / script_name / "train.py", f"{script_name}_dist")
    cfg = script.Config(
        model=model_dir,
        dataset=data_path,
        dtype="fp32",
        device="cpu",
        max_seq_len=64,
        val_fraction=0.0,
        warmup_steps=0,
        lr=1e-2,
        **overrides,
    )
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    assert mesh["dp"].size() == world_size and mesh["dp"].get_local_rank() == rank
    tokenizer = Tokenizer.from_dir(model_dir)
    train_set, _ = script.build_datasets(cfg, tokenizer)
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    nf4 = [p for n, p in model.named_parameters() if "proj.weight" in n and "lora" not in n]
    if script_name.startswith("qlora") and world_size > 1:  # the NF4 base is really sharded
        assert all(isinstance(p, DTensor) for p in nf4)
        assert all(p.device_mesh.ndim == 1 + (cfg.dp_replicate > 1) for p in nf4)  # HSDP: 2-D
    optimizer, scheduler = script.build_optimizer(cfg, model)
    losses = []
    for step in range(2):  # the same global batch of 4 everywhere; each rank takes its share
        examples = train_set[4 * step : 4 * step + 4][rank::world_size]
        micro_batches = [
            script.collate(examples[i : i + 1], tokenizer.pad_token_id)
            for i in range(len(examples))
        ]
        metrics = script.train_step(
            model, optimizer, scheduler, micro_batches, cfg, dist_info.device
        )
        losses.append(metrics["loss"])
    if hasattr(script, "save"):  # the adapter scripts' own save (PEFT layout)
        script.save(
            model,
            None,
            Path(model_dir),
            cfg,
            dataclasses.asdict(cfg),
            Path(out_dir),
            dist_info.is_main,
        )
    else:  # KD saves the student in Hugging Face layout
        config = dataclasses.asdict(cfg)
        script.save_hf_model(model, Path(model_dir), Path(out_dir), config, dist_info.is_main)
    return losses


@pytest.mark.parametrize(
    "script_name, use_dora, layouts",
    [
        # HSDP 2 x 2 shards like FSDP over 2 and replicates over the other 2
        ("lora_smollm2", False, [(4, 2)]),
        # NF4 shards on a 1-D mesh (FSDP) and on the dp_shard dim of a 2-D one (HSDP)
        ("qlora_smollm2", True, [(2, 1), (4, 2)]),
    ],
    ids=["lora", "qdora"],
)
def test_ranks_equal_one(
    script_name, use_dora, layouts, tiny_model_dir, shardable_model_dir, small_dataset, tmp_path
):
    """`layouts`: (world size, dp_replicate) runs, each compared with 1 process."""
    model_dir = tiny_model_dir if script_name.startswith("lora") else shardable_model_dir
    results = {}
    for world, replicate in [(1, 1), *layouts]:
        out = tmp_path / f"ws{world}"
        overrides = dict(use_dora=use_dora, save_merged=True, dp_replicate=replicate)
        args = (script_name, str(model_dir), str(small_dataset), str(out), overrides)
        results[world] = spawn(_train, world_size=world, args=args)
    (ref,) = results[1]
    one = load_file(tmp_path / "ws1" / "merged" / "model.safetensors")
    adapter_one = load_file(tmp_path / "ws1" / "adapter_model.safetensors")
    assert not any("lora" in k for k in one)
    for world, _ in layouts:
        for losses in results[world]:
            assert losses == pytest.approx(ref, abs=1e-5), (world, losses, ref)
        many = load_file(tmp_path / f"ws{world}" / "merged" / "model.safetensors")
        assert one.keys() == many.keys()
        for key, tensor in one.items():
            # fp32 rounding: the 1-process run is unwrapped, the sharded one sums DoRA's row norms
            # and the merge over DTensor shards in another order (measured max 3.3e-6)
            torch.testing.assert_close(
                many[key], tensor, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: key + m
            )
        adapter_many = load_file(tmp_path / f"ws{world}" / "adapter_model.safetensors")
        assert adapter_one.keys() == adapter_many.keys()
        for key, tensor in adapter_one.items():  # Adam's first steps (m / sqrt(v)) amplify the
            # reduction-order noise of near-zero gradients: up to 7.9e-5 on entries of size 0.07
            # (measured, unwrapped 1 process vs 2 FSDP ranks)
            torch.testing.assert_close(
                adapter_many[key], tensor, atol=1e-4, rtol=1e-4, msg=lambda m, key=key: key + m
            )


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, small_tokenizer_dir):
    """A teacher for the tiny student: the same tiny Llama shape and tokenizer, other weights
    (seed 1), so the KL term is far from 0."""
    from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint

    out = tmp_path_factory.mktemp("tiny_teacher")
    args = ModelArgs(
        **{**TINY_CONFIG, "vocab_size": SMALL_VOCAB}, rope_theta=1e5, tie_word_embeddings=True
    )
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(1))
    save_hf_checkpoint(model, out, args.to_hf_config())
    copy_tokenizer_files(small_tokenizer_dir, out)
    return out


def test_kd_hsdp_equals_one(tiny_model_dir, teacher_dir, small_dataset, tmp_path):
    """KD under HSDP 2 x 2 (the student sharded over dp_shard, replicated over dp_replicate; the
    teacher whole on each rank) equals 1 process."""
    results = {}
    for world, replicate in ((1, 1), (4, 2)):
        overrides = dict(teacher=str(teacher_dir), kd_ratio=0.5, dp_replicate=replicate)
        out = str(tmp_path / f"ws{world}")
        args = ("kd_smollm2", str(tiny_model_dir), str(small_dataset), out, overrides)
        results[world] = spawn(_train, world_size=world, args=args)
    (ref,) = results[1]
    for losses in results[4]:
        assert losses == pytest.approx(ref, abs=1e-5), (losses, ref)
    one = load_file(tmp_path / "ws1" / "model.safetensors")
    many = load_file(tmp_path / "ws4" / "model.safetensors")
    assert one.keys() == many.keys()
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert any(not torch.equal(one[k], start[k]) for k in one)  # the student was trained
    for key, tensor in one.items():  # AdamW's first steps amplify reduction-order noise
        torch.testing.assert_close(
            many[key], tensor, atol=1e-4, rtol=1e-4, msg=lambda m, key=key: key + m
        )
