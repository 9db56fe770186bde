"""Expert parallel: the experts of every MoE block sharded over ranks, tokens moved by all-to-all.

The model (`runtime.models.moe.SparseMoeBlock`) routes and weights; this module owns everything
distributed: which rank keeps which experts, and `dispatch_to_experts`, which sends each rank's
(token, slot) assignments to the ranks holding their experts and brings the outputs back.
`apply_expert_parallel` installs it on every block (`block.ep_dispatch`).

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

__all__ = ["apply_expert_parallel", "dispatch_to_experts"]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> set[nn.Parameter]:
    """Shard the experts of every `SparseMoeBlock` over the ranks of `ep_mesh` (expert parallel).

    Rank r keeps experts [r * E/ep, (r+1) * E/ep) as `mlp.experts` = ModuleDict keyed by their
    global ids, so parameter names stay HF keys (`mlp.experts.{e}.gate_proj.weight`); the others
    are dropped. Tokens then travel to their experts' ranks and back by all-to-all in every
    forward; routing (the replicated `mlp.gate`) and `load_balancing_loss` are unchanged. Call on
    the meta-device model, before `fully_shard`, and pass the returned parameters as
    `fully_shard(..., ignored_params=...)`: each expert lives on exactly one rank and its
    gradient is already complete there (it saw the tokens of every rank), so it must not be
    sharded or reduced by FSDP. Only the data-parallel shard dim can serve as `ep_mesh` here
    (ep = dp_shard), so every rank of the group holds different tokens.

    Args:
        model: a model with `SparseMoeBlock` MLPs (Qwen3-MoE family).
        ep_mesh: 1-D DeviceMesh of ep ranks (the script passes `mesh["dp_shard"]`).

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
