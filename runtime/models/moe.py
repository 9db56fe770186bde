"""Sparse mixture-of-experts MLP (Qwen3-MoE) with Hugging Face's on-disk module names.

Keys equal the safetensors layout of real Qwen3-MoE checkpoints: the router is `mlp.gate.weight`
[E, D] and every expert is its own SwiGLU, `mlp.experts.{e}.{gate,up,down}_proj.weight`. (In
memory transformers 5 fuses the experts into 3-D `gate_up_proj`/`down_proj` parameters, but
converts back to these per-expert keys on save and from them on load; we keep the disk layout so
checkpoints and vLLM weight sync need no key map.)

Shape legend: B batch, S sequence, T = B * S tokens, D hidden_size, E num_experts,
k num_experts_per_tok, I moe_intermediate_size, L MoE layers.

Reference:
    Qwen Team 2025, "Qwen3 Technical Report", https://arxiv.org/abs/2505.09388 (fine-grained
    experts, top-8 of 128, global-batch load balancing); HF
    `transformers/models/qwen3_moe/modeling_qwen3_moe.py` (`Qwen3MoeTopKRouter`,
    `Qwen3MoeExperts`, `load_balancing_loss_func`).
    Fedus et al. 2021, "Switch Transformers", https://arxiv.org/abs/2101.03961 eq. 4-6 (the
    auxiliary load-balancing loss).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _ExpertLinear(nn.Linear):
    """nn.Linear that skips its random init on the meta device, where there is no data.

    Qwen3-235B-A22B has 36k expert projections; the (no-op) meta init of each one made building
    it take ~11 s instead of ~4 s. On a real device the init is PyTorch's default, as nn.Linear.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class MoeExpert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)), no biases (as Qwen3-MoE)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = _ExpertLinear(hidden_size, intermediate_size, bias=False)
        self.up_proj = _ExpertLinear(hidden_size, intermediate_size, bias=False)
        self.down_proj = _ExpertLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] tokens routed here -> [N, D], in x's dtype.

        The weights are cast to x's dtype: under expert parallel FSDP ignores the experts, so
        no mixed-precision policy casts their fp32 master weights to the bf16 compute dtype as
        it does every other weight's (a bf16 run then failed its first forward on the dtype
        mismatch). The bf16 copies are kept for backward; the gradient reaches the fp32 weights
        through the cast. Where FSDP has cast them already (or in fp32) the cast is a no-op."""
        gate, up, down = (
            p.weight.to(x.dtype) for p in (self.gate_proj, self.up_proj, self.down_proj)
        )
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def route_top_k(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, keep the top k, optionally renormalise them to sum to 1.

    Args:
        router_logits: [T, E] router outputs (any float dtype).
        top_k: k, experts per token.
        norm_topk_prob: divide the kept probabilities by their sum (Qwen3-MoE: True).

    Returns:
        (weights, experts): [T, k] in router_logits' dtype, and [T, k] int64 expert ids, in
        descending probability order.
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts; replaces the dense `mlp` of a decoder layer.

    After each forward, `router_logits` holds that call's [T, E] router logits (with their
    autograd graph), so a recipe can add `load_balancing_loss` (see
    `CausalLM.forward(output_router_logits=True)`). Under activation checkpointing use the
    non-reentrant kind (PyTorch's default): the reentrant one runs the forward without autograd,
    so the aux loss would get no gradient.

    Differs from reference: HF loops over the experts hit and gathers their tokens with a
    one-hot mask per expert; here tokens are sorted by expert once and split into contiguous
    groups (one host sync per layer instead of one per expert), and every expert runs, possibly
    on zero tokens, so an unused expert gets a zero gradient rather than None (FSDP and
    optimizers then see the same parameters every step). Same math, and on CPU the same
    summation order (k outputs added per token in expert order). A grouped GEMM
    (`F.grouped_mm`) would need the experts stacked in 3-D, which would break the 1:1
    checkpoint keys.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        num_experts_per_tok: int,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            [MoeExpert(hidden_size, moe_intermediate_size) for _ in range(num_experts)]
        )
        self.router_logits: torch.Tensor | None = None
        # whether forward keeps router_logits; `CausalLM` sets it to its output_router_logits.
        # Kept logits hold their autograd graph, and under activation checkpointing the
        # backward's recompute stores new ones whose graph holds the block's recomputed tensors:
        # every block's stayed alive to the end of backward (Qwen3-30B-A3B, 2048 tokens, ac: 7.3
        # GiB per rank, simulated), for a load-balancing loss no script asked for.
        self.keep_router_logits = True
        # expert parallel (`runtime.expert_parallel.apply_expert_parallel`): `experts` then holds
        # only this rank's experts, as a ModuleDict keyed by their global ids (so keys stay HF
        # keys), and `ep_dispatch(block, x_sorted, counts)` runs them on the tokens of every ep
        # rank. The model stays free of collectives: the parallel layer installs the dispatch.
        self.ep_group: torch.distributed.ProcessGroup | None = None
        self.ep_size = 1
        self.ep_rank = 0
        self.ep_dispatch: Callable[[SparseMoeBlock, Tensor, Tensor], Tensor] | None = None
        # EP x FSDP (ep < the dp_shard ranks): the other ep groups' ranks that hold the same
        # experts, over which their gradients are summed (`all_reduce_expert_grads`)
        self.ep_replicate_group: torch.distributed.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, S, D] -> [B, S, D]; also sets `self.router_logits` [T, E] (None unless
        `keep_router_logits`)."""
        B, S, D = x.shape
        x_flat = x.reshape(-1, D)  # [B, S, D] -> [T, D]
        router_logits = self.gate(x_flat)  # [T, E]
        weights, experts = route_top_k(router_logits, self.top_k, self.norm_topk_prob)
        self.router_logits = router_logits if self.keep_router_logits else None
        return self.run_experts(x_flat, experts, weights).view(B, S, D)

    def run_experts(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of each token's k expert outputs.

        Args:
            x: [T, D] tokens.
            experts: [T, k] int64 expert id per token and slot.
            weights: [T, k] routing weight per token and slot.

        Returns:
            [T, D] in x's dtype.
        """
        k = experts.shape[1]
        flat = experts.reshape(-1)  # [T, k] -> [T*k] (token-major)
        order = flat.argsort(stable=True)  # [T*k] assignments grouped by expert id
        token_idx = order // k  # [T*k] the token of each sorted assignment
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E]
        x_sorted = x.index_select(0, token_idx)  # [T*k, D]
        if self.ep_group is None:
            splits = counts.tolist()  # one host sync
            y_sorted = torch.cat([e(xe) for e, xe in zip(self.experts, x_sorted.split(splits))])
        else:
            y_sorted = self.ep_dispatch(self, x_sorted, counts)
        y = y_sorted * weights.reshape(-1).index_select(0, order)[:, None]  # [T*k, D]
        return torch.zeros_like(x).index_add_(0, token_idx, y.to(x.dtype))


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch-Transformer auxiliary loss: E * sum_e f_e * P_e over all MoE layers' tokens.

    f_e is the fraction of (token, slot) assignments that went to expert e (summed over the k
    slots, so sum_e f_e = k) and P_e the mean router probability of e; both are averaged over
    every layer's valid tokens. Minimal (= k) when routing is uniform. Add it to the loss as
    `router_aux_loss_coef * load_balancing_loss(...)` (`ModelArgs.router_aux_loss_coef`).

    Args:
        router_logits: L tensors [T, E], e.g. from `model(ids, output_router_logits=True)`.
        num_experts: E.
        top_k: k, experts per token (`num_experts_per_tok`).
        attention_mask: [B, S] with B * S = T, 1/True = real token; None = all tokens count.

    Returns:
        Scalar fp32 loss; gradients flow through P_e only (f_e comes from a top-k).

    Reference:
        Fedus et al. 2021, https://arxiv.org/abs/2101.03961 eq. 4-6; HF
        `qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func` (same reductions).
    """
    device = router_logits[0].device
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)  # [E]
    prob_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)  # [E]
    total_rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = F.softmax(logits.to(device).float(), dim=-1)  # [T, E]
        if attention_mask is None:
            valid = probs.new_ones(probs.shape[0])  # [T]
        else:
            valid = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)  # [T]
        _, selected = torch.topk(probs, top_k, dim=-1)  # [T, k]
        slot_weight = valid.repeat_interleave(top_k)  # [T*k], token-major like selected
        tokens_per_expert = tokens_per_expert.scatter_add(0, selected.reshape(-1), slot_weight)
        prob_per_expert = prob_per_expert + (probs * valid[:, None]).sum(dim=0)
        total_rows = total_rows + valid.sum()
    f = tokens_per_expert / total_rows
    p = prob_per_expert / total_rows
    return num_experts * torch.sum(f * p)
