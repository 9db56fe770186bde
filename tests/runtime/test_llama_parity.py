"""Parity of runtime.models.llama with transformers' LlamaForCausalLM (logits and grads)."""

from __future__ import annotations

import pytest
import torch

from runtime.models.llama import KVCache, ModelArgs, build_model
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

transformers = pytest.importorskip("transformers")

# The tiny config (tests/helpers.py TINY_CONFIG): 2 layers, hidden 64, 4 heads, 2 KV heads, Dh 16, I 128, vocab 256.
TINY = dict(
    **TINY_CONFIG,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,  # with Dh 16 this puts frequencies in all three scaling bands
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
B, S = 2, 16
# Beyond original_max_position_embeddings=8192, where llama3 scaling matters.
FAR_POSITIONS = torch.stack([torch.arange(8190, 8190 + S), torch.arange(12000, 12000 + S)])


def hf_tiny_model(seed: int = 0, **overrides):
    """A transformers LlamaForCausalLM with every weight random (norms too), eager attention."""
    cfg = transformers.LlamaConfig(**{**TINY, **overrides})
    cfg._attn_implementation = "eager"  # an independent reference: not our SDPA path
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise)
    return model


def ours_from_hf(hf_model):
    """Our model from the HF config, weights copied with strict key equality."""
    args = ModelArgs.from_hf_config(hf_model.config.to_dict(), source="test config")
    model = build_model(args, device="cpu")
    hf_sd = hf_model.state_dict()
    assert set(model.state_dict()) == set(hf_sd), set(model.state_dict()) ^ set(hf_sd)
    model.load_state_dict(hf_sd, strict=True)
    return model


# Pairwise covering of {kv heads 1, 2, 4} x tie x attention_bias x rope (every pair of values
# occurs), 6 cases instead of the 24 of the full product: same coverage of interactions, 4x faster.
CASES = [
    (1, False, False, None),
    (1, True, True, "llama3"),
    (2, False, True, "llama3"),
    (2, True, False, None),
    (4, False, False, "llama3"),
    (4, True, True, None),
]


@pytest.mark.parametrize("kv_heads, tie, attention_bias, rope", CASES)
def test_logits_and_grads_match_hf(kv_heads, tie, attention_bias, rope):
    overrides = dict(
        num_key_value_heads=kv_heads, tie_word_embeddings=tie, attention_bias=attention_bias
    )
    if rope == "llama3":
        overrides["rope_parameters"] = dict(LLAMA3_ROPE)
    hf = hf_tiny_model(**overrides)
    ours = ours_from_hf(hf)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    ids = torch.randint(0, TINY["vocab_size"], (B, S), generator=torch.Generator().manual_seed(1))
    pos = FAR_POSITIONS if rope == "llama3" else None
    targets = torch.roll(ids, -1, dims=1)

    logits = ours(ids, position_ids=pos)
    hf_logits = hf(ids, position_ids=pos).logits
    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=1e-5)

    loss_fn = torch.nn.functional.cross_entropy
    loss_fn(logits.flatten(0, 1), targets.flatten()).backward()
    loss_fn(hf_logits.flatten(0, 1), targets.flatten()).backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)


def test_far_positions_default_rope_match_hf():
    hf = hf_tiny_model()
    ours = ours_from_hf(hf)
    ids = torch.randint(0, TINY["vocab_size"], (B, S))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, position_ids=FAR_POSITIONS),
            hf(ids, position_ids=FAR_POSITIONS).logits,
            atol=1e-5,
            rtol=1e-5,
        )


def test_explicit_padding_mask_matches_hf():
    hf = hf_tiny_model()
    ours = ours_from_hf(hf)
    ids = torch.randint(1, TINY["vocab_size"], (B, S))
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :5] = False  # row 1 is left-padded by 5 tokens
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    # causal AND key-not-padding; padding queries see themselves so no row is fully masked.
    mask = ((causal & valid[:, None, :]) | torch.eye(S, dtype=torch.bool))[:, None]
    with torch.no_grad():
        logits = ours(ids, position_ids=pos, attention_mask=mask)
        hf_logits = hf(ids, attention_mask=valid.long(), position_ids=pos).logits
    torch.testing.assert_close(logits[valid], hf_logits[valid], atol=1e-5, rtol=1e-5)


def test_forward_hidden_is_pre_lm_head():
    ours = ours_from_hf(hf_tiny_model())
    ids = torch.randint(0, TINY["vocab_size"], (B, S))
    with torch.no_grad():
        hidden = ours.forward_hidden(ids)
        assert hidden.shape == (B, S, TINY["hidden_size"])
        torch.testing.assert_close(ours.lm_head(hidden), ours(ids))


def test_logits_mask_selects_positions_and_their_gradients():
    """Masked logits == full logits at the kept positions; the dropped positions get no gradient
    through lm_head, and the loss's parameter gradients equal the full-logits loss's."""
    ours = ours_from_hf(hf_tiny_model())
    ids = torch.randint(0, TINY["vocab_size"], (B, S))
    labels = torch.randint(0, TINY["vocab_size"], (B, S))
    keep = torch.rand(B, S) < 0.5
    keep[0, 0] = True
    full = ours(ids)
    masked = ours(ids, logits_mask=keep)
    assert masked.shape == (int(keep.sum()), TINY["vocab_size"])
    torch.testing.assert_close(masked, full[keep])
    loss_full = torch.nn.functional.cross_entropy(
        full.flatten(0, 1), labels.masked_fill(~keep, -100).flatten(), reduction="sum"
    )
    grads_full = torch.autograd.grad(loss_full, list(ours.parameters()))
    loss_masked = torch.nn.functional.cross_entropy(masked, labels[keep], reduction="sum")
    grads_masked = torch.autograd.grad(loss_masked, list(ours.parameters()))
    torch.testing.assert_close(loss_masked, loss_full)
    for g_full, g_masked in zip(grads_full, grads_masked, strict=True):
        torch.testing.assert_close(g_masked, g_full, atol=1e-6, rtol=1e-5)


def test_kv_cache_chunks_equal_full_forward():
    ours = ours_from_hf(hf_tiny_model())
    args = ours.args
    ids = torch.randint(0, TINY["vocab_size"], (B, S))
    cache = KVCache(args.num_hidden_layers, B, S, args.num_key_value_heads, args.head_dim,
                    torch.float32, "cpu")  # fmt: skip
    with torch.no_grad():
        full = ours(ids)
        parts = [ours(ids[:, :10], kv_cache=cache), ours(ids[:, 10:13], kv_cache=cache)]
        parts += [ours(ids[:, t : t + 1], kv_cache=cache) for t in range(13, S)]
    assert cache.seq_len == S
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="max_seq_len"):
        ours(ids[:, :1], kv_cache=cache)


def test_bf16_keeps_rope_in_fp32_and_tracks_fp32_model():
    args = ModelArgs(**{**TINY, "rope_scaling": LLAMA3_ROPE})
    model = build_model(args, device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, TINY["vocab_size"], (B, S))
    with torch.no_grad():
        ref = model(ids, position_ids=FAR_POSITIONS)
        model.to(torch.bfloat16)
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        out = model(ids, position_ids=FAR_POSITIONS)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)


def _hf_dict(**overrides) -> dict:
    return transformers.LlamaConfig(**{**TINY, **overrides}).to_dict()


def test_from_hf_config_both_layouts():
    expected = ModelArgs(**{**TINY, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE})
    v5 = _hf_dict(rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})
    assert "rope_parameters" in v5
    assert ModelArgs.from_hf_config(v5) == expected
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = 500000.0
    v4["rope_scaling"] = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert ModelArgs.from_hf_config(v4) == expected
    v4["rope_scaling"]["type"] = v4["rope_scaling"].pop("rope_type")  # oldest spelling
    assert ModelArgs.from_hf_config(v4) == expected
    plain = {k: v for k, v in v4.items() if k != "rope_scaling"}
    assert ModelArgs.from_hf_config(plain).rope_scaling is None


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_ROPE])
@pytest.mark.parametrize("tie", [False, True])
def test_to_hf_config_round_trips_through_transformers(tie, rope_scaling):
    args = ModelArgs(**{**TINY, "tie_word_embeddings": tie, "rope_scaling": rope_scaling})
    hf_cfg = transformers.LlamaConfig(**args.to_hf_config())
    assert hf_cfg.rope_parameters["rope_theta"] == args.rope_theta
    assert ModelArgs.from_hf_config(hf_cfg.to_dict()) == args
    hf_params = sum(p.numel() for p in transformers.LlamaForCausalLM(hf_cfg).parameters())
    assert args.num_params() == hf_params


def test_from_hf_config_rejects_other_models():
    bad = {**_hf_dict(), "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    with pytest.raises(ValueError, match=r"/ckpt/config.json.*'mistral'.*llama"):
        ModelArgs.from_hf_config(bad, source="/ckpt/config.json")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        ModelArgs.from_hf_config({**_hf_dict(), "hidden_act": "gelu"}, source="c.json")
    yarn = _hf_dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match=r"c.json.*rope_type='yarn'.*supports"):
        ModelArgs.from_hf_config(yarn, source="c.json")
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ModelArgs(**{**TINY, "num_key_value_heads": 3})
