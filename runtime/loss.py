"""Token-level losses for causal LM training.

Shape legend: B batch, S sequence, D hidden, V vocab, T flattened tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = (
    -100
)  # PyTorch's and Hugging Face's default ignore_index; the one value used everywhere.


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over supervised positions.

    Loss parallel: when `logits` is a DTensor sharded on the vocab dim over a 1-D (tensor-parallel)
    mesh, e.g. the output of `lm_head` under `runtime.parallel.llama_tp_plan(loss_parallel=True)`,
    the CE is computed on the local [.., V/tp] shard with three all-reduces of [T] vectors (max,
    sum of exp, target logit) and no all-gather of the logits (`vocab_parallel_cross_entropy_sum`).

    Args:
        logits: [B, S, V] or [T, V], any float dtype; upcast to fp32 for the softmax. Or a DTensor
            with placements (Shard(-1),) (vocab-sharded).
        labels: [B, S] or [T] int64, pre-shifted (labels[:, t] is the target of position t),
            IGNORE_INDEX = not supervised. A plain tensor, the same on every tensor-parallel rank.

    Returns:
        Scalar fp32: the sum of token losses (0.0, never NaN, when nothing is supervised). Divide by
        the global number of supervised tokens of the optimizer step, not per micro-batch. Under
        loss parallel a plain tensor, equal on every rank of the tensor-parallel group.

    Raises:
        ValueError: a DTensor logits that is not vocab-sharded over one mesh dim.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy_sum(logits, labels)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _vocab_shard(t, dim: int, what: str):
    """(local tensor, vocab_start, process group) of a DTensor sharded evenly on `dim` over 1 mesh dim."""
    from torch.distributed.tensor import Shard

    placements = t.placements
    if len(placements) != 1 or not (
        isinstance(placements[0], Shard) and placements[0].dim % t.ndim == dim % t.ndim
    ):
        raise ValueError(
            f"{what} is a DTensor {tuple(t.shape)} with placements {placements} on mesh "
            f"{t.device_mesh.mesh_dim_names}; loss parallel needs it sharded on the vocab dim over "
            "the tensor-parallel mesh only (Shard on the vocab dim of mesh['tp'])"
        )
    mesh = t.device_mesh
    V = t.shape[dim]
    if V % mesh.size():
        raise ValueError(
            f"vocab_size={V} is not divisible by tp={mesh.size()}; loss parallel needs equal "
            "vocab shards: pick tp dividing the vocabulary size"
        )
    local = t.to_local()  # differentiable: the gradient comes back as a DTensor of t's layout
    return local, mesh.get_local_rank() * (V // mesh.size()), mesh.get_group()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE [T] of vocab-sharded logits: local [T, V/tp] + all-reduces of [T] vectors.

    Forward keeps the local fp32 softmax [T, V/tp] (as F.cross_entropy keeps its log-softmax);
    backward is local: softmax - one_hot (1 only on the shard owning the target). The gradient of
    lm_head's input is summed over tp by ColwiseParallel's own backward.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        import torch.distributed as dist

        z = logits.float()  # [T, Vl]
        Vl = z.shape[-1]
        valid = targets != IGNORE_INDEX
        local_t = targets - vocab_start
        in_shard = valid & (local_t >= 0) & (local_t < Vl)
        idx = local_t.clamp(0, Vl - 1)
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # [T] global max per row
        e = (z - m[:, None]).exp_()  # [T, Vl]
        sum_exp = e.sum(dim=-1)
        target_logit = torch.where(in_shard, z.gather(1, idx[:, None]).squeeze(1), 0.0)
        both = torch.stack([sum_exp, target_logit])  # [2, T]: one collective for both
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_logit = both[0], both[1]
        lse = sum_exp.log() + m
        loss = torch.where(valid, lse - target_logit, 0.0)  # [T], 0 where ignored
        e.div_(sum_exp[:, None])  # local softmax, kept for backward
        ctx.save_for_backward(e, idx, in_shard, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):  # grad_loss [T]
        probs, idx, in_shard, valid = ctx.saved_tensors
        rows = torch.arange(probs.shape[0], device=probs.device)
        probs[rows, idx] -= in_shard.to(probs.dtype)  # softmax - one_hot on the owning shard
        probs.mul_((valid.to(probs.dtype) * grad_loss)[:, None])  # ignored rows: no gradient
        return probs.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy_sum(logits, labels: torch.Tensor) -> torch.Tensor:
    """Loss parallel: summed CE of logits sharded on the vocab dim over the tensor-parallel ranks.

    Equals `cross_entropy_sum(logits.full_tensor(), labels)` (loss and gradient; fp32 math) without
    the [T, V] all-gather: each rank reduces its [T, V/tp] shard and the ranks all-reduce the row
    max, the row sum of exp and the target logit ([T] vectors). Works outside
    `torch.distributed.tensor.parallel.loss_parallel()` (no context needed for the backward).

    Args:
        logits: DTensor [B, S, V] or [T, V], placements (Shard(-1),) on a 1-D mesh, V divisible
            by the mesh size.
        labels: [B, S] or [T] int64 plain tensor, the same on every rank, IGNORE_INDEX = ignored.

    Returns:
        Scalar fp32 plain tensor, the same on every rank of the mesh.

    Raises:
        ValueError: other placements, or V not divisible by the mesh size.

    Reference: Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053 (vocab-parallel CE),
    Megatron-LM `core/tensor_parallel/cross_entropy.py`; PyTorch
    `torch.distributed.tensor.parallel.loss_parallel` (same layout contract).
    """
    local, vocab_start, group = _vocab_shard(logits, -1, "logits")
    local = local.reshape(-1, local.shape[-1])  # [T, V/tp]
    return _VocabParallelCrossEntropy.apply(local, labels.reshape(-1), vocab_start, group).sum()


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets] per row: the log-probability of each target token.

    Loss parallel: when `logits` is a DTensor sharded on the vocab dim over a 1-D (tensor-parallel)
    mesh (lm_head's output under `runtime.parallel.llama_tp_plan(loss_parallel=True)`), each rank
    reduces its [T, V/tp] shard and the ranks all-reduce the row max, the row sum of exp and the
    target logit ([T] vectors): no [T, V] all-gather; the backward is local (softmax - one_hot on
    the shard owning the target), as `vocab_parallel_cross_entropy_sum`'s.

    Args:
        logits: [T, V] any float dtype (upcast to fp32), or a DTensor with placements
            (Shard(-1),), V divisible by the mesh size.
        targets: [T] int64 plain tensor, the same on every tensor-parallel rank; every entry a
            real token (no IGNORE_INDEX: select the supervised rows first).

    Returns:
        [T] fp32 plain tensor (the same on every tensor-parallel rank): DPO's per-token log pi.

    Raises:
        ValueError: a DTensor not sharded on the vocab dim over one mesh dim, or V not divisible
            by its size.

    Reference: Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053 (vocab-parallel softmax).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        local, vocab_start, group = _vocab_shard(logits, -1, "logits")
        return -_VocabParallelCrossEntropy.apply(local, targets, vocab_start, group)
    return logits.float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


_DEFAULT_NUM_CHUNKS = 8  # 1/8 of the tokens per chunk: peak logits memory is ~1/8 of plain CE's


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_chunks: int = _DEFAULT_NUM_CHUNKS,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` without materialising the [T, V] logits.

    Equals `F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")`
    (loss and gradients), but first drops the ignored positions, then runs the output projection,
    logsumexp and its backward chunk by chunk, so at most one chunk's logits are alive at a time.

    Memory: nothing of size V is kept for backward, and the peak is about two chunks of fp32
    logits plus the [V, D] fp32 weight-gradient accumulator; time: one extra logits matmul in
    backward (recompute). See `_LinearCrossEntropy` for the strategy, numerics and trade-off.

    Loss parallel: when `weight` is a DTensor sharded on the vocab dim over the mesh named "tp"
    (lm_head / the tied embedding under `runtime.parallel.llama_tp_plan`), each rank runs the
    chunks on its [V/tp, D] rows and the ranks combine the per-token logsumexp and target logit
    with all-reduces of [T] vectors; the weight gradient stays local (vocab-sharded) and the hidden
    gradient is summed over tp. `hidden` must then be the same [B, S, D] on every tp rank.

    Tied embeddings: the returned weight gradient is an ordinary autograd gradient, so when
    `weight` is also `embed_tokens.weight` it adds to the embedding's gradient in the same
    parameter. FSDP2: pass the *unsharded* lm_head weight, i.e. call this inside the root module's
    forward, or after `register_fsdp_forward_method(model, "forward_hidden")` and
    `model.forward_hidden(...)` (the root keeps its parameters unsharded after forward, so
    `model.lm_head.weight` is then a plain tensor and its gradient is reduce-scattered at the end
    of backward like any other).

    Args:
        hidden: [B, S, D] or [T, D] final hidden states (pre lm_head), fp32 or bf16.
        weight: [V, D] output projection (lm_head.weight, possibly the tied embedding), same dtype
            as hidden.
        labels: [B, S] or [T] int64, pre-shifted (labels[..., t] is the target of position t),
            IGNORE_INDEX = not supervised.
        num_chunks: split the supervised tokens into this many chunks (ignored if chunk_size).
        chunk_size: tokens per chunk; bounds the peak memory independently of the batch size.

    Returns:
        Scalar fp32 (float64 for float64 inputs): the sum of token losses; 0.0 (never NaN, with
        zero gradients) when nothing is supervised. Divide by the global supervised-token count
        of the optimizer step (all micro-batches and ranks), as with `cross_entropy_sum`.

    Raises:
        ValueError: mismatched shapes or dtypes, num_chunks < 1 or chunk_size < 1.
        RuntimeError: weight is a DTensor other than the tp vocab-sharded one (e.g. an FSDP2-sharded
            lm_head.weight used outside the root's forward).

    Reference:
        Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models",
        https://arxiv.org/abs/2411.09009 (Sec. 4: blockwise logsumexp, recomputation in backward);
        Hsu et al. 2024, "Liger Kernel", https://arxiv.org/abs/2410.10989 (fused linear CE).
        Differs from reference: PyTorch ops per chunk (no fused Triton kernel), so the chunk's
        logits are materialised; no gradient filtering (the CCE paper's sparsity skip).
    """
    vocab_start, group = 0, None
    if _is_tp_vocab_sharded(weight):  # loss parallel: this rank's [V/tp, D] rows of lm_head
        weight, vocab_start, group = _vocab_shard(weight, 0, "lm_head.weight")
    _check_lce_inputs(hidden, weight, labels, num_chunks, chunk_size)
    D = hidden.shape[-1]
    flat_labels = labels.reshape(-1)  # [B, S] -> [B*S]
    valid = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)  # [T] positions of supervised tokens
    hidden_valid = hidden.reshape(-1, D).index_select(0, valid)  # [B*S, D] -> [T, D]
    targets = flat_labels.index_select(0, valid)  # [T]
    T = targets.numel()
    size = chunk_size if chunk_size is not None else -(-T // num_chunks)  # ceil(T / num_chunks)
    return _LinearCrossEntropy.apply(
        hidden_valid, weight, targets, max(1, size), vocab_start, group
    )


def _is_tp_vocab_sharded(weight: torch.Tensor) -> bool:
    """True for a DTensor [V, D] weight sharded on the vocab dim over the 1-D mesh named "tp"."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(weight, DTensor)
        and weight.device_mesh.mesh_dim_names == ("tp",)
        and tuple(weight.placements) == (Shard(0),)
    )


def _check_lce_inputs(hidden, weight, labels, num_chunks, chunk_size) -> None:
    """Shape, dtype and layout checks for `linear_cross_entropy` (messages say what to fix)."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        raise RuntimeError(
            f"linear_cross_entropy got a DTensor weight {tuple(weight.shape)} with placements "
            f"{weight.placements}; under FSDP2 pass the unsharded lm_head.weight: call it inside the "
            "root module's forward, or register_fsdp_forward_method(model, 'forward_hidden') and "
            "call model.forward_hidden(...) first."
        )
    if hidden.shape[-1] != weight.shape[-1] or weight.ndim != 2:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} disagree: expected "
            "hidden [..., D] and weight [V, D] (lm_head.weight)."
        )
    if hidden.shape[:-1].numel() != labels.numel():
        raise ValueError(
            f"hidden {tuple(hidden.shape)} has {hidden.shape[:-1].numel()} positions but labels "
            f"{tuple(labels.shape)} has {labels.numel()}; pass labels [B, S] for hidden [B, S, D]."
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one of them (under FSDP2 "
            "MixedPrecisionPolicy both are param_dtype)."
        )
    if num_chunks < 1 or (chunk_size is not None and chunk_size < 1):
        raise ValueError(
            f"num_chunks={num_chunks}, chunk_size={chunk_size}: both must be >= 1 (chunk_size "
            "may be None)."
        )


class _LinearCrossEntropy(torch.autograd.Function):
    """Chunked CE over pre-filtered tokens (all targets valid); `linear_cross_entropy` is the API.

    Backward strategy (recompute, as Cut Cross-Entropy): the forward keeps only the valid hidden
    rows [T, D], the targets [T] and the fp32 logsumexp [T]; the backward recomputes each chunk's
    logits, turns them into `softmax - one_hot` in place and accumulates the grads of hidden and
    weight chunk by chunk. Cost: one extra [T, D] x [D, V] matmul (4 instead of 3, about +33% of
    this layer's FLOPs); memory: nothing of size V is kept between forward and backward (Liger's
    alternative, computing the grads in the forward, saves that matmul but holds a [V, D] fp32
    weight gradient and a [T, D] hidden gradient from forward to backward, also under no_grad
    evaluation). Peak extra memory: about 2 x chunk_tokens x V x 4 bytes (one chunk's fp32 logits
    plus logsumexp's temporary, or the probabilities plus their bf16 copy), plus the [V, D] fp32
    weight-gradient accumulator (and for bf16 one reused [V, D] bf16 partial). Dropping ignored tokens needs their count on the host (one
    device sync per call).

    Numerics: logits are computed in the inputs' dtype (autocast is disabled inside, so bf16 inputs
    give bf16 matmuls), then upcast to fp32 per chunk for the logsumexp, the softmax and the loss
    sum; each chunk's weight gradient (a bf16 matmul for bf16 inputs: CPU has no bf16 x bf16 ->
    fp32 matmul) is summed across chunks in fp32 and cast to weight.dtype at the end. float64
    inputs stay float64 throughout (for gradcheck).

    Loss parallel (vocab-sharded weight, `group` set): per chunk and shard,
    `lse_local = logsumexp(z_local)` and the target logit (from the shard owning the label, 0
    elsewhere) are stored for all T tokens, then combined across shards once, after the loop:
    `lse = M + log(sum_shards exp(lse_local - M))` with `M` the all-reduced max, and a sum
    all-reduce of the target logits. The backward is local per shard given the global `lse`:
    `dz_local = exp(z_local - lse) - one_hot_local`; grad_hidden is all-reduced (summed) once.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, vocab_start=0, group=None):
        """hidden [T, D], weight [V, D] (this rank's [V/tp, D] rows under loss parallel, starting
        at vocab id vocab_start), targets [T] int64 (all valid) -> scalar fp32 loss sum."""
        import torch.distributed as dist

        T, V_local = targets.numel(), weight.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 for gradcheck)
        lse = torch.empty(T, dtype=acc_dtype, device=hidden.device)  # [T] logsumexp
        target_logits = torch.zeros(T, dtype=acc_dtype, device=hidden.device)  # [T]
        local_targets = targets - vocab_start
        in_shard = (local_targets >= 0) & (local_targets < V_local)  # all True without TP
        local_targets = local_targets.clamp(0, V_local - 1)
        with torch.autocast(hidden.device.type, enabled=False):  # compute in the inputs' dtype
            for start in range(0, T, chunk_size):
                end = min(start + chunk_size, T)
                logits = (hidden[start:end] @ weight.T).to(acc_dtype)  # [C, V] fp32
                lse[start:end] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, local_targets[start:end, None]).squeeze(1)  # [C]
                target_logits[start:end] = torch.where(in_shard[start:end], picked, 0.0)
                del logits  # free the chunk before the next one is allocated
        if group is not None:  # combine the vocab shards: global logsumexp and target logit
            M = lse.clone()
            dist.all_reduce(M, op=dist.ReduceOp.MAX, group=group)
            both = torch.stack([(lse - M).exp(), target_logits])  # [2, T]: one collective
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
            lse, target_logits = both[0].log() + M, both[1]
        loss = (lse - target_logits).sum()
        ctx.save_for_backward(hidden, weight, local_targets, in_shard, lse)
        ctx.chunk_size, ctx.group = chunk_size, group
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        """grad_loss: scalar -> (grad hidden [T, D], grad weight [V, D], None x 4)."""
        import torch.distributed as dist

        hidden, weight, targets, in_shard, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T = targets.numel()
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (  # fp32 sum over chunks
            torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
            if need_weight
            else None
        )
        rows = torch.arange(min(ctx.chunk_size, T), device=hidden.device)
        partial = torch.empty_like(weight) if need_weight and weight.dtype != lse.dtype else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, T, ctx.chunk_size):
                end = min(start + ctx.chunk_size, T)
                h = hidden[start:end]  # [C, D]
                probs = (h @ weight.T).to(lse.dtype)  # [C, V] fp32, recomputed
                probs.sub_(lse[start:end, None]).exp_()  # softmax
                # d loss / d logits: softmax - one_hot (the 1 only on the shard owning the target)
                probs[rows[: end - start], targets[start:end]] -= in_shard[start:end].to(lse.dtype)
                grad_logits = probs.mul_(grad_loss).to(hidden.dtype)  # [C, V]
                del probs
                if need_hidden:
                    torch.mm(grad_logits, weight, out=grad_hidden[start:end])  # [C, D]
                if need_weight:  # [V, D], summed over chunks in fp32 without a [V, D] temporary
                    if grad_logits.dtype == grad_weight.dtype:
                        grad_weight.addmm_(grad_logits.T, h)
                    else:  # bf16 matmul into one reused bf16 buffer (no bf16 -> fp32 mm on CPU)
                        partial = torch.mm(grad_logits.T, h, out=partial)
                        grad_weight.add_(partial)
                del grad_logits
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if need_hidden and ctx.group is not None:  # each shard gave its vocab rows' part
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_hidden, grad_weight, None, None, None, None


def _chunk_sizes(T: int, num_chunks: int, chunk_size: int | None) -> int:
    """Tokens per chunk: chunk_size, else ceil(T / num_chunks); at least 1."""
    if num_chunks < 1 or (chunk_size is not None and chunk_size < 1):
        raise ValueError(f"num_chunks={num_chunks}, chunk_size={chunk_size}: both must be >= 1")
    return max(1, chunk_size if chunk_size is not None else -(-T // num_chunks))


def _chunk_token_logprobs(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, logits_transform=None
):
    """log softmax(h @ weight.T)[targets] for one chunk: [C, D], [V, D], [C] -> [C] fp32;
    `logits_transform(logits [C, V], targets [C]) -> [C, V]` runs before the softmax. weight may
    be the tp vocab-sharded DTensor (`token_logprobs`' loss parallel)."""
    acc_dtype = torch.promote_types(h.dtype, torch.float32)  # fp32 (fp64 for gradcheck)
    if _is_tp_vocab_sharded(weight):
        from torch.distributed.tensor import DTensor, Replicate

        # h is the same on every tp rank (Replicate), as lm_head's ColwiseParallel input: the
        # backward all-reduces its gradient (each rank's vocab rows give a part of it)
        h = DTensor.from_local(h, weight.device_mesh, [Replicate()], run_check=False)
        logits = (h @ weight.T).to(acc_dtype)  # DTensor [C, V] Shard(-1): this rank's [C, V/tp]
        if logits_transform is None:  # all-reduces of [C] vectors, no [C, V] gather
            return target_logprobs(logits, targets)
        # top-k / top-p cut each whole row: this chunk's [C, V] on every tp rank (its backward
        # keeps this rank's vocab slice of the gradient, every rank computing the same loss)
        logits = logits.full_tensor()
    else:
        logits = (h @ weight.T).to(acc_dtype)  # [C, V] fp32
    if logits_transform is not None:
        logits = logits_transform(logits, targets)
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_chunks: int = _DEFAULT_NUM_CHUNKS,
    chunk_size: int | None = None,
    logits_transform=None,
) -> torch.Tensor:
    """Per-token log-probabilities of the labels under `hidden @ weight.T`, chunk by chunk.

    Equals `log_softmax(hidden @ weight.T, -1).gather(-1, labels)` (0 at ignored positions), values
    and gradients, but only the supervised positions reach the output projection and at most one
    chunk's [C, V] logits exist at a time: each chunk runs under activation checkpointing, so the
    backward recomputes that chunk's logits instead of keeping them (one extra [C, D] x [D, V]
    matmul per chunk). Under `torch.no_grad()` (a reference model) nothing is kept at all.

    Args:
        hidden: [B, S, D] final hidden states (pre lm_head), fp32 or bf16.
        weight: [V, D] lm_head.weight (the tied embedding when tied), same dtype as hidden;
            unsharded under FSDP2 (see `linear_cross_entropy`). Loss parallel: the DTensor
            sharded on the vocab dim over the mesh named "tp"; `hidden` is then the same on
            every tp rank (its gradient is all-reduced over tp) and each chunk reduces its
            [C, V/tp] logits with all-reduces of [C] vectors, or, with a `logits_transform`
            (which needs whole rows), all-gathers that chunk's [C, V] on every tp rank.
        labels: [B, S] int64, pre-shifted, IGNORE_INDEX = not supervised.
        num_chunks: split the supervised tokens into this many chunks (ignored if chunk_size).
        chunk_size: tokens per chunk.
        logits_transform: optional `f(logits [C, V] fp32, targets [C] int64) -> [C, V]` applied
            to each chunk's logits before the log-softmax (GRPO's top-k / top-p truncation,
            `runtime.generate.truncate_logits`); it runs again in the backward's recomputation.

    Returns:
        [B, S] fp32 (fp64 for fp64 inputs) log-probabilities, 0.0 at ignored positions; `.sum(-1)` is the sequence
        log-probability of the supervised tokens (DPO's log pi(y|x)). With grad enabled it is in
        hidden's graph even when no position is supervised (zero gradients).

    Raises:
        ValueError: as `linear_cross_entropy`.
    """
    from torch.utils.checkpoint import checkpoint

    local_weight = weight.to_local() if _is_tp_vocab_sharded(weight) else weight
    _check_lce_inputs(hidden, local_weight, labels, num_chunks, chunk_size)
    flat_labels = labels.reshape(-1)  # [B*S]
    valid = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)  # [T]
    hidden_valid = hidden.reshape(-1, hidden.shape[-1]).index_select(0, valid)  # [T, D]
    targets = flat_labels.index_select(0, valid)  # [T]
    size = _chunk_sizes(targets.numel(), num_chunks, chunk_size)
    pieces = []
    with torch.autocast(hidden.device.type, enabled=False):
        # no supervised token: one empty chunk still, so the output reaches hidden and weight in
        # autograd (a zero gradient for every parameter: FSDP's reduce-scatters pair up across
        # ranks) and loss parallel's tp ranks run the same collectives
        for start in range(0, max(1, targets.numel()), size):
            chunk = (hidden_valid[start : start + size], weight, targets[start : start + size])
            args = (*chunk, logits_transform)
            if torch.is_grad_enabled():
                pieces.append(checkpoint(_chunk_token_logprobs, *args, use_reentrant=False))
            else:
                pieces.append(_chunk_token_logprobs(*args))
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 for gradcheck)
    out = torch.zeros(flat_labels.numel(), dtype=acc_dtype, device=hidden.device)
    out = out.index_put((valid,), torch.cat(pieces).to(acc_dtype))  # out of place: autograd
    return out.view(labels.shape)


def kd_kl_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 1.0,
    kind: str = "forward",
) -> torch.Tensor:
    """Summed token KL between teacher and student logits at `temperature` (no T^2 factor).

    Args:
        student_logits: [T, V] (any float dtype; computed in fp32, fp64 stays fp64).
        teacher_logits: [T, V]; a fixed target (no gradient flows into it).
        temperature: softmax temperature of both distributions (> 0).
        kind: "forward" = KL(teacher || student) (Hinton et al.), "reverse" = KL(student ||
            teacher) (mode-seeking, MiniLLM).

    Returns:
        Scalar fp32: the sum over the T tokens of the per-token KL.

    Raises:
        ValueError: unknown kind, or the two logits differ in shape.
    """
    if kind not in ("forward", "reverse"):
        raise ValueError(f"kd kind={kind!r}: choose 'forward' or 'reverse'")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} vs teacher logits "
            f"{tuple(teacher_logits.shape)}: distillation needs the same tokens and vocabulary"
        )
    acc_dtype = torch.promote_types(student_logits.dtype, torch.float32)  # fp32 (fp64: gradcheck)
    student = torch.log_softmax(student_logits.to(acc_dtype) / temperature, dim=-1)  # [T, V]
    with torch.no_grad():  # the teacher is a fixed target
        teacher = torch.log_softmax(teacher_logits.detach().to(acc_dtype) / temperature, dim=-1)
    if kind == "reverse":  # KL(student || teacher) = sum p_s (log p_s - log p_t): mode-seeking
        return (student.exp() * (student - teacher)).sum()
    # KL(teacher || student) = sum p_t (log p_t - log p_s): mean-seeking, Hinton et al.'s
    return (teacher.exp() * (teacher - student)).sum()


def _chunk_kd(
    h_s: torch.Tensor,
    w_s: torch.Tensor,
    h_t: torch.Tensor,
    w_t: torch.Tensor,
    temperature: float,
    reverse: bool,
) -> torch.Tensor:
    """Summed KL of one chunk of tokens: [C, D_s], [V, D_s], [C, D_t], [V, D_t] -> scalar fp32."""
    with torch.no_grad():
        teacher_logits = h_t @ w_t.T  # [C, V]
    return kd_kl_sum(h_s @ w_s.T, teacher_logits, temperature, "reverse" if reverse else "forward")


def chunked_kd_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    kind: str = "forward",
    num_chunks: int = _DEFAULT_NUM_CHUNKS,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Summed token KL between teacher and student at `temperature`, without [B, S, V] logits.

    Only supervised positions are compared; each chunk of them computes the student's and the
    teacher's [C, V] logits, the KL, and (under activation checkpointing) recomputes them in
    backward, so at most one chunk of each model's logits is alive. The teacher side never needs
    a gradient (pass its hidden states from a `no_grad` forward).

    Args:
        student_hidden: [B, S, D_s] student final hidden states (pre lm_head).
        student_weight: [V, D_s] student lm_head.weight (unsharded under FSDP2).
        teacher_hidden: [B, S, D_t] teacher final hidden states (no grad).
        teacher_weight: [V, D_t] teacher lm_head.weight.
        labels: [B, S] int64, pre-shifted, IGNORE_INDEX = not compared.
        temperature: softmax temperature of both distributions; the KL is multiplied by
            temperature**2 so its gradient scale does not depend on it (Hinton et al. 2015).
        kind: "forward" = KL(teacher || student), "reverse" = KL(student || teacher).
        num_chunks / chunk_size: as `linear_cross_entropy`.

    Returns:
        Scalar fp32: temperature**2 * the sum over supervised tokens of the per-token KL (divide
        by the global supervised-token count, as the CE).

    Raises:
        ValueError: unknown kind, temperature <= 0, mismatched shapes or vocabularies.

    Reference:
        Hinton et al. 2015, "Distilling the Knowledge in a Neural Network", arXiv:1503.02531
        (soft targets at temperature T, gradients scaled by T^2); Gu et al. 2024, "MiniLLM",
        arXiv:2306.08543 (reverse KL for generative models).
    """
    from torch.utils.checkpoint import checkpoint

    if kind not in ("forward", "reverse"):
        raise ValueError(f"kd kind={kind!r}: choose 'forward' or 'reverse'")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"student vocab {student_weight.shape[0]} != teacher vocab {teacher_weight.shape[0]}; "
            "distillation compares token distributions, so both need the same tokenizer"
        )
    _check_lce_inputs(student_hidden, student_weight, labels, num_chunks, chunk_size)
    _check_lce_inputs(teacher_hidden.detach(), teacher_weight, labels, num_chunks, chunk_size)
    flat_labels = labels.reshape(-1)
    valid = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)  # [T]
    h_s = student_hidden.reshape(-1, student_hidden.shape[-1]).index_select(0, valid)  # [T, D_s]
    h_t = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]).index_select(0, valid)
    size = _chunk_sizes(valid.numel(), num_chunks, chunk_size)
    acc_dtype = torch.promote_types(student_hidden.dtype, torch.float32)
    total = torch.zeros((), dtype=acc_dtype, device=student_hidden.device)
    with torch.autocast(student_hidden.device.type, enabled=False):
        for start in range(0, valid.numel(), size):
            end = start + size
            args = (h_s[start:end], student_weight, h_t[start:end], teacher_weight)
            if torch.is_grad_enabled():
                kl = checkpoint(
                    _chunk_kd, *args, temperature, kind == "reverse", use_reentrant=False
                )
            else:
                kl = _chunk_kd(*args, temperature, kind == "reverse")
            total = total + kl
    return total * temperature**2
