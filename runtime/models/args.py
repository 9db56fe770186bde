"""Model dimensions and family switches (`ModelArgs`), read from and written to HF config.json.

Field names are Hugging Face's config names, so `ModelArgs.from_hf_config(json.load(...))` reads
a checkpoint's config.json of model_type llama, qwen2 (Qwen2 / Qwen2.5), qwen3 or qwen3_moe
(transformers 4.x and 5.x layouts), and `to_hf_config()` writes one transformers and vLLM load.
No torch here: the generator's catalog and `scaffold list` count parameters with it.

Reference: HF `LlamaConfig`, `Qwen2Config`, `Qwen3Config`, `Qwen3MoeConfig` (transformers 5.x),
whose defaults apply when config.json omits a field.
"""

from __future__ import annotations

from dataclasses import dataclass

_SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
_HF_DEFAULT_RMS_NORM_EPS = 1e-6  # LlamaConfig's default when config.json omits rms_norm_eps
_HF_DEFAULT_ROPE_THETA = 10000.0  # LlamaConfig's default when config.json omits rope_theta


# HF model_type -> the `architectures` entry transformers writes for it.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# ... and the sequence-classification head over the same decoder (a reward model's, num_labels=1)
HF_SEQUENCE_CLASSIFICATION_ARCHITECTURES = {
    t: a.replace("ForCausalLM", "ForSequenceClassification") for t, a in HF_ARCHITECTURES.items()
}
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")
_QWEN3_DEFAULT_HEAD_DIM = 128  # Qwen3Config's default when config.json omits head_dim
_HF_DEFAULT_ROUTER_AUX_LOSS_COEF = 0.001  # Qwen3MoeConfig's default


@dataclass
class ModelArgs:
    """Decoder dimensions, named exactly as Hugging Face's config fields.

    `model_type` selects the family (see the table in runtime.models.llama). `head_dim=None` means
    `hidden_size // num_attention_heads`; `num_key_value_heads=None` means `num_attention_heads`
    (no GQA). `rope_scaling` is the HF dict form, e.g. `{"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}`;
    None or rope_type "default" means plain RoPE.

    Mixture of experts (qwen3_moe): layer i uses a `SparseMoeBlock` of `num_experts` SwiGLU
    experts of width `moe_intermediate_size`, `num_experts_per_tok` per token, when
    `num_experts > 0`, i is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`
    (HF's rule); other layers use a dense SwiGLU of width `intermediate_size`.
    `router_aux_loss_coef` is the weight a recipe gives `load_balancing_loss`.

    Raises:
        ValueError: unknown model_type, num_attention_heads not a multiple of
            num_key_value_heads, odd head_dim, an unsupported / incomplete rope_scaling, or
            inconsistent MoE fields.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = _HF_DEFAULT_ROUTER_AUX_LOSS_COEF

    def __post_init__(self) -> None:
        if self.model_type not in HF_ARCHITECTURES:
            raise ValueError(
                f"ModelArgs.model_type={self.model_type!r} is not supported; pick one of "
                f"{list(HF_ARCHITECTURES)}."
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; GQA shares each KV head by a whole "
                "number of query heads, so pick num_key_value_heads dividing num_attention_heads."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of dims.")
        self.rope_scaling = _normalize_rope_scaling(
            self.rope_scaling, self.max_position_embeddings, "ModelArgs.rope_scaling"
        )
        self.mlp_only_layers = tuple(self.mlp_only_layers)  # HF writes a list; keep it hashable
        self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts == 0:
            return
        if self.model_type != "qwen3_moe":
            raise ValueError(
                f"num_experts={self.num_experts} with model_type={self.model_type!r}: only "
                "'qwen3_moe' has experts; set num_experts=0 or model_type='qwen3_moe'."
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                f"{self.num_experts}]: each token is sent to that many distinct experts."
            )
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError(
                f"moe_intermediate_size={self.moe_intermediate_size} and decoder_sparse_step="
                f"{self.decoder_sparse_step} must both be >= 1 when num_experts > 0."
            )

    @property
    def qkv_bias(self) -> bool:
        """Bias on q/k/v_proj: Qwen2 always has it; the others follow attention_bias."""
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        """Bias on o_proj: never for Qwen2 (its o_proj is bias-free); else attention_bias."""
        return self.model_type != "qwen2" and self.attention_bias

    @property
    def use_qk_norm(self) -> bool:
        """Qwen3 / Qwen3-MoE: RMSNorm over Dh of every q and k head, before RoPE."""
        return self.model_type in _QK_NORM_TYPES

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a SparseMoeBlock as its `mlp` (HF's Qwen3-MoE rule)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> ModelArgs:
        """Build from a HF `config.json` dict (transformers 4.x or 5.x layout).

        Args:
            cfg: the parsed config.json, of model_type llama, qwen2, qwen3 or qwen3_moe. 4.x
                keeps `rope_theta`/`rope_scaling` at top level; 5.x nests them in
                `rope_parameters: {rope_theta, rope_type, factor, ...}`.
            source: where `cfg` came from, named in error messages.

        Returns:
            The ModelArgs of that checkpoint.

        Raises:
            ValueError: an unsupported model_type or architecture, hidden_act other than silu,
                an unsupported rope type, sliding-window attention, or a required field missing.
        """
        model_type = cfg.get("model_type")
        expected = HF_ARCHITECTURES.get(model_type)
        archs = cfg.get("architectures") or [expected]
        scored = HF_SEQUENCE_CLASSIFICATION_ARCHITECTURES.get(model_type)
        if expected is None or (expected not in archs and scored not in archs):
            supported = ", ".join(f"{t!r} / {a}" for t, a in HF_ARCHITECTURES.items())
            raise ValueError(
                f"{source}: model_type={model_type!r}, architectures={archs} is not supported; "
                f"the runtime decoder loads model_type / architectures {supported}. Use a "
                "checkpoint of one of these families."
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"{source}: hidden_act={cfg['hidden_act']!r} is not supported; the SwiGLU MLP "
                "uses 'silu'. Use a checkpoint with hidden_act 'silu'."
            )
        layer_types = set(cfg.get("layer_types") or ["full_attention"])
        if cfg.get("use_sliding_window", False) or layer_types != {"full_attention"}:
            raise ValueError(
                f"{source}: sliding-window attention (use_sliding_window="
                f"{cfg.get('use_sliding_window', False)}, layer_types {sorted(layer_types)}) "
                "is not supported: every layer here attends to the full causal context. Use a "
                "config with use_sliding_window false and only 'full_attention' layers."
            )
        missing = [k for k in _REQUIRED_HF_KEYS if k not in cfg]
        if missing:
            raise ValueError(f"{source}: missing required {model_type} fields {missing}.")
        rope_theta, rope_scaling = _rope_from_hf(cfg, source)
        default_head_dim = _QWEN3_DEFAULT_HEAD_DIM if model_type == "qwen3" else None
        return cls(
            **{k: cfg[k] for k in _REQUIRED_HF_KEYS},
            num_key_value_heads=cfg.get("num_key_value_heads"),
            head_dim=cfg.get("head_dim") or default_head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=cfg.get("rms_norm_eps", _HF_DEFAULT_RMS_NORM_EPS),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 has no such field (its q/k/v bias is fixed); see ModelArgs.qkv_bias.
            attention_bias=model_type != "qwen2" and cfg.get("attention_bias", False),
            mlp_bias=model_type == "llama" and cfg.get("mlp_bias", False),
            model_type=model_type,
            **_moe_from_hf(cfg, source) if model_type == "qwen3_moe" else {},
        )

    def to_hf_config(self) -> dict:
        """A config.json dict that transformers loads as the matching config class (4.x, 5.x).

        `rope_theta` is written at top level and in `rope_parameters` (5.x); llama3 scaling is
        also written as `rope_scaling` so 4.x readers (and vLLM on them) see it.
        """
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
        cfg = {
            "architectures": [HF_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "hidden_act": "silu",
            **{k: getattr(self, k) for k in _REQUIRED_HF_KEYS},
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
        }
        if self.model_type != "qwen2":
            cfg["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            cfg["mlp_bias"] = self.mlp_bias
        else:
            cfg["use_sliding_window"] = False
        if self.model_type == "qwen3_moe":
            cfg.update({k: getattr(self, k) for k in _MOE_HF_KEYS})
            cfg["mlp_only_layers"] = list(self.mlp_only_layers)
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        return cfg

    def _attn_params(self) -> int:
        D, Dh = self.hidden_size, self.head_dim
        q_dim = self.num_attention_heads * Dh  # H * Dh
        kv_dim = self.num_key_value_heads * Dh  # Hkv * Dh
        n = 2 * D * q_dim + 2 * D * kv_dim  # q, o and k, v projections
        n += (q_dim + 2 * kv_dim) if self.qkv_bias else 0
        n += D if self.o_bias else 0
        return n + (2 * Dh if self.use_qk_norm else 0)  # + q_norm, k_norm weights

    def _mlp_params(self, layer_idx: int, active: bool) -> int:
        D = self.hidden_size
        if not self.is_moe_layer(layer_idx):
            inter = self.intermediate_size
            return 3 * D * inter + ((2 * inter + D) if self.mlp_bias else 0)
        experts = self.num_experts_per_tok if active else self.num_experts
        return experts * 3 * D * self.moe_intermediate_size + self.num_experts * D  # + router

    def _count(self, active: bool) -> int:
        D = self.hidden_size
        layers = sum(
            self._attn_params() + self._mlp_params(i, active) + 2 * D  # + the two RMSNorms
            for i in range(self.num_hidden_layers)
        )
        embed = self.vocab_size * D * (1 if self.tie_word_embeddings else 2)
        return embed + layers + D  # + final norm

    def num_params(self) -> int:
        """Total parameter count (a tied embedding counted once; every expert counted)."""
        return self._count(active=False)

    def num_active_params(self) -> int:
        """Parameters used per token: as `num_params`, but only `num_experts_per_tok` experts.

        Embedding and head are included (the convention of "Qwen3-30B-A3B: 3.3B activated").
        Equals `num_params()` for dense models.
        """
        return self._count(active=True)


_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_MOE_HF_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "router_aux_loss_coef",
)


def _moe_from_hf(cfg: dict, source: str) -> dict:
    """The MoE fields of a qwen3_moe config.json as ModelArgs kwargs (HF defaults if absent)."""
    # transformers 5 writes `num_local_experts` (an attribute_map alias); Qwen writes num_experts.
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    missing = [
        k
        for k, v in [
            ("num_experts", num_experts),
            ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
            ("moe_intermediate_size", cfg.get("moe_intermediate_size")),
        ]
        if v is None
    ]
    if missing:
        raise ValueError(f"{source}: qwen3_moe config lacks {missing}; is it complete?")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "norm_topk_prob": cfg.get("norm_topk_prob", False),
        "decoder_sparse_step": cfg.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ()),
        "router_aux_loss_coef": cfg.get("router_aux_loss_coef", _HF_DEFAULT_ROUTER_AUX_LOSS_COEF),
    }


def _normalize_rope_scaling(scaling: dict | None, max_pos: int, source: str) -> dict | None:
    """Validate a HF rope-scaling dict; return None for plain RoPE, else the llama3 dict."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope_type={rope_type!r} is not supported; the runtime supports "
            f"{list(_SUPPORTED_ROPE_TYPES)}. Use a checkpoint with one of these RoPE types."
        )
    if rope_type == "default":
        return None
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"{source}: llama3 rope scaling lacks {missing}; add them to the config.")
    out = {"rope_type": "llama3", **{k: float(scaling[k]) for k in _LLAMA3_ROPE_KEYS}}
    out["original_max_position_embeddings"] = int(
        scaling.get("original_max_position_embeddings", max_pos)
    )
    return out


def _rope_from_hf(cfg: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a 5.x `rope_parameters` or a 4.x `rope_scaling` layout."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"{source}: per-layer-type rope_parameters {sorted(params)} are not supported by "
            "this runtime; use a config with a single rope_parameters dict."
        )
    theta = params.get("rope_theta", cfg.get("rope_theta", _HF_DEFAULT_ROPE_THETA))
    max_pos = cfg.get("max_position_embeddings", 2048)
    return theta, _normalize_rope_scaling(params, max_pos, source)
