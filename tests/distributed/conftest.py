"""Fixtures of the parallel-plan tests."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import SMALL_VOCAB, TINY_CONFIG


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random checkpoints: a tied Llama and an untied Qwen3 with attention biases."""
    from runtime import ModelArgs, build_model, save_hf_checkpoint

    variants = {
        "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
        "qwen3_untied": dict(model_type="qwen3", tie_word_embeddings=False, attention_bias=True),
    }
    out = {}
    for name, extra in variants.items():
        d = tmp_path_factory.mktemp(name)
        args = ModelArgs(**TINY_CONFIG, max_position_embeddings=64, **extra)
        model = build_model(args, device="cpu")
        model.init_weights(generator=torch.Generator().manual_seed(0))
        if args.attention_bias:  # non-zero biases, so their sharding is checked too
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n.endswith("bias"):
                        p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
        save_hf_checkpoint(model, d, args.to_hf_config())
        out[name] = str(d)
    return out


@pytest.fixture(scope="module")
def shardable_model_dir(tmp_path_factory, small_tokenizer_dir):
    """A 2-layer Llama whose every projection's NF4 blocks split evenly over 2 ranks (hidden 256)."""
    from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint

    out = tmp_path_factory.mktemp("tiny_256")
    dims = dict(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=SMALL_VOCAB)
    args = ModelArgs(**{**TINY_CONFIG, **dims}, rope_theta=1e5, tie_word_embeddings=True)
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, out, args.to_hf_config())
    copy_tokenizer_files(small_tokenizer_dir, out)
    return out
