"""Process groups and device meshes: one code path from 1 process to N.

`init_distributed()` works under `torchrun` and as plain `python train.py` (a 1-process group, so
FSDP2 and DeviceMesh code runs unchanged at world size 1).
"""

from __future__ import annotations

import gc
import math
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class DistInfo:
    """This process's place: global rank, local rank on the node, world size, and its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one, so parallel runs never clash
        return s.getsockname()[1]


def init_distributed(device_type: str = "auto") -> DistInfo:
    """Initialise the default process group and pick this rank's device.

    Under torchrun (RANK/WORLD_SIZE set) joins that group; otherwise creates a 1-process group on a
    free local port. Backend: NCCL on CUDA, gloo on CPU.

    Args:
        device_type: "auto" (CUDA when available), "cuda" or "cpu".

    Returns:
        DistInfo for this process.

    Raises:
        RuntimeError: device_type="cuda" without a CUDA device.
    """
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch.cuda.is_available() is False; use --device cpu")
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend, device_id=device if device_type == "cuda" else None)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    return DistInfo(rank, local_rank, world_size, device)


def build_mesh(
    device_type: str, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1
) -> DeviceMesh:
    """A DeviceMesh with named dims ("dp_replicate", "dp_shard", "tp"); dims of size 1 are dropped
    except "dp_shard", which always exists (FSDP2 shards over it; at size 1 it only applies the
    mixed-precision policy).

    Args:
        device_type: "cpu" or "cuda".
        dp_replicate: replica groups (HSDP); dp_shard: FSDP shard degree (-1 = whatever is left);
        tp: tensor-parallel degree.

    Raises:
        ValueError: the degrees do not multiply to the world size (message lists them).
    """
    world = dist.get_world_size()
    if dp_shard == -1:
        if world % (dp_replicate * tp):
            raise ValueError(
                f"world size {world} is not divisible by dp_replicate*tp={dp_replicate * tp}; "
                "set --dp_replicate/--tp so that they divide the number of processes"
            )
        dp_shard = world // (dp_replicate * tp)
    if dp_replicate * dp_shard * tp != world:
        raise ValueError(
            f"dp_replicate={dp_replicate} x dp_shard={dp_shard} x tp={tp} = "
            f"{dp_replicate * dp_shard * tp}, but the world size is {world}; make the product equal "
            "the number of processes (torchrun --nproc-per-node x --nnodes)"
        )
    dims = [("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("tp", tp)]
    dims = [(n, s) for n, s in dims if s > 1 or n == "dp_shard"]
    return init_device_mesh(
        device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims)
    )


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks in place (no-op without a process group) and return it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def destroy_distributed() -> None:
    """Tear down cleanly: collect garbage, barrier, destroy the group.

    Without the gc + barrier, 10-30% of gloo runs abort at exit ("terminate called without an
    active exception") while FSDP buffers are freed after the group is gone (measured, STACK.md).
    Delete the model and optimizer before calling this.
    """
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
    """Make every FSDP2 module sum gradients across ranks instead of averaging them.

    The recipes divide the summed token loss by the global supervised-token count (all micro-batches,
    all data-parallel ranks) themselves; FSDP's default division by the world size would average a
    second time. Reduction is forced to plain SUM: a divide factor of 1 otherwise becomes NCCL's
    PREMUL_SUM, which gloo does not have. Reference: torchtitan `disable_fsdp_gradient_division`.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip all gradients of `model` to a global L2 norm of `max_norm`; return the norm before.

    Like `torch.nn.utils.clip_grad_norm_`, but also right under expert parallel, where the
    parameters mix FSDP2 DTensors (norm over their shards) with plain expert tensors that differ
    per rank (their squared norms are summed over the ep group). Every rank gets the same norm
    and the same clip coefficient.

    Args:
        model: the (FSDP2-sharded, possibly expert-parallel) model.
        max_norm: clip threshold; float("inf") only measures.

    Returns:
        Scalar fp32 tensor (plain, not a DTensor): the global gradient norm before clipping.

    Reference: torch.nn.utils.clip_grad_norm_ (same norm, coefficient max_norm / (norm + 1e-6));
    torchtitan `dist_utils.clip_grad_norm_` (expert-parallel norm).
    """
    from runtime.models.moe import SparseMoeBlock

    expert_groups = {}
    for m in model.modules():
        if isinstance(m, SparseMoeBlock) and m.ep_group is not None:
            expert_groups.update({id(p): m.ep_group for p in m.experts.parameters()})
    params = [p for p in model.parameters() if p.grad is not None]
    shared = [p.grad for p in params if id(p) not in expert_groups]
    experts = [p for p in params if id(p) in expert_groups]
    norm_sq = torch.zeros((), dtype=torch.float32)
    if shared:
        norm = torch.nn.utils.get_total_norm(shared)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        norm_sq = norm_sq.to(norm.device) + norm.float() ** 2
    if experts:
        local = torch.nn.utils.get_total_norm([p.grad for p in experts]).float() ** 2
        dist.all_reduce(local, group=expert_groups[id(experts[0])])  # other ranks' experts
        norm_sq = norm_sq.to(local.device) + local
    total = norm_sq.sqrt()
    coef = min(max_norm / (total.item() + 1e-6), 1.0)  # a Python float: DTensor and plain alike
    if math.isfinite(coef) and coef < 1:
        for p in params:
            p.grad.mul_(coef)
    return total
