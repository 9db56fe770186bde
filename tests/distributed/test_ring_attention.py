"""Ring context parallel (runtime.ring_attention) equals the all-gather mode and one process: the
attention output and the gradients of q, k and v, on 2 and 4 gloo ranks, causal with GQA (Hkv < H)
and without (Hkv = H), block-causal on packed documents (the ring only: the all-gather mode refuses
a document mask), and in bf16 (merged in fp32). Each rank attends its two zig-zag chunks
(`context_parallel_chunks`) of the same full tensors and back-propagates its chunks of one upstream
gradient; the reference is SDPA over the whole sequence in this process.

The documents cross chunk boundaries and some blocks of the ring hold no key of a query's document
(rows with no key in a block: the merge must drop them, not count a log-sum-exp of 0).
Tolerance fp32: atol 2e-6, rtol 1e-5 (the parameter tolerance of tests/distributed/
test_context_parallel.py; measured max abs error 1e-6: the online softmax sums in another order).
bf16: 2e-2 against the fp32 result of the same bf16 inputs (bf16's own rounding of the output;
one-process bf16 SDPA is as far).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import context_parallel_chunks
from tests.helpers import spawn

B, S, Dh = 2, 32, 8
# (name, H, Hkv, packed documents, dtype)
CASES = [
    ("causal gqa", 4, 2, False, torch.float32),
    ("causal mha", 2, 2, False, torch.float32),
    ("documents gqa", 4, 2, True, torch.float32),
    ("causal gqa bf16", 4, 2, False, torch.bfloat16),
]


def _documents() -> torch.Tensor:
    """[B, S] int32, as packing writes them: 0, 1, ... per row, the padding the last document.
    Row 0: documents of 5, 13, 9 tokens and 5 of padding (every chunk boundary at cp 2 and 4
    falls inside a document somewhere); row 1: 20 tokens and 12 of padding."""
    lens = ([5, 13, 9, 5], [20, 12])
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(n), dtype=torch.int32), torch.tensor(n)) for n in lens]
    )  # fmt: skip


def _local(t: torch.Tensor, rank: int, cp: int, dim: int) -> torch.Tensor:
    """This cp rank's chunks r and 2*cp-1-r of `t` along `dim`."""
    L = t.shape[dim] // (2 * cp)
    first, second = context_parallel_chunks(rank, cp)
    return torch.cat((t.narrow(dim, first * L, L), t.narrow(dim, second * L, L)), dim)


def _inputs(H: int, Hkv: int, dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(H * 10 + Hkv)
    q, dout = (torch.randn(B, H, S, Dh, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hkv, S, Dh, generator=g) for _ in range(2))
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def _reference(q, k, v, dout, documents) -> dict:
    """One process, fp32 (bf16 inputs upcast): SDPA over the whole sequence."""
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    mask = None
    if documents is not None:  # block-causal: same document and not after the query
        same = documents[:, :, None] == documents[:, None, :]
        mask = (same & torch.ones(S, S, dtype=torch.bool).tril())[:, None]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )
    out.backward(dout.float())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _worker(rank, world_size, cases):
    import torch.distributed as dist

    from runtime.context_parallel import context_parallel_attention
    from runtime.ring_attention import ring_attention

    group = dist.group.WORLD
    results = {}
    for name, H, Hkv, packed, dtype in cases:
        q, k, v, dout = (_local(t, rank, world_size, 2) for t in _inputs(H, Hkv, dtype))
        documents = _local(_documents(), rank, world_size, 1) if packed else None
        modes = {"ring": ring_attention}
        if not packed:
            modes["allgather"] = context_parallel_attention
        for mode, attention in modes.items():
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            out = attention(ql, kl, vl, group, documents)
            assert out.dtype == dtype and out.shape == ql.shape
            out.backward(dout)
            results[name, mode] = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_equals_allgather_and_one_process(cp):
    results = spawn(_worker, cp, args=(CASES,))
    for name, H, Hkv, packed, dtype in CASES:
        inputs = _inputs(H, Hkv, dtype)
        ref = _reference(*inputs, _documents() if packed else None)
        tol = (
            {"atol": 2e-2, "rtol": 2e-2}
            if dtype == torch.bfloat16
            else {"atol": 2e-6, "rtol": 1e-5}
        )
        for rank, got in enumerate(results):
            for mode in ("ring",) if packed else ("ring", "allgather"):
                for key, want in ref.items():
                    where = f"{name} {mode} cp={cp} rank {rank} {key}"
                    torch.testing.assert_close(
                        got[name, mode][key].float(), _local(want, rank, cp, 2), **tol,
                        msg=lambda m, where=where: f"{where}: {m}",
                    )  # fmt: skip
        if not packed and dtype == torch.float32:  # the two modes agree with each other as closely
            for got in results:
                for key in ref:
                    torch.testing.assert_close(
                        got[name, "ring"][key], got[name, "allgather"][key], atol=2e-6, rtol=1e-5
                    )


def test_modes_refuse_what_they_do_not_build():
    """The all-gather mode names the ring for a document mask; a mode outside CP_MODES and a dense
    mask under context parallel are refused with one line each (no collective is reached)."""
    from runtime import ModelArgs, apply_context_parallel, build_model
    from runtime.context_parallel import CP_MODES, context_parallel_attention
    from tests.helpers import TINY_CONFIG

    q = torch.zeros(1, 2, 4, Dh)
    with pytest.raises(NotImplementedError, match="mode='ring'"):
        context_parallel_attention(q, q, q, None, torch.zeros(1, 4, dtype=torch.int32))
    model = build_model(ModelArgs(**TINY_CONFIG, max_position_embeddings=64), device="cpu")
    with pytest.raises(ValueError, match=r"mode 'rings': choose one of allgather, ring"):
        apply_context_parallel(model, None, "rings")
    from generator.spec.core import CP_MODES as SPEC_CP_MODES  # repeated there (no torch import)

    assert CP_MODES == SPEC_CP_MODES == ("allgather", "ring")
    attn = model.model.layers[0].self_attn
    attn.cp_group, attn.cp_attention = object(), None  # cp on: a dense mask must not reach it
    dense = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="integer document ids"):
        model(torch.zeros(1, 4, dtype=torch.long), attention_mask=dense)


def test_cuda_block_kernels_shapes_on_meta_tensors():
    """The CUDA path (efficient attention; no GPU here) on meta tensors: the shapes, the padded
    log-sum-exp handed back to the backward, and GQA's repeated heads summed back onto Hkv,
    with and without a document mask (an odd key length: the bias's aligned stride)."""
    import runtime.ring_attention as ring

    q, dout = (torch.empty(2, 4, 40, 16, device="meta") for _ in range(2))
    k, v = (torch.empty(2, 2, 24, 16, device="meta") for _ in range(2))
    for mask in (None, torch.empty(2, 1, 40, 24, dtype=torch.bool, device="meta")):
        out, lse = ring._cuda_attend(q, k, v, False, mask)
        assert out.shape == q.shape and lse.shape == (2, 4, 40)
        dq, dk, dv = ring._cuda_attend_backward(dout, q, k, v, out, lse, False, mask)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
