"""runtime.lora: LoRA / DoRA / QLoRA math, the PEFT layout (checked against the peft library), the
merged HF export (checked against transformers) and the load paths (meta, NF4, strict adapters)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from runtime.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from runtime.lora import (
    LORA_TARGET_MODULES,
    LoRALinear,
    adapter_param_names,
    add_lora,
    init_lora,
    is_adapter_param,
    load_adapter,
    merged_hf_tensors,
    save_adapter,
)
from runtime.models.llama import ModelArgs, build_model
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = [t for t in LORA_TARGET_MODULES if t != "lm_head"]
IDS = torch.randint(
    0, TINY_CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
)


def tiny_model(tie: bool = True, seed: int = 0, bias: bool = False):
    args = ModelArgs(**TINY_CONFIG, tie_word_embeddings=tie, attention_bias=bias)
    model = build_model(args, device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    return model


@torch.no_grad()
def perturb_adapters(model, seed: int = 3) -> None:
    """Non-zero B (and a magnitude away from ||W||), as after some training."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if is_adapter_param(name):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def lora_model(use_dora=False, targets=ALL, tie=True, bias=False, seed=0):
    model = tiny_model(tie=tie, bias=bias, seed=seed)
    add_lora(model, targets, rank=4, alpha=8, use_dora=use_dora)
    init_lora(model, seed=0)
    return model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_init_equals_base_and_merge_equals_unmerged(use_dora):
    base = tiny_model(bias=True)
    with torch.no_grad():
        ref = base(IDS)
    model = lora_model(use_dora, bias=True)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), ref, atol=1e-5, rtol=1e-5)  # B = 0, m = ||W||
    perturb_adapters(model)
    with torch.no_grad():
        adapted = model(IDS)
        assert (adapted - ref).abs().max() > 1e-3  # the adapters now matter
        merged = tiny_model(bias=True)
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                merged.get_submodule(name).weight.copy_(module.merged_weight())
        torch.testing.assert_close(merged(IDS), adapted, atol=1e-5, rtol=1e-5)


def test_init_is_kaiming_b_zero_and_deterministic():
    a, b = lora_model(), lora_model()
    q = a.model.layers[0].self_attn.q_proj
    assert torch.equal(q.lora_B.weight, torch.zeros_like(q.lora_B.weight))
    bound = 1 / TINY_CONFIG["hidden_size"] ** 0.5  # kaiming_uniform(a=sqrt(5)): 1/sqrt(fan_in)
    assert q.lora_A.weight.abs().max() <= bound and q.lora_A.weight.std() > bound / 3
    assert q.scale == 8 / 4
    for (n, p), (_, p2) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, p2), n


def test_only_adapters_are_adapter_params_and_keys_are_peft_like():
    model = lora_model(use_dora=True)
    names = adapter_param_names(model)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert "model.layers.1.mlp.down_proj.lora_magnitude_vector" in names
    assert len(names) == 2 * 7 * 3
    assert "model.layers.0.self_attn.q_proj.weight" in dict(model.named_parameters())


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_saved_adapter_loads_in_peft_with_equal_logits(use_dora, tmp_path):
    """Our PEFT-layout save, loaded by peft.PeftModel onto the transformers model: same logits."""
    model = lora_model(use_dora, targets=["q_proj", "v_proj", "down_proj", "lm_head"], tie=False)
    perturb_adapters(model)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    save_hf_checkpoint(model, base_dir, model.args.to_hf_config(), tensors=_base_tensors(model))
    save_adapter(model, adapter_dir, str(base_dir))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["use_dora"] == use_dora
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(IDS).logits, model(IDS), atol=1e-5, rtol=1e-5)
        # and peft's own merge equals our merged export
        merged_dir = tmp_path / "merged"
        save_hf_checkpoint(
            model,
            merged_dir,
            model.args.to_hf_config(),
            tensors=merged_hf_tensors(model, model.args.to_hf_config()),
        )
        ours_merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir)
        peft_merged = peft_model.merge_and_unload()
        torch.testing.assert_close(
            ours_merged(IDS).logits, peft_merged(IDS).logits, atol=1e-5, rtol=1e-5
        )


def _base_tensors(model):
    """The base model's HF tensors only (what a base checkpoint holds)."""
    from runtime.checkpoint import tensors_to_save as _tensors_to_save

    hf = _tensors_to_save(model, model.args.to_hf_config())
    return {n: t for n, t in hf.items() if not is_adapter_param(n)}


def test_peft_adapter_loads_into_ours_strictly(tmp_path):
    """An adapter written by peft itself (get_peft_model + save_pretrained) loads with strict keys
    and gives peft's logits."""
    base = tiny_model(tie=True)
    base_dir = tmp_path / "base"
    save_hf_checkpoint(base, base_dir, base.args.to_hf_config())
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL, use_dora=True)
    peft_model = peft.get_peft_model(hf, config)
    perturb_adapters(peft_model)
    peft_model.save_pretrained(tmp_path / "peft")
    model = lora_model(use_dora=True)
    load_adapter(model, tmp_path / "peft" / "")
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), peft_model.eval()(IDS).logits, atol=1e-5, rtol=1e-5)


def test_load_adapter_errors_name_the_file_and_keys(tmp_path):
    model = lora_model()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(model, tmp_path / "nowhere")
    save_adapter(model, tmp_path / "a", "base")
    fewer = lora_model(targets=["q_proj", "v_proj"])
    with pytest.raises(
        ValueError, match=r"adapter_model.safetensors.*unexpected keys \['base_model"
    ):
        load_adapter(fewer, tmp_path / "a")
    more = lora_model(targets=[*ALL])
    weights = tmp_path / "a" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    sd = load_file(weights)
    sd.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    save_file(sd, weights)
    with pytest.raises(ValueError, match=r"missing keys \['model.layers.0.self_attn.q_proj.lora_A"):
        load_adapter(more, tmp_path / "a")
    with pytest.raises(ValueError, match="use_dora=False"):
        load_adapter(lora_model(use_dora=True), tmp_path / "a")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(target_modules=["lm_head"]),
            "ties lm_head.*remove 'lm_head' from --lora_target_modules",
        ),
        (dict(target_modules=["qkv"]), "unknown \\['qkv'\\]; valid: q_proj, k_proj"),
        (dict(target_modules=[]), "unknown \\(empty list\\)"),
        (dict(target_modules=["q_proj"], rank=0), "lora_rank=0: must be >= 1"),
        (dict(target_modules=["q_proj"], dropout=1.0), "lora_dropout=1.0"),
    ],
)
def test_bad_input_is_refused_naming_the_option(kwargs, message):
    model = tiny_model(tie=True)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        add_lora(model, **{"rank": 4, "alpha": 8, **kwargs})
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie is intact
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_meta_build_load_then_init(tmp_path):
    """The script's flow: meta -> add_lora -> to_empty -> strict base load -> init_lora gives the
    same model as adding LoRA to the loaded model."""
    ref = tiny_model()
    save_hf_checkpoint(ref, tmp_path, ref.args.to_hf_config())
    model = build_model(ref.args, device="meta")
    add_lora(model, ALL, rank=4, alpha=8, use_dora=True)
    model.to_empty(device="cpu")
    model.init_rope()
    load_hf_checkpoint(model, tmp_path, exclude=adapter_param_names(model))
    init_lora(model, seed=0)
    expected = lora_model(use_dora=True)
    for (n, p), (_, q) in zip(model.named_parameters(), expected.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=n, atol=0, rtol=0)
    with pytest.raises(ValueError, match="missing keys"):  # strict: adapters are not in the file
        load_hf_checkpoint(model, tmp_path)


# --- QLoRA ---------------------------------------------------------------------------------------


def _nf4_error_bound(layer: LoRALinear, weight: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequant(nf4(W)) - W| for 64-weight blocks with absmax s: the nearest
    NF4 level is within half the widest level gap (-1.0 -> -0.6962) of W / s, and the stored
    scaler s' (8-bit double quantization) differs from s by |s' - s| (levels are <= 1 in size)."""
    nf4 = layer.weight
    blocks = weight.reshape(-1, 64)
    s = blocks.abs().amax(dim=1, keepdim=True)
    s_stored = nf4.dequantize_scalers(
        nf4.quantized_scalers, nf4.quantization_factor, nf4.scaler_block_size
    )[:, None]
    half_gap = (nf4.nf4[1:] - nf4.nf4[:-1]).max() / 2  # 0.1519
    bound = s * half_gap + (s_stored - s).abs() + 1e-7
    return bound.expand_as(blocks).reshape(weight.shape)


def test_nf4_forward_is_the_dequantized_linear_within_nf4_error():
    torch.manual_seed(0)
    base = nn.Linear(576, 192)  # 576 wide: SmolLM2's shapes need a 216 scaler block, not 256
    x = torch.randn(3, 5, 576)
    layer = LoRALinear(base, rank=4, alpha=8, quantize_base=True)
    layer.reset_lora_parameters(torch.Generator().manual_seed(0))
    assert layer.is_nf4 and not layer.weight.requires_grad
    dequant = layer.weight.get_original_weight()
    err = (dequant - base.weight).abs()
    assert (err <= _nf4_error_bound(layer, base.weight.detach())).all()
    assert 0.02 < err.norm() / base.weight.norm() < 0.15  # a real 4-bit quantization, not a copy
    with torch.no_grad():
        torch.testing.assert_close(layer(x), nn.functional.linear(x, dequant, base.bias))
    # adapters train, the NF4 base does not; gradient w.r.t. the input flows through it
    x.requires_grad_(True)
    layer.lora_B.weight.data.normal_()
    layer(x).sum().backward()
    assert layer.lora_A.weight.grad is not None and x.grad is not None
    assert layer.weight.grad is None


@pytest.mark.parametrize("use_dora", [False, True], ids=["qlora", "qdora"])
def test_nf4_loads_tensor_by_tensor_from_meta_and_merges(use_dora, tmp_path):
    """meta NF4 layout -> to_empty -> load quantizes each file tensor: the same NF4 data as
    quantizing the loaded weights; DoRA init reads the dequantized base; merge == unmerged."""
    ref = tiny_model()
    save_hf_checkpoint(ref, tmp_path, ref.args.to_hf_config())
    model = build_model(ref.args, device="meta")
    add_lora(model, ALL, rank=4, alpha=8, use_dora=use_dora, quantize_base=True)
    model.to_empty(device="cpu")
    model.init_rope()
    load_hf_checkpoint(model, tmp_path, exclude=adapter_param_names(model))
    init_lora(model, seed=0)
    direct = tiny_model()
    add_lora(direct, ALL, rank=4, alpha=8, use_dora=use_dora, quantize_base=True)
    init_lora(direct, seed=0)
    q, dq = model.model.layers[1].mlp.up_proj, direct.model.layers[1].mlp.up_proj
    assert torch.equal(q.weight.get_original_weight(), dq.weight.get_original_weight())
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), direct(IDS), atol=0, rtol=0)
        # = the plain model whose targeted weights are the dequantized NF4 weights
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                ref.get_submodule(name).weight.copy_(module.weight.get_original_weight())
        torch.testing.assert_close(model(IDS), ref(IDS), atol=1e-5, rtol=1e-5)
    perturb_adapters(model)
    merged_dir = tmp_path / "merged"
    save_hf_checkpoint(
        model,
        merged_dir,
        ref.args.to_hf_config(),
        tensors=merged_hf_tensors(model, ref.args.to_hf_config()),
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged_dir)
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, model(IDS), atol=1e-5, rtol=1e-5)
