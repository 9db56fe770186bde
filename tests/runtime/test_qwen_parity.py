"""Qwen2/Qwen2.5, Qwen3 and Qwen3-MoE against transformers: logits, grads, routing, aux loss,
checkpoint round trips (both directions, tied and untied), meta-device loading, KV cache."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from runtime.checkpoint import load_hf_checkpoint, read_hf_config, save_hf_checkpoint
from runtime.generate import generate
from runtime.models.llama import KVCache, ModelArgs, build_model
from runtime.models.moe import SparseMoeBlock, load_balancing_loss, route_top_k
from tests.helpers import TINY_CONFIG, safetensors_keys

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

# The tiny config (tests/helpers.py TINY_CONFIG); MoE: 4 experts, top-2, expert width 32.
TINY = dict(
    **TINY_CONFIG,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
HF_CONFIGS = {
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "qwen3_moe": transformers.Qwen3MoeConfig,
}
HF_MODELS = {
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
}
B, S = 2, 16
IDS = torch.randint(0, TINY["vocab_size"], (B, S), generator=torch.Generator().manual_seed(1))


def hf_config(family: str, **overrides):
    base = {**TINY, **(TINY_MOE if family == "qwen3_moe" else {})}
    cfg = HF_CONFIGS[family](**{**base, **overrides})
    cfg._attn_implementation = "eager"  # an independent reference: not our SDPA path
    cfg._experts_implementation = "eager"  # HF's plain per-expert loop, not its grouped_mm
    return cfg


def hf_tiny_model(family: str, seed: int = 0, **overrides):
    """A transformers model with every weight random (norms, biases and router too)."""
    torch.manual_seed(seed)
    model = HF_MODELS[family](hf_config(family, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise)
    return model


def hf_to_disk_layout(tensors: dict, moe_intermediate_size: int) -> dict:
    """transformers 5 keeps experts fused in memory ([E, 2I, D] gate_up, [E, D, I] down); map
    them to the per-expert keys of checkpoints on disk (and of our model)."""
    out = {}
    for key, t in tensors.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                gate, up = t[e].split(moe_intermediate_size, dim=0)  # [2I, D] -> 2 x [I, D]
                out[f"{prefix}{e}.gate_proj.weight"] = gate
                out[f"{prefix}{e}.up_proj.weight"] = up
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[key] = t
    return out


def ours_from_hf(hf_model):
    """Our model from the HF config, weights copied with strict key equality (disk layout)."""
    args = ModelArgs.from_hf_config(hf_model.config.to_dict(), source="test config")
    model = build_model(args, device="cpu")
    sd = hf_to_disk_layout(hf_model.state_dict(), args.moe_intermediate_size)
    assert set(model.state_dict()) == set(sd), set(model.state_dict()) ^ set(sd)
    model.load_state_dict(sd, strict=True)
    return model


def hf_grads(hf_model, moe_intermediate_size: int) -> dict:
    return hf_to_disk_layout(
        {n: p.grad for n, p in hf_model.named_parameters()}, moe_intermediate_size
    )


# (family, kv heads, tied, extra HF overrides): GQA 1/2/4, tied and untied in every family,
# Qwen3 with attention_bias, MoE with and without top-k renormalisation and with dense layers
# mixed in (decoder_sparse_step, mlp_only_layers).
CASES = [
    ("qwen2", 2, True, {}),
    ("qwen2", 1, False, {}),
    ("qwen3", 2, True, {}),
    ("qwen3", 4, False, {"attention_bias": True}),
    ("qwen3_moe", 2, False, {"norm_topk_prob": True}),
    ("qwen3_moe", 1, True, {"norm_topk_prob": False}),
    ("qwen3_moe", 2, False, {"norm_topk_prob": True, "decoder_sparse_step": 2}),
    ("qwen3_moe", 4, False, {"mlp_only_layers": [1], "num_experts_per_tok": 1}),
]


@pytest.mark.parametrize("family, kv_heads, tie, extra", CASES)
def test_logits_and_grads_match_hf(family, kv_heads, tie, extra):
    hf = hf_tiny_model(family, num_key_value_heads=kv_heads, tie_word_embeddings=tie, **extra)
    ours = ours_from_hf(hf)
    assert ours.args.model_type == family
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    assert sum(p.numel() for p in ours.parameters()) == ours.args.num_params()
    assert ours.args.num_params() == sum(p.numel() for p in hf.parameters())
    targets = torch.roll(IDS, -1, dims=1)

    logits = ours(IDS)
    hf_logits = hf(IDS).logits
    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=1e-5)

    loss_fn = torch.nn.functional.cross_entropy
    loss_fn(logits.flatten(0, 1), targets.flatten()).backward()
    loss_fn(hf_logits.flatten(0, 1), targets.flatten()).backward()
    ref = hf_grads(hf, ours.args.moe_intermediate_size)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_module_layout_per_family():
    """Bias placement and QK-norm follow model_type: Llama's attention_bias is on all four
    projections, Qwen2's bias on q/k/v only, Qwen3 has q_norm/k_norm and no bias."""

    def attn_keys(args):
        return {k for k in build_model(args).state_dict() if ".layers.0.self_attn." in k}

    proj = {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    bias = {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}
    norms = {f"model.layers.0.self_attn.{n}_norm.weight" for n in "qk"}
    llama_bias = ModelArgs(**TINY, attention_bias=True)
    assert attn_keys(llama_bias) == proj | bias
    qwen2 = ModelArgs.from_hf_config(hf_config("qwen2").to_dict())
    assert attn_keys(qwen2) == proj | (bias - {"model.layers.0.self_attn.o_proj.bias"})
    qwen3 = ModelArgs.from_hf_config(hf_config("qwen3").to_dict())
    assert attn_keys(qwen3) == proj | norms
    moe = ModelArgs.from_hf_config(hf_config("qwen3_moe", mlp_only_layers=[0]).to_dict())
    mlp_keys = {k for k in build_model(moe).state_dict() if ".mlp." in k}
    assert "model.layers.0.mlp.gate_proj.weight" in mlp_keys  # dense layer
    assert "model.layers.1.mlp.gate.weight" in mlp_keys  # router
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in mlp_keys
    assert not any(".mlp.experts.gate_up_proj" in k for k in mlp_keys)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_block_routing_and_output_match_hf(norm_topk_prob):
    """Same chosen experts, same weights, same block output (and input grad) as HF's block."""
    cfg = hf_config("qwen3_moe", norm_topk_prob=norm_topk_prob, num_experts=8)
    torch.manual_seed(0)
    hf_block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in hf_block.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    ours = SparseMoeBlock(64, 32, 8, 2, norm_topk_prob)
    sd = hf_to_disk_layout({f"mlp.{k}": v for k, v in hf_block.state_dict().items()}, 32)
    ours.load_state_dict({k.removeprefix("mlp."): v for k, v in sd.items()}, strict=True)
    # float64: HF sums the experts' outputs in another order, and in fp32 that alone moved one
    # output element by 1.2e-6 and two input-grad elements by 3.8e-5 (cancellation) on this
    # machine; in float64 the comparison is of the math, at the same tolerances
    hf_block, ours = hf_block.double(), ours.double()
    x = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()

    hf_logits, hf_weights, hf_experts = hf_block.gate(x_hf.reshape(-1, 64))
    out = ours(x_ours)
    weights, experts = route_top_k(ours.router_logits, 2, norm_topk_prob)
    torch.testing.assert_close(ours.router_logits, hf_logits, atol=1e-6, rtol=1e-6)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(B * S, dtype=torch.float64))
    hf_out = hf_block(x_hf)
    torch.testing.assert_close(out, hf_out, atol=1e-6, rtol=1e-6)
    out.square().sum().backward()
    hf_out.square().sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=1e-5, rtol=1e-5)


def test_unused_expert_gets_zero_grad_not_none():
    block = SparseMoeBlock(64, 32, 4, 1, False)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[0, :] = 1.0  # positive inputs: every token picks expert 0
    block(torch.rand(1, 4, 64)).sum().backward()
    assert block.experts[0].up_proj.weight.grad.abs().sum() > 0
    for expert in block.experts[1:]:
        assert torch.equal(expert.up_proj.weight.grad, torch.zeros(32, 64))


def test_router_logits_are_kept_only_when_asked_for():
    """Under activation checkpointing a forward that did not ask for router logits leaves no
    block holding any after backward (the recompute's graph would keep every block's recomputed
    tensors alive to the end of backward); one that asks gets them."""
    from torch.distributed._composable import checkpoint

    model = ours_from_hf(hf_tiny_model("qwen3_moe"))
    for layer in model.model.layers:
        checkpoint(layer)
    model(IDS).sum().backward()
    assert all(layer.mlp.router_logits is None for layer in model.model.layers)
    _, router_logits = model(IDS, output_router_logits=True)
    assert len(router_logits) == 2 and all(r.grad_fn is not None for r in router_logits)


@pytest.mark.parametrize("with_mask", [False, True])
def test_load_balancing_loss_matches_hf(with_mask):
    gen = torch.Generator().manual_seed(3)
    logits = tuple(torch.randn(B * S, 4, generator=gen) for _ in range(3))
    mask = None
    if with_mask:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, :5] = 0  # left padding
    ours = load_balancing_loss(logits, num_experts=4, top_k=2, attention_mask=mask)
    ref = modeling_qwen3_moe.load_balancing_loss_func(logits, 4, 2, mask)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    uniform = tuple(torch.zeros(B * S, 4) for _ in range(2))
    # Uniform probabilities: E * sum_e f_e * (1/E) = sum_e f_e = k.
    torch.testing.assert_close(load_balancing_loss(uniform, 4, 2), torch.tensor(2.0))


def test_aux_loss_and_its_grads_match_hf_model():
    """End to end: model router logits -> aux loss equals HF's `aux_loss`, with the same grads."""
    hf = hf_tiny_model("qwen3_moe", norm_topk_prob=True, router_aux_loss_coef=0.01)
    ours = ours_from_hf(hf)
    assert ours.args.router_aux_loss_coef == 0.01
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0
    logits, router_logits = ours(IDS, output_router_logits=True)
    assert len(router_logits) == 2 and router_logits[0].shape == (B * S, 4)
    hf_out = hf(IDS, output_router_logits=True, attention_mask=None)
    torch.testing.assert_close(logits, hf_out.logits, atol=1e-5, rtol=1e-5)
    for r, h in zip(router_logits, hf_out.router_logits):
        torch.testing.assert_close(r, h, atol=1e-5, rtol=1e-5)
    aux = load_balancing_loss(router_logits, 4, 2, mask)
    hf_aux = modeling_qwen3_moe.load_balancing_loss_func(hf_out.router_logits, 4, 2, mask)
    torch.testing.assert_close(aux, hf_aux, atol=1e-6, rtol=1e-6)
    (ours.args.router_aux_loss_coef * aux).backward()
    (hf.config.router_aux_loss_coef * hf_aux).backward()
    hf_params = dict(hf.named_parameters())
    for i in range(2):
        name = f"model.layers.{i}.mlp.gate.weight"
        torch.testing.assert_close(
            ours.get_parameter(name).grad, hf_params[name].grad, atol=1e-7, rtol=1e-5
        )
    hidden, router_logits = ours.forward_hidden(IDS, output_router_logits=True)
    assert hidden.shape == (B, S, 64) and len(router_logits) == 2
    dense = build_model(ModelArgs(**TINY), device="cpu")
    assert dense(IDS, output_router_logits=True)[1] == ()


@torch.no_grad()
def assert_same_logits(ours, hf) -> None:
    torch.testing.assert_close(ours(IDS), hf(IDS).logits, atol=1e-5, rtol=1e-5)


ROUND_TRIP_CASES = [
    ("qwen2", True),
    ("qwen2", False),
    ("qwen3", True),
    ("qwen3", False),
    ("qwen3_moe", False),
    ("qwen3_moe", True),
]


@pytest.mark.parametrize("family, tie", ROUND_TRIP_CASES)
def test_transformers_save_loads_into_meta_built_model(tmp_path, family, tie):
    """HF save_pretrained -> from_hf_config -> build on meta -> to_empty -> load: same logits."""
    hf = hf_tiny_model(family, tie_word_embeddings=tie)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")  # sharded: exercises the index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    args = ModelArgs.from_hf_config(read_hf_config(tmp_path), source=str(tmp_path))
    model = build_model(args, device="meta")
    assert set(model.state_dict()) >= safetensors_keys(tmp_path)  # HF's on-disk keys are ours
    model.to_empty(device="cpu")
    model.init_rope()
    load_hf_checkpoint(model, tmp_path)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert_same_logits(model, hf)


@pytest.mark.parametrize("family, tie", ROUND_TRIP_CASES)
def test_our_save_loads_in_transformers_and_back(tmp_path, family, tie):
    hf_ref = hf_tiny_model(family, tie_word_embeddings=tie)
    model = ours_from_hf(hf_ref)
    out = tmp_path / "out"
    save_hf_checkpoint(model, out, model.args.to_hf_config(), max_shard_bytes=100_000)
    keys = safetensors_keys(out)
    assert ("lm_head.weight" in keys) == (not tie)
    if family == "qwen3_moe":
        assert "model.layers.1.mlp.experts.3.gate_proj.weight" in keys  # on-disk layout
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf) is HF_MODELS[family]
    assert hf.config.model_type == family
    assert_same_logits(model, hf)
    reloaded = build_model(ModelArgs.from_hf_config(read_hf_config(out)), device="cpu")
    load_hf_checkpoint(reloaded, out)
    for (name, p), q in zip(reloaded.named_parameters(), model.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    """Qwen3-0.6B/1.7B/4B are tied yet their safetensors also hold `lm_head.weight`."""
    hf = hf_tiny_model("qwen3", tie_word_embeddings=True)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    args = ModelArgs.from_hf_config(read_hf_config(tmp_path))
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    model.init_rope()
    load_hf_checkpoint(model, tmp_path)  # strict: the extra head key is the tied alias
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_same_logits(model, hf)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_kv_cache_equals_no_cache(family):
    ours = ours_from_hf(hf_tiny_model(family))
    args = ours.args
    cache = KVCache(args.num_hidden_layers, B, S, args.num_key_value_heads, args.head_dim,
                    torch.float32, "cpu")  # fmt: skip
    with torch.no_grad():
        full = ours(IDS)
        parts = [ours(IDS[:, :9], kv_cache=cache)]
        parts += [ours(IDS[:, t : t + 1], kv_cache=cache) for t in range(9, S)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
        # Greedy generation with the cache equals re-running the whole sequence each step.
        prompts = [[5, 17, 99, 3], [11, 12]]
        new = generate(ours, prompts, 6)
        for prompt, row in zip(prompts, new):
            seq = list(prompt)
            for _ in range(6):
                seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
            assert row == seq[len(prompt) :]


def test_from_hf_config_fields_and_round_trip():
    for family in HF_CONFIGS:
        args = ModelArgs.from_hf_config(hf_config(family).to_dict(), source="c.json")
        again = ModelArgs.from_hf_config(HF_CONFIGS[family](**args.to_hf_config()).to_dict())
        assert again == args, family
        assert args.to_hf_config()["architectures"] == [HF_MODELS[family].__name__]
    moe = ModelArgs.from_hf_config(hf_config("qwen3_moe", norm_topk_prob=True).to_dict())
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 32)
    assert moe.norm_topk_prob and moe.use_qk_norm and not moe.qkv_bias
    # Qwen's own config.json spells num_experts; transformers 5 writes num_local_experts.
    raw = {k: v for k, v in moe.to_hf_config().items()}
    assert raw["num_experts"] == 4
    raw["num_local_experts"] = raw.pop("num_experts")
    assert ModelArgs.from_hf_config(raw) == moe
    # Qwen3Config's head_dim default is 128, not hidden_size // num_attention_heads.
    no_head_dim = {k: v for k, v in hf_config("qwen3").to_dict().items() if k != "head_dim"}
    assert ModelArgs.from_hf_config(no_head_dim).head_dim == 128
    qwen2 = ModelArgs.from_hf_config(hf_config("qwen2").to_dict())
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.use_qk_norm
    assert qwen2.head_dim == 16  # hidden_size // num_attention_heads


def test_num_active_params_counts_top_k_experts():
    moe = ModelArgs(**TINY, model_type="qwen3_moe", **TINY_MOE, mlp_only_layers=[0])
    dense_layer = 3 * 64 * 128
    expert = 3 * 64 * 32
    router = 4 * 64
    assert moe.num_params() - moe.num_active_params() == (4 - 2) * expert  # one MoE layer
    hf = HF_MODELS["qwen3_moe"](HF_CONFIGS["qwen3_moe"](**moe.to_hf_config()))
    assert moe.num_params() == sum(p.numel() for p in hf.parameters())
    qwen3_dense = ModelArgs(**TINY, model_type="qwen3")
    assert moe.num_params() - qwen3_dense.num_params() == 4 * expert + router - dense_layer
    dense = ModelArgs(**TINY, model_type="qwen2")
    assert dense.num_active_params() == dense.num_params()


def test_from_hf_config_errors_name_file_and_supported_types():
    bad = {**hf_config("qwen2").to_dict(), "model_type": "mistral"}
    bad["architectures"] = ["MistralForCausalLM"]
    with pytest.raises(ValueError) as err:
        ModelArgs.from_hf_config(bad, source="/ckpt/config.json")
    msg = str(err.value)
    assert "/ckpt/config.json" in msg and "'mistral'" in msg
    for family in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        assert f"'{family}'" in msg
    sliding = {**hf_config("qwen2").to_dict(), "use_sliding_window": True}
    with pytest.raises(ValueError, match=r"c.json.*use_sliding_window=True"):
        ModelArgs.from_hf_config(sliding, source="c.json")
    mixed = {**hf_config("qwen3").to_dict(), "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(ValueError, match=r"c.json.*sliding_attention"):
        ModelArgs.from_hf_config(mixed, source="c.json")
    incomplete = {k: v for k, v in hf_config("qwen3_moe").to_dict().items()}
    incomplete.pop("moe_intermediate_size")
    with pytest.raises(ValueError, match=r"c.json.*moe_intermediate_size"):
        ModelArgs.from_hf_config(incomplete, source="c.json")
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelArgs(**TINY, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5,
                  moe_intermediate_size=32)  # fmt: skip
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        ModelArgs(**TINY, model_type="gpt2")


def test_moe_fsdp2_load_train_step_and_save(tmp_path):
    """1-rank gloo FSDP2 on a meta-built Qwen3-MoE: load, aux-loss backward, save, reload."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ref = ours_from_hf(hf_tiny_model("qwen3_moe", tie_word_embeddings=True))
    save_hf_checkpoint(ref, tmp_path / "in", ref.args.to_hf_config())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = build_model(ref.args, device="meta")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.init_rope()
        load_hf_checkpoint(model, tmp_path / "in")
        logits, router_logits = model(IDS, output_router_logits=True)
        torch.testing.assert_close(logits, ref(IDS), atol=1e-5, rtol=1e-5)
        aux = load_balancing_loss(router_logits, 4, 2)
        (logits.logsumexp(-1).mean() + ref.args.router_aux_loss_coef * aux).backward()
        assert all(p.grad is not None for p in model.parameters())  # every expert, every step
        save_hf_checkpoint(model, tmp_path / "out", ref.args.to_hf_config())
    finally:
        dist.destroy_process_group()
    reloaded = build_model(ref.args, device="cpu")
    load_hf_checkpoint(reloaded, tmp_path / "out")
    for (name, p), q in zip(reloaded.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)
