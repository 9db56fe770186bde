"""Ring attention over the cp ranks: K/V blocks travel around the ring, no rank holds them all.

The layout is context parallel's (runtime.context_parallel): every row is cut into 2*cp chunks and
cp rank r holds chunks r and 2*cp-1-r of the queries, keys and values. Instead of all-gathering
K/V, each rank attends its queries to one rank's K/V at a time: at ring step s (0..cp-1) it holds
the K/V of rank src = (r - s) mod cp, computes that block's attention output and log-sum-exp, and
passes the block on to rank r+1 while it receives the next one from rank r-1. The block outputs
are merged with the online softmax (running log-sum-exp, fp32), so the result equals one softmax
over all the keys up to summation order. A rank holds its own K/V, the block it attends to and the
block in flight: two K/V blocks of S/cp tokens, whatever cp, instead of the whole sequence's.

Zig-zag makes every step the same work under the causal mask (for each pair of a query chunk i and
a key chunk j: j < i fully visible, j = i the causal diagonal, j > i skipped):
- s = 0 (its own K/V): the local [chunk r | chunk 2cp-1-r] against itself, top-left causal (chunk
  r sees itself causally and nothing of the later chunk; the later chunk sees all of chunk r).
- src < r: both query chunks see all of chunk src, none of chunk 2cp-1-src: the full local queries
  against the first half of the block.
- src > r: chunk r sees nothing; chunk 2cp-1-r sees all of both of rank src's chunks: the second
  half of the queries against the whole block.

Packed rows (document_ids given): a block's mask is also "same document" (query chunk's ids ==
key chunk's ids), the key block's ids travel around the ring with its K/V. A query row may then
see no key of a block: that block's log-sum-exp is -inf for the row and adds nothing. Every row
sees at least itself (step 0), so the merged log-sum-exp is finite.

Backward (`torch.autograd.Function`, the standard ring attention backward): the K/V blocks go
around the ring again; each block's gradients come from the kernel's backward given the merged
output and log-sum-exp (P = exp(QK^T scale - lse) is then the final softmax restricted to the
block, so the block's dQ, dK, dV are exact terms of the full gradient). dQ stays local; the block's
dK/dV (fp32) travel with it and reach their owner after one more hop.

Memory per rank: each layer keeps for backward its own q, K, V, output and fp32 log-sum-exp
(all-gather keeps the whole sequence's K/V: cp times its own). The backward of a layer adds an
fp32 dQ accumulator, two K/V blocks and two fp32 dK/dV buffers (the one coming in, the one going
out): about 14 times a rank's own K (bf16) with H = Hkv, its dQ share H/Hkv times larger. So the
ring is the smaller mode once the other ranks' K/V that all-gather keeps ((cp - 1) times its own
K and V, for every layer kept for backward) outweigh that: at larger cp, or over many layers
without activation checkpointing; at cp 2 with it the ring is the larger (measured:
benchmarks/RESULTS.md, "Context parallel: ring vs all-gather").

Kernels, per block (both return the log-sum-exp the merge needs and take it back in backward):
CPU: aten `_scaled_dot_product_flash_attention_for_cpu` (GQA native, float mask); CUDA: aten
`_scaled_dot_product_efficient_attention` (K/V heads repeated to H for the block, additive bias
for the document mask). Communication: `funcol.all_to_all_single` with one non-empty split (the
permute of `funcol.permute_tensor`), which runs on gloo and NCCL and has fake-tensor kernels (so
`scaffold plan` simulates the ring's buffers). GQA: Hkv heads travel, not H.

Shape legend: B batch, H query heads, Hkv KV heads, S_loc = 2L local tokens, L chunk, Dh head dim.

Reference: Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", https://arxiv.org/abs/2310.01889 (blockwise attention, K/V around the
ring, online softmax; backward passing dK/dV with the blocks); the 2*cp zig-zag layout of Llama 3
(arXiv:2407.21783 sec. 3.3.2). Differs from reference: the zig-zag chunks balance the causal work
(the paper's contiguous blocks leave the late ranks most of it); attention only (the paper's
blockwise feed-forward is not needed: the MLP runs per token on the local chunks anyway).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

__all__ = ["ring_attention"]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: dist.ProcessGroup,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (or block-causal by document) attention of the local queries over every cp rank's
    K/V, passing the K/V blocks around the ring.

    Args:
        q: [B, H, S_loc, Dh] the local queries: chunk r then chunk 2*cp-1-r, RoPE applied.
        k: [B, Hkv, S_loc, Dh] the local keys, same layout, RoPE applied.
        v: [B, Hkv, S_loc, Dh] the local values.
        cp_group: the process group of the cp mesh dim.
        document_ids: [B, S_loc] int, the document of every local token (packed rows), or None
            (plain causal).

    Returns:
        [B, H, S_loc, Dh] in q's dtype (merged in fp32).
    """
    if q.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"ring attention runs on cpu and cuda (the aten kernels that return the log-sum-exp); "
            f"got {q.device.type}: use cp_mode='allgather'"
        )
    return _RingAttention.apply(q, k, v, document_ids, cp_group)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, document_ids, group):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        L = q.shape[2] // 2
        ring = _Ring(group)
        kv, docs = torch.stack((k, v)), document_ids  # [2, B, Hkv, S_loc, Dh]: one buffer a step
        out = lse = None
        for step in range(cp):
            # the next block: sent now, received after this block's compute (async collective)
            incoming = (ring.send(kv), ring.send(docs)) if step < cp - 1 else None
            rows, cols, causal = _visible(rank, (rank - step) % cp, L)
            mask = _document_mask(document_ids, docs, rows, cols, causal)
            out_b, lse_b = _attend(
                q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], causal, mask
            )
            if out is None:  # step 0 covers every query row (each sees at least itself)
                out, lse = out_b.float(), lse_b
            else:  # online softmax: out = sum_b exp(lse_b - lse) out_b, lse = logsumexp_b lse_b
                o, m = out[:, :, rows], lse[:, :, rows]  # views: updated in place
                step_out = o - out_b  # fp32; one temporary: out -= sigmoid(lse_b - m) (out - out_b)
                o -= step_out.mul_(torch.sigmoid(lse_b - m)[..., None])
                m -= F.logsigmoid(m - lse_b)  # logaddexp(m, lse_b); lse_b = -inf adds nothing
                del step_out
            del out_b, lse_b
            if incoming is not None:
                kv, docs = ring.wait(incoming[0]), ring.wait(incoming[1])
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, document_ids = ctx.saved_tensors
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        L = q.shape[2] // 2
        ring = _Ring(group)
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv, docs = torch.stack((k, v)), document_ids
        dkv_handle = None
        for step in range(cp):
            incoming = (ring.send(kv), ring.send(docs)) if step < cp - 1 else None
            rows, cols, causal = _visible(rank, (rank - step) % cp, L)
            mask = _document_mask(document_ids, docs, rows, cols, causal)
            dq_b, dk_b, dv_b = _attend_backward(
                dout[:, :, rows], q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols],
                out[:, :, rows], lse[:, :, rows], causal, mask,
            )  # fmt: skip
            dq[:, :, rows] += dq_b
            del dq_b
            # the block's dK/dV (fp32): the terms of the ranks it visited before, travelling with it
            if step == 0:
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            else:
                dkv = ring.wait(dkv_handle)
            dkv[0, :, :, cols] += dk_b
            dkv[1, :, :, cols] += dv_b
            del dk_b, dv_b
            if incoming is not None:  # the next block in (the last one freed) before dK/dV go out
                kv, docs = ring.wait(incoming[0]), ring.wait(incoming[1])
            dkv_handle = ring.send(dkv)  # to rank r+1; after the last step that is the owner
            del dkv
        del kv, docs
        dq = dq.to(q.dtype)
        dkv = ring.wait(dkv_handle)  # this rank's own K/V gradients, every rank's terms added
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


class _Ring:
    """Send a tensor to cp rank r+1 and receive rank r-1's of the same shape:
    `funcol.all_to_all_single` of the flat tensor with one non-empty split each way (what
    `funcol.permute_tensor` does), asynchronous until `wait`."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next, self.prev = (rank + 1) % self.cp, (rank - 1) % self.cp

    def send(self, t: torch.Tensor | None) -> _Pending | None:
        if t is None:
            return None
        splits_in, splits_out = [0] * self.cp, [0] * self.cp
        splits_in[self.next] = splits_out[self.prev] = t.numel()
        flat = t.contiguous().view(-1)
        received = funcol.all_to_all_single(flat, splits_out, splits_in, self.group)
        return _Pending(received, t.shape, flat)

    @staticmethod
    def wait(pending: _Pending | None) -> torch.Tensor | None:
        return None if pending is None else pending.wait()


class _Pending:
    """A transfer in flight. It keeps the sent tensor until `wait`, as the collective does (gloo
    and NCCL hold it until they complete), so that a simulation under fake tensors frees it when
    they do; `wait` drops it."""

    def __init__(self, received: torch.Tensor, shape: torch.Size, sent: torch.Tensor) -> None:
        self.received, self.shape, self.sent = received, shape, sent

    def wait(self) -> torch.Tensor:
        received = funcol.wait_tensor(self.received).view(self.shape)
        self.received = self.sent = None
        return received


def _visible(rank: int, src: int, L: int) -> tuple[slice, slice, bool]:
    """The one block of this ring step: (query rows, key rows of the block, top-left causal).

    Local layout [chunk r | chunk 2cp-1-r] for both queries and keys (module docstring)."""
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, L), False
    return slice(L, None), slice(None), False


def _document_mask(
    documents: torch.Tensor | None,
    block_documents: torch.Tensor | None,
    rows: slice,
    cols: slice,
    causal: bool,
) -> torch.Tensor | None:
    """[B, 1, Lq, Lk] bool, True = may attend: same document (and causal on the diagonal); None
    without documents (the kernels' own causal flag, or no mask)."""
    if documents is None:
        return None
    dq, dk = documents[:, rows], block_documents[:, cols]  # [B, Lq], [B, Lk]
    mask = dq[:, :, None] == dk[:, None, :]  # [B, Lq, Lk]
    if causal:
        Lq, Lk = mask.shape[1:]
        mask &= torch.ones(Lq, Lk, dtype=torch.bool, device=mask.device).tril()
    return mask[:, None]  # [B, Lq, Lk] -> [B, 1, Lq, Lk]


# --- the per-block kernels: (out, lse) forward and (dq, dk, dv) given the merged out and lse -----


def _attend(q, k, v, causal: bool, mask: torch.Tensor | None):
    """out [B, H, Lq, Dh] (q's dtype), lse [B, H, Lq] fp32; a row the mask leaves no key gets
    out 0 and lse -inf (it then adds nothing to the merge)."""
    if q.device.type == "cuda":
        out, lse = _cuda_attend(q, k, v, causal, mask)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and mask is None, attn_mask=_cpu_bias(mask, q)
        )
    if mask is not None:  # the kernels give such a row lse 0 (cpu) or nan: make it "no keys"
        seen = mask.any(-1)  # [B, 1, Lq]
        lse = torch.where(seen, lse, float("-inf"))
        out = torch.where(seen[..., None], out, 0.0)
    return out, lse.float()


def _attend_backward(dout, q, k, v, out, lse, causal: bool, mask: torch.Tensor | None):
    """dq [B, H, Lq, Dh], dk/dv [B, Hkv, Lk, Dh] of one block, from the merged out and lse."""
    dout, q, out, lse = dout.contiguous(), q.contiguous(), out.contiguous(), lse.contiguous()
    if q.device.type == "cuda":
        return _cuda_attend_backward(dout, q, k, v, out, lse, causal, mask)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal and mask is None, attn_mask=_cpu_bias(mask, q)
    )


def _cuda_attend(q, k, v, causal: bool, mask: torch.Tensor | None):
    """The efficient-attention kernel (equal head counts: K/V repeated for the block)."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, q), _repeat_kv(v, q), _cuda_bias(mask, q), True, 0.0,
        causal and mask is None,
    )  # fmt: skip
    return out, lse[:, :, : q.shape[2]]  # the kernel pads the query dim of lse to 32


def _cuda_attend_backward(dout, q, k, v, out, lse, causal: bool, mask: torch.Tensor | None):
    """Its backward, given the merged lse padded as the forward pads it; the repeated heads'
    dK/dV summed back onto their KV head."""
    padded = F.pad(lse, (0, -q.shape[2] % 32))
    # no dropout: the philox seed and offset are unread; the forward returns such empty CPU scalars
    unused = torch.empty((), dtype=torch.int64)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat_kv(k, q), _repeat_kv(v, q), _cuda_bias(mask, q), out, padded,
        unused, unused, 0.0, [True, True, True, False], causal and mask is None,
    )  # fmt: skip
    group = q.shape[1] // k.shape[1]
    if group > 1:
        dk = dk.unflatten(1, (k.shape[1], group)).sum(2)  # [B, H, Lk, Dh] -> [B, Hkv, Lk, Dh]
        dv = dv.unflatten(1, (k.shape[1], group)).sum(2)
    return dq, dk, dv


def _cpu_bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The CPU kernel's mask: additive, in q's dtype (it refuses bool)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, -torch.inf)


def _cuda_bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The efficient kernel's bias: additive, q's dtype, [B, H, Lq, Lk] (expanded, no copy) with
    the key dim's stride a multiple of 16 (the kernel's alignment; SDPA pads it the same way)."""
    if mask is None:
        return None
    B, _, Lq, Lk = mask.shape
    bias = torch.zeros((B, 1, Lq, Lk + (-Lk % 16)), dtype=q.dtype, device=q.device)[..., :Lk]
    bias.masked_fill_(~mask, -torch.inf)
    return bias.expand(B, q.shape[1], Lq, Lk)


def _repeat_kv(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, L, Dh] -> [B, H, L, Dh] (each KV head for its group of query heads), for the CUDA
    kernel, which takes equal head counts; the travelling block keeps Hkv heads."""
    group = q.shape[1] // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)
