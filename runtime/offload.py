"""Activation offloading: a block's tensors saved for backward live in pinned CPU memory between
its forward and its backward, instead of in GPU memory.

`offload_activations(block)` registers forward hooks that wrap the block's forward in
`torch.autograd.graph.saved_tensors_hooks`:
- pack (forward, every saved tensor of at least `min_bytes` that is not a parameter): a side CUDA
  stream waits for the compute stream, copies the tensor into a pinned CPU buffer
  (`non_blocking`), and records an event; `record_stream` keeps the GPU memory from being reused
  until that copy ran, so the copy overlaps the following compute and the GPU tensor is freed as
  soon as autograd drops it. A tensor saved several times in one block (the input of q/k/v_proj)
  is copied once.
- unpack (backward): the compute stream waits for the copy's event, then copies the buffer back
  (`non_blocking`, in stream order). No prefetch: the copy back is not overlapped with the
  previous block's backward, which torchtune's `OffloadActivations` does with a second stream;
  ours is the small, obviously ordered version (PyTorch's `save_on_cpu(pin_memory=True)` is the
  baseline: the same, without the side stream for the forward copies).

Memory: GPU activation memory drops to about one block's (the one computing) plus what the layers
outside the blocks save; CPU (pinned) memory grows by the offloaded bytes. Time: PCIe traffic of
every offloaded byte twice; forward copies overlap compute, backward copies do not.

On CPU tensors (tests) the same hooks copy into new CPU tensors, so the pack/unpack round trip is
exercised without a GPU; offloading a CPU run saves nothing, and the emitted script refuses it.

Reference:
    PyTorch `torch.autograd.graph.saved_tensors_hooks` and `save_on_cpu`
    (https://pytorch.org/docs/stable/autograd.html#saved-tensors-default-hooks); torchtune
    `OffloadActivations` (torchtune/training/_activation_offloading.py: side stream, pinned memory,
    deduplication by storage). Differs from reference: per block (module hooks) rather than one
    context over the whole model, and no backward prefetch.
"""

from __future__ import annotations

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1024  # smaller tensors (norm statistics, scalars) cost more to move than keep


def offload_activations(block: nn.Module, min_bytes: int = MIN_OFFLOAD_BYTES) -> list:
    """Offload the activations `block` saves for backward to (pinned) CPU memory.

    Call before `fully_shard` and after activation checkpointing if any (the model-setup order
    of the script). The hooks act only when grad is enabled (not in eval or generation).

    Args:
        block: a module, typically one transformer block.
        min_bytes: saved tensors smaller than this stay where they are.

    Returns:
        The two hook handles (call `.remove()` on both to undo).
    """
    state: dict = {"ctx": None, "copies": {}}

    def pack(t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.numel() * t.element_size() < min_bytes:
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if key not in state["copies"]:  # keep `t` referenced until the block ends: no reused key
            state["copies"][key] = (t, _to_cpu(t))
        return state["copies"][key][1]

    def pre_hook(module, args):
        if torch.is_grad_enabled():
            state["ctx"] = torch.autograd.graph.saved_tensors_hooks(pack, _from_cpu)
            state["ctx"].__enter__()

    def post_hook(module, args, output):
        if state["ctx"] is not None:
            state["ctx"].__exit__(None, None, None)
            state["ctx"] = None
            state["copies"].clear()

    return [block.register_forward_pre_hook(pre_hook), block.register_forward_hook(post_hook)]


_side_streams: dict = {}


def _to_cpu(t: torch.Tensor) -> tuple:
    """Start copying t into CPU memory; returns (device, cpu_tensor, event or None)."""
    if t.device.type != "cuda":
        return t.device, t.to("cpu", copy=True), None
    if t.device not in _side_streams:
        _side_streams[t.device] = torch.cuda.Stream(t.device)
    stream = _side_streams[t.device]
    stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully computed
    with torch.cuda.stream(stream):
        cpu = torch.empty_like(t, device="cpu", pin_memory=True)
        cpu.copy_(t, non_blocking=True)
        event = stream.record_event()
    t.record_stream(stream)  # its memory is not reused before the copy on `stream` finished
    return t.device, cpu, event


def _from_cpu(packed):
    """unpack: the saved tensor back on its device (in stream order after the offload copy)."""
    if isinstance(packed, torch.Tensor):  # was not offloaded
        return packed
    device, cpu, event = packed
    if event is None:
        return cpu.to(device, copy=True)
    torch.cuda.current_stream(device).wait_event(event)
    return cpu.to(device, non_blocking=True)
