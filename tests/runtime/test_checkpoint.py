"""HF safetensors I/O: round trips with transformers, sharding, tied heads, strict errors, FSDP2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.checkpoint import (
    checkpoint_dtype,
    copy_tokenizer_files,
    load_hf_checkpoint,
    read_hf_config,
    read_model_args,
    save_hf_checkpoint,
    save_hf_model,
)
from runtime.models.llama import ModelArgs, build_model
from tests.helpers import TINY_CONFIG, safetensors_keys

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

transformers = pytest.importorskip("transformers")

# The tiny config (tests/helpers.py TINY_CONFIG).
TINY = dict(
    **TINY_CONFIG,
    rms_norm_eps=1e-5,
)
IDS = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
TINY_SHARD_BYTES = 40_000  # a tiny model (~360 KB fp32) then needs several shards


def tiny_model(tie: bool = False, seed: int = 0):
    """Our tiny model on CPU with random N(0, 0.1) weights."""
    model = build_model(ModelArgs(**TINY, tie_word_embeddings=tie), device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    return model


@torch.no_grad()
def assert_same_logits(ours, hf) -> None:
    torch.testing.assert_close(ours(IDS), hf(IDS).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, TINY_SHARD_BYTES])
def test_our_save_loads_in_transformers(tmp_path, tie, max_shard_bytes):
    model = tiny_model(tie)
    save_hf_checkpoint(model, tmp_path / "out", model.args.to_hf_config(), max_shard_bytes)
    out = tmp_path / "out"
    sharded = max_shard_bytes == TINY_SHARD_BYTES
    assert (out / "model.safetensors.index.json").is_file() == sharded
    assert (out / "model.safetensors").is_file() == (not sharded)
    if sharded:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == safetensors_keys(out)
        assert len(set(index["weight_map"].values())) > 1
        num_shards = len(list(out.glob("*.safetensors")))
        assert (out / f"model-00001-of-{num_shards:05d}.safetensors").is_file()
    assert ("lm_head.weight" in safetensors_keys(out)) == (not tie)
    assert not list(tmp_path.glob(".out.tmp-*")), "temp dir left behind"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float32
    assert_same_logits(model, hf)
    reloaded = build_model(model.args, device="cpu")
    load_hf_checkpoint(reloaded, out)
    assert_same_logits(reloaded, hf)


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_save_loads_into_meta_built_model(tmp_path, tie):
    hf_cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=tie)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if tie else "5GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == tie  # tied case: sharded
    args = ModelArgs.from_hf_config(read_hf_config(tmp_path))
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    model.init_rope()
    load_hf_checkpoint(model, tmp_path)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert_same_logits(model, hf)


def test_save_dtype_and_existing_dir_replaced(tmp_path):
    model = tiny_model()
    out = tmp_path / "out"
    save_hf_checkpoint(model, out, model.args.to_hf_config(), max_shard_bytes=TINY_SHARD_BYTES)
    (out / "tokenizer.json").write_text("{}")
    save_hf_checkpoint(model, out, model.args.to_hf_config(), dtype=torch.bfloat16)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]  # stale shards gone
    assert read_hf_config(out)["dtype"] == "bfloat16"
    assert checkpoint_dtype(out) == torch.bfloat16
    save_hf_checkpoint(
        model, tmp_path / "fp32", model.args.to_hf_config(), max_shard_bytes=TINY_SHARD_BYTES
    )
    assert checkpoint_dtype(tmp_path / "fp32") == torch.float32  # sharded: every shard's headers
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    reloaded = build_model(model.args, device="cpu")
    load_hf_checkpoint(reloaded, out)  # casts bf16 file -> fp32 params
    assert reloaded.model.norm.weight.dtype == torch.float32
    torch.testing.assert_close(
        reloaded.model.embed_tokens.weight,
        model.model.embed_tokens.weight.to(torch.bfloat16).float(),
    )


def _write(tmp_path, tensors: dict, config: dict) -> None:
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))


def test_strict_errors_name_keys_and_file(tmp_path):
    model = tiny_model()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    del sd["model.norm.weight"]
    sd["model.extra.weight"] = torch.zeros(3)
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 64)
    _write(tmp_path, sd, model.args.to_hf_config())
    fresh = build_model(model.args, device="cpu")
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(fresh, tmp_path)
    msg = str(err.value)
    assert "model.safetensors" in msg and "model.norm.weight" in msg
    assert "model.extra.weight" in msg
    assert "model.layers.0.mlp.up_proj.weight: file [7, 64] vs model [128, 64]" in msg
    del sd["model.layers.0.mlp.up_proj.weight"]
    _write(tmp_path, sd, model.args.to_hf_config())
    with pytest.raises(ValueError, match="up_proj"):
        load_hf_checkpoint(fresh, tmp_path)
    load_hf_checkpoint(fresh, tmp_path, strict=False)  # skips missing / unexpected keys
    torch.testing.assert_close(fresh.lm_head.weight, model.lm_head.weight)


def test_meta_parameters_left_raise(tmp_path):
    model = tiny_model()
    save_hf_checkpoint(model, tmp_path, model.args.to_hf_config())
    with pytest.raises(RuntimeError, match="meta device.*to_empty"):
        load_hf_checkpoint(build_model(model.args, device="meta"), tmp_path)


def test_read_hf_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        read_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tiny_model(), tmp_path)


def test_copy_tokenizer_files(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for name in ["tokenizer.json", "chat_template.jinja", "model.safetensors"]:
        (src / name).write_text(name)
    assert copy_tokenizer_files(src, dst) == ["tokenizer.json", "chat_template.jinja"]
    assert (dst / "chat_template.jinja").read_text() == "chat_template.jinja"
    assert not (dst / "model.safetensors").exists()


def test_load_into_fsdp2_dtensor_shards(tmp_path):
    """Rank 1 of a fake 2-rank mesh: every parameter's local shard equals its slice of the file."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    ref = tiny_model(tie=True)
    save_hf_checkpoint(ref, tmp_path, ref.args.to_hf_config())
    # The fake backend has no-op collectives; loading needs none (each rank slices locally).
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = build_model(ref.args, device="meta")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.init_rope()
        load_hf_checkpoint(model, tmp_path)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            full = ref_params[name]
            expected = full.chunk(2, dim=0)[1]  # FSDP2 shards dim 0; rank 1 holds the 2nd half
            torch.testing.assert_close(p.to_local(), expected, msg=name)
    finally:
        dist.destroy_process_group()


def test_fsdp2_load_generate_train_then_save(tmp_path):
    """1-rank gloo FSDP2: load, generate, a training forward (root left unsharded), save, reload."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from runtime.generate import generate

    ref = tiny_model(tie=True)
    save_hf_checkpoint(ref, tmp_path / "in", ref.args.to_hf_config())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(ref.args, device="meta")
        for layer in model.model.layers:
            fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        model.to_empty(device="cpu")
        model.init_rope()
        load_hf_checkpoint(model, tmp_path / "in")
        prompts = [[5, 17, 99, 3], [11, 12]]
        assert generate(model, prompts, 6) == generate(ref, prompts, 6)
        model(IDS).sum().backward()  # the root now holds unsharded (all-gathered) parameters
        save_hf_checkpoint(model, tmp_path / "out", ref.args.to_hf_config())
    finally:
        dist.destroy_process_group()
    reloaded = build_model(ref.args, device="cpu")
    load_hf_checkpoint(reloaded, tmp_path / "out")
    for (name, p), q in zip(reloaded.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_read_model_args_names_the_options_that_overflow_the_positions(tmp_path):
    model = tiny_model()
    hf_config = {**model.args.to_hf_config(), "max_position_embeddings": 128}
    save_hf_checkpoint(model, tmp_path, hf_config)
    args = read_model_args(tmp_path, {"max_seq_len": 128})
    assert (args.hidden_size, args.max_position_embeddings) == (TINY["hidden_size"], 128)
    with pytest.raises(ValueError) as e:
        read_model_args(tmp_path, {"max_seq_len": 129})
    assert str(e.value) == (
        "max_seq_len=129 exceeds the model's max_position_embeddings=128; lower --max_seq_len"
    )
    with pytest.raises(ValueError) as e:
        read_model_args(tmp_path, {"max_prompt_len": 100, "max_new_tokens": 64})
    assert str(e.value) == (
        "max_prompt_len + max_new_tokens = 164 exceeds the model's max_position_embeddings=128; "
        "lower --max_prompt_len or --max_new_tokens"
    )


def test_save_hf_model_writes_what_transformers_loads_with_the_tokenizer_and_config(tmp_path):
    model = tiny_model(tie=True)
    src = tmp_path / "src"
    save_hf_checkpoint(model, src, model.args.to_hf_config())
    (src / "tokenizer.json").write_text("{}")
    save_hf_model(model, src, tmp_path / "model", {"lr": 0.5}, is_main=True)
    out = tmp_path / "model"
    assert json.loads((out / "training_config.json").read_text()) == {"lr": 0.5}
    assert (out / "tokenizer.json").read_text() == "{}"
    assert_same_logits(model, transformers.AutoModelForCausalLM.from_pretrained(out).eval())
