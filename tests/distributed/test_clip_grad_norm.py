"""runtime.clip_grad_norm on 2 gloo ranks equals torch.nn.utils.clip_grad_norm_ in one process:
FSDP2 (DTensor gradients, norm over both ranks' shards) on the tiny Llama, and expert parallel
(ep = 2 = dp_shard: FSDP2 DTensors plus plain expert gradients that differ per rank) on a tiny
Qwen3-MoE. Each rank backpropagates its half of the rows; the loss is divided by the global
token count and FSDP's gradient division is off, so the summed gradients are the full batch's.
fp32, only the summation order differs: norm at rtol 1e-5, clipped gradients at atol 1e-6."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tests.helpers import TINY_CONFIG, full_tensor, spawn

MOE = dict(
    TINY_CONFIG,
    model_type="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)


def _batch():
    """[4, 16] ids and labels, some positions ignored."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (4, 16), generator=g)
    labels = torch.randint(0, TINY_CONFIG["vocab_size"], (4, 16), generator=g)
    labels[:, :3] = -100
    return ids, labels


def _build(model_dir: Path, world_size: int, expert_parallel: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from runtime import (
        ModelArgs,
        apply_expert_parallel,
        build_model,
        disable_fsdp_gradient_division,
        load_hf_checkpoint,
        read_hf_config,
    )

    model = build_model(ModelArgs.from_hf_config(read_hf_config(model_dir)), device="meta")
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        experts = apply_expert_parallel(model, mesh["dp_shard"]) if expert_parallel else None
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"], ignored_params=experts)
        fully_shard(model, mesh=mesh["dp_shard"], ignored_params=experts)
        disable_fsdp_gradient_division(model)
    model.to_empty(device="cpu")
    model.init_rope()
    load_hf_checkpoint(model, model_dir)
    return model


def _clipped(rank, world_size, model_dir, expert_parallel, max_norm):
    """(norm, {name: full clipped gradient}) after one backward of this rank's rows; one
    process: torch's own clip_grad_norm_ of the plain model (the reference)."""
    from runtime import clip_grad_norm

    model = _build(model_dir, world_size, expert_parallel)
    ids, labels = _batch()
    logits = model(ids[rank::world_size])
    ce = F.cross_entropy(
        logits.flatten(0, 1).float(), labels[rank::world_size].flatten(), reduction="sum"
    )
    (ce / (labels != -100).sum()).backward()
    if world_size == 1:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    else:
        norm = clip_grad_norm(model, max_norm)
        assert type(norm) is torch.Tensor and norm.dtype == torch.float32 and norm.shape == ()
    grads = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    return norm, grads


def _both_on_ranks(rank, world_size, cases):
    """`_clipped` for each (model_dir, expert_parallel, max_norm) of `cases`, in one start."""
    return [_clipped(rank, world_size, *case) for case in cases]


def _save_tiny(path: Path, config: dict) -> Path:
    from runtime import ModelArgs, build_model, save_hf_checkpoint

    args = ModelArgs(**config)
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, path, args.to_hf_config())
    return path


def test_two_ranks_fsdp_and_expert_parallel_equal_one_process(tmp_path):
    cases, refs = [], []
    for name, config, expert_parallel in (("llama", TINY_CONFIG, False), ("moe", MOE, True)):
        model_dir = _save_tiny(tmp_path / name, config)
        # the 1-process reference here; clip at half its norm, so clipping is active
        max_norm = 0.5 * _clipped(0, 1, model_dir, expert_parallel, float("inf"))[0].item()
        refs.append(_clipped(0, 1, model_dir, expert_parallel, max_norm))
        cases.append((model_dir, expert_parallel, max_norm))
    two = spawn(_both_on_ranks, 2, args=(cases,))
    for index, ((ref_norm, ref_grads), (_, expert_parallel, max_norm)) in enumerate(
        zip(refs, cases, strict=True)
    ):
        results = [rank_results[index] for rank_results in two]
        grads = {}
        for norm, rank_grads in results:
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
            grads.update(rank_grads)  # experts: each rank's own; the rest: the same full tensor
        assert grads.keys() == ref_grads.keys()
        if expert_parallel:
            held = [{k for k in g if ".mlp.experts." in k} for _, g in results]
            assert held[0] and held[0].isdisjoint(held[1])  # experts really split over the ranks
        for key, g in ref_grads.items():
            torch.testing.assert_close(grads[key], g, atol=1e-6, rtol=1e-4, msg=key)
        clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
        torch.testing.assert_close(clipped, torch.tensor(max_norm), rtol=1e-4, atol=0)
