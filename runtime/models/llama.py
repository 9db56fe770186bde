"""The decoder of the Llama, Qwen2/Qwen2.5, Qwen3 and Qwen3-MoE families, with HF module names.

One decoder serves every family; their differences are `ModelArgs` fields (runtime.models.args,
re-exported here) with Hugging Face's config names (`model_type`, `attention_bias`,
`num_experts`, ...):

| model_type | q/k/v bias     | o_proj bias    | q_norm/k_norm | mlp                       |
|------------|----------------|----------------|---------------|---------------------------|
| llama      | attention_bias | attention_bias | no            | SwiGLU (mlp_bias)         |
| qwen2      | always         | never          | no            | SwiGLU                    |
| qwen3      | attention_bias | attention_bias | per head      | SwiGLU                    |
| qwen3_moe  | attention_bias | attention_bias | per head      | SparseMoeBlock (or SwiGLU |
|            |                |                |               | on `mlp_only_layers`)     |

State-dict keys equal the HF checkpoints' (`model.layers.0.self_attn.q_proj.weight`,
`model.layers.0.mlp.experts.3.up_proj.weight`), so HF safetensors load 1:1 and vLLM weight sync
needs no key map.

Shape legend: B batch, S sequence (query tokens of this call), S_kv keys (cached + new),
D hidden_size, H query heads, Hkv KV heads, Dh head_dim, V vocab_size, I intermediate_size,
E num_experts.

Reference:
    Touvron et al. 2023, "Llama 2", https://arxiv.org/abs/2307.09288 (pre-norm, RMSNorm,
    SwiGLU, RoPE, GQA); HF `transformers/models/llama/modeling_llama.py` (rotate_half RoPE).
    Grattafiori et al. 2024, "The Llama 3 Herd of Models", https://arxiv.org/abs/2407.21783
    (RoPE frequency scaling, rope_type "llama3").
    Qwen Team 2024, "Qwen2.5 Technical Report", https://arxiv.org/abs/2412.15115 (QKV bias);
    HF `models/qwen2/modeling_qwen2.py`.
    Qwen Team 2025, "Qwen3 Technical Report", https://arxiv.org/abs/2505.09388 (QK-norm, no
    QKV bias, MoE); HF `models/qwen3/modeling_qwen3.py`, `models/qwen3_moe/modeling_qwen3_moe.py`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from runtime.models.args import (
    HF_ARCHITECTURES,
    HF_SEQUENCE_CLASSIFICATION_ARCHITECTURES,
    ModelArgs,
)
from runtime.models.moe import SparseMoeBlock

__all__ = [  # ModelArgs and HF_ARCHITECTURES live in runtime.models.args, re-exported here
    "HF_ARCHITECTURES",
    "HF_SEQUENCE_CLASSIFICATION_ARCHITECTURES",
    "CausalLM",
    "KVCache",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "LlamaRotaryEmbedding",
    "ModelArgs",
    "RMSNorm",
    "SequenceClassifier",
    "apply_rotary_pos_emb",
    "build_model",
    "build_sequence_classifier",
    "compute_rope_inv_freq",
    "rotate_half",
]


def compute_rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict | None, device=None
) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama 3 scaling when `rope_scaling` is set.

    Args:
        head_dim: Dh, the rotated dims per head.
        rope_theta: RoPE base.
        rope_scaling: None, or the llama3 dict of `ModelArgs.rope_scaling`.
        device: where to compute; None uses the current default device.

    Returns:
        [Dh // 2] fp32 inverse frequencies.

    Reference:
        RoFormer, https://arxiv.org/abs/2104.09864 eq. 15; Llama 3 scaling as in HF
        `modeling_rope_utils._compute_llama3_parameters` (same fp32 ops, so parity is bitwise).
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponent)
    if rope_scaling is None:
        return inv_freq
    factor = rope_scaling["factor"]
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`; short ones are kept.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # In between: interpolate smoothly between the scaled and unscaled frequency.
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., Dh] -> [..., Dh]: (x1, x2) -> (-x2, x1) over the two halves (HF Llama convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q: [B, H, S, Dh] and k: [B, Hkv, S, Dh] by cos/sin: [B, S, Dh] (in q's dtype)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, S, Dh] -> [B, 1, S, Dh], broadcast on heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight multiply (as HF).

    Reference: Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467 eq. 4.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] any float dtype -> [..., D] in x's dtype (times weight)."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LlamaRotaryEmbedding(nn.Module):
    """Holds `inv_freq` (non-persistent fp32 buffer); makes cos/sin on the fly for any position."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        inv_freq = compute_rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_inv_freq(self, device=None) -> None:
        """Recompute `inv_freq` in fp32 on `device` (default: where the buffer is)."""
        device = self.inv_freq.device if device is None else device
        a = self.args
        self.inv_freq = compute_rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling, device)

    def _apply(self, fn, recurse=True):
        # `.to(bf16)` would round inv_freq and `to_empty` leaves it uninitialised, so recompute it
        # in fp32 after any device/dtype move (a no-op while on meta).
        super()._apply(fn, recurse)
        if not self.inv_freq.is_meta:
            self.reset_inv_freq()
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids: [B, S] int64 -> (cos, sin): [B, S, Dh] each, computed in fp32, cast to dtype."""
        inv_freq = self.inv_freq.to(device=position_ids.device, dtype=torch.float32)
        freqs = position_ids[..., None].float() * inv_freq  # [B, S, 1] * [Dh/2] -> [B, S, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, Dh/2] -> [B, S, Dh]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention on `F.scaled_dot_product_attention`, with Qwen3's QK-norm.

    Reference: Ainslie et al. 2023 (GQA), https://arxiv.org/abs/2305.13245; QK-norm as HF
    `Qwen3Attention` (RMSNorm over Dh of each head, after the projection, before RoPE).
    """

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = args.head_dim
        D = args.hidden_size
        q_dim = args.num_attention_heads * args.head_dim  # H * Dh
        kv_dim = args.num_key_value_heads * args.head_dim  # Hkv * Dh
        self.q_proj = nn.Linear(D, q_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(D, kv_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(D, kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, D, bias=args.o_bias)
        if args.use_qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # context parallel (runtime.context_parallel.apply_context_parallel): the cp process
        # group whose ranks hold the other chunks of the sequence (None = the whole sequence is
        # here), and the attention over their K/V, cp_attention(q, k, v, cp_group). The parallel
        # layer installs both, so the model holds no collective.
        self.cp_group = None
        self.cp_attention: Callable[..., torch.Tensor] | None = None

    def forward(self, x, cos, sin, attention_mask, is_causal, kv_cache):
        """x: [B, S, D]; cos/sin: [B, S, Dh]; attention_mask: [B|1, 1, S, S_kv] bool, a flex
        attention BlockMask (then flex attention runs instead of SDPA), or None.

        `is_causal` is used only when attention_mask is None. Returns [B, S, D]. Under context
        parallel (`cp_group` set) x holds this rank's two chunks of every row and attention is
        causal over the K/V of all cp ranks (no KV cache); attention_mask is then None or, for
        packed rows, the [B, S] integer document ids of the local tokens (block-causal by
        document; the ring mode builds each block's mask from them).
        """
        B, S, _ = x.shape
        # -1 for the head count: tensor parallel shards heads, so a rank holds H/tp of them.
        q = self.q_proj(x).view(B, S, -1, self.head_dim)  # [B, S, H*Dh] -> [B, S, H, Dh]
        k = self.k_proj(x).view(B, S, -1, self.head_dim)  # -> [B, S, Hkv, Dh]
        v = self.v_proj(x).view(B, S, -1, self.head_dim)  # -> [B, S, Hkv, Dh]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over Dh
        q = q.transpose(1, 2)  # [B, S, H, Dh] -> [B, H, S, Dh]
        k = k.transpose(1, 2)  # [B, S, Hkv, Dh] -> [B, Hkv, S, Dh]
        v = v.transpose(1, 2)  # [B, S, Hkv, Dh] -> [B, Hkv, S, Dh]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # -> [B, Hkv, S_kv, Dh]
        if self.cp_group is not None:
            documents = attention_mask  # None, or [B, S] int document ids (packed rows)
            if kv_cache is not None or not is_causal or not _document_ids(documents):
                raise NotImplementedError(
                    "context parallel attention is causal over whole rows, or block-causal by "
                    "document given [B, S] integer document ids as attention_mask: a dense or "
                    "flex mask, a KV cache (decoding) or non-causal attention is not supported; "
                    "run those without cp (cp_group=None)"
                )
            out = self.cp_attention(q, k, v, self.cp_group, documents)  # [B, H, S, Dh]
        elif isinstance(attention_mask, BlockMask):  # flex attention (packed documents on GPU)
            out = _flex_attention(q, k, v, attention_mask)  # [B, H, S, Dh]
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attention_mask,
                is_causal=is_causal and attention_mask is None,
                enable_gqa=q.shape[1] != k.shape[1],
            )  # [B, H, S, Dh]
        out = out.transpose(1, 2)  # [B, H, S, Dh] -> [B, S, H, Dh]
        out = out.reshape(B, S, -1)  # [B, S, H, Dh] -> [B, S, H*Dh]
        return self.o_proj(out)


def _document_ids(mask) -> bool:
    """Context parallel's attention_mask: None, or [B, S] integer document ids (packed rows)."""
    if mask is None:
        return True
    return (
        isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and not mask.is_floating_point()
        and mask.dtype != torch.bool
    )


@functools.cache
def _compiled_flex_attention():
    # flex attention is fast only compiled (eager runs a reference that materialises [S, S] scores);
    # one compile per shape, reused by every layer
    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(q, k, v, block_mask: BlockMask) -> torch.Tensor:
    """q: [B, H, S, Dh], k/v: [B, Hkv, S, Dh], block_mask over [S, S] -> [B, H, S, Dh].

    Compiled on CUDA; eager elsewhere (CPU has flex forward only, used by tests and inference).
    Same softmax scale (1/sqrt(Dh)) and GQA sharing as the SDPA path.
    """
    if k.shape[2] != q.shape[2]:
        raise ValueError(
            f"flex attention got {q.shape[2]} queries but {k.shape[2]} keys: a BlockMask is for "
            "training on whole packed rows, not KV-cache decoding; pass a bool mask instead."
        )
    fn = _compiled_flex_attention() if q.is_cuda else flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Reference: Shazeer 2020, arXiv:2002.05202 eq. 6."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D, inter, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(D, inter, bias=bias)
        self.up_proj = nn.Linear(D, inter, bias=bias)
        self.down_proj = nn.Linear(inter, D, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, S, D] -> [B, S, D]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)); mlp is dense or MoE."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, layer_idx)
        if args.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(
                args.hidden_size,
                args.moe_intermediate_size,
                args.num_experts,
                args.num_experts_per_tok,
                args.norm_topk_prob,
            )
        else:
            self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, attention_mask=None, is_causal=True, kv_cache=None):
        """x: [B, S, D] -> [B, S, D]; other args as `LlamaAttention.forward`."""
        h_norm = self.input_layernorm(x)
        h = x + self.self_attn(h_norm, cos, sin, attention_mask, is_causal, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF `LlamaModel`); returns hidden states."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(args)

    def forward(self, input_ids, position_ids=None, attention_mask=None, kv_cache=None):
        """Same args as `LlamaForCausalLM.forward`; returns [B, S, D] final-norm hidden states.

        With a kv_cache the new k/v are written at `kv_cache.seq_len` by every layer, then the
        cache is advanced by S once all layers ran.
        """
        B, S = input_ids.shape
        past = kv_cache.seq_len if kv_cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + S, device=input_ids.device).expand(B, S)
        h = self.embed_tokens(input_ids)  # [B, S] -> [B, S, D]
        cos, sin = self.rotary_emb(position_ids, h.dtype)
        is_causal = True
        if attention_mask is None and past > 0:
            # SDPA's is_causal aligns the diagonal top-left; with cached keys the new queries sit at
            # the bottom right, so build that mask explicitly (a single new token sees everything).
            attention_mask = _causal_mask(S, past + S, input_ids.device) if S > 1 else None
            is_causal = False
        for layer in self.layers:
            h = layer(h, cos, sin, attention_mask, is_causal, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(S)
        return self.norm(h)


def _causal_mask(S: int, S_kv: int, device) -> torch.Tensor:
    """[1, 1, S, S_kv] bool, True = may attend; query i sits at key position S_kv - S + i."""
    ones = torch.ones(S, S_kv, dtype=torch.bool, device=device)
    return ones.tril(diagonal=S_kv - S)[None, None]  # [S, S_kv] -> [1, 1, S, S_kv]


class CausalLM(nn.Module):
    """Decoder plus LM head; module tree and state-dict keys identical to HF's `*ForCausalLM`.

    One class for every `ModelArgs.model_type` (`LlamaForCausalLM` is the same class).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the same Parameter as `model.embed_tokens.weight` when tied.

        `to_empty` on plain (non-FSDP) parameters gives each module its own new Parameter and so
        unties them; `_apply` below re-ties, and calling this again is always safe.
        """
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.tie_weights()  # `.to()`/`to_empty` may have replaced the shared Parameter per module
        return self

    def init_rope(self, device=None) -> None:
        """(Re)compute the RoPE `inv_freq` buffer in fp32 on `device` (default: where it is).

        Needed after building on meta: `model.to_empty(device=...)` then `model.init_rope()`.
        """
        self.model.rotary_emb.reset_inv_freq(device)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random init for tests: N(0, std) linear/embedding weights, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def forward_hidden(
        self,
        input_ids,
        position_ids=None,
        attention_mask=None,
        kv_cache=None,
        output_router_logits: bool = False,
    ):
        """Final-norm hidden states [B, S, D] (pre lm_head), for a chunked linear-CE loss.

        Args and the router-logits tuple as `forward`. Under FSDP2, first
        `register_fsdp_forward_method(model, "forward_hidden")` so the root's all-gather hooks
        run for this method too.
        """
        self._keep_router_logits(output_router_logits)
        hidden = self.model(input_ids, position_ids, attention_mask, kv_cache)
        return (hidden, self.router_logits()) if output_router_logits else hidden

    def _keep_router_logits(self, keep: bool) -> None:
        """Have the MoE blocks keep their router logits (and graphs) only when asked for."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.keep_router_logits = keep

    def router_logits(self) -> tuple[torch.Tensor, ...]:
        """Each MoE layer's [T, E] router logits from the latest forward, in layer order.

        Empty for dense models. Feed them to `load_balancing_loss`.
        """
        return tuple(
            layer.mlp.router_logits
            for layer in self.model.layers
            if isinstance(layer.mlp, SparseMoeBlock)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        output_router_logits: bool = False,
        logits_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Logits of every position, or only of the positions in `logits_mask`.

        Args:
            input_ids: [B, S] int64 token ids.
            position_ids: [B, S] int64 RoPE positions; None = arange(S) + kv_cache.seq_len.
            attention_mask: [B, 1, S, S_kv] bool, True = may attend (passed to SDPA); or a
                flex-attention BlockMask (runtime.packing.document_attention_mask), which runs
                flex attention instead (no KV cache); None = plain causal. Every query row should allow at least one key, else SDPA
                returns NaN for that row. Under context parallel (runtime.apply_context_parallel,
                ring mode): [B, S] integer document ids of this rank's tokens (packed rows).
            kv_cache: optional KVCache; the new k/v are appended and seq_len advances by S.
            output_router_logits: also return every MoE layer's router logits.
            logits_mask: [B, S] bool, True = compute this position's logits. The other hidden
                states never reach lm_head (in SFT about half the positions are prompt or
                padding: that share of the [D, V] projection, its backward and the softmax is
                skipped, and no [B, S, V] tensor exists).

        Returns:
            [B, S, V] logits in lm_head's dtype ([T, V] with T = logits_mask.sum(), positions in
            row-major order, when logits_mask is given); with output_router_logits, the tuple (logits,
            router_logits), router_logits being L tensors [B*S, E] (empty for dense models),
            for `load_balancing_loss`.
        """
        self._keep_router_logits(output_router_logits)
        hidden = self.model(input_ids, position_ids, attention_mask, kv_cache)  # [B, S, D]
        if logits_mask is not None:
            hidden = hidden[logits_mask]  # [T, D]
        logits = self.lm_head(hidden)
        return (logits, self.router_logits()) if output_router_logits else logits


LlamaForCausalLM = CausalLM  # the name emitted scripts and older code use


class SequenceClassifier(nn.Module):
    """Decoder plus a linear score head; module tree and state-dict keys identical to HF's
    `*ForSequenceClassification` (`model.*`, `score.weight`; transformers' `GenericForSequenceClassification`).

    A reward model is this with num_labels=1: the score of a sequence is the head applied to the
    final-norm hidden state of one token per row (its last one; the caller picks it, as
    transformers pools at the last token that is not `pad_token_id`).
    """

    def __init__(self, args: ModelArgs, num_labels: int = 1) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.score = nn.Linear(args.hidden_size, num_labels, bias=False)  # HF: no bias

    def tie_weights(self) -> None:
        """No output embedding to tie (the head is `score`); kept so plans that re-tie after
        sharding may call it on either class."""

    def init_rope(self, device=None) -> None:
        """(Re)compute the RoPE `inv_freq` buffer, as `CausalLM.init_rope`."""
        self.model.rotary_emb.reset_inv_freq(device)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random init for tests: N(0, std) linear/embedding weights, zero biases, unit norms."""
        CausalLM.init_weights(self, std, generator)

    def forward_hidden(self, input_ids, position_ids=None, attention_mask=None):
        """Final-norm hidden states [B, S, D] (as `CausalLM.forward_hidden`)."""
        return self.model(input_ids, position_ids, attention_mask)

    def forward(
        self,
        input_ids: torch.Tensor,
        score_index: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores of one token per row.

        Args:
            input_ids: [B, S] int64 token ids.
            score_index: [B] int64, the position scored in each row (its last real token).
            position_ids, attention_mask: as `CausalLM.forward` (None: positions 0..S-1, causal).

        Returns:
            [B, num_labels] in the head's dtype; only the B pooled hidden states reach the head.
        """
        hidden = self.model(input_ids, position_ids, attention_mask)  # [B, S, D]
        rows = torch.arange(input_ids.shape[0], device=hidden.device)
        return self.score(hidden[rows, score_index])  # [B, D] -> [B, num_labels]


class KVCache:
    """Preallocated per-layer key/value buffers `[B, Hkv, S_max, Dh]` for incremental decoding.

    Each layer calls `update(layer_idx, k, v)`, which writes at `seq_len` and returns the valid
    prefix; `LlamaModel.forward` calls `advance(S)` once after its last layer, so `seq_len` counts
    the tokens already cached.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        num_key_value_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
    ) -> None:
        shape = (batch_size, num_key_value_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seq_len = max_seq_len
        self.seq_len = 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Write k/v: [B, Hkv, S, Dh] at [seq_len, seq_len + S).

        Returns:
            (k_all, v_all): [B, Hkv, seq_len + S, Dh] in k's dtype (the cache may be wider, e.g.
            fp32 buffers under a bf16 mixed-precision forward).

        Raises:
            ValueError: the cache would overflow max_seq_len.
        """
        end = self.seq_len + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(
                f"KVCache overflow: {self.seq_len} cached + {k.shape[2]} new tokens > "
                f"max_seq_len={self.max_seq_len}; build the cache with a larger max_seq_len."
            )
        self.k[layer_idx][:, :, self.seq_len : end] = k
        self.v[layer_idx][:, :, self.seq_len : end] = v
        k_all, v_all = self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]
        return k_all.to(k.dtype), v_all.to(v.dtype)

    def advance(self, n: int) -> None:
        """Mark n more tokens as cached (called once per forward, after the last layer)."""
        self.seq_len += n

    def repeat_interleave(self, repeats: int) -> None:
        """Grow the batch `repeats`-fold in place: row b becomes rows b * repeats ... b * repeats +
        repeats - 1, each with row b's cached prefix ([B, ...] -> [B * repeats, ...] buffers).
        A sampler prefills each prompt once and then decodes its samples from the copies."""
        for buffers in (self.k, self.v):
            for i in range(len(buffers)):
                # one layer at a time, each old buffer freed as its copy replaces it: the peak is
                # the grown cache plus one layer's old buffer, not both caches whole
                buffers[i] = buffers[i].repeat_interleave(repeats, dim=0)


def build_model(
    args: ModelArgs, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """Construct the `CausalLM` of `args.model_type` on `device` in `dtype`.

    On "meta" no memory is used: shard it, then `to_empty(device=...)`,
    `load_hf_checkpoint(...)` and `init_rope()`. On a real device the weights get PyTorch's
    default init (call `init_weights` for the test init) and RoPE is ready.
    """
    with torch.device(device):
        model = CausalLM(args)
    if all(t.dtype == dtype for t in model.parameters()):
        # already built in `dtype`: no conversion (under FakeTensorMode, as `scaffold plan` runs
        # it, a no-op `.to` would still try to swap every fake parameter and fail)
        return model
    return model.to(dtype=dtype)


def build_sequence_classifier(
    args: ModelArgs,
    num_labels: int = 1,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float32,
) -> SequenceClassifier:
    """Construct a `SequenceClassifier` (decoder + `score` head) on `device` in `dtype`; on "meta"
    as `build_model` (shard, `to_empty`, load, `init_rope`)."""
    with torch.device(device):
        model = SequenceClassifier(args, num_labels)
    if all(t.dtype == dtype for t in model.parameters()):
        return model  # as build_model: no no-op `.to` under FakeTensorMode
    return model.to(dtype=dtype)
