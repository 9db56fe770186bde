"""The fake-tensor harness of `scaffold plan`: runs an emitted script's training step under
`FakeTensorMode` and reports rank 0's peak memory by category.

This is the only planner code that reaches into private torch APIs (`torch._subclasses`,
DTensor's sharding propagation, `torch.distributed._tools`, the fake process group), so it is the
only file a torch upgrade should have to touch. The verdict and the report are in
`generator.plan_report`, the search for a change that fits in `generator.plan`.

The planner renders the script of a Spec into a temporary directory, imports it, and runs the
script's own functions (`setup_distributed`, `setup_model`, `build_optimizer`, `train_step`;
for GRPO `setup_model` and its rollout `train_step`; for DPO also `build_reference` and its pair
`train_step`) for two optimizer steps under
`FakeTensorMode` (tensors carry shapes and dtypes, no memory), with a fake process group of the
trainer's world size (`trainer_gpus(spec) * nodes`: `gpus * nodes`, less GRPO's engine GPUs;
backend "fake", so collectives are no-ops) and PyTorch's `MemTracker` counting every tensor by
category. The answer is therefore the memory of what the script does (its FSDP2 wrapping, its
1-process fp32 exception, the tricks' code), not of a formula. Only rank 0 is simulated: FSDP2
shards evenly, so every rank holds the same bytes up to rounding (and rank 0 gets the largest
share of GRPO's rollouts).

`scaffold plan DIR` simulates DIR/train.py itself under DIR's recorded spec: the user's functions
as edited, and its Config defaults (micro_batch_size, max_seq_len, dtype, lora_rank, kl_coef, ...:
the planner reads every size from the script's Config, the plan's options overriding). The fresh
render of the spec is still imported, to tell which Config defaults the user changed
(`config_edits`); the suggestion's candidates are renders of other specs and take those edits
(`config_with`), since a user's code edits cannot be carried into another spec's render.

What is simulated, and what is not:
- Device: tensors live on a fake CPU device (FSDP2's CUDA path creates CUDA streams and
  events, which need a CUDA build and device; its CPU path runs anywhere). The bytes per tensor
  are the same on a GPU; not modelled: stream-ordered reuse of FSDP's all-gather buffers, the CUDA
  context and NCCL buffers (about 0.5-1 GiB), caching-allocator fragmentation, cuBLAS workspaces.
  The verdict therefore keeps `plan_report.HEADROOM` of the GPU's memory free.
- The synthetic batch: micro_batch_size rows of max_seq_len tokens (the options, else the
  script's Config defaults), every position supervised (the largest logits a batch of that size
  can produce), gradient_accumulation_steps = 1. Under --cp, train_step is called as the
  script's main() calls it (cp rank and size, the dp x cp group; the RM script's cuts the chunks
  itself), so the rank keeps its 2 of the 2*cp chunks of every row; the attention is the Config's cp_mode (all-gather or ring), and the
  all-gather's bottom-right causal mask is a GPU's (no mask tensor: `_causal_bias_outside_modes`).
- GRPO: the trainer's step on synthetic rollouts, built as the script's loop builds them:
  prompts_per_step * num_generations `Rollout`s of max_prompt_len prompt and max_new_tokens
  completion tokens (the longest rows the script trains on; the script's Config defaults, or
  --max-seq-len = prompt + completion with the prompt length kept), rank 0's share of them over
  the trainer ranks, and the frozen reference when kl_coef > 0 (`--kl-coef`; the Config's
  default 0 loads none). --algo grpo-lora runs the same step on its own script: `setup_model`
  adds the adapters of the Config's defaults (LoRA rank 8 on q/k/v/o/gate/up/down; --peft dora
  adds DoRA's magnitudes) on meta and freezes the base before fully_shard, so gradients and AdamW
  state are the adapters' only; its KL reference (kl_coef > 0) is the policy with the adapters
  off (`adapters_disabled`, one more no-grad forward per micro-batch), no second model, as its
  main() does. Micro-batches from the second on repeat the second's memory exactly,
  so at most SIMULATED_MICRO_BATCHES run per step. The rollout engines (vLLM or the runtime's
  sampler, on Ray) are not simulated: their memory is a computed estimate (`engine_estimate`),
  reported beside the trainer's, and combined with it per phase of the layout
  (`plan_report.grpo_phases`: split adds an engine sharing the trainer's GPU to its peak;
  colocated takes the max of trainer step, generation and weight sync) (grpo-lora's
  engines hold the merged plain model: the same estimate). Nor is the weight sync after each
  step (`gather_hf_state_dict`; grpo-lora's `gather_merged_hf_state_dict` computes each merged
  weight W + lora_scale * B A in fp32): on the GPU it adds one full parameter (merged: and its
  temporaries) at a time after the gradients are freed, below the step's peak. With
  `--weight_transfer object-store` rank 0 keeps the gathered bf16 weights in host memory for the
  push, which the plan does not count; the collective transfer (vLLM's default) keeps none.
- DPO (dpo, dpo-lora; `measure_dpo_step`): a micro-batch is micro_batch_size pairs, as the
  script's collate batches them: 2 x micro_batch_size rows of max_seq_len tokens (the chosen
  rows, then their rejected ones; with --tricks packing, one pair per packed row of
  2 x max_seq_len), every position supervised, one micro-batch per step. The reference is the
  script's Config `ref_mode` (its default: dpo separate, dpo-lora adapters-off; `scaffold plan
  DIR` plans an edited one, `simulate(config={"ref_mode": ...})` any): separate builds the frozen
  copy (`build_reference`, sharded like the policy, in the compute dtype) and runs its no-grad
  forward per micro-batch; adapters-off runs the policy once more with its adapters off, no
  second model; precomputed first runs the one-off pass over the pairs that main() runs before
  training (the runtime's `precompute_reference_logprobs` with the script's log-prob function,
  two micro-batches per rank), then the steps, which read the table. That pass and the steps
  are two stages, each with its own peak (`PlanResult.stages`); the plan's peak is the larger
  and the report says which. Not simulated: ref_device="cpu" (the reference in host memory).
  The Config's loss_type decides whether there is a reference at all (`dpo_reference_mode`):
  simpo and orpo build none, whatever ref_mode says, as main(); kto's micro-batch is
  micro_batch_size examples, their completions and KL sequences in the same 2 x micro_batch_size
  rows, half of them desirable. `scaffold new` plans the rendered default, loss_type "sigmoid"
  (with a reference); a script run with `--loss_type simpo` needs less than that plan says.
- Mixture of experts (qwen3_moe; experts FSDP-sharded like any weight, or --ep: EP x FSDP,
  each ep group's ranks holding num_experts / ep whole experts): which expert a token goes to is
  the router's run-time choice, so the expert batches and the all-to-all sizes are data fake
  tensors do not have. The plan fixes them by an assumption, balanced routing
  (`balanced_routing`): the router runs, but token t's k slots go to experts t*k .. t*k+k-1
  (mod E), so every expert gets tokens * k / E of a rank's assignments, the expectation under a
  load-balanced router; the report says so. Checked against real gloo ranks run under the same
  routing (tests/generator/test_plan.py: exact); a real router's imbalance puts more tokens on
  the ranks holding its favourite experts (a tiny random model: their peak 9-15% above the
  plan's under --ep; no difference with the experts FSDP-sharded, where every rank runs every
  expert on its own tokens).
- Data-dependent branches take the path of a healthy step: `torch.isfinite(grad_norm)` is True
  (the optimizer steps), a boolean mask selects every position (GRPO's label mask: the
  completion tokens, as many as its rows have), and a number read on the host (the step's
  `.item()` / `.tolist()` metrics) is 0, so the script's train_step runs unchanged.
- DTensor's sharding propagation gets a fake mode of its own (as on real tensors), so its
  global-shape metadata tensors are not counted (`_separate_propagation_fake_mode`).
- Weights are not loaded (`load_hf_checkpoint` is skipped: it copies into the already sharded
  parameters and frees each source tensor at once).
- Depth: a model of identical blocks deeper than EXTRAPOLATION_DEPTHS[-1] is simulated at 3
  and 4 blocks (a config.json copy with fewer `num_hidden_layers`) and extrapolated to its own
  depth per segment of the step (`extrapolate_depth`; equal bytes, checked against the full
  simulation in tests/generator/test_plan_speed.py); `simulate(full_depth=True)` runs every
  block. The engines' numbers are the full model's.
- Not simulated (the plan says so instead of printing a number): --tricks compile (inductor
  fuses temporaries, which fake tensors cannot model), offload (pinned host copies on a side
  stream), cpu-offload (host-resident shards: on the CPU the simulation cannot tell host memory
  from the GPU's; `plan_estimate` counts them off the GPU).
- qlora: the targeted base weights are torchao NF4Tensors of torchao's own layout (built on
  meta outside the fake mode, `_fake_nf4_layout`; 4-bit codes, int8 block scalers, the
  double quantization's factors), sharded by FSDP2 over its mesh where the blocks split and whole
  where `nf4_params_fsdp_cannot_shard` says so, as in the script; each forward and backward
  dequantizes them to the dtype. Not simulated: the quantization during the checkpoint load (one
  full-precision tensor and torchao's chunked temporaries at a time, before training).
- kd: the teacher of the script's Config (a catalog model's config.json, or the local directory;
  at its own depth when the student's is extrapolated) is built by the script's `load_teacher`,
  whole on each rank in the compute dtype, and runs its no-grad forward in every step (under CP
  over the student's chunks). The tokenizer check (`check_same_tokenizer`) is skipped.

Reference: torchtitan `scripts/estimate/estimation.py` (FakeTensorMode + fake process group +
FSDPMemTracker around one training step); PyTorch `torch.distributed._tools.mem_tracker`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from generator.features import ALGOS, PEFT_ALGOS
from generator.spec import ScaffoldError, Spec, trainer_gpus, validate_spec

GIB = 2**30
# GRPO: micro-batches per step the plan runs. The second and every later one hold the same
# memory (same shapes; the gradients exist and accumulate in place), so running more changes no
# byte of the peak, only the time (a 70B rank with 16 micro-batches per step: 2 instead of 16).
SIMULATED_MICRO_BATCHES = 2
# Decoder depths the plan simulates a deeper model at, to extrapolate to its own depth
# (`extrapolate_depth`): 3 and 4 both have a block between the first and the last, whose
# neighbours differ (FSDP prefetches the next block, the last block's output feeds the head).
EXTRAPOLATION_DEPTHS = (3, 4)
# Algorithms of the GRPO skeleton the planner has been checked on against real gloo runs
GRPO_SIMULATED = ("grpo", "grpo-lora", "ppo")
UNSIMULATED_TRICKS = {
    "compile": "inductor fuses temporaries, which fake tensors cannot model",
    "offload": "activations move to pinned host memory on a side stream, outside the simulation",
    "cpu-offload": "FSDP2's CPUOffloadPolicy keeps the sharded weights, gradients and optimizer "
    "state in host memory, which a simulation on the CPU does not tell apart from the GPU's; "
    "`scaffold new` and `scaffold plan` print an arithmetic estimate of the GPU's and the "
    "host's shares where the rest of the spec is plannable",
}
# MemTracker category -> row of the report
ROWS = {
    "parameters": ("Parameter", "Buffer"),
    "gradients": ("Gradient",),
    "optimizer state": ("Optstate",),
    "activations": ("Activation",),
    "temporaries": ("Temp", "Other"),
}


# Optimizer state bytes per trained parameter (fp32 weights: AdamW's two fp32 moments)
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2, "adamw4bit": 1}


def trained_bytes(tricks) -> tuple[int, float]:
    """(weight bytes, optimizer state bytes) per trained parameter for a trick set: fp32 master
    weights (4), or bf16 under bf16-sr (2, no master copy; torchao's AdamW then keeps its two
    moments in bf16, 4 bytes, unless a low-bit state is chosen). Gradients have the weight's
    dtype (FSDP2 reduces into the sharded parameter's dtype)."""
    optimizer = next((o for o in ("adamw8bit", "adamw4bit") if o in tricks), "adamw")
    if "bf16-sr" in tricks:
        return 2, (4 if optimizer == "adamw" else OPTIMIZER_BYTES[optimizer])
    return 4, OPTIMIZER_BYTES[optimizer]


def model_dims(config: dict) -> dict:
    """A decoder's shapes and parameter counts from its HF config (`plan_estimate` and
    `engine_layout`): hidden D, intermediate I, kv / q widths, layers L, vocab V, elements per
    block (the mean over the blocks), of the root (embedding, head, final norm) and in all.

    A mixture of experts (qwen3_moe, `ModelArgs.is_moe_layer`'s rule) counts every expert and
    the router of its MoE blocks: "experts" is the experts' elements (what --ep shards),
    "expert_block" one MoE block's, and "I_active" the MLP width a token passes through
    (num_experts_per_tok x moe_intermediate_size; the dense I elsewhere)."""
    D, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or D // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    L, inter, V = config["num_hidden_layers"], config["intermediate_size"], config["vocab_size"]
    tied = config.get("tie_word_embeddings", False)
    attention = D * heads * head_dim * 2 + D * kv * 2 + 2 * D  # q, o, k, v, norms
    E = config.get("num_experts") or 0
    dense_mlp = 3 * D * inter
    moe_layers, expert_block, active = 0, 0, inter
    if E:
        step, dense_only = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers", [])
        moe_layers = sum(1 for i in range(L) if i not in dense_only and (i + 1) % step == 0)
        expert_block = E * 3 * D * config["moe_intermediate_size"]
        active = config["num_experts_per_tok"] * config["moe_intermediate_size"]
    mlps = moe_layers * (expert_block + E * D) + (L - moe_layers) * dense_mlp  # + routers
    root = V * D * (1 if tied else 2) + D
    return {"D": D, "I": inter, "kv": kv, "q": heads * head_dim, "L": L, "V": V,
            "block": attention + mlps / L, "root": root, "params": root + L * attention + mlps,
            "experts": moe_layers * expert_block, "expert_block": expert_block,
            "k": config.get("num_experts_per_tok", 0) if E else 0,
            "I_active": active if moe_layers == L else inter}  # fmt: skip


def adapter_params(d: dict, cfg: dict) -> int:
    """LoRA (and DoRA's magnitudes) elements of the whole model, from the Config's rank and
    target modules."""
    D, inter, q, kv, r = d["D"], d["I"], d["q"], d["kv"], cfg.get("lora_rank", 8)
    shapes = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
              "gate_proj": (D, inter), "up_proj": (D, inter), "down_proj": (inter, D)}  # fmt: skip
    targets = cfg.get("lora_target_modules", list(shapes))
    dora = cfg.get("use_dora", False)
    per_block = sum(
        r * (shapes[t][0] + shapes[t][1]) + (shapes[t][1] if dora else 0)
        for t in targets
        if t in shapes
    )
    return per_block * d["L"]


class PlanError(ScaffoldError, ValueError):
    """A bad `scaffold plan` option, or a configuration the planner cannot simulate."""


@dataclass(frozen=True)
class PlanResult:
    """Rank 0's memory at the peak of two simulated optimizer steps (bytes)."""

    spec: Spec
    micro_batch_size: int
    max_seq_len: int
    world_size: int
    categories: dict  # row of ROWS -> bytes at the peak
    peak: int  # bytes, all categories, at the peak
    logits: int  # bytes of the largest lm_head output ([B, S, V] or [T, V]); 0 under lce
    seconds: float  # wall time of the simulation
    # GRPO: the step's rollouts and the engines' numbers (`measure_grpo_step`); None otherwise
    rollout: dict | None = None
    # `scaffold plan DIR`: the train.py simulated (the user's, as edited; None: a fresh render)
    # and its Config defaults that differ from a fresh render of its spec ({field: value})
    script: str | None = None
    config_edits: dict | None = None
    # the decoder depths simulated when the model's own depth was extrapolated from them
    # (`extrapolate_depth`); None: every block simulated
    simulated_depths: list | None = None
    # DPO: {"ref_mode", "pairs" per micro-batch, "sequences" (2 x pairs)}; None otherwise
    dpo: dict | None = None
    # DPO precomputed: each stage's peak, {"reference pass" | "training step": {"categories",
    # "peak"}} (bytes); `peak` is the larger of the two. None: one stage (the step)
    stages: dict | None = None

    def to_json(self) -> dict:
        return {**asdict(self), "spec": asdict(self.spec)}

    @classmethod
    def from_json(cls, data: dict) -> PlanResult:
        spec = dict(data["spec"], tricks=tuple(data["spec"]["tricks"]))
        spec["fit_note"] = tuple(spec.get("fit_note", ()))
        return cls(**{**data, "spec": Spec(**spec)})


def is_grpo(spec: Spec) -> bool:
    """The spec renders the GRPO skeleton (rollouts, engines, `setup_model`)."""
    return ALGOS[spec.algo].skeleton == "grpo"


def is_rm(spec: Spec) -> bool:
    """The spec renders the reward-model skeleton (pairs scored by a `score` head: `measure_step`
    with `synthetic_rm_pairs`)."""
    return ALGOS[spec.algo].skeleton == "rm"


def is_dpo(spec: Spec) -> bool:
    """The spec renders the DPO skeleton (preference pairs, a reference: `measure_dpo_step`)."""
    return ALGOS[spec.algo].skeleton == "dpo"


# the DPO script's REFERENCE_FREE: the loss types that score the policy alone (SimPO, ORPO)
REFERENCE_FREE_LOSSES = ("simpo", "orpo")


def dpo_reference_mode(config: dict) -> str:
    """The reference the DPO script's main() sets up for these Config values ({field: value}):
    "none" for a reference-free loss_type (no model built, loaded or precomputed), else the
    Config's ref_mode."""
    if config.get("loss_type", "sigmoid") in REFERENCE_FREE_LOSSES:
        return "none"
    return config.get("ref_mode", "separate")


def has_adapters(spec: Spec) -> bool:
    """The spec trains LoRA/DoRA adapters on a frozen base (grpo-lora in the GRPO skeleton): its
    KL reference is the policy itself with the adapters off (`adapters_disabled`), so
    kl_coef > 0 builds no second model (`setup_frozen_model`)."""
    return spec.algo in PEFT_ALGOS


def check_simulable(
    spec: Spec, micro_batch_size: int | None, max_seq_len: int | None, kl_coef: float | None = None
) -> None:
    """Raise PlanError when the planner cannot give a right number for `spec` (names why).

    micro_batch_size / max_seq_len None: the script's Config defaults.
    """
    validate_spec(spec)
    unsimulated = {}  # every algorithm of the SFT, DPO and RM skeletons is simulated
    for name in ALGOS:
        if ALGOS[name].skeleton == "grpo" and name not in GRPO_SIMULATED:
            unsimulated[name] = (
                "the planner's GRPO path is checked against real runs for --algo "
                f"{', '.join(GRPO_SIMULATED)} only"
            )
    if spec.algo in unsimulated:
        raise PlanError(
            f"scaffold plan cannot simulate --algo {spec.algo}: {unsimulated[spec.algo]}; "
            f"it simulates --algo {', '.join(a for a in ALGOS if a not in unsimulated)}"
        )
    if kl_coef is not None and (not is_grpo(spec) or not kl_coef >= 0):
        raise PlanError(
            f"--kl-coef {kl_coef}: a GRPO-skeleton option (> 0 adds the KL reference: a frozen "
            "model for grpo and ppo, a no-grad forward with the adapters off for grpo-lora; 0 has "
            "none); give it with --algo grpo, grpo-lora or ppo, as a number >= 0"
        )
    if is_grpo(spec) and "packing" in spec.tricks:
        kept = ",".join(t for t in spec.tricks if t != "packing")
        raise PlanError(
            f"scaffold plan cannot simulate --algo {spec.algo} with --tricks packing: the step "
            "lays its rollouts out by their token counts, read on the host from the rollout "
            "tensors (runtime.packed_completion_values), which the simulation's fake tensors do "
            f"not hold; plan without it ({f'--tricks {kept}' if kept else 'no --tricks'}: every "
            "rollout padded to the longest, at most the packed rows' tokens per micro-batch)"
        )
    blocked = [t for t in spec.tricks if t in UNSIMULATED_TRICKS]
    if blocked:
        why = "; ".join(f"{t}: {UNSIMULATED_TRICKS[t]}" for t in blocked)
        kept = ",".join(t for t in spec.tricks if t not in UNSIMULATED_TRICKS)
        them = "it" if len(blocked) == 1 else "them"
        raise PlanError(
            f"scaffold plan cannot simulate --tricks {','.join(blocked)} ({why}); plan without "
            f"{them} ({f'--tricks {kept}' if kept else 'no --tricks'}): the memory without {them} "
            "is an upper bound"
        )
    # checked against real gloo runs: FSDP2, TP (+ sequence and loss parallel), TP x FSDP, HSDP,
    # CP, and mixture-of-experts models with experts FSDP-sharded or EP x FSDP, under the
    # balanced-routing assumption (`balanced_routing`)
    if (micro_batch_size is not None and micro_batch_size < 1) or (
        max_seq_len is not None and max_seq_len < 1
    ):
        raise PlanError(
            f"--micro-batch-size {micro_batch_size} and --max-seq-len {max_seq_len} must be >= 1"
        )


def describe_spec(spec: Spec) -> str:
    tricks = ",".join(spec.tricks) or "no tricks"
    degrees = (
        ("tp", spec.tp),
        ("cp", spec.cp),
        ("dp_replicate", spec.dp_replicate),
        ("ep", spec.ep),
    )
    mesh = "".join(f", {name} {n}" for name, n in degrees if n > 1)
    if spec.cp > 1:  # the two modes hold different K/V: say which one was planned
        mesh = mesh.replace(f", cp {spec.cp}", f", cp {spec.cp} ({spec.cp_mode})", 1)
    if is_grpo(spec):
        ranks = trainer_gpus(spec) * spec.nodes
        engines = (
            f" + {spec.engine_gpus} engine GPU(s) per node (engine_tp {spec.engine_tp})"
            if spec.engine_gpus
            else f", colocated engines (engine_tp {spec.engine_tp}) asleep while it steps"
            if spec.layout == "colocated"
            else ", engines on the trainer's GPU(s)"
        )
        return f"{spec.model} {spec.algo} {spec.dtype}, {tricks}, {ranks} trainer rank(s){engines}"
    ranks = spec.gpus * spec.nodes
    return f"{spec.model} {spec.algo} {spec.dtype}, {tricks}, {ranks} rank(s){mesh}"


# --- the simulation (runs in a child process: it owns the fake process group) ---------------


def _data_dependent_answers(
    true_fraction: tuple[int, int] = (1, 1), local_fraction: tuple[int, int] | None = None
):
    """A dispatch mode that answers the questions fake tensors cannot: a boolean mask selects
    `true_fraction` (numerator, denominator) of its elements (`nonzero`, boolean indexing; all of
    them by default), every boolean host sync (`if torch.isfinite(x)`) is True, and a number read
    on the host (`.item()`, `.tolist()`: the step's metrics) is 0, except the numbers queued in
    the mode's `host_reads` (a list, read from the front): a mixture-of-experts block's token
    counts per expert (`balanced_routing`), whose `torch.bincount` returns [minlength]. So the
    script's train_step runs unchanged, host syncs included.

    GRPO passes (max_new_tokens, max_prompt_len + max_new_tokens): its only masks are the label
    masks of collated rollout rows, whose completion positions are that share of each row. Under
    context parallel also `local_fraction` (completion positions, S / cp): a mask whose last dim
    is S / cp is a cp rank's chunks of the rows (`context_parallel_rows`), which select that many.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    fused_in_place_steps = (aten._fused_adamw_.default, aten._fused_adam_.default)

    def all_true_nonzero(mask):  # [N, mask.dim()] int64 indices of the selected elements
        num, den = true_fraction
        if local_fraction is not None and mask.dim() == 2 and mask.shape[-1] == local_fraction[1]:
            num, den = local_fraction
        assert mask.numel() % den == 0, f"a mask of {mask.numel()} elements, rows of {den}"
        n = mask.numel() // den * num
        return torch.empty((n, mask.dim()), dtype=torch.long, device=mask.device)

    class DataDependentAnswers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):
                return NotImplemented  # as MemTracker: let DTensor desugar into local ops first
            kwargs = kwargs or {}
            if func in fused_in_place_steps:
                # the real kernel updates params and states in place (no new memory); fake
                # tensors run its functional form, whose param-sized outputs would be counted
                return None
            if func is aten.nonzero.default:
                return all_true_nonzero(args[0])
            if func is aten.index.Tensor:
                x, indices = args
                expanded = []
                for i in indices:
                    if i is not None and i.dtype is torch.bool:
                        expanded += all_true_nonzero(i).unbind(1)
                    else:
                        expanded.append(i)
                return func(x, expanded)
            if func is aten.bincount.default:  # an MoE block's counts per expert: [E] int64
                minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
                assert minlength > 0, "bincount without minlength: its length is data"
                return torch.zeros(minlength, dtype=torch.long, device=args[0].device)
            if func is aten._local_scalar_dense.default:
                if self.host_reads:  # a count the routing assumption fixes (sizes a split)
                    return self.host_reads.pop(0)
                # bool: the healthy-step branch; a number (.item() of a metric, .tolist() of
                # sample ids): 0, a placeholder the step only reports (nothing is sized by it)
                return True if args[0].dtype is torch.bool else 0
            return func(*args, **kwargs)

    mode = DataDependentAnswers()
    mode.host_reads = []
    return mode


def balanced_expert_ids(tokens: int, top_k: int, num_experts: int, device=None):
    """The planner's routing assumption: [tokens, top_k] int64 expert ids, assignment i of the
    token-major (token, slot) order (i = t * top_k + j) going to expert i % num_experts.

    Every expert then gets tokens * top_k / num_experts assignments (the first
    tokens * top_k % num_experts experts one more): the expectation under a router that its
    load-balancing loss keeps balanced. A token's top_k slots are top_k consecutive experts
    (mod num_experts), so distinct, as top-k's are. Each rank routes its tokens the same way, so
    under expert parallel every rank also receives the same count per local expert from each
    rank of its ep group."""
    import torch

    i = torch.arange(tokens * top_k, device=device)
    return (i % num_experts).view(tokens, top_k)


def balanced_counts(tokens: int, top_k: int, num_experts: int) -> list[int]:
    """[num_experts] assignments per expert under `balanced_expert_ids`."""
    base, extra = divmod(tokens * top_k, num_experts)
    return [base + (e < extra) for e in range(num_experts)]


def _routing(answers):
    """The simulation's routing (`balanced_routing`, answering `answers`); nothing on real
    tensors (answers a nullcontext), whose callers choose (the tests' real steps)."""
    if isinstance(answers, contextlib.nullcontext):
        return contextlib.nullcontext()
    return balanced_routing(answers)


@contextlib.contextmanager
def balanced_routing(answers=None):
    """Route every mixture-of-experts token by the planner's assumption (`balanced_expert_ids`)
    instead of the router's top-k, so the expert batches and the all-to-all sizes are concrete.

    The router still runs (its [T, E] logits, the softmax and the load-balancing loss are
    computed as in a real step) and each token's weights are its router probabilities of the
    assigned experts, renormalised like `route_top_k`'s; only which experts is fixed. Patches
    `runtime.models.moe.route_top_k`. The simulation runs under it; the tests run the real
    steps they compare with under it too, so the comparison checks the simulation, and apart
    from it measure how far a real router's step is from the assumption.

    answers: the simulation's `_data_dependent_answers` mode, whose `host_reads` receive, before
    each block's `run_experts`, the counts it reads on the host: its [E] counts per expert, and
    under expert parallel the [E] counts it receives per (source rank, local expert), which
    every rank routing alike makes its own counts of its local experts. A block that reads
    other numbers than those fails the simulation (the runtime changed under the planner).
    """
    import torch
    import torch.nn.functional as F

    import runtime.models.moe as moe

    route, run_experts = moe.route_top_k, moe.SparseMoeBlock.run_experts

    def balanced_route_top_k(router_logits, top_k, norm_topk_prob):
        experts = balanced_expert_ids(
            router_logits.shape[0], top_k, router_logits.shape[1], router_logits.device
        )
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights = probs.gather(1, experts)  # [T, k]
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(router_logits.dtype), experts

    def run_experts_reading_counts(block, x, experts, weights):
        counts = balanced_counts(experts.shape[0], experts.shape[1], block.num_experts)
        reads = list(counts)
        if block.ep_group is not None:  # dispatch_to_experts: [send counts, receive counts]
            n_local = block.num_experts // block.ep_size
            mine = counts[block.ep_rank * n_local : (block.ep_rank + 1) * n_local]
            reads += mine * block.ep_size
        answers.host_reads[:] = reads
        out = run_experts(block, x, experts, weights)
        if answers.host_reads:
            raise PlanError(
                f"the MoE block read {len(reads) - len(answers.host_reads)} counts on the host "
                f"where the planner expected {len(reads)} (runtime/models/moe.py changed)"
            )
        return out

    moe.route_top_k = balanced_route_top_k
    if answers is not None:
        moe.SparseMoeBlock.run_experts = run_experts_reading_counts
    try:
        yield
    finally:
        moe.route_top_k, moe.SparseMoeBlock.run_experts = route, run_experts


@contextlib.contextmanager
def _separate_propagation_fake_mode():
    """Give DTensor's sharding propagation a fake mode of its own while the step runs.

    DTensor computes each op's output metadata by running the op on global-shape tensors under
    `detect_fake_mode() or FakeTensorMode()` (torch.distributed.tensor._sharding_prop). On real
    tensors that is a private fake mode, and MemTracker skips its ops (it counts only ops under
    the fake mode that was active when it was entered). Under the planner's FakeTensorMode,
    detect_fake_mode() returns the planner's own mode, so MemTracker counted the global-shape
    propagation tensors as allocations: inside optimizer.step() (the lazy `zeros_like` state and
    the fused update of every DTensor parameter) as optimizer state, 3x the real state for
    SmolLM2-135M (3.01 vs 1.00 GiB). A separate mode restores what a real run does.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    detect = _sharding_prop.detect_fake_mode
    propagation_mode = FakeTensorMode()
    _sharding_prop.detect_fake_mode = lambda *args: propagation_mode
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect


@contextlib.contextmanager
def _real_mesh_ops():
    """Build the meshes FSDP derives while wrapping (`DeviceMesh._concatenate` of the dp and tp
    meshes for a TP-sharded parameter) and expert parallel's (`expert_meshes`' `_unflatten`) on
    real tensors.

    A DeviceMesh is a small int tensor of ranks plus this rank's coordinates, found with
    `nonzero`; under the planner's FakeTensorMode that is a data-dependent op on a real tensor
    and fails. The mesh is process-group metadata, not memory the plan counts.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    concatenate, unflatten = DeviceMesh._concatenate, DeviceMesh._unflatten

    def real_concatenate(meshes):
        with unset_fake_temporarily():
            return concatenate(meshes)

    def real_unflatten(mesh, *args, **kwargs):  # EP x FSDP's (dp_shard / ep, ep) split
        with unset_fake_temporarily():
            return unflatten(mesh, *args, **kwargs)

    DeviceMesh._concatenate = staticmethod(real_concatenate)
    DeviceMesh._unflatten = real_unflatten
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)
        DeviceMesh._unflatten = unflatten


def _local_nbytes(t) -> int:
    """Bytes this rank holds of `t`: a DTensor's local shard (loss parallel's vocab-sharded
    logits are [T, V/tp] per rank; `DTensor.nbytes` is the global [T, V])."""
    from torch.distributed.tensor import DTensor

    return t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes


@contextlib.contextmanager
def _causal_bias_outside_modes(fake: bool):
    """Context parallel's all-gather attention under the dispatch modes: its bottom-right causal
    mask `causal_lower_right(L, S)` as a GPU sees it (fake), or created outside the modes (real).

    The mask is a tensor subclass whose meaning is two lengths; SDPA dispatches it per device.
    On CUDA it runs the flash or efficient kernel with no mask tensor; on the CPU it is
    materialised as a dense [L, S] mask, which SDPA keeps for backward (2 GiB per layer for
    llama3.3-70b at 128k tokens on 8 cp ranks). The plan is a GPU's, so under fake tensors the
    attention runs with no mask: the same kernel outputs and saved tensors as the GPU's, none of
    the CPU's mask. A real CPU measurement (the tests' reference) keeps the CPU's mask: creating
    one under any TorchDispatchMode fails (MemTracker's, or the FakeTensorMode: "the raw Tensor
    object is already associated to a python object"), so it is made outside them, and at 1 x 1
    with the lengths set after: PyTorch builds it with the legacy `Tensor(variant, L, S)`
    constructor, a real, never-read [2, L, S] fp32 tensor (torch 2.13).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    import runtime.context_parallel as cp

    make = cp.causal_lower_right

    def real_causal_lower_right(seq_len_q: int, seq_len_kv: int):
        with _disable_current_modes():
            bias = make(1, 1)  # placeholder storage [2, 1, 1]
        bias.seq_len_q, bias.seq_len_kv = seq_len_q, seq_len_kv
        return bias

    cp.causal_lower_right = (lambda *sizes: None) if fake else real_causal_lower_right
    try:
        yield
    finally:
        cp.causal_lower_right = make


@contextlib.contextmanager
def _fake_to_empty():
    """`Module.to_empty` and `Module.to` for a model built on meta under FakeTensorMode.

    The 1-process fp32 script leaves its model unwrapped and calls `model.to_empty(device)`;
    kd's teacher (whole on each rank, never wrapped) is `to_empty` then `.to(dtype)`.
    PyTorch swaps fake parameters in place (`torch.utils.swap_tensors`), which refuses a tied
    parameter (embed_tokens.weight is lm_head.weight) and one referenced elsewhere (expert
    parallel's experts, which fully_shard keeps as ignored_params). These replacements give every
    such parameter and buffer a new tensor of the same shape (`to_empty`: uninitialised on
    `device`; `to`: converted as `Module.to` converts it, floating-point tensors to its dtype),
    keeping ties (one new tensor per original): the bytes the real methods allocate on a real
    device. A module whose own parameters are FSDP2's DTensors keeps PyTorch's path, which works
    there (`to`: a model with any).
    """
    import torch
    from torch.distributed.tensor import DTensor

    original_to_empty, original_to = torch.nn.Module.to_empty, torch.nn.Module.to

    def replace_tensors(module, make, recurse: bool = True, sharded=None):
        new = {}
        for sub in module.modules() if recurse else [module]:
            if sharded and any(isinstance(p, DTensor) for p in sub._parameters.values()):
                sharded(sub)
                continue
            for name, t in [*sub._parameters.items(), *sub._buffers.items()]:
                if t is None:
                    continue
                if id(t) not in new:
                    made = make(t)
                    is_param = isinstance(t, torch.nn.Parameter)
                    new[id(t)] = torch.nn.Parameter(made, t.requires_grad) if is_param else made
                table = sub._parameters if name in sub._parameters else sub._buffers
                table[name] = new[id(t)]
        return module

    def to_empty(module, *, device, recurse=True):
        return replace_tensors(
            module, lambda t: torch.empty_like(t, device=device), recurse,
            lambda sub: original_to_empty(sub, device=device, recurse=False),
        )  # fmt: skip

    def to(module, *args, **kwargs):
        if any(isinstance(p, DTensor) for p in module.parameters()):  # FSDP2: its own path works
            return original_to(module, *args, **kwargs)
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)

        def convert(t):
            cast = (
                dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else None
            )
            return t.to(device=device, dtype=cast, non_blocking=non_blocking)

        return replace_tensors(module, convert)

    torch.nn.Module.to_empty, torch.nn.Module.to = to_empty, to
    try:
        yield
    finally:
        torch.nn.Module.to_empty, torch.nn.Module.to = original_to_empty, original_to


class _NoHook:
    """Stands in for a hook handle MemTracker would remove on exit."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


_BLOCK = re.compile(r"\.layers\.(\d+)(?:\.|$)")  # a decoder block's FQN in ModTracker.parents


def _peak_tracker(num_layers: int | None = None):
    """PyTorch's MemTracker reduced to the global peak by category.

    `start_stage(name)` starts a stage (DPO precomputed: the reference pass, then the training
    step): from then on the peak of the stage is kept too (`stage_peaks`: name -> {category
    name: bytes}), and its segments' keys start with its name.

    With `num_layers` (the model's decoder depth, >= 3) it also keeps the peak of every segment
    of the step (`segment_peaks`: segment key -> {category name: bytes}), for the depth
    extrapolation (`extrapolate_depth`). A segment is named so that the same key exists at every
    depth: (phase, sweep, region). The phase counts the changes between forward, backward and
    optimizer step; a sweep is one pass over the blocks (a forward, a backward, an activation
    recompute pass, the reference's forward); the region is the first block, the last block,
    any block between them (and the gaps between blocks), or the gap before the sweep (the
    embedding, the head and the loss). Inside a segment the bytes are one line in the depth
    (every block adds the same), so its peak is too; the peak of the whole step is their max.

    MemTracker also keeps per-module snapshots: it deep-copies a snapshot per module state and
    scans every tracked module on every op (most of its cost: 46 s of CPU for two SmolLM2 steps),
    and it refuses a module that runs forward twice in one step, which optimizer-in-backward with
    clipping does (a norm pass, then a step pass). This subclass keeps what decides the peak and
    its categories (each module's parameters and gradient hooks are registered on its first
    forward; an activation-checkpoint recompute in backward counts as activations, not
    temporaries) and drops the per-module statistics. Overrides private hooks of
    torch.distributed._tools.mem_tracker (PyTorch 2.13).
    """
    import weakref

    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    class PeakTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._seen = WeakIdKeyDictionary()  # modules whose parameters are registered
            self.segment_peaks: dict[tuple, dict] = {}
            self._phase, self._kind = -1, None
            self._sweep, self._visited = 0, set()
            # DPO's precomputed reference: its one-off pass and the training steps are stages,
            # each with its own peak (`stage_peaks`: name -> {category name: bytes}) and its own
            # segments (the stage name leads their keys)
            self.stage: str | None = None
            self.stage_peaks: dict[str, dict] = {}

        def start_stage(self, name: str) -> None:
            """What runs from here on is stage `name`: its segments are counted from its own
            first phase, so their keys are the same at every depth."""
            self.stage = name
            self._phase, self._kind = -1, None
            self._sweep, self._visited = 0, set()

        def _segment_key(self) -> tuple:
            key = self._stage_segment_key()
            return key if self.stage is None else (self.stage, *key)

        def _stage_segment_key(self) -> tuple:
            kind = "bw" if self._mod_tracker.is_bw else "opt" if self._in_opt else "fw"
            if kind != self._kind:  # a new phase starts before any block of it
                self._phase, self._kind = self._phase + 1, kind
                self._sweep, self._visited = 0, set()
            # the block running now; in backward the previous block can still be in `parents`
            # when the next one starts (a set: iteration order differs per process), so take
            # the one entered last, the lowest index in backward, the highest in forward
            blocks = [int(m.group(1)) for m in map(_BLOCK.search, self._mod_tracker.parents) if m]
            block = (min if kind == "bw" else max)(blocks) if blocks else None
            if block is None:
                if {"first", "last"} <= self._visited:  # the sweep is over: the next one's gap
                    self._sweep, self._visited = self._sweep + 1, set()
                return (self._phase, kind, self._sweep, "gap" if not self._visited else "middle")
            region = "first" if block == 0 else "last" if block == num_layers - 1 else "middle"
            self._visited.add(region)
            return (self._phase, kind, self._sweep, region)

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            if self.stage is not None and self._curr_mem_snap:
                (snap,) = self._curr_mem_snap.values()  # one device
                best = self.stage_peaks.get(self.stage)
                if best is None or best[_TOTAL] < snap[_TOTAL]:
                    self.stage_peaks[self.stage] = {_name(k): v for k, v in snap.items()}
            if num_layers is None:
                return
            key = self._segment_key()
            (snap,) = self._curr_mem_snap.values()  # one device
            best = self.segment_peaks.get(key)
            if best is None or best[_TOTAL] < snap[_TOTAL]:
                self.segment_peaks[key] = {_name(k): v for k, v in snap.items()}

        def _pre_fw_hook(self, module, inputs):
            if module not in self._seen:
                for param in module.parameters():  # frozen (LoRA's base): no gradient to hook
                    if not param.requires_grad:
                        self._param_to_grad_hook_handles.setdefault(param, (_NO_HOOK, _NO_HOOK))
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
                self._seen[module] = True
            elif self._mod_tracker.is_bw and self._ac_mod is None:  # AC recompute starts
                self._ac_mod = weakref.ref(module)
                self._in_ac = True

        def _post_fw_hook(self, module, inputs, outputs):
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod = None
                self._in_ac = False

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    return PeakTracker()


def synthetic_batch(micro_batch_size: int, max_seq_len: int, packing: bool) -> dict:
    """A collated micro-batch of the script's layout: [B, S] int64 ids, every label supervised."""
    import torch

    B, S = micro_batch_size, max_seq_len
    batch = {
        "input_ids": torch.zeros(B, S, dtype=torch.long),
        "labels": torch.zeros(B, S, dtype=torch.long),  # 0 != IGNORE_INDEX: all supervised
        "num_tokens": torch.tensor(B * S),
        "sample_ids": torch.arange(B),
    }
    if packing:  # one document per row
        batch["position_ids"] = torch.arange(S).expand(B, S).contiguous()
        batch["document_ids"] = torch.zeros(B, S, dtype=torch.long)
    return batch


def import_script(path: Path, name: str):
    """Import a rendered train.py as a module (importing it has no side effects, docs/DESIGN.md)."""
    import importlib.util

    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


_TOTAL = "Total"  # MemTracker's key of the sum over categories


def _name(key) -> str:
    """A MemTracker snapshot key (a _MemRefType, or "Total") as its name."""
    return getattr(key, "value", str(key))


def _rows(by_name: dict) -> dict:
    """{row of ROWS: bytes} of a snapshot keyed by category name."""
    return {row: sum(by_name.get(c, 0) for c in cats) for row, cats in ROWS.items()}


def _peak_rows(tracker) -> tuple[dict, int]:
    """({row of ROWS: bytes}, total bytes) of a tracker's peak snapshot (one device)."""
    (per_device,) = tracker.get_tracker_snapshot("peak").values()
    by_name = {_name(k): v for k, v in per_device.items()}
    return _rows(by_name), by_name[_TOTAL]


def _segments(tracker) -> list:
    """The tracker's segment peaks, JSON-ready: [[key as a list, {row: bytes}, total], ...]."""
    return [[list(key), _rows(snap), snap[_TOTAL]] for key, snap in tracker.segment_peaks.items()]


@contextlib.contextmanager
def _simulated_build(script, fake: bool):
    """Around the model build and the steps: FakeTensorMode with the weight load skipped
    (fake=True: there are no weights to read, the parameters are fake; `_skipped_load`), QLoRA's
    NF4 layout built as torchao builds it (`_fake_nf4_layout`), and kd's tokenizer check skipped
    (it reads tokenizer files, which the plan's config-only model directories lack); or nothing
    but eager mode (fake=False, real CPU tensors)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    # the RM script loads through load_reward_weights (a causal LM's decoder under a new head)
    skipped = {"load_hf_checkpoint": _skipped_load, "load_reward_weights": _skipped_load,
               "check_same_tokenizer": lambda *args: None}  # fmt: skip
    loaders = {name: getattr(script, name) for name in skipped if hasattr(script, name)}
    if fake:
        for name in loaders:
            setattr(script, name, skipped[name])
    try:
        with FakeTensorMode() if fake else contextlib.nullcontext():
            with torch.compiler.set_stance("force_eager"), _compiled_torchao_step(fake):
                with _fake_nf4_layout() if fake else contextlib.nullcontext():
                    yield
    finally:
        for name, loader in loaders.items():
            setattr(script, name, loader)


def _skipped_load(model, *args, **kwargs) -> None:
    """The checkpoint load under FakeTensorMode: no weights are read, except that an NF4 weight's
    replicated inner tensors (its scaler_mean and 16-level lookup table, which `to_empty` leaves
    on meta) are re-bound on the weight's device, as `runtime.dtensors.copy_into_nf4` does when it
    quantizes the file's tensor into it."""
    import torch
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        if type(local).__name__ == "NF4Tensor":
            device = local.quantized_data.device
            local.scaler_mean = torch.empty_like(local.scaler_mean, device=device)
            local.nf4 = torch.empty_like(local.nf4, device=device)


@contextlib.contextmanager
def _fake_nf4_layout():
    """QLoRA's NF4 base weights under FakeTensorMode: `runtime.lora.to_nf4_param` builds torchao's
    layout on real meta tensors (outside the fake mode), then gives the NF4Tensor fake inner
    tensors of exactly those shapes and dtypes.

    The script quantizes on meta (the layout only; `load_hf_checkpoint` fills it). Under the
    planner's FakeTensorMode, torchao's `NF4Tensor.from_tensor` creates its 16-level lookup table
    with `torch.tensor([...])`, a real (not fake) tensor, which the fake mode then refuses as an
    operand. The layout is torchao's own, so the bytes are what a real run stores: quantized_data
    uint8 [numel / 2] (two 4-bit codes per byte), quantized_scalers int8 [numel / 64] (one per
    64-weight block), quantization_factor [numel / 64 / scaler_block] and scaler_mean [] in the
    weight's dtype, the lookup table nf4 [16]. FSDP2 then shards the blocks over its mesh or
    leaves the weight whole (`nf4_params_fsdp_cannot_shard`), as in the script."""
    import torch
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    import runtime.lora as lora

    real = lora.to_nf4_param

    def fake_to_nf4_param(weight, name: str = "weight"):
        mode = detect_fake_mode()
        with unset_fake_temporarily():
            layout = real(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), name).data
        names, ctx = layout.__tensor_flatten__()
        inner = {n: mode.from_tensor(getattr(layout, n)) for n in names}
        nf4 = type(layout).__tensor_unflatten__(inner, ctx, layout.shape, layout.stride())
        return torch.nn.Parameter(nf4, requires_grad=False)

    lora.to_nf4_param = fake_to_nf4_param
    try:
        yield
    finally:
        lora.to_nf4_param = real


@contextlib.contextmanager
def _compiled_torchao_step(fake: bool):
    """torchao's AdamW (low-bit states, bf16-sr) runs its per-parameter step compiled
    (`torch.compile(single_param_adam)`), which the simulation cannot do (fake tensors, eager):
    eager, the step's intermediates (fp32 copies of the parameter, gradient and both moments,
    int64 quantization codes) are alive at once, many bytes per value of the parameter stepped,
    which the compiled step never holds (Llama 3.1 8B SFT with optim-in-bwd and adamw8bit on one
    GPU: an optimizer-state row of 26.9 GiB at the peak where its states are 15.2). Under fake=True the step is replaced by what the compiled
    one allocates, read from inductor's output code for it (torch 2.13): with a low-bit
    state, the two new moments in fp32 before they are re-quantized block by block (each
    block's absmax is a reduction over them); with plain states, nothing (one fused pointwise
    kernel). Its in-place results (weights, moments) exist already, so values are not needed."""
    try:
        import torchao.optim.adam as torchao_adam
    except ImportError:  # no torchao: no torchao optimizer to step
        yield
        return
    if not fake:
        yield
        return
    import torch
    from torch.distributed.tensor import DTensor

    def compiled_step_allocations(p, grad, step, exp_avg, exp_avg_sq, *rest):
        buffers = []
        for moment in (exp_avg, exp_avg_sq):
            local = moment.to_local() if isinstance(moment, DTensor) else moment
            if type(local) is not torch.Tensor:  # torchao's OptimState8bit / OptimState4bit
                buffers.append(torch.empty(local.shape, dtype=torch.float32, device=local.device))
        del buffers

    real = torchao_adam.single_param_adam
    torchao_adam.single_param_adam = compiled_step_allocations
    try:
        yield
    finally:
        torchao_adam.single_param_adam = real


def measure_step(
    script, model_dir: Path, micro_batch_size: int | None, max_seq_len: int | None, spec: Spec,
    fake: bool, config: dict | None = None, segments: bool = False,
) -> dict:  # fmt: skip
    """Build the script's model and optimizer and run two `train_step`s under `MemTracker`.

    Needs a default process group (fake for the plan, gloo for a real measurement). With
    fake=True everything runs under FakeTensorMode and the weights are not loaded; with
    fake=False the same calls run on real CPU tensors (tests compare the two).

    Args:
        micro_batch_size, max_seq_len: None = the script's Config default.
        config: Config values to use instead of the script's defaults (`config_with`), below
            the two above.
        segments: also return "segments", the peak of every segment of the step
            (`_peak_tracker`), for `extrapolate_depth`.

    Returns:
        {"categories": {row: bytes}, "peak": bytes, "logits": bytes} of this rank at the peak,
        and the "micro_batch_size", "max_seq_len" and "dtype" the step ran with.
    """
    sizes = {"micro_batch_size": micro_batch_size, "max_seq_len": max_seq_len}
    cfg = config_with(
        script, config, model=str(model_dir), device="cpu",
        **{k: v for k, v in sizes.items() if v is not None},
    )  # fmt: skip
    micro_batch_size, max_seq_len = cfg.micro_batch_size, cfg.max_seq_len
    packing = "packing" in spec.tricks
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    with _simulated_build(script, fake):
        with _fake_to_empty() if fake else contextlib.nullcontext(), _real_mesh_ops():
            model = script.setup_model(cfg, model_dir, mesh, dist_info.device)
        optimizer, scheduler = script.build_optimizer(cfg, model)
        # rows padded as the script's collate pads them: to a multiple of tp (sequence parallel),
        # and of 2*cp*tp under context parallel (2*cp chunks per row)
        multiple = spec.tp * (2 * spec.cp if spec.cp > 1 else 1)
        padded_len = -(-max_seq_len // multiple) * multiple
        rm = is_rm(spec)
        if rm:  # micro_batch_size pairs: 2 x micro_batch_size sequences, one score each
            batch = synthetic_rm_pairs(micro_batch_size, padded_len)
        else:
            batch = synthetic_batch(micro_batch_size, padded_len, packing)
        logits = [0]  # a reward model has no lm_head: its [2P, 1] scores are nothing to count
        head = model.score if rm else model.lm_head
        hook = head.register_forward_hook(
            lambda mod, args, out: logits.__setitem__(
                0, 0 if rm else max(logits[0], _local_nbytes(out))
            )
        )
        tracker = _peak_tracker(_num_layers(model_dir) if segments else None)
        optimizers = getattr(optimizer, "optimizers", optimizer)  # optimizer-in-backward
        tracker.track_external(model, optimizers, *_teacher(script, cfg, dist_info.device))
        answers = _data_dependent_answers() if fake else contextlib.nullcontext()
        propagation = _separate_propagation_fake_mode() if fake else contextlib.nullcontext()
        dp_group = mesh["dp"].get_group()
        cp_args = ()
        # as the script's main(): SFT's train_step takes this rank's chunks of every row and the
        # dp x cp group; the RM's reduces over dp and cuts its cp chunks inside (`pair_rewards`)
        if getattr(cfg, "cp", 1) > 1 and not rm:
            dp_group = mesh["dp_cp"].get_group()
            cp_args = (mesh["cp"].get_local_rank(), cfg.cp)
        with propagation, tracker, answers, _causal_bias_outside_modes(fake), _routing(answers):
            groups = (dp_group, *cp_args)
            for _ in range(2):  # step 1 creates the optimizer state; step 2 holds it
                script.train_step(
                    model, optimizer, scheduler, [batch], cfg, dist_info.device, *groups
                )
        hook.remove()
        categories, peak = _peak_rows(tracker)
    del model, optimizer, scheduler
    measured = {
        "categories": categories, "peak": peak, "logits": logits[0],
        "micro_batch_size": micro_batch_size, "max_seq_len": max_seq_len, "dtype": cfg.dtype,
    }  # fmt: skip
    if segments:
        measured["segments"] = _segments(tracker)
    return measured


def _teacher(script, cfg, device) -> list:
    """kd: [the script's frozen teacher], which setup_model built (`load_teacher`, cached: the
    same module the loss reuses; whole on each rank, in the compute dtype), so that all its
    weights count (under lce the loss reads teacher.lm_head.weight without running that module,
    so the forward hooks alone would miss it); [] for a script without one."""
    if not hasattr(script, "load_teacher"):
        return []
    return [script.load_teacher(cfg.teacher, script.teacher_repo_id(cfg), cfg.dtype, str(device))]


def synthetic_pairs(pairs: int, max_seq_len: int, packing: bool, first_id: int = 0) -> dict:
    """A collated DPO micro-batch of `pairs` preference pairs, every position supervised, in the
    layout of the DPO script's collate: input_ids and labels [2P, S] int64 (the P chosen rows,
    then their P rejected ones), num_tokens, sample_ids [P] (the pair ids first_id..).

    packing: the script's `collate_preference_packs` layout with one pair per row, its two
    sequences of max_seq_len tokens each (a row holds 2 * max_seq_len, the pair's two unpacked
    rows: the most tokens a packed row can hold): input_ids, labels, position_ids (restarting
    per sequence), document_ids (0 chosen, 1 rejected) and sequence_ids (row b: b chosen,
    P + b rejected), all [P, 2S] int64.
    """
    import torch

    P, S = pairs, max_seq_len
    ids = torch.arange(first_id, first_id + P)
    if not packing:
        return {
            "input_ids": torch.zeros(2 * P, S, dtype=torch.long),
            "labels": torch.zeros(2 * P, S, dtype=torch.long),  # 0 != IGNORE_INDEX: supervised
            "num_tokens": torch.tensor(2 * P * S),
            "sample_ids": ids,
        }
    halves = torch.arange(2 * S) // S  # [2S]: 0 on the chosen sequence, 1 on the rejected one
    return {
        "input_ids": torch.zeros(P, 2 * S, dtype=torch.long),
        "labels": torch.zeros(P, 2 * S, dtype=torch.long),
        "position_ids": (torch.arange(2 * S) % S).expand(P, 2 * S).contiguous(),
        "document_ids": halves.expand(P, 2 * S).contiguous(),
        "sequence_ids": (torch.arange(P)[:, None] + P * halves).contiguous(),
        "num_tokens": torch.tensor(2 * P * S),
        "sample_ids": ids,
    }


def synthetic_rm_pairs(pairs: int, max_seq_len: int) -> dict:
    """A collated reward-model micro-batch of `pairs` pairs in the layout of the RM script's
    collate: input_ids [2P, S] int64 (no padding: every row scored at its last position,
    score_index [2P]), margin [P] fp32, num_tokens, sample_ids [P]."""
    import torch

    P, S = pairs, max_seq_len
    return {
        "input_ids": torch.ones(2 * P, S, dtype=torch.long),
        "score_index": torch.full((2 * P,), S - 1, dtype=torch.long),
        "margin": torch.zeros(P),
        "num_tokens": torch.tensor(2 * P * S),
        "sample_ids": torch.arange(P),
    }


REFERENCE_PASS, TRAINING_STEP = "reference pass", "training step"  # DPO precomputed's stages


def measure_dpo_step(
    script, model_dir: Path, micro_batch_size: int | None, max_seq_len: int | None, spec: Spec,
    fake: bool, config: dict | None = None, segments: bool = False,
) -> dict:  # fmt: skip
    """The DPO script's model, reference and two `train_step`s under `MemTracker`, as its main()
    runs them for the Config's ref_mode (the script's default, or `config`'s):

    - separate: `build_reference` (a frozen copy, parallelized like the policy; one no-grad
      forward per micro-batch in `pair_losses`);
    - adapters-off (dpo-lora): no second model, the policy's no-grad forward with its adapters
      off (`base_logprobs`);
    - precomputed: first the one-off pass over the pairs before training, the runtime's
      `precompute_reference_logprobs` with the script's log-prob function (main's: `base_logprobs`
      where the script has it, else `sequence_logprobs`), on two micro-batches per rank (the
      second holds what the first does; a real run's [N, 2] fp32 table of N pairs is N x 8
      bytes), then the steps, which read the table. The two are stages of the measurement, each
      with its own peak ("stages"); the peak is the larger.

    A micro-batch is micro_batch_size pairs, 2 x micro_batch_size sequences of max_seq_len
    tokens (`synthetic_pairs`), one per step (gradient_accumulation_steps = 1).

    Needs a default process group; fake as `measure_step`.

    Returns:
        as `measure_step`, plus "dpo": {"ref_mode", "pairs" (per micro-batch), "sequences"},
        and "stages": {stage: {"categories", "peak"}} for precomputed, else None.

    Raises:
        PlanError: ref_device="cpu" (a full reference copy in host memory, and its forward on
            the CPU: not GPU memory, which the plan's one device cannot tell apart).
    """
    import functools

    import torch

    from runtime.parallel import data_parallel
    from runtime.preference import precompute_reference_logprobs

    sizes = {"micro_batch_size": micro_batch_size, "max_seq_len": max_seq_len}
    cfg = config_with(
        script, config, model=str(model_dir), device="cpu",
        **{k: v for k, v in sizes.items() if v is not None},
    )  # fmt: skip
    script.validate(cfg)
    ref_mode = dpo_reference_mode(asdict(cfg))
    if ref_mode == "separate" and cfg.ref_device == "cpu":
        raise PlanError(
            "scaffold plan cannot simulate ref_device='cpu': the reference is a full copy in host "
            "memory and its forward runs on the CPU, which the plan's one simulated device cannot "
            "tell apart from GPU memory; plan ref_device='auto' (the reference sharded on the "
            "GPUs: an upper bound of the GPU memory with the reference on the CPU)"
        )
    P, S, packing = cfg.micro_batch_size, cfg.max_seq_len, "packing" in spec.tricks
    dist_info, mesh = script.setup_distributed(cfg)
    dp_rank, dp_size, dp_group = data_parallel(mesh)
    # under TP and CP the counts and the table reduce over mesh["dp"] only (None = the world
    # otherwise, which also serves scripts rendered before train_step took a dp_group)
    group = (dp_group,) if spec.tp > 1 or spec.cp > 1 else ()
    device = dist_info.device
    stages = ref_mode == "precomputed"
    with _simulated_build(script, fake):
        with _fake_to_empty() if fake else contextlib.nullcontext(), _real_mesh_ops():
            model = script.setup_model(cfg, model_dir, mesh, device)
            reference = None
            if ref_mode == "separate":
                reference = script.build_reference(cfg, model_dir, mesh, device)
        optimizer, scheduler = script.build_optimizer(cfg, model)
        logits = [0]
        hook = model.lm_head.register_forward_hook(
            lambda mod, args, out: logits.__setitem__(0, max(logits[0], _local_nbytes(out)))
        )
        tracker = _peak_tracker(_num_layers(model_dir) if segments else None)
        optimizers = getattr(optimizer, "optimizers", optimizer)  # optimizer-in-backward
        tracker.track_external(model, optimizers, *([reference] if reference else []))
        answers = _data_dependent_answers() if fake else contextlib.nullcontext()
        propagation = _separate_propagation_fake_mode() if fake else contextlib.nullcontext()
        ref_cache = None
        # context parallel (all-gather mode): the bottom-right causal mask as the SFT step has it
        with propagation, tracker, answers, _causal_bias_outside_modes(fake), _routing(answers):
            if stages:
                tracker.start_stage(REFERENCE_PASS)
                if hasattr(script, "base_logprobs"):  # dpo-lora: the base, adapters off
                    logprob_fn = functools.partial(script.base_logprobs, cfg=cfg)
                else:
                    logprob_fn = lambda m, b: script.sequence_logprobs(m, b, cfg)[0]  # noqa: E731
                # every rank scores its shard of the pairs: 2 micro-batches here
                examples = [{"id": i} for i in range(2 * P * dp_size)]

                def collate(rows: list[dict]) -> dict:
                    return synthetic_pairs(len(rows), S, packing, rows[0]["id"])

                ref_cache = precompute_reference_logprobs(
                    model, examples, logprob_fn, collate, P, dp_rank, dp_size, device, *group
                )
                tracker.start_stage(TRAINING_STEP)
            batch = synthetic_pairs(P, S, packing)
            if getattr(cfg, "loss_type", "") == "kto":  # P examples, every other one desirable
                batch["desirable"] = torch.arange(P) % 2 == 0
            for _ in range(2):  # step 1 creates the optimizer state; step 2 holds it
                script.train_step(
                    model, reference, ref_cache, optimizer, scheduler, [batch], cfg, device, *group
                )
        hook.remove()
        categories, peak = _peak_rows(tracker)
    del model, reference, optimizer, scheduler
    measured = {
        "categories": categories, "peak": peak, "logits": logits[0],
        "micro_batch_size": P, "max_seq_len": S, "dtype": cfg.dtype,
        "dpo": {"ref_mode": ref_mode, "pairs": P, "sequences": 2 * P},
        "stages": {
            name: {"categories": _rows(snap), "peak": snap[_TOTAL]}
            for name, snap in tracker.stage_peaks.items()
        } if stages else None,
    }  # fmt: skip
    if segments:
        measured["segments"] = _segments(tracker)
    return measured


def _num_layers(model_dir: Path) -> int:
    from runtime import read_hf_config

    return read_hf_config(model_dir)["num_hidden_layers"]


def config_with(script, config: dict | None = None, **overrides):
    """The script's Config: its defaults, then `config` where the Config has such a field (a
    rendered candidate keeps the user's edits of `scaffold plan DIR`; a field only the user's
    script has is skipped; a JSON list becomes a tuple where the default is one), then
    `overrides`.

    dtype is the Config's too: a fresh render's default is the spec's, an edited script's is
    what `python train.py` would run.
    """
    import dataclasses

    defaults = script.Config()
    names = {f.name for f in dataclasses.fields(defaults)}
    values = {}
    for name, value in (config or {}).items():
        if name in names:
            default = getattr(defaults, name)
            values[name] = tuple(value) if isinstance(default, tuple) else value
    return script.Config(**{**values, **overrides})


def config_edits(script, rendered) -> dict:
    """{field: value} of `script`'s Config defaults that differ from `rendered`'s (the fresh
    render of the same spec), JSON-ready: what the user edited in the Config."""
    import dataclasses

    mine, pristine = dataclasses.asdict(script.Config()), dataclasses.asdict(rendered.Config())
    return {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in mine.items()
        if name in pristine and value != pristine[name]
    }


def grpo_config(
    script, model_dir: Path, spec: Spec, micro_batch_size: int | None, max_seq_len: int | None,
    kl_coef: float | None, config: dict | None = None,
):  # fmt: skip
    """The GRPO script's Config for the plan: its defaults, with the plan's options applied.

    max_seq_len is the row the trainer sees, prompt + completion tokens: the prompt keeps the
    Config's max_prompt_len and the completion gets the rest (max_new_tokens); None keeps both
    defaults. micro_batch_size / kl_coef None: the Config's. config: as `config_with`.

    Raises:
        PlanError: max_seq_len leaves no completion token.
    """
    defaults = config_with(script, config)
    overrides = dict(model=str(model_dir), device="cpu")
    if max_seq_len is not None:
        if max_seq_len <= defaults.max_prompt_len:
            raise PlanError(
                f"--max-seq-len {max_seq_len} with --algo {spec.algo}: it is prompt + completion "
                f"tokens per rollout and the script's prompts take up to max_prompt_len = "
                f"{defaults.max_prompt_len}; give more than {defaults.max_prompt_len} (the "
                f"completion gets the rest; the default is {defaults.max_prompt_len} + "
                f"{defaults.max_new_tokens})"
            )
        overrides["max_new_tokens"] = max_seq_len - defaults.max_prompt_len
    if micro_batch_size is not None:
        overrides["micro_batch_size"] = micro_batch_size
    if kl_coef is not None:
        overrides["kl_coef"] = kl_coef
    cfg = config_with(script, config, **overrides)
    # the trainer does not depend on the engine: validate it as if the engines were the runtime's,
    # so planning a vLLM spec needs no vllm here (the engine estimate reads cfg.engine)
    script.validate(replace(cfg, engine="runtime", engine_tensor_parallel_size=1))
    return cfg


def synthetic_rollouts(cfg, rank: int, world_size: int) -> tuple[list, int, int]:
    """A step's rollouts as the GRPO script's loop hands them to `train_step`.

    prompts_per_step groups of num_generations `Rollout`s, every one max_prompt_len prompt and
    max_new_tokens completion tokens long (the longest rows the script trains on); this rank's
    share is every world_size-th from `rank` (the script's `[dp_rank::dp_size]`).

    Returns:
        (this rank's rollouts, completion tokens of the whole step (the loss divisor),
        micro-batches per step on every rank (the script's `num_micro`)).
    """
    import math

    from runtime import Rollout

    P, C, G = cfg.max_prompt_len, cfg.max_new_tokens, cfg.num_generations
    total = cfg.prompts_per_step * G
    flat = [
        Rollout(
            prompt_ids=[0] * P,
            completion_ids=[0] * C,
            sampler_logprobs=[0.0] * C,
            reward=0.0,
            rewards={},
            policy_version=0,
            group=i // G,
        )
        for i in range(total)
    ]
    num_micro = math.ceil(math.ceil(total / world_size) / cfg.micro_batch_size)
    return flat[rank::world_size], total * C, num_micro


def engine_layout(spec: Spec, cfg, model_dir: Path) -> dict:
    """The GRPO engines' numbers the report computes from (no simulation): from the script's
    Config (engine, num_engines, GPUs per engine, vLLM's memory share) and the model's config."""
    from runtime import ModelArgs, read_hf_config

    hf = read_hf_config(model_dir)
    args = ModelArgs.from_hf_config(hf)
    dtype_bytes = {"bf16": 2, "fp32": 4}[cfg.dtype]  # the engines sample in cfg.dtype
    d = model_dims(hf)
    lora = {k: getattr(cfg, k) for k in ("lora_rank", "lora_target_modules", "use_dora")
            if hasattr(cfg, k)}  # fmt: skip
    return {
        # the phase model of the layout (`plan_report.grpo_phases`): the script's Config; a
        # split script has no sleep (level 0) and no optimizer offload
        "layout": getattr(cfg, "layout", "split"),
        "engine_sleep_level": getattr(cfg, "engine_sleep_level", 0),
        "offload_optimizer": bool(getattr(cfg, "offload_optimizer", False)),
        "trainer_ranks": trainer_gpus(spec) * spec.nodes,
        "num_params": args.num_params(),
        "trained_params": adapter_params(d, lora) if has_adapters(spec) else args.num_params(),
        "weight_bytes_trained": trained_bytes(spec.tricks)[0],
        "optimizer_bytes": trained_bytes(spec.tricks)[1],
        "reference": getattr(cfg, "kl_coef", 0) > 0 and not has_adapters(spec),
        "largest_param": max(d["V"], d["I"], d["q"], d["kv"]) * d["D"],
        "vocab_size": d["V"],
        "dtype_bytes": dtype_bytes,
        "engine": cfg.engine,
        "num_engines": cfg.num_engines,
        "engine_tp": cfg.engine_tensor_parallel_size if cfg.engine == "vllm" else 1,
        "engine_gpus": spec.engine_gpus,
        "engine_gpu_memory_utilization": cfg.engine_gpu_memory_utilization,
        "dtype": cfg.dtype,
        "weight_bytes": args.num_params() * dtype_bytes,
        # K and V of every layer, per token, all KV heads (an engine's tp splits them)
        "kv_heads": args.num_key_value_heads,
        "kv_bytes_per_token": 2 * args.num_hidden_layers * args.num_key_value_heads
        * args.head_dim * dtype_bytes,
    }  # fmt: skip


def _cp_completions(cfg, row: int) -> tuple[int, int] | None:
    """Under context parallel (cfg.cp > 1): (completion positions, S / cp) of cp rank 0's chunks
    0 and 2*cp-1 of a collated row of `row` tokens (prompt, then max_new_tokens completion labels
    from position max_prompt_len - 1). Rank 0 holds the row's end, where the completions are: the
    busiest rank, whose logits the plan must fit. None without cp."""
    cp = getattr(cfg, "cp", 1)
    if cp == 1:
        return None
    chunk = row // (2 * cp)
    first = cfg.max_prompt_len - 1
    labels = range(first, first + cfg.max_new_tokens)
    on_rank_0 = sum(1 for t in labels if t < chunk or t >= (2 * cp - 1) * chunk)
    return on_rank_0, row // cp


def measure_grpo_step(
    script, model_dir: Path, micro_batch_size: int | None, max_seq_len: int | None, spec: Spec,
    fake: bool, kl_coef: float | None = None, max_micro_batches: int = SIMULATED_MICRO_BATCHES,
    config: dict | None = None, segments: bool = False, engine_model_dir: Path | None = None,
) -> dict:  # fmt: skip
    """The GRPO script's `setup_distributed`, `setup_model` (and, for grpo, the frozen
    reference when kl_coef > 0, as its main() does; grpo-lora's reference is the policy with its
    adapters off, no second model), `build_optimizer`, and two `train_step`s on synthetic
    rollouts (`synthetic_rollouts`) under `MemTracker`: this rank's share of the step, in at
    most `max_micro_batches` micro-batches per step.

    Needs a default process group of the trainer's world size. fake=True: FakeTensorMode, no
    weights loaded; fake=False: the same calls on real CPU tensors (tests compare the two).

    Args:
        micro_batch_size, max_seq_len, kl_coef, config: see `grpo_config` (None = the
            Config's).
        segments: also return "segments", the peak of every segment of the step
            (`_peak_tracker`), for `extrapolate_depth`.
        engine_model_dir: the model the engines hold (`engine_layout`), if not model_dir (a
            depth-reduced copy of its config is simulated, the engines hold the full model).

    Returns:
        {"categories", "peak", "logits"} as `measure_step`, plus the resolved
        "micro_batch_size" and "max_seq_len" (prompt + completion) and "rollout": the step's
        numbers and the engines' (`engine_layout`).
    """
    import torch

    from runtime.parallel import data_parallel

    cfg = grpo_config(script, model_dir, spec, micro_batch_size, max_seq_len, kl_coef, config)
    dist_info, mesh = script.setup_distributed(cfg)
    # the script's share: every dp_size-th rollout over the flattened dp ranks (HSDP included)
    rank, world, _ = data_parallel(mesh)
    share, num_tokens, num_micro = synthetic_rollouts(cfg, rank, world)
    micro = min(num_micro, max_micro_batches)
    rollouts = share[: micro * cfg.micro_batch_size]
    row = cfg.max_prompt_len + cfg.max_new_tokens
    with _simulated_build(script, fake):
        with _fake_to_empty() if fake else contextlib.nullcontext(), _real_mesh_ops():
            model = script.setup_model(cfg, model_dir, mesh, dist_info.device)
            reference = None
            # as main(): grpo builds the frozen reference only when kl_coef > 0; grpo-lora never
            # does (its reference is the policy with the adapters off, inside microbatch_loss)
            if cfg.kl_coef > 0 and not has_adapters(spec):
                reference = script.setup_frozen_model(cfg, model_dir, mesh, dist_info.device)
        optimizer, scheduler = script.build_optimizer(cfg, model)
        advantages = torch.zeros(len(rollouts))  # [M] fp32, this rank's (main's advantages[r::W])
        logits = [0]
        hook = model.lm_head.register_forward_hook(
            lambda mod, args, out: logits.__setitem__(0, max(logits[0], _local_nbytes(out)))
        )
        tracker = _peak_tracker(_num_layers(model_dir) if segments else None)
        tracker.track_external(model, optimizer, *([reference] if reference else []))
        # the label masks: max_new_tokens completion positions in each collated row
        # the script pads rows to a multiple of tp * 2*cp (sequence / context parallel)
        cp = getattr(cfg, "cp", 1)
        multiple = getattr(cfg, "tp", 1) * (2 * cp if cp > 1 else 1)
        padded = -(-row // multiple) * multiple
        answers = (
            _data_dependent_answers((cfg.max_new_tokens, padded), _cp_completions(cfg, padded))
            if fake
            else contextlib.nullcontext()
        )
        propagation = _separate_propagation_fake_mode() if fake else contextlib.nullcontext()
        with propagation, tracker, answers, _causal_bias_outside_modes(fake), _routing(answers):
            for _ in range(2):  # step 1 creates the optimizer state; step 2 holds it
                targets = {}
                if hasattr(script, "ppo_targets"):  # ppo: main()'s no-grad pass before a batch
                    split = script.split_micro_batches(rollouts, advantages, micro, cfg)
                    old, critic, _ = script.ppo_targets(
                        model, reference, split, cfg, dist_info.device
                    )
                    targets = {"old_logprobs": old, "critic": critic}
                script.train_step(
                    model, reference, optimizer, scheduler, rollouts, advantages, num_tokens,
                    micro, cfg, dist_info.device, **targets,
                )  # fmt: skip
        hook.remove()
        categories, peak = _peak_rows(tracker)
    del model, reference, optimizer, scheduler
    adapters = None
    if has_adapters(spec):  # grpo-lora: the adapters of the script's Config (its defaults)
        adapters = {
            "peft": "dora" if cfg.use_dora else "lora",
            "lora_rank": cfg.lora_rank,
            "lora_target_modules": list(cfg.lora_target_modules),
        }
    rollout = {
        "prompt_len": cfg.max_prompt_len,
        "completion_len": cfg.max_new_tokens,
        "rollouts_per_step": cfg.prompts_per_step * cfg.num_generations,
        "prompts_per_step": cfg.prompts_per_step,
        "num_generations": cfg.num_generations,
        "rollouts_on_rank": len(share),
        "micro_batches": num_micro,
        "simulated_micro_batches": micro,
        "kl_coef": cfg.kl_coef,
        "adapters": adapters,
        **engine_layout(spec, cfg, engine_model_dir or model_dir),
    }
    measured = {
        "categories": categories, "peak": peak, "logits": logits[0], "rollout": rollout,
        "micro_batch_size": cfg.micro_batch_size, "max_seq_len": row, "dtype": cfg.dtype,
    }  # fmt: skip
    if segments:
        measured["segments"] = _segments(tracker)
    return measured


def model_dir_for(spec: Spec, tmp: Path) -> Path:
    """A directory with the model's config.json only (the plan reads no weights)."""
    from generator.catalog import MODELS

    entry = MODELS.get(spec.model)
    if entry is None:
        return Path(spec.model).expanduser().resolve()
    model_dir = tmp / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(entry.config))
    return model_dir


def teacher_dir_for(teacher: str, tmp: Path) -> Path:
    """kd: a directory with the teacher's config.json (the plan reads no weights): the
    Config's teacher itself where it is a local model directory, else a catalog model's config
    written under tmp.

    Raises:
        PlanError: neither (a name only the script's download would resolve).
    """
    from generator.catalog import MODELS

    if (Path(teacher).expanduser() / "config.json").is_file():
        return Path(teacher).expanduser().resolve()
    if teacher not in MODELS:
        raise PlanError(
            f"teacher={teacher!r} in the script's Config: neither a catalog model (`scaffold list "
            "models`) nor a local directory with a config.json; the plan reads the teacher's "
            "config to count it, so give one of those"
        )
    out = tmp / "teacher"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(MODELS[teacher].config))
    return out


def _simulate_here(
    spec: Spec, micro_batch_size: int | None, max_seq_len: int | None, index: int,
    kl_coef: float | None = None, script_path: str | None = None, config: dict | None = None,
    full_depth: bool = False,
) -> PlanResult:  # fmt: skip
    """One simulation in this process (which must have no process group yet): of the render of
    `spec`, or of the train.py at `script_path` (`scaffold plan DIR`: the user's own script, so
    its edited functions and Config defaults are what is planned).

    A model deeper than EXTRAPOLATION_DEPTHS[-1] blocks of one kind is simulated at those
    depths and extrapolated to its own (`extrapolate_depth`); full_depth=True, or a step whose
    segments differ between the two depths, simulates every block."""
    start = time.perf_counter()
    world = trainer_gpus(spec) * spec.nodes  # GRPO's engine GPUs are not the trainer's
    with tempfile.TemporaryDirectory(prefix="scaffold-plan-") as tmp:
        tmp = Path(tmp)
        script, edits = _import_planned(spec, script_path, tmp, index)
        model_dir = model_dir_for(spec, tmp)
        if hasattr(script.Config, "teacher"):  # kd: the teacher's config.json, at its own depth
            teacher = config_with(script, config).teacher
            config = {**(config or {}), "teacher": str(teacher_dir_for(teacher, tmp))}

        def measure(directory: Path, segments: bool) -> dict:
            return _measure_here(
                script, spec, directory, world, micro_batch_size, max_seq_len, kl_coef, config,
                segments, model_dir,
            )  # fmt: skip

        measured, depths = None, None
        depth = _num_layers(model_dir)
        if not full_depth and depth > EXTRAPOLATION_DEPTHS[-1] and _identical_blocks(model_dir):
            a, b = (
                _in_fork(lambda k=k: measure(_reduced_model_dir(model_dir, k, tmp), True))
                for k in EXTRAPOLATION_DEPTHS
            )
            measured = extrapolate_depth(a, b, EXTRAPOLATION_DEPTHS, depth)
            depths = list(EXTRAPOLATION_DEPTHS) if measured is not None else None
        if measured is None:
            measured = measure(model_dir, False)
    # the spec as simulated: dtype is the script's Config default (an edit of it counts)
    spec = replace(spec, dtype=measured.pop("dtype"))
    return PlanResult(
        spec=spec, world_size=world, seconds=time.perf_counter() - start, script=script_path,
        config_edits=edits, simulated_depths=depths, **measured,
    )  # fmt: skip


def _in_fork(fn):
    """fn() in a fork of this process, its JSON-ready result sent back through a pipe: each
    measurement starts from the same process state (see `_request`).

    Raises:
        PlanError: the fork failed (its exception's type and message).
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            reply = {"ok": fn()}
        except PlanError as e:  # the parent raises it as it is
            reply = {"plan_error": str(e)}
        except BaseException as e:  # the parent raises it as a PlanError
            reply = {"error": f"{type(e).__name__}: {e}"}
        with os.fdopen(write, "w") as f:
            json.dump(reply, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    reply = json.loads(text) if text else {"error": "the measurement's process died"}
    if "plan_error" in reply:
        raise PlanError(reply["plan_error"])
    if "error" in reply:
        raise PlanError(f"the memory simulation failed: {reply['error']}")
    return reply["ok"]


def _import_planned(spec: Spec, script_path: str | None, tmp: Path, index: int):
    """(the script to simulate, its Config edits or None): the render of `spec`, or the user's
    train.py at script_path, whose edits the fresh render tells."""
    from generator.render import render

    (tmp / "train.py").write_text(render(spec))
    script = import_script(tmp / "train.py", f"scaffold_plan_{index}")
    if script_path is None:
        return script, None
    user = import_script(Path(script_path), f"scaffold_plan_user_{index}")
    return user, config_edits(user, script)


def _measure_here(
    script, spec: Spec, model_dir: Path, world: int, micro_batch_size: int | None,
    max_seq_len: int | None, kl_coef: float | None, config: dict | None, segments: bool,
    engine_model_dir: Path,
) -> dict:  # fmt: skip
    """measure_step or measure_grpo_step under a fake process group of `world` ranks (rank 0)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        if is_grpo(spec):
            return measure_grpo_step(
                script, model_dir, micro_batch_size, max_seq_len, spec, True, kl_coef,
                config=config, segments=segments, engine_model_dir=engine_model_dir,
            )  # fmt: skip
        if is_dpo(spec):
            return measure_dpo_step(
                script, model_dir, micro_batch_size, max_seq_len, spec, True, config, segments
            )
        return measure_step(
            script, model_dir, micro_batch_size, max_seq_len, spec, True, config, segments
        )
    finally:
        dist.destroy_process_group()


def _identical_blocks(model_dir: Path) -> bool:
    """The model's decoder blocks are all of one kind (same shapes, same attention), so its step
    memory is a line in its depth: no per-layer lists (sliding windows, dense-only layers), and
    a mixture of experts in every block or in none (decoder_sparse_step 1: under the balanced
    routing every MoE block holds the same bytes)."""
    from runtime import read_hf_config

    cfg = read_hf_config(model_dir)
    kinds = set(cfg.get("layer_types") or ["one"])
    mixed = cfg.get("num_experts") and cfg.get("decoder_sparse_step", 1) != 1
    return len(kinds) == 1 and not cfg.get("mlp_only_layers") and not mixed


def _reduced_model_dir(model_dir: Path, depth: int, tmp: Path) -> Path:
    """A copy of the model's config.json with `depth` decoder blocks (the plan reads no weights)."""
    from runtime import read_hf_config

    cfg = read_hf_config(model_dir)
    cfg["num_hidden_layers"] = depth
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:depth]
    reduced = tmp / f"model-{depth}-blocks"
    reduced.mkdir(exist_ok=True)
    (reduced / "config.json").write_text(json.dumps(cfg))
    return reduced


def extrapolate_depth(a: dict, b: dict, depths: tuple[int, int], depth: int) -> dict | None:
    """The measurement at `depth` blocks from two at depths[0] and depths[0] + 1 blocks.

    Each segment of the step (`_peak_tracker`) holds bytes that are a line in the depth (every
    block is the same and adds the same parameters, gradients, states and activations), so its
    peak at `depth` is b's + (depth - depths[1]) x (b's - a's), per category; the step's peak is
    the largest segment's. Exact (equal bytes) where the blocks are identical; the tests check it
    against the full simulation.

    Segments whose key starts with a stage name (DPO's precomputed reference: "reference pass",
    "training step"; `_peak_tracker`) also give each stage's peak, the largest of its segments.

    Returns:
        b with "categories" and "peak" extrapolated ("segments" dropped; "stages", where b has
        them, extrapolated too), or None when a and b have different segments or logits (the
        step is not the same at both depths).
    """
    (ka, kb) = depths
    if kb - ka != 1:
        raise ValueError(f"depths {depths}: must be consecutive (integer extrapolation)")
    seg_a = {tuple(key): (rows, total) for key, rows, total in a["segments"]}
    seg_b = {tuple(key): (rows, total) for key, rows, total in b["segments"]}
    if seg_a.keys() != seg_b.keys() or a["logits"] != b["logits"]:
        return None
    steps = depth - kb
    best, stages = None, {}
    for key, (rows_b, total_b) in seg_b.items():
        rows_a, total_a = seg_a[key]
        rows = {row: n + steps * (n - rows_a[row]) for row, n in rows_b.items()}
        total = total_b + steps * (total_b - total_a)
        if best is None or total > best[1]:
            best = (rows, total)
        if isinstance(key[0], str) and (key[0] not in stages or total > stages[key[0]]["peak"]):
            stages[key[0]] = {"categories": rows, "peak": total}
    extrapolated = {k: v for k, v in b.items() if k != "segments"}
    extrapolated["categories"], extrapolated["peak"] = best
    if b.get("stages"):
        extrapolated["stages"] = stages
    return extrapolated


def simulate(
    specs: list[Spec], micro_batch_size: int | None, max_seq_len: int | None, progress=None,
    kl_coef: float | None = None, scripts: list[str | None] | None = None,
    config: dict | None = None, full_depth: bool = False, until=None,
) -> list[PlanResult]:  # fmt: skip
    """Simulate each spec in one child process (the fake process group and the imported scripts
    stay out of the caller), forked by the planner's server (`_server`: started at this
    process's first call, reused by the later ones). `progress(line)` receives one line per spec
    as it starts.

    A deep model is simulated at EXTRAPOLATION_DEPTHS blocks and extrapolated to its depth
    (`extrapolate_depth`: equal bytes, about 20x faster at 80 blocks); full_depth=True
    simulates every block. `until(result)`: a predicate; the first result it holds for ends
    the run there (the child and the server are stopped), so fewer results than specs come back.

    micro_batch_size / max_seq_len / kl_coef None take the script's Config defaults (GRPO:
    max_seq_len is prompt + completion, `grpo_config`).

    Args:
        scripts: per spec, a train.py to simulate instead of the spec's render (`scaffold plan
            DIR`: DIR/train.py, whose spec is DIR's), or None for the render.
        config: Config values every rendered script takes instead of its defaults (a plan of
            DIR's suggestions: the `config_edits` of DIR's script), below the options above.

    Raises:
        PlanError: a spec the planner cannot simulate, or the child failed (its last line).
    """
    scripts = list(scripts) if scripts is not None else [None] * len(specs)
    if len(scripts) != len(specs):
        raise ValueError(f"{len(scripts)} scripts for {len(specs)} specs")
    for spec in specs:
        check_simulable(spec, micro_batch_size, max_seq_len, kl_coef)
    request = {
        "specs": [asdict(s) for s in specs],
        # paths as given: the child runs in this process's working directory
        "scripts": [str(s) if s is not None else None for s in scripts],
        "micro_batch_size": micro_batch_size,
        "max_seq_len": max_seq_len,
        "kl_coef": kl_coef,
        "config": config,
        "full_depth": full_depth,
    }
    # the request process takes this process's environment and directory (the server keeps the
    # ones it started with), so SCAFFOLD_DEBUG and relative script paths mean what they mean here
    request.update(env=dict(os.environ), cwd=os.getcwd())
    server = _server()
    # stderr to a file: the child's warnings (torchao's import lines) must not fill a pipe
    with tempfile.NamedTemporaryFile("w+", prefix="scaffold-plan-", suffix=".log") as stderr:
        request["stderr"] = stderr.name
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        try:
            results, error, status, stopped = _events(server, progress, until)
        except BaseException:  # an interrupt, or a callback that raised: the stream is mid-request
            _stop_server()
            raise
        if stopped:
            return results
        stderr.seek(0)
        last = (stderr.read().strip().splitlines() or ["no output"])[-1]
    if status is None:  # the server itself died
        _stop_server()
        last = _server_log_tail() or last
    if error is not None:
        raise PlanError(error)
    if status != 0 or len(results) != len(specs):
        raise PlanError(f"the memory simulation failed: {last} (SCAFFOLD_DEBUG=1 shows more)")
    return results


_MESSAGE = "scaffold-plan: "  # prefix of the server's and request processes' JSON lines on stdout


def _events(server: subprocess.Popen, progress, until) -> tuple[list, str | None, int | None, bool]:
    """Read one request's events from the server: (results, the error it sent or None, its
    exit status or None if the server died, whether `until` stopped it: then the request's
    processes and the server are stopped, since a fork killed mid-line could garble the
    server's next line)."""
    results, error, pid = [], None, None
    for line in server.stdout:
        if not line.startswith(_MESSAGE):
            continue  # anything else the script's code printed
        msg = json.loads(line[len(_MESSAGE) :])
        if "pid" in msg:
            pid = msg["pid"]
            _REQUEST[0] = pid
        if "start" in msg and progress:
            progress(msg["start"])
        if "result" in msg:
            results.append(PlanResult.from_json(msg["result"]))
            if until is not None and until(results[-1]):
                _stop_server()
                return results, None, 0, True
        error = msg.get("error", error)
        if "done" in msg:
            _REQUEST[0] = None
            return results, error, msg["done"], False
    return results, error, None, False


# The planner's server: `python -m generator.plan_harness`, started at a process's first
# simulate() and kept for its later ones, so torch and the runtime are imported once per process
# (a new interpreter's start-up and imports take several seconds; a fork, milliseconds)
_SERVER: subprocess.Popen | None = None
_SERVER_LOG = None  # the server's own stderr (a start-up failure's message)
_REQUEST = [None]  # the pid (and process group) of the request in flight, else None


def _server() -> subprocess.Popen:
    global _SERVER, _SERVER_LOG
    if _SERVER is not None and _SERVER.poll() is None:
        return _SERVER
    _stop_server()
    atexit.register(_stop_server)  # once per server; a second call finds none to stop
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")])),
    }
    _SERVER_LOG = tempfile.TemporaryFile("w+")
    _SERVER = subprocess.Popen(
        [sys.executable, "-m", "generator.plan_harness"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=_SERVER_LOG, text=True, env=env,
    )  # fmt: skip
    return _SERVER


def _stop_server() -> None:
    """Stop the request in flight (its process group) and the server, if any; the next
    simulate() starts a new server."""
    global _SERVER
    if _REQUEST[0] is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_REQUEST[0], signal.SIGKILL)
        _REQUEST[0] = None
    if _SERVER is not None:
        _SERVER.kill()
        _SERVER.wait()
        _SERVER.stdin.close()
        _SERVER.stdout.close()
        _SERVER = None


def _server_log_tail() -> str | None:
    if _SERVER_LOG is None:
        return None
    _SERVER_LOG.seek(0)
    lines = _SERVER_LOG.read().strip().splitlines()
    return lines[-1] if lines else None


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def _send(msg: dict) -> None:
    print(_MESSAGE + json.dumps(msg), flush=True)


def _serve() -> None:
    """`python -m generator.plan_harness`: one request per line on stdin (until it closes), each
    handled in a forked request process (`_request`) whose events are JSON lines on stdout; then
    `{"done": exit status}`. torch and the runtime are imported before the first fork."""
    import runtime  # noqa: F401  (imported before the forks, so each starts with it)

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                _request(request)
                status = 0
            finally:
                sys.stdout.flush()
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        _send({"done": os.waitstatus_to_exitcode(status)})


def _request(request: dict) -> None:
    """One simulate() call: in its own session (`until` kills it and its forks as a group), with
    the caller's environment and directory, stderr to the request's file. Each spec is simulated
    in a fork of this process, so no simulation sees what an earlier one left in the process
    (module caches, the harness's patches of torch and the script)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    with open(request["stderr"], "w") as err:
        os.dup2(err.fileno(), 2)
    _send({"pid": os.getpid()})
    for index, data in enumerate(request["specs"]):
        spec = Spec(
            **dict(data, tricks=tuple(data["tricks"]), fit_note=tuple(data.get("fit_note", ())))
        )
        _send({"start": describe_spec(spec)})
        pid = os.fork()
        if pid == 0:
            status = 3
            try:
                status = 0 if _child_one(request, index, spec) else 3
            except BaseException:  # SCAFFOLD_DEBUG: the traceback, to stderr
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            return  # the fork sent its error (or died: simulate() reports the missing result)


def _child_one(request: dict, index: int, spec: Spec) -> bool:
    """Simulate one spec of the request and send its result; False after sending an error."""
    script = request["scripts"][index]
    try:
        result = _simulate_here(
            spec, request["micro_batch_size"], request["max_seq_len"], index,
            request["kl_coef"], script, request["config"], request.get("full_depth", False),
        )  # fmt: skip
    except PlanError as e:
        _send({"error": str(e)})
        return False
    except Exception as e:
        if os.environ.get("SCAFFOLD_DEBUG"):
            raise
        what = f"{script} ({describe_spec(spec)})" if script else describe_spec(spec)
        msg = f"simulating {what} failed: {type(e).__name__}: {e}"
        _send({"error": " ".join(msg.split())[:2000]})
        return False
    _send({"result": result.to_json()})
    return True


if __name__ == "__main__":
    _serve()
