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


def process_group_backend(device_type: str, cpu_collectives: bool = False) -> str:
    """The `init_process_group` backend: "nccl" on CUDA, "gloo" on CPU; on CUDA with
    cpu_collectives, "cuda:nccl,cpu:gloo" (each collective goes to the backend of its tensors'
    device, as torchtitan's enable_cpu_offload and torchtune's distributed recipes)."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


def init_distributed(device_type: str = "auto", cpu_collectives: bool = False) -> DistInfo:
    """Initialise the default process group and pick this rank's device.

    Under torchrun (RANK/WORLD_SIZE set) joins that group; otherwise creates a 1-process group on a
    free local port. Backend: `process_group_backend`.

    Args:
        device_type: "auto" (CUDA when available), "cuda" or "cpu".
        cpu_collectives: a CUDA run also gets gloo for collectives on CPU tensors. FSDP2's
            CPUOffloadPolicy needs it: the sharded parameters and gradients live in host memory,
            so the gradient norm's all-reduce and every `full_tensor()` gather (saving the HF
            model, GRPO's weight sync) run on CPU shards, which NCCL cannot take.

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
        backend = process_group_backend(device_type, cpu_collectives)
        if "RANK" in os.environ:
            dist.init_process_group(backend, device_id=device if device_type == "cuda" else None)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    return DistInfo(rank, local_rank, world_size, device)


# Mesh dims, outermost first (torchtitan's order): replicas, FSDP shards, context-parallel ranks,
# tensor-parallel ranks. tp is innermost so its ranks are neighbours (one node, fast links).
MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


def build_mesh(
    device_type: str, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1
) -> DeviceMesh:
    """A DeviceMesh with named dims ("dp_replicate", "dp_shard", "cp", "tp") plus flattened dims.

    Dims of size 1 are dropped except "dp_shard", which always exists (FSDP2 shards over it; at
    size 1 it only applies the mixed-precision policy). Flattened dims (DeviceMesh._flatten, as
    torchtitan's `ParallelDims`) that the script slices by name:

    - "dp" = dp_replicate x dp_shard: the data-parallel ranks. The sampler shards the data over
      them, and the supervised-token count is all-reduced over them (TP and CP ranks of one dp rank
      see the same batch, so reducing over the world would count it tp * cp times).
    - "dp_shard_cp" = dp_shard x cp: FSDP shards over it, since a CP rank holds
      a slice of every sequence and can also hold a shard of the weights.
    - "dp_cp" = dp_replicate x dp_shard x cp: the ranks that hold different
      tokens, i.e. the group of the loss normalisation under CP.

    Args:
        device_type: "cpu" or "cuda".
        dp_replicate: replica groups (HSDP: each group holds one sharded copy; gradients are
            reduce-scattered within a group and all-reduced across groups).
        dp_shard: FSDP shard degree; -1 = world // (dp_replicate * cp * tp).
        cp: context-parallel degree (sequence split over ranks in attention).
        tp: tensor-parallel degree (heads / hidden columns split over ranks).

    Raises:
        ValueError: a degree < 1 (other than dp_shard=-1), or the degrees do not multiply to the
            world size (the message lists them).

    Reference: torchtitan `torchtitan/distributed/parallel_dims.py` (`ParallelDims.build_mesh`).
    """
    world = dist.get_world_size()
    sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
    bad = {n: s for n, s in sizes.items() if s < 1 and not (n == "dp_shard" and s == -1)}
    if bad:
        raise ValueError(f"parallel degrees {bad} must be >= 1 (dp_shard may be -1 = the rest)")
    others = dp_replicate * cp * tp
    if dp_shard == -1:
        if world % others:
            raise ValueError(
                f"world size {world} is not divisible by dp_replicate*cp*tp="
                f"{dp_replicate}*{cp}*{tp}={others}; set --dp_replicate/--cp/--tp so that their "
                "product divides the number of processes"
            )
        sizes["dp_shard"] = dp_shard = world // others
    if others * dp_shard != world:
        raise ValueError(
            f"dp_replicate={dp_replicate} x dp_shard={dp_shard} x cp={cp} x tp={tp} = "
            f"{others * dp_shard}, but the world size is {world}; make the product equal "
            "the number of processes (torchrun --nproc-per-node x --nnodes)"
        )
    names = [n for n in MESH_DIMS if sizes[n] > 1 or n == "dp_shard"]
    mesh = init_device_mesh(
        device_type, tuple(sizes[n] for n in names), mesh_dim_names=tuple(names)
    )
    _flatten(mesh, ("dp_replicate", "dp_shard"), "dp")
    # also at cp = 1 (then equal to dp_shard and dp), so a context-parallel script runs with --cp 1
    _flatten(mesh, ("dp_shard", "cp"), "dp_shard_cp")
    _flatten(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")
    return mesh


def _flatten(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> None:
    """Register `name` as the flattened product of those of `dims` that exist in `mesh`."""
    present = tuple(d for d in dims if d in mesh.mesh_dim_names)
    mesh[present]._flatten(name)


def data_parallel(mesh: DeviceMesh) -> tuple[int, int, dist.ProcessGroup]:
    """(rank, size, process group) of this rank in the mesh's flattened "dp" dim (`build_mesh`):
    the ranks that read different data. The sampler shards over (rank, size); token counts and
    loss sums are all-reduced over the group."""
    dp = mesh["dp"]
    return dp.get_local_rank(), dp.size(), dp.get_group()


def check_tp_degree(
    tp: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    vocab_size: int,
    model_type: str = "llama",
) -> None:
    """Raise ValueError unless the tensor-parallel plan can split this model over `tp` ranks.

    Each rank must hold whole query and KV heads (ColwiseParallel on q/k/v_proj), and an equal
    slice of the vocabulary (vocab-sharded embed_tokens / lm_head and loss parallel). The message
    names the numbers and lists the valid tp values. MoE models (qwen3_moe) are refused: their
    experts take expert parallel, not this dense plan.
    """
    if tp == 1:
        return
    if model_type == "qwen3_moe":
        raise ValueError(
            f"tp={tp} with a {model_type} model: the tensor-parallel plan covers dense MLPs only; "
            "MoE experts are split with expert parallel; use tp=1"
        )
    dims = {
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "vocab_size": vocab_size,
    }
    bad = {n: v for n, v in dims.items() if v % tp}
    if bad:
        valid = [
            d for d in range(1, num_key_value_heads + 1) if all(v % d == 0 for v in dims.values())
        ]
        raise ValueError(
            f"tp={tp} does not divide {', '.join(f'{n}={v}' for n, v in bad.items())} (each "
            f"tensor-parallel rank holds whole heads and an equal vocabulary slice); pick tp in "
            f"{{{', '.join(map(str, valid))}}}"
        )


def _adapter_styles():
    """`ColwiseParallel` / `RowwiseParallel` that also take a LoRA linear (`runtime.lora.LoRALinear`:
    a base `weight` [D_out, D_in], an optional `bias`, children `lora_A` [r, D_in] and `lora_B`
    [D_out, r]), sharded consistently with the base so that x W^T + s B A x keeps the base's
    layouts (Hu et al. 2021 for LoRA; the plan of Megatron-LM, Shoeybi et al. 2019):

    - colwise base (W `Shard(0)`, bias `Shard(0)`): lora_A replicated, lora_B `Shard(0)`. A x is
      [.., r] on every rank; B A x comes out `Shard(-1)` like W x. A's gradient sums the tp
      ranks' output shards (a `Partial` DTensor gradient, reduced by DTensor).
    - rowwise base (W `Shard(1)`, bias replicated): lora_A `Shard(1)`, lora_B replicated. A x is a
      `Partial` sum over the input shards, B A x stays `Partial` like W x, and the style's output
      redistribution (the reduce-scatter to the sequence-sharded residual) sums both at once.

    On a plain `nn.Linear` they are exactly their parents. The adapters' `requires_grad` is kept.
    A DoRA magnitude (a row norm of W + s B A, whose rows a rowwise base splits) and an NF4 base
    (torchao 0.18's NF4Tensor splits along dim 0 only) are refused.
    """
    from functools import partial

    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def partition(placements: dict, src_data_rank, name, module, device_mesh) -> None:
        if name:  # distribute_module visits every submodule: the LoRA linear's own call does all
            return
        if getattr(module, "use_dora", False) or type(module.weight).__name__ == "NF4Tensor":
            raise ValueError(
                "tensor parallel takes LoRA adapters on a bf16/fp32 base only: a DoRA magnitude "
                "is a row norm over the rows a rowwise base splits, and torchao's NF4Tensor "
                "splits along dim 0 only; use --peft lora (and --algo lora, not qlora) or tp=1"
            )
        for full_name, param in list(module.named_parameters()):
            owner_name, _, leaf = full_name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            key = full_name if owner_name else leaf
            dist_param = nn.Parameter(
                distribute_tensor(
                    param, device_mesh, [placements[key]], src_data_rank=src_data_rank
                ),
                requires_grad=param.requires_grad,
            )
            owner.register_parameter(leaf, dist_param)

    def is_adapted(module) -> bool:
        return not isinstance(module, nn.Linear) and hasattr(module, "lora_A")

    def distribute(style, module, device_mesh, placements):
        """The parent style's input/output hooks around `placements` of the adapted module."""
        return distribute_module(
            module,
            device_mesh,
            partial(partition, placements, style.src_data_rank),
            partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
            partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
        )

    class ColwiseParallelWithAdapters(ColwiseParallel):
        def _apply(self, module, device_mesh):
            if not is_adapted(module):
                return super()._apply(module, device_mesh)
            placements = {"weight": Shard(0), "bias": Shard(0)}
            placements |= {"lora_A.weight": Replicate(), "lora_B.weight": Shard(0)}
            return distribute(self, module, device_mesh, placements)

    class RowwiseParallelWithAdapters(RowwiseParallel):
        def _apply(self, module, device_mesh):
            if not is_adapted(module):
                return super()._apply(module, device_mesh)
            self.desired_input_layouts = (Shard(-1),)  # as the parent's for nn.Linear
            placements = {"weight": Shard(1), "bias": Replicate()}
            placements |= {"lora_A.weight": Shard(1), "lora_B.weight": Replicate()}
            return distribute(self, module, device_mesh, placements)

    return ColwiseParallelWithAdapters, RowwiseParallelWithAdapters


def reward_model_tp_plan() -> dict:
    """Tensor + sequence parallel plan of the non-block modules of a `SequenceClassifier` (a
    reward model; HF names): `llama_tp_plan`'s embed_tokens, model.norm and the final all-gather
    of the hidden states to [B, S, D] on every tp rank, and no lm_head. The `score` head is not in
    the plan: `replicate_over_mesh` keeps it whole on each tp rank."""
    plan = llama_tp_plan()
    del plan["lm_head"]
    return plan


def llama_tp_plan(loss_parallel: bool = True) -> dict:
    """Tensor + sequence parallel plan of the non-block modules of a `CausalLM` (HF names).

    Applied to the root with `parallelize_module(model, mesh["tp"], plan)`; the blocks take
    `llama_block_tp_plan`. Layouts between modules (the residual stream is sequence-sharded,
    `Shard(1)` over S, so S must be a multiple of tp):

    - embed_tokens: `RowwiseParallel` shards the [V, D] table on the vocab dim; tokens are
      looked up in the local rows and the partial sums reduce-scattered over S: [B, S] ->
      [B, S/tp, D] local.
    - model.norm: `SequenceParallel` (the norm runs on S/tp tokens; its weight is replicated and
      its gradient summed over tp).
    - model: `PrepareModuleOutput` all-gathers the final hidden states to [B, S, D] on every tp
      rank (a plain tensor), so `logits_mask` selects the supervised rows and `forward_hidden`
      feeds the vocab-parallel linear cross-entropy.
    - lm_head: `ColwiseParallel` shards the [V, D] weight on the vocab dim (the same dim as
      embed_tokens, so a tied weight is one DTensor `Shard(0)`; call `model.tie_weights()` after
      `parallelize_module`, which replaced both Parameters). With `loss_parallel` its output stays
      vocab-sharded ([T, V] DTensor `Shard(-1)`; `runtime.loss.cross_entropy_sum` computes the
      vocab-parallel CE on it, no [T, V] all-gather); without, the logits are all-gathered.

    Reference: torchtitan `torchtitan/models/llama3/infra/parallelize.py` (`apply_tp`).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    ColwiseParallel, _ = _adapter_styles()  # lm_head may carry LoRA adapters (untied models)
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "model": PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        ),
        "lm_head": ColwiseParallel(
            input_layouts=Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def llama_block_tp_plan(use_qk_norm: bool = False) -> dict:
    """Tensor + sequence parallel plan of one `LlamaDecoderLayer` (HF names), Megatron-style.

    q/k/v_proj and gate/up_proj are `ColwiseParallel` (each rank computes H/tp query heads,
    Hkv/tp KV heads and I/tp MLP columns; biases sharded alike); o_proj and down_proj are
    `RowwiseParallel` and reduce-scatter their output back to the sequence-sharded residual
    stream `Shard(1)`; the two norms are `SequenceParallel`; `PrepareModuleInput` all-gathers the
    normed [B, S/tp, D] input to [B, S, D] before attention and the MLP. Attention runs on the
    local heads (`LlamaAttention` reshapes with -1 heads, so H/tp and Hkv/tp follow from the
    sharded projections). Qwen3's q_norm/k_norm act on the local heads [B, S, H/tp, Dh]:
    `SequenceParallel(sequence_dim=2)` treats them as head-sharded, so their replicated weight's
    gradient is summed over tp.

    A projection with LoRA adapters (`runtime.lora.add_lora`, before this plan) is sharded with
    its base: lora_A replicated and lora_B colwise on a colwise base, lora_A rowwise and lora_B
    replicated on a rowwise one (`_adapter_styles`).

    Needs num_attention_heads and num_key_value_heads divisible by tp; dense MLP only (MoE
    blocks take expert parallel instead). Reference: torchtitan
    `torchtitan/models/llama3/infra/parallelize.py` (`apply_tp`), Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198 (SP).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    # the projections may carry LoRA adapters: sharded with their base (`_adapter_styles`)
    ColwiseParallel, RowwiseParallel = _adapter_styles()
    plan = {
        "input_layernorm": SequenceParallel(),
        # self_attn(x, cos, sin, attention_mask, is_causal, kv_cache): only x is laid out
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None, None),
            use_local_output=True,
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if use_qk_norm:
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def replicate_over_mesh(module: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Replicate a small head that the tensor-parallel plan leaves whole (PPO's value head, a
    reward model's `score`: [D] -> 1, nothing worth splitting) over the 1-D `mesh` (mesh["tp"]),
    in place: its parameters become `Replicate()` DTensors, and it takes and returns plain tensors
    (the same on every rank of the mesh; non-tensor inputs pass through).

    Why: beside the plan's DTensor parameters, plain ones would be mixed into one gradient norm
    (`clip_grad_norm`) and FSDP2's 2-D (dp_shard x tp) sharding would skip them. The module reads
    the all-gathered hidden states, so every tp rank computes the same output and loss, and its
    gradient is already the same on every rank: nothing is reduced.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_replicated(_module, inputs, device_mesh):
        return tuple(
            DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def to_local(_module, output, _device_mesh):
        return output.to_local()

    distribute_module(module, mesh, input_fn=to_replicated, output_fn=to_local)


def all_reduce_sum(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum a tensor in place over `group` (None = all ranks) and return it.

    No-op without a process group or on a 1-rank group. Pass the data-parallel group
    (`mesh["dp"].get_group()`) for token counts and losses: TP/CP ranks hold copies of the same
    batch, so summing over all ranks would count it tp * cp times.
    """
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def destroy_distributed() -> None:
    """Tear down cleanly: collect garbage, barrier, destroy the group.

    Without the gc + barrier, 10-30% of gloo runs abort at exit ("terminate called without an
    active exception") while FSDP buffers are freed after the group is gone (measured: docs/DESIGN.md#facts-the-code-relies-on).
    Delete the model and optimizer before calling this.
    """
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cast_frozen_params(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen floating parameter (requires_grad False) in `dtype`, in place.

    Frozen weights never take an optimizer step, so fp32 "master" copies of them buy nothing:
    under FSDP2 with `MixedPrecisionPolicy(param_dtype=dtype)` the forward computes with the same
    values either way (FSDP casts each all-gathered parameter to param_dtype; rounding at load
    gives the same bf16 numbers as rounding at the cast), and bf16 storage halves their memory:
    a LoRA model's base, a frozen reference. torchtune keeps LoRA bases in bf16 the same way.
    Trainable parameters (adapters, DoRA magnitudes) keep their dtype. Call on meta, before
    `fully_shard` (FSDP2 records each parameter's dtype when it shards), with the same Parameter
    objects kept (`param.data` is swapped), so optimizer and module references stay valid.
    NF4 (torchao) weights are left alone.

    Returns:
        the number of parameters cast.
    """
    cast = 0
    for param in model.parameters():
        if param.requires_grad or not param.is_floating_point() or param.dtype == dtype:
            continue
        if type(param.data).__name__ == "NF4Tensor":  # torchao NF4 (QLoRA): its own 4-bit layout
            continue
        param.data = param.data.to(dtype)
        cast += 1
    return cast


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


@torch.no_grad()  # as clip_grad_norm_; to_local() is then a plain alias of the local shard
def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip all gradients of `model` to a global L2 norm of `max_norm`; return the norm before.

    The one clipping call for every script: plain parameters (1 process), FSDP2 DTensors (the
    norm over all shards) and expert parallel, where the parameters mix FSDP2 DTensors with plain
    expert tensors that differ per rank (their squared norms are summed over the ep group). Every
    rank gets the same norm and the same clip coefficient. Without experts the norm and the
    clipped gradients are bit-identical to `torch.nn.utils.clip_grad_norm_(model.parameters(),
    max_norm)` (same reduction, same coefficient `clamp(max_norm / (norm + 1e-6), max=1)`), and no
    value is copied to the host. A non-finite norm is returned as it is (the gradients are then
    not finite either): the caller skips the optimizer step.

    Args:
        model: the plain or FSDP2-sharded (possibly expert-parallel) model; parameters without a
            gradient are skipped.
        max_norm: clip threshold; 0 (the scripts' `--max_grad_norm 0`) or float("inf") only
            measures, leaving the gradients untouched.

    Returns:
        Scalar fp32 tensor (plain, not a DTensor) on the gradients' device: the global gradient
        norm before clipping (0.0 when no parameter has a gradient). A collective under FSDP or
        expert parallel: call it on every rank.

    Raises:
        ValueError: max_norm is negative or NaN.

    Reference: torch.nn.utils.clip_grad_norm_ (same norm, coefficient max_norm / (norm + 1e-6));
    torchtitan `dist_utils.clip_grad_norm_` (expert-parallel norm).
    """
    if not max_norm >= 0:
        raise ValueError(f"max_norm={max_norm}: must be >= 0 (0 or inf = only measure the norm)")
    params = [p for p in model.parameters() if p.grad is not None]
    total = _global_grad_norm(model, params)
    if 0 < max_norm < math.inf:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grad_norm_'s arithmetic
        for p in params:  # a DTensor's local shard (an alias): a plain coefficient fits any layout
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            local.mul_(coef.to(local.device))
    return total


def _global_grad_norm(model: torch.nn.Module, params: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of the gradients of `params` (of `model`, each with a grad) over all ranks."""
    from runtime.models.moe import SparseMoeBlock

    expert_groups = {}
    for m in model.modules():
        if isinstance(m, SparseMoeBlock) and m.ep_group is not None:
            expert_groups.update({id(p): m.ep_group for p in m.experts.parameters()})
    shared = [p.grad for p in params if id(p) not in expert_groups]
    experts = [p for p in params if id(p) in expert_groups]
    norm = torch.nn.utils.get_total_norm(shared)  # tensor(0.) when empty
    total = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float()
    if experts:
        local = torch.nn.utils.get_total_norm([p.grad for p in experts]).float() ** 2
        dist.all_reduce(local, group=expert_groups[id(experts[0])])  # other ranks' experts
        total = (total.to(local.device) ** 2 + local).sqrt()
    return total
