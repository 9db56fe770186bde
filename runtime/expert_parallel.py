"""Expert parallel: the experts of every MoE block sharded over ranks, tokens moved by all-to-all.

The model (`runtime.models.moe.SparseMoeBlock`) routes and weights; this module owns everything
distributed: which rank keeps which experts, and `dispatch_to_experts`, which sends each rank's
(token, slot) assignments to the ranks holding their experts and brings the outputs back.
`apply_expert_parallel` installs it on every block (`block.ep_dispatch`). With ep smaller than
the data-parallel shard ranks (EP x FSDP, `expert_meshes`), each expert set is held by
dp_shard / ep ranks, one per ep group, and `all_reduce_expert_grads` sums their gradients.

Shape legend: N (token, slot) assignments of this rank, D hidden_size, E num_experts.

Reference: Lepikhin et al. 2020, "GShard", https://arxiv.org/abs/2006.16668 (experts sharded over
devices, tokens dispatched and combined by all-to-all); torchtitan
`torchtitan/distributed/expert_parallel.py` (`ExpertParallel`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from runtime.models.moe import SparseMoeBlock

__all__ = [
    "all_reduce_expert_grads",
    "apply_expert_parallel",
    "dispatch_to_experts",
    "expert_meshes",
]


def expert_meshes(dp_shard_mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The ep mesh and the experts' replica mesh of the data-parallel shard ranks.

    The dp_shard ranks are split as (dp_shard / ep, ep), ep innermost: rank i * ep + j is rank j
    of ep group i, so an ep group is ep consecutive ranks (one node's fast links carry the
    all-to-all). ep = dp_shard: one ep group, no replicas (the experts' gradients are complete
    on their one rank). ep < dp_shard: expert set j lives on the dp_shard / ep ranks j, ep + j,
    2 ep + j, ..., each seeing its own ep group's tokens; `all_reduce_expert_grads` sums their
    gradients over that replica mesh, as data parallel does.

    Args:
        dp_shard_mesh: 1-D DeviceMesh of the FSDP shard ranks (the script's `mesh["dp_shard"]`).
        ep: expert-parallel degree, dividing dp_shard_mesh.size().

    Returns:
        (ep_mesh [ep], replica_mesh [dp_shard / ep] or None when ep = dp_shard).

    Raises:
        ValueError: ep < 1 or not a divisor of the dp_shard ranks (lists the valid values).

    Reference: torchtitan `ParallelDims` (ep borrowed from dp_shard: "dp_shard_mod_ep" x "ep").
    """
    size = dp_shard_mesh.size()
    if ep < 1 or size % ep:
        valid = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"ep={ep} must divide the {size} data-parallel shard ranks (experts sharded over ep, "
            f"replicated over dp_shard / ep); choose ep among {valid}"
        )
    if ep == size:
        return dp_shard_mesh, None
    mesh = dp_shard_mesh._unflatten(0, (size // ep, ep), ("ep_replicate", "ep"))
    return mesh["ep"], mesh["ep_replicate"]


def all_reduce_expert_grads(model: nn.Module) -> None:
    """Sum every local expert's gradient over its replicas (EP x FSDP, `expert_meshes`).

    Each replica's gradient is its own ep group's tokens' contribution (the loss is already
    divided by the step's global count), so the sum is the whole step's gradient, as FSDP's
    reduce-scatter gives the other parameters. One all-reduce per MoE block; an expert that got
    no token on this replica contributes zeros (a missing gradient is created as zeros, so every
    replica sends the same sizes). A no-op without replicas. Call on every rank, after the last
    backward of the step and before the gradient norm.
    """
    for block in model.modules():
        group = getattr(block, "ep_replicate_group", None)
        if not isinstance(block, SparseMoeBlock) or group is None:
            continue
        params = [p for p in block.experts.parameters() if p.requires_grad]
        if not params:  # frozen experts: nothing to sum
            continue
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p.grad))


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, replicate_mesh: DeviceMesh | None = None
) -> set[nn.Parameter]:
    """Shard the experts of every `SparseMoeBlock` over the ranks of `ep_mesh` (expert parallel).

    Rank r keeps experts [r * E/ep, (r+1) * E/ep) as `mlp.experts` = ModuleDict keyed by their
    global ids, so parameter names stay HF keys (`mlp.experts.{e}.gate_proj.weight`); the others
    are dropped. Tokens then travel to their experts' ranks and back by all-to-all in every
    forward; routing (the replicated `mlp.gate`) and `load_balancing_loss` are unchanged. Call on
    the meta-device model, before `fully_shard`, and pass the returned parameters as
    `fully_shard(..., ignored_params=...)`: each expert lives on exactly one rank and its
    gradient is already complete there (it saw the tokens of every rank), so it must not be
    sharded or reduced by FSDP. The ep ranks are data-parallel shard ranks, so every rank of the
    group holds different tokens: all of them (ep = dp_shard), or one ep group of them
    (`expert_meshes`), whose replicas then sum the experts' gradients
    (`all_reduce_expert_grads`).

    Args:
        model: a model with `SparseMoeBlock` MLPs (Qwen3-MoE family).
        ep_mesh: 1-D DeviceMesh of ep ranks (`expert_meshes`: `mesh["dp_shard"]` or its "ep").
        replicate_mesh: the ranks holding the same experts (`expert_meshes`), or None.

    Returns:
        The expert parameters this rank holds (empty when ep = 1, where nothing changes).

    Raises:
        ValueError: no MoE layer in the model, or num_experts not divisible by ep (names both).

    Reference: torchtitan `ExpertParallel` (all-to-all dispatch/combine around the experts);
    GShard (https://arxiv.org/abs/2006.16668) section 2.2.
    """
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        raise ValueError(
            "ep > 1 needs a mixture-of-experts model (qwen3_moe family); this model has no MoE layer"
        )
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    if ep == 1:
        return set()
    params: set[nn.Parameter] = set()
    for block in blocks:
        if block.num_experts % ep:
            raise ValueError(
                f"ep={ep} does not divide num_experts={block.num_experts}; choose ep among "
                f"{[d for d in range(1, block.num_experts + 1) if block.num_experts % d == 0]}"
            )
        n_local = block.num_experts // ep
        local = range(rank * n_local, (rank + 1) * n_local)
        block.experts = nn.ModuleDict({str(e): block.experts[e] for e in local})
        block.ep_group, block.ep_size, block.ep_rank = ep_mesh.get_group(), ep, rank
        block.ep_replicate_group = replicate_mesh.get_group() if replicate_mesh else None
        block.ep_dispatch = dispatch_to_experts
        params.update(block.experts.parameters())
    return params


def dispatch_to_experts(
    block: SparseMoeBlock, x_sorted: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Dispatch tokens to the ranks that hold their experts, run the local experts, combine.

    Args:
        block: a `SparseMoeBlock` after `apply_expert_parallel` (its local experts and ep group).
        x_sorted: [N, D] this rank's (token, slot) assignments sorted by global expert id,
            hence grouped by destination rank (expert e lives on rank e // E_local).
        counts: [E] int64, assignments of this rank per global expert.

    Returns:
        [N, D] expert outputs in x_sorted's order. Differentiable: both all-to-alls are
        `all_to_all_single_autograd` (the backward is the reverse all-to-all).
    """
    ep, n_local = block.ep_size, block.num_experts // block.ep_size
    # counts[r * n_local + j]: my tokens for expert j of rank r; after the exchange
    # recv[s * n_local + j]: rank s's tokens for my expert j
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=block.ep_group)
    send_rows, recv_rows = torch.stack([counts, recv]).view(2, ep, n_local).tolist()  # sync
    send_splits, recv_splits = [sum(r) for r in send_rows], [sum(r) for r in recv_rows]
    x_recv = funcol.all_to_all_single_autograd(x_sorted, recv_splits, send_splits, block.ep_group)
    # x_recv is source-major ([rank s][expert j] chunks); each expert takes its chunks of
    # every source in rank order, then the outputs go back to the source-major layout
    chunks = x_recv.split([c for row in recv_rows for c in row])
    outs = [
        expert(torch.cat([chunks[s * n_local + j] for s in range(ep)]))
        for j, expert in enumerate(block.experts.values())
    ]
    per_source = [o.split([recv_rows[s][j] for s in range(ep)]) for j, o in enumerate(outs)]
    y_recv = torch.cat([per_source[j][s] for s in range(ep) for j in range(n_local)])
    return funcol.all_to_all_single_autograd(y_recv, send_splits, recv_splits, block.ep_group)
