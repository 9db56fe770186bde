"""Copy and gather one tensor at a time between full tensors and (possibly sharded) parameters.

The I/O primitive under HF checkpoints (`runtime.checkpoint`), PEFT adapters (`runtime.lora`) and
weight sync (`runtime.rollout`): a parameter may be a plain tensor, an FSDP2 / TP `DTensor`, or a
QLoRA NF4 tensor, and each of those callers moves exactly one full tensor at a time so peak memory
stays one tensor above the sharded model. Loading needs no communication (every rank holds the
full tensor and keeps its slice); gathering is a collective for DTensors (every rank calls it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "ComputedTensor",
    "copy_into",
    "copy_into_nf4",
    "gather_for_save",
    "global_rank",
    "reshard_fsdp",
    "save_dtype",
]


def global_rank() -> int:
    """This process's rank in the default group; 0 without torch.distributed."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def reshard_fsdp(model: nn.Module) -> None:
    """Register every FSDP2 module's sharded DTensor parameters again (a local op, no comms).

    After a forward the root keeps its parameters unsharded: they are then plain tensors in
    all-gather buffers that FSDP may free or overwrite, so never read or write those. Call this
    before reading or writing parameters outside a forward/backward.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _is_nf4(t: torch.Tensor) -> bool:
    # by type name: importing torchao (to isinstance-check) costs seconds and is only needed by QLoRA
    return type(t).__name__ == "NF4Tensor"


@torch.no_grad()
def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter in place.

    Args:
        param: plain tensor, DTensor (keeps only its local shard: every rank holds `full`, so this
            slices, no communication) or NF4 tensor (QLoRA base weight: quantized, `copy_into_nf4`).
        full: the whole tensor, same shape as `param`'s global shape; cast to `param.dtype`.
    """
    local = param._local_tensor if isinstance(param, DTensor) else param
    if _is_nf4(local):
        copy_into_nf4(param, full)
        return
    full = full.to(dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the full tensor, so just slice, no communication.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def copy_into_nf4(param: torch.Tensor, full: torch.Tensor) -> None:
    """Quantize a full-precision [D_out, D_in] tensor into an NF4 parameter in place (this rank's
    shard for an FSDP2 DTensor); `copy_into` calls it for NF4 parameters.

    The whole tensor is quantized once, then sharded by rows, so every rank holds exactly the
    shard a 1-process run would hold (the double quantization's mean is over the whole tensor).
    After `to_empty`, torchao leaves the replicated inner tensors (`scaler_mean`, the NF4 lookup
    table) on meta, so they are re-bound here on the tensor FSDP reads (`_local_tensor`).
    """
    local = param._local_tensor if isinstance(param, DTensor) else param
    from torchao.quantization import to_nf4

    full = full.to(device=local.device, dtype=local.dtype)
    q = to_nf4(full.contiguous(), local.block_size, local.scaler_block_size)
    if isinstance(param, DTensor):  # rows split over the Shard(0) mesh dim (HSDP: replicated
        mesh = param.device_mesh  # over "dp_replicate", sharded over "dp_shard")
        for dim, placement in enumerate(param.placements):
            if placement.is_shard():
                q = torch.chunk(q, mesh.size(dim), dim=0)[mesh.get_local_rank(dim)]
    for attr in ("quantized_scalers", "quantization_factor", "quantized_data"):
        getattr(local, attr).copy_(getattr(q, attr))
    local.scaler_mean = q.scaler_mean.clone()
    local.nf4 = q.nf4.clone()


@dataclass(frozen=True)
class ComputedTensor:
    """A tensor computed only when it is written (e.g. a merged LoRA weight), so at most one such
    full tensor exists at a time.

    `compute()` is called on every rank (it may run collectives, e.g. `full_tensor()`) and returns
    the full tensor of `shape` and `dtype`.
    """

    shape: torch.Size
    dtype: torch.dtype
    compute: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def save_dtype(t: torch.Tensor | ComputedTensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `t` is written in: `dtype` for floating tensors (None = keep), else t's own."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def gather_for_save(
    t: torch.Tensor | ComputedTensor, dtype: torch.dtype | None, is_writer: bool
) -> torch.Tensor | None:
    """The full tensor as a contiguous CPU copy in `save_dtype(t, dtype)` on the writer, else None.

    Collective for DTensors and for ComputedTensors that gather: call on every rank.
    """
    if isinstance(t, ComputedTensor):
        full = t.compute()
    else:
        full = t.full_tensor() if isinstance(t, DTensor) else t
    if not is_writer:
        return None
    # copy=True: never alias a live parameter (safetensors refuses shared storage, and the
    # caller may keep training while we write).
    return full.detach().to(device="cpu", dtype=save_dtype(t, dtype), copy=True).contiguous()
