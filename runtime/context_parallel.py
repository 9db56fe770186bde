"""Context parallel: every rank holds a slice of each sequence; attention sees every rank's K/V.

The layout of Llama 3 (sec. 3.3.2): the sequence of every row is cut into 2*cp equal chunks and
cp rank r keeps chunks r and 2*cp-1-r, so under the causal mask every rank has the same attention
work (an early, cheap chunk paired with a late, expensive one). Everything outside attention is
per token and runs on the local tokens unchanged. Attention reaches the other ranks' K/V (after
RoPE, which used the global position ids) in one of two modes (`CP_MODES`):

- "allgather" (Llama 3): every attention layer all-gathers the local K and V over the cp ranks
  (GQA keeps them small: Hkv heads, not H), puts them back in sequence order, and each local query
  chunk attends to the keys up to its own end with a bottom-right-aligned causal mask. One softmax
  over exactly the keys one process would use. Memory: each rank holds the whole sequence's K/V
  per layer (and keeps it for backward), which bounds the longest context.
- "ring" (Liu et al. 2023, runtime.ring_attention): the K/V blocks travel around the cp ranks,
  attended one at a time and merged by their log-sum-exp (exact up to summation order); each rank
  holds its own K/V, the block it attends to and the one in flight (and keeps only its own for
  backward), so its K/V memory is a few times its own S/cp tokens', never the whole sequence's.
  Takes packed rows' document ids (block-causal by document); all-gather does not (not built).

This is our own plan rather than PyTorch's `context_parallel` because that one dispatches only the
CUDA SDPA kernels; this one runs on CPU (gloo, the tests) and GPU alike.

Shape legend: B batch, S full sequence, S_loc = S / cp local tokens, L = S / (2 * cp) tokens per
chunk, H query heads, Hkv KV heads, Dh head dim.

Reference: Grattafiori et al. 2024, "The Llama 3 Herd of Models", https://arxiv.org/abs/2407.21783,
sec. 3.3.2 "Context parallelism" (all-gather K/V, 2*cp chunks, rank r holds r and 2*cp-1-r);
Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
https://arxiv.org/abs/2310.01889 (the ring mode). Differs from reference: the all-gather mode has
no document mask (packed rows need the ring mode).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# all_gather_tensor_autograd, not the newer all_gather_single_autograd: torch 2.11 (the GPU
# image's) lacks the latter; for gather_dim=0 they are the same collective and backward
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from runtime.models.llama import LlamaAttention
from runtime.ring_attention import ring_attention

__all__ = [
    "CP_MODES",
    "CP_SEQUENCE_KEYS",
    "apply_context_parallel",
    "context_parallel_attention",
    "context_parallel_chunks",
    "context_parallel_gather",
    "context_parallel_group",
    "context_parallel_sum",
    "shard_for_context_parallel",
]

# Batch entries laid out [B, S] over the sequence: these are sharded, everything else is kept
# (sequence_ids: packed DPO rows' sequence of each token, `collate_preference_packs`).
CP_SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "document_ids", "sequence_ids")
# How attention reaches the other cp ranks' K/V (module docstring): the Config's cp_mode.
CP_MODES = ("allgather", "ring")


def context_parallel_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices (of 2 * cp_size) that cp rank `cp_rank` holds: r and 2*cp-1-r."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _local_chunks(t: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """[B, S, ...] -> [B, S / cp, ...]: chunks r and 2*cp-1-r (of 2*cp along dim 1) of every row,
    concatenated in that order."""
    L = t.shape[1] // (2 * cp_size)
    first, second = context_parallel_chunks(cp_rank, cp_size)
    return torch.cat(
        (t[:, first * L : (first + 1) * L], t[:, second * L : (second + 1) * L]), dim=1
    )


def shard_for_context_parallel(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """This cp rank's share of a collated batch: chunks r and 2*cp-1-r of every row.

    Args:
        batch: input_ids [B, S] int64, labels [B, S] int64 (pre-shifted, so a label stays with its
            input token), optional position_ids / document_ids / sequence_ids [B, S] (packed
            rows: each token's document and sequence go with it), num_tokens scalar int64 (the
            non-padding tokens of the rows), and anything else (kept as is).
        cp_rank: this rank's index in the cp mesh dim.
        cp_size: cp degree; S must be a multiple of 2 * cp_size.

    Returns:
        A new dict: the [B, S] entries as [B, S / cp] (the two chunks concatenated, in that order);
        position_ids added as the global arange(S) when absent (RoPE and the causal mask need the
        global positions); num_tokens kept on cp rank 0 and 0 on the others, so a sum over
        dp x cp counts every row once.

    Raises:
        ValueError: S is not a multiple of 2 * cp_size.
    """
    B, S = batch["input_ids"].shape
    if S % (2 * cp_size):
        raise ValueError(
            f"sequence length {S} is not divisible by 2*cp={2 * cp_size}: context parallel cuts "
            "each row into 2*cp equal chunks; pad rows to a multiple of 2*cp (collate's "
            "pad_to_multiple_of)"
        )
    out = dict(batch)
    if "position_ids" not in out:
        positions = torch.arange(S, device=batch["input_ids"].device)
        out["position_ids"] = positions.expand(B, S)  # [S] -> [B, S]
    for key in CP_SEQUENCE_KEYS:
        if key in out:
            out[key] = _local_chunks(out[key], cp_rank, cp_size)  # [B, S] -> [B, S_loc]
    if "num_tokens" in out and cp_rank != 0:
        out["num_tokens"] = torch.zeros_like(out["num_tokens"])
    return out


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: dist.ProcessGroup,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the local queries over the K/V of all cp ranks (the all-gather mode).

    Args:
        q: [B, H, S_loc, Dh] the local queries: chunk r then chunk 2*cp-1-r, RoPE applied.
        k: [B, Hkv, S_loc, Dh] the local keys, same layout, RoPE applied.
        v: [B, Hkv, S_loc, Dh] the local values.
        cp_group: the process group of the cp mesh dim.
        document_ids: must be None: packed rows' document mask is the ring mode's
            (`ring_attention`).

    Returns:
        [B, H, S_loc, Dh] attention output of the local queries (same layout as q).

    The all-gather is autograd-aware: its backward reduce-scatters (sums) every rank's gradient
    of the gathered K/V back to the rank that owns those tokens.
    """
    if document_ids is not None:
        raise NotImplementedError(
            "all-gather context parallel has no document mask (not built); packed rows need "
            "the ring mode: apply_context_parallel(model, group, mode='ring')"
        )
    cp = dist.get_world_size(cp_group)
    rank = dist.get_rank(cp_group)
    B, Hkv, S_loc, Dh = k.shape
    L = S_loc // 2
    kv = torch.stack((k, v))  # 2 x [B, Hkv, S_loc, Dh] -> [2, B, Hkv, S_loc, Dh]: one collective
    gathered = funcol.all_gather_tensor_autograd(kv.contiguous(), gather_dim=0, group=cp_group)
    # [cp * 2, B, Hkv, S_loc, Dh] -> [cp, k|v, B, Hkv, 2 chunks, L, Dh]
    gathered = gathered.view(cp, 2, B, Hkv, 2, L, Dh)
    # chunk j < cp is rank j's first chunk; chunk 2*cp-1-j is rank j's second: reverse the ranks
    in_order = torch.cat((gathered[:, :, :, :, 0], gathered[:, :, :, :, 1].flip(0)))
    # [2 * cp, k|v, B, Hkv, L, Dh] -> [k|v, B, Hkv, 2 * cp, L, Dh] -> [k|v, B, Hkv, S, Dh]
    in_order = in_order.permute(1, 2, 3, 0, 4, 5).reshape(2, B, Hkv, 2 * cp * L, Dh)
    k_all, v_all = in_order[0], in_order[1]
    outs = []
    for half, chunk in enumerate(context_parallel_chunks(rank, cp)):
        end = (chunk + 1) * L  # the chunk's queries see keys [0, end): the bottom-right causal mask
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, half * L : (half + 1) * L],
                k_all[:, :, :end],
                v_all[:, :, :end],
                attn_mask=causal_lower_right(L, end),
                enable_gqa=q.shape[1] != Hkv,
            )
        )  # [B, H, L, Dh]
    return torch.cat(outs, dim=2)  # 2 x [B, H, L, Dh] -> [B, H, S_loc, Dh]


def apply_context_parallel(
    model: torch.nn.Module, cp_group: dist.ProcessGroup, mode: str = "allgather"
) -> None:
    """Make every attention layer of `model` attend over the cp ranks' K/V.

    Sets `cp_group` and `cp_attention` on each `LlamaAttention`: `context_parallel_attention`
    for mode "allgather", `ring_attention` for "ring" (cp_group None, the default, is the
    unchanged single-rank path). Feed the model `shard_for_context_parallel` batches with their
    global position_ids (packed rows: their positions, and their document_ids as the model's
    attention_mask, ring mode only); a KV cache is refused by the attention layer under cp.

    Raises:
        ValueError: mode is not one of CP_MODES.
    """
    if mode not in CP_MODES:
        raise ValueError(f"context parallel mode {mode!r}: choose one of {', '.join(CP_MODES)}")
    attention = ring_attention if mode == "ring" else context_parallel_attention
    for module in model.modules():
        if isinstance(module, LlamaAttention):
            module.cp_group = cp_group
            module.cp_attention = attention


def context_parallel_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The cp process group `apply_context_parallel` gave `model`'s attention layers, or None for
    a model without context parallel (cp 1, or a reference copy kept whole on the CPU)."""
    for module in model.modules():
        if isinstance(module, LlamaAttention):
            return module.cp_group
    return None


class _SumOverContextParallel(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def context_parallel_sum(local: torch.Tensor, cp_group: dist.ProcessGroup) -> torch.Tensor:
    """Complete per-sequence sums whose terms the cp ranks hold (each its chunks' tokens).

    Forward: the all-reduced sum, the same on every cp rank. Backward: identity, so each rank's
    gradient reaches only its own tokens' terms. That is the gradient when every cp rank computes
    the same loss from the sums (DPO's sequence log-probs) and FSDP then sums the parameter
    gradients over dp_shard x cp: each token's term is counted once. (An autograd all-reduce, whose
    backward all-reduces too, would count it cp times.) Megatron-LM's
    `reduce_from_tensor_model_parallel_region` is the same operator for tensor parallel
    (Shoeybi et al. 2019, arXiv:1909.08053).

    Args:
        local: [N] float (e.g. [2P] sequence log-prob sums over this rank's tokens).
        cp_group: the cp mesh dim's process group.

    Returns:
        [N], the sum over the cp ranks.
    """
    return _SumOverContextParallel.apply(local, cp_group)


class _GatherOverContextParallel(torch.autograd.Function):
    """All-gather of the cp ranks' chunks back into whole rows forward; this rank's chunks of
    the gradient backward."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.cp, ctx.rank = cp, rank
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        L = local.shape[1] // 2
        chunks = [None] * (2 * cp)
        for j, part in enumerate(parts):  # rank j holds chunks j and 2*cp-1-j, in that order
            first, second = context_parallel_chunks(j, cp)
            chunks[first], chunks[second] = part[:, :L], part[:, L:]
        return torch.cat(chunks, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _local_chunks(grad, ctx.rank, ctx.cp), None


def context_parallel_gather(local: torch.Tensor, cp_group: dist.ProcessGroup) -> torch.Tensor:
    """Whole rows of per-token values whose chunks the cp ranks hold: the inverse of
    `shard_for_context_parallel` for one [B, S_loc, ...] tensor.

    Forward: the all-gathered rows in sequence order, the same on every cp rank. Backward: this
    rank's two chunks of the gradient, nothing summed. That is the gradient when every cp rank
    computes the same loss from the whole rows (GRPO's per-token losses, whose sequence means,
    gspo's sequence ratio and PPO's GAE need every token of a row) and FSDP then sums the
    parameter gradients over dp_shard x cp: each token's term reaches the parameters once,
    through the rank that computed it. The same contract as `context_parallel_sum` (and as a
    DTensor Shard -> Replicate redistribute, whose backward keeps the local shard).

    Args:
        local: [B, S_loc, ...] this rank's chunks r and 2*cp-1-r of every row, concatenated
            (S_loc = S / cp, even).
        cp_group: the cp mesh dim's process group.

    Returns:
        [B, S, ...], S = cp * S_loc, the chunks in sequence order.
    """
    return _GatherOverContextParallel.apply(local, cp_group)
