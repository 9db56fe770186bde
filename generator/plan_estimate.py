"""The planner's arithmetic estimate: per-rank peak memory of a spec's training step from the
model's shapes and the script's Config defaults, without simulating it (well under a second).

`scaffold new` prints its verdict; the search in `generator.plan` uses it to skip candidates it
rules out before simulating the others. The simulation (`generator.plan_harness`) stays the
figure `scaffold plan` prints; `tests/generator/test_plan_estimate.py` holds this estimate
within ESTIMATE_TOLERANCE of it over a matrix of models, algorithms, tricks and GPU counts.

What it counts, per trainer rank (bytes):
- resident: the sharded parameters (fp32 master weights of what is trained, bf16 under bf16-sr;
  the frozen LoRA base in the script's dtype), their gradients (the weights' dtype) and the
  optimizer's state (AdamW: 8 bytes per trained parameter, 4 under bf16-sr's bf16 moments, 8-bit:
  2, 4-bit: 1), each divided over the ranks that shard it (`plan_harness.trained_bytes`);
- in flight: the bf16 copies FSDP gathers (the root unit: embedding and head; two blocks);
- activations: bytes per token per decoder block (the recipe's: saved tensors of a block, or
  its input only under ac, plus one block recomputed), times the micro-batch's tokens;
- the loss: the [T, V] logits and their fp32 work (none under lce but one chunk);
- DPO: a micro-batch of P pairs is 2P sequences of max_seq_len tokens; the reference of the
  Config's ref_mode (`_dpo_moments`): separate's frozen copy (and its root left gathered),
  nothing for adapters-off, and for precomputed a "reference pass" moment before training;
  none at all for the reference-free loss_type simpo and orpo (`dpo_reference_mode`). kto is
  estimated as DPO (its 2P rows of completions and KL sequences; it trains on P of them, so
  the activations are an upper bound);
- GRPO: the largest phase of the layout on the trainer's GPU (`plan_report.grpo_phases`):
  split, the trainer peak (plus the engine where one shares its GPU); colocated, the max of the
  trainer step (+ a sleeping engine), the generation (the awake engine + what the trainer keeps
  resident) and the weight sync.
The peak is the largest of three moments: the end of the forward (activations live), the end of
the backward (every gradient) and the optimizer step.
"""

from __future__ import annotations

import ast
import functools
import math
from dataclasses import dataclass, replace

from generator.features import PEFT_ALGOS
from generator.plan_harness import (
    GIB,
    adapter_params,
    dpo_reference_mode,
    is_dpo,
    is_grpo,
    is_rm,
    model_dims,
    trained_bytes,
)
from generator.plan_report import HEADROOM, grpo_phases
from generator.spec import Spec, model_config, trainer_gpus

# The estimate is within this share of the simulated peak on the tests' matrix
ESTIMATE_TOLERANCE = 0.15

# Activation bytes per token per decoder block: a x hidden + b x intermediate + c x kv width,
# bf16 (fp32 doubles them). Fitted to the simulated end of the forward (1 x 2048 tokens, 64
# ranks so the weights are negligible) of Llama 3.2 1B, 3.1 8B, 3.3 70B, Qwen2.5 7B and
# SmolLM2 1.7B: a block saves its normed inputs and their fp32 upcasts, q, k, v, the attention
# output, the gate, up and their product. LoRA's blocks save 0.93 of that (within 1%
# of 0.93 on all five but 70B: 0.98).
ACT_PER_TOKEN = (17.8, 7.7, 10.0)
LORA_ACT_SHARE = 0.93
# Mixture of experts: bytes per token per block per (slot x hidden) element, bf16, beside the
# dense terms (with I the active width, top-k x moe_intermediate_size): x_sorted, the experts'
# inputs, outputs and their weighted sum, [T * k, D] each, so four bf16 tensors. With it the
# estimate of Qwen3-30B-A3B is within 5% of the simulation in the matrix of
# tests/generator/test_plan_speed.py (EP 8 and EP 4 x FSDP 2, sft, grpo, dpo).
MOE_SLOT_PER_TOKEN = 8.0
AC_PER_TOKEN = 2.0  # ac: a block keeps its bf16 input (x hidden); one block is recomputed
# bf16-sr: torchao's per-parameter AdamW step (compiled, fallback_random on) holds fp32 buffers of
# the parameter it steps (its fp32 copy, gradient, moments, the rounding's random bits, ...): the
# simulation shows 10.4 of the largest parameter's fp32 shard over the moments (Llama 3.1 8B: 20.5
# GiB on 1 rank, 5.0 GiB on 4), at the optimizer step, or in backward under optim-in-bwd
BF16_SR_STEP_BUFFERS = 10.4


@dataclass(frozen=True)
class Estimate:
    """An estimated per-rank peak (bytes) and its parts at that moment."""

    spec: Spec
    peak: int  # the largest phase on a trainer GPU (non-GRPO: the trainer rank's peak)
    parts: dict  # name -> bytes at the peak moment
    # "forward", "backward", "optimizer step"; DPO precomputed may be "reference pass"; GRPO
    # colocated may be "generation" or "weight sync"
    moment: str
    world_size: int
    micro_batch_size: int
    max_seq_len: int
    # GRPO: the engines start and hold their weights and a rollout's KV cache (`grpo_phases`)
    engine_ok: bool = True
    # cpu-offload: what a rank keeps in host memory instead (sharded weights, gradients, optimizer
    # state, DPO's separate reference), bytes; 0 without it
    host: int = 0


def config_defaults(script_text: str) -> dict:
    """The literal defaults of the `Config` dataclass in a rendered train.py, read with `ast` (no
    import, so no torch): {field: value}; fields whose default is not a literal are left out."""
    return dict(_config_defaults(script_text))


@functools.lru_cache(maxsize=8)  # the recipe search estimates every trick set on one text
def _config_defaults(script_text: str) -> dict:
    tree = ast.parse(script_text)
    (config,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config"]
    values = {}
    for node in config.body:
        if not isinstance(node, ast.AnnAssign) or node.value is None:
            continue
        value = node.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
            factories = [k.value for k in value.keywords if k.arg == "default_factory"]
            if not factories or not isinstance(factories[0], ast.Lambda):
                continue
            value = factories[0].body
        try:
            values[node.target.id] = ast.literal_eval(value)
        except ValueError:
            continue
    return values


def _rollout(spec: Spec, cfg: dict, d: dict, seq: int) -> dict:
    """The rollout dict `engine_estimate_of` and `grpo_phases` read (`engine_layout`'s
    numbers), from the script's Config defaults and the model's shapes."""
    dtype = {"bf16": 2, "fp32": 4}[cfg.get("dtype", spec.dtype)]
    adapters = spec.algo in PEFT_ALGOS
    heads = model_config(spec).get("num_key_value_heads", model_config(spec)["num_attention_heads"])
    vllm = cfg["engine"] == "vllm"
    return {
        "engine": cfg["engine"], "num_engines": cfg["num_engines"],
        "engine_tp": cfg["engine_tensor_parallel_size"] if vllm else 1,
        "engine_gpus": spec.engine_gpus,
        "engine_gpu_memory_utilization": cfg["engine_gpu_memory_utilization"],
        "weight_bytes": d["params"] * dtype, "kv_heads": heads,
        "kv_bytes_per_token": 2 * d["L"] * d["kv"] * dtype,
        "prompt_len": cfg["max_prompt_len"], "completion_len": seq - cfg["max_prompt_len"],
        "prompts_per_step": cfg["prompts_per_step"], "num_generations": cfg["num_generations"],
        "layout": cfg.get("layout", "split"), "engine_sleep_level": cfg.get("engine_sleep_level", 0),
        "offload_optimizer": bool(cfg.get("offload_optimizer", False)),
        "cpu_offload": "cpu-offload" in spec.tricks,
        "trainer_ranks": trainer_gpus(spec) * spec.nodes, "num_params": d["params"],
        "trained_params": adapter_params(d, cfg) if adapters else d["params"],
        "weight_bytes_trained": trained_bytes(spec.tricks)[0],
        "optimizer_bytes": trained_bytes(spec.tricks)[1],
        "reference": cfg.get("kl_coef", 0) > 0 and not adapters,
        "largest_param": max(d["V"], d["I"], d["q"], d["kv"]) * d["D"],
        "vocab_size": d["V"], "dtype_bytes": dtype,
    }  # fmt: skip


def estimate(
    spec: Spec, script_text: str, micro_batch_size: int | None = None,
    max_seq_len: int | None = None, gpu_gib: float = 79.6, config: dict | None = None,
) -> Estimate:  # fmt: skip
    """Estimate the per-rank peak of `spec`'s step (bytes) from arithmetic alone.

    Args:
        script_text: the rendered train.py (its Config defaults: lengths, LoRA rank, engines,
            DPO's ref_mode).
        micro_batch_size, max_seq_len: None = the Config's (GRPO: max_seq_len is prompt +
            completion, the prompt keeping max_prompt_len; DPO: micro_batch_size is pairs, each
            two sequences of max_seq_len).
        gpu_gib: the GPU's memory in GiB (vLLM engines sharing a trainer GPU take a share of it).
        config: Config values instead of the script's defaults ({field: value}, as `simulate`'s
            config), e.g. {"ref_mode": "precomputed"}.

    Raises:
        KeyError: the script has no Config field the estimate needs.
    """
    cfg = {**config_defaults(script_text), **(config or {})}
    d = model_dims(model_config(spec))
    grpo = is_grpo(spec)
    dpo = is_dpo(spec)
    rm = is_rm(spec)  # reward model: pairs, a [D] -> 1 head, no lm_head
    world = trainer_gpus(spec) * spec.nodes
    shard = world // spec.dp_replicate  # ranks one parameter is split over (TP's share included)
    mbs = micro_batch_size or cfg["micro_batch_size"]
    if grpo:
        prompt = cfg["max_prompt_len"]
        seq = max_seq_len or prompt + cfg["max_new_tokens"]
    else:
        seq = max_seq_len or cfg["max_seq_len"]
    tokens = mbs * -(-seq // spec.tp) / spec.cp  # per rank: sequence parallel and cp split rows
    if dpo or rm:  # a pair is two sequences (chosen, rejected): 2P rows, or P packed rows of 2S
        tokens *= 2
    dtype = 4 if spec.dtype == "fp32" else 2
    tricks = set(spec.tricks)
    adapters = "lora" in spec.algo or spec.algo in ("qlora", "dora")
    unwrapped = world == 1 and spec.dtype == "fp32"  # the 1-process fp32 script: no FSDP

    # --ep: a rank holds num_experts / ep experts whole (replicated over the world / ep ep
    # groups), the other parameters FSDP-sharded over every rank; `pshard` is the ranks the
    # parameters are split over in effect
    ep_experts = d["experts"] if spec.ep > 1 else 0
    pshard = d["params"] / ((d["params"] - ep_experts) / shard + ep_experts / spec.ep)
    trained = adapter_params(d, cfg) if adapters else d["params"]
    frozen = d["params"] if adapters else 0
    frozen_bytes, nf4_saved = dtype * frozen, 0  # the base; bytes NF4 saves per gathered block
    dequantized = 0
    if spec.algo == "qlora":  # the targeted base weights in NF4 (`nf4_bytes`), the rest in dtype
        dense, nf4 = _nf4_base(d, cfg, dtype)
        frozen_bytes = dtype * (frozen - d["L"] * dense) + d["L"] * nf4
        nf4_saved = 2 * dense - nf4
        # each NF4 linear is dequantized to the dtype in its forward and again in its backward:
        # one dense copy of the largest at a time
        dequantized = dtype * max(d["I"], d["q"], d["kv"]) * d["D"]
    tshard = shard if adapters else pshard
    master, state_bytes = trained_bytes(tricks)  # fp32 master weights, or bf16 under bf16-sr
    params = master * trained / tshard + frozen_bytes / pshard
    grads = 0 if "optim-in-bwd" in tricks else master * trained / tshard
    state = state_bytes * trained / tshard
    # cpu-offload (FSDP2 CPUOffloadPolicy): the sharded weights, their gradients (each block's
    # reduce-scatter output is copied out) and the optimizer state, whose step runs on the CPU,
    # live in host memory; the GPU keeps the gathered blocks, activations and loss work
    on_gpu = 0 if "cpu-offload" in tricks else 1
    host = (1 - on_gpu) * (params + grads + state)
    params, grads, state = on_gpu * params, on_gpu * grads, on_gpu * state
    # FSDP gathers two blocks in flight (under --ep without their experts, which it ignores;
    # qlora's NF4 weights as their NF4 bytes)
    gathered_block = 2 * (d["block"] - (d["expert_block"] if ep_experts else 0)) - nf4_saved
    gathered = 0 if unwrapped else (2 * d["root"] + 2 * gathered_block) / spec.tp + dequantized
    if ep_experts and dtype == 2:  # the experts' bf16 casts, saved for backward (`MoeExpert`):
        # every block's (one block's, recomputed, under ac)
        gathered += 2 * d["experts"] / spec.ep / (d["L"] if "ac" in tricks else 1)

    a, b, c = ACT_PER_TOKEN
    per_block = (a * d["D"] + b * d["I_active"] + c * d["kv"]) * dtype / 2 / spec.tp
    if d["experts"]:  # a token's top-k slots: gathered, sorted, dispatched and weighted copies
        per_block += MOE_SLOT_PER_TOKEN * d["k"] * d["D"] * dtype / 2
    per_block *= LORA_ACT_SHARE if adapters else 1
    if "ac" in tricks:
        acts = tokens * (AC_PER_TOKEN * d["D"] * dtype / 2 * d["L"]) + tokens * per_block
    else:
        acts = tokens * per_block * d["L"]
    if spec.cp > 1 and spec.cp_mode == "allgather":
        # all-gather context parallel: a block keeps the whole sequence's K and V for backward,
        # cp - 1 times its own tokens' more (the ring passes blocks and keeps only its own)
        gathered_kv = tokens * (spec.cp - 1) * 2 * d["kv"] * dtype / spec.tp
        acts += gathered_kv * (1 if "ac" in tricks else d["L"])
    if grpo:  # the loss on completion tokens only; the log-probs in fp32
        loss_tokens = mbs * cfg["max_new_tokens"]
    else:
        loss_tokens = tokens
    vocab = d["V"] / spec.tp
    if rm:  # one score per sequence: no logits
        loss = 0
    elif "lce" in tricks:  # the chunked loss: lm_head's weight in fp32 (and its fp32 gradient
        # where it is trained), two chunks of 1/8 of the tokens' fp32 logits
        head = vocab * d["D"] * 4 * (1 if adapters else 2)
        loss = head + loss_tokens * vocab * 4 * 2 / 8
    else:  # the [T, V] logits in the dtype, their fp32 upcast and its gradient
        loss = loss_tokens * vocab * (dtype + 4 + 4)

    # GRPO accumulates over its micro-batches: the second one's forward runs with the first's
    # gradients held (SFT's plan runs one micro-batch per step)
    accumulated = 0
    if grpo:
        rows = cfg["prompts_per_step"] * cfg["num_generations"]
        if math.ceil(math.ceil(rows / world) / mbs) > 1:
            # optimizer-in-backward steps a parameter in the last micro-batch's backward only:
            # until then its gradient accumulates like any other, so every one exists in the
            # forwards after the first (the last backward frees them as it steps)
            accumulated = on_gpu * master * trained / shard
    moments = {
        "forward": {"parameters": params + gathered, "gradients": accumulated,
                    "optimizer state": state, "activations": acts, "loss": loss},
        "backward": {"parameters": params + gathered, "gradients": grads,
                     "optimizer state": state, "loss": loss / 2},
        "optimizer step": {"parameters": params, "gradients": grads, "optimizer state": state,
                           "update": on_gpu * master * trained / shard * (0 if "optim-in-bwd" in tricks else 0.25)},
    }  # fmt: skip
    if "bf16-sr" in tricks and on_gpu:  # torchao's step of the largest parameter: fp32 work buffers
        step = BF16_SR_STEP_BUFFERS * 4 * max(d["V"], d["I"], d["q"], d["kv"]) * d["D"] / shard
        moments["backward" if "optim-in-bwd" in tricks else "optimizer step"]["update"] = step
    if spec.algo == "kd":
        _kd_moments(moments, spec, dtype, loss_tokens, vocab, tricks)
    if dpo:
        _dpo_moments(moments, cfg, d, dtype, shard, unwrapped, loss_tokens, vocab, tricks, on_gpu)
        if dpo_reference_mode(cfg) == "separate":  # offloaded with the policy
            host += (1 - on_gpu) * dtype * d["params"] / shard
    moment = max(moments, key=lambda m: sum(moments[m].values()))
    engine_ok = True
    parts = {k: int(v) for k, v in moments[moment].items()}
    if grpo:  # the largest phase of the layout on the trainer's GPU (`grpo_phases`)
        layout = grpo_phases(_rollout(spec, cfg, d, seq), sum(parts.values()), gpu_gib)
        phases, engine_ok = layout["phases"], layout["engine_ok"]
        name = max(phases, key=lambda n: sum(phases[n].values()))
        trainer = parts
        parts = {}
        for part, nbytes in phases[name].items():
            if part == "trainer peak":
                parts.update(trainer)
            else:
                parts[part] = int(nbytes)
        if name != "trainer step":
            moment = name
    return Estimate(
        spec=spec, peak=sum(parts.values()), parts=parts, moment=moment, world_size=world,
        micro_batch_size=mbs, max_seq_len=seq, engine_ok=engine_ok, host=int(host),
    )  # fmt: skip


def nf4_bytes(numel: int, dtype: int) -> int:
    """Bytes of one torchao NF4Tensor of `numel` weights dequantizing to a `dtype`-byte type:
    two 4-bit codes per byte (uint8 [numel / 2]), an int8 scaler per 64-weight block, one
    `dtype` factor per scaler block (the largest divisor of the block count <= 256, as
    `runtime.lora._nf4_scaler_block_size`), the scalers' mean and the 16-level lookup table."""
    blocks = numel // 64
    scaler_block = next(s for s in range(min(256, blocks), 0, -1) if blocks % s == 0)
    return numel // 2 + blocks + (blocks // scaler_block + 1 + 16) * dtype


def _nf4_base(d: dict, cfg: dict, dtype: int) -> tuple[int, int]:
    """qlora, per decoder block: (elements of the base weights the Config's lora_target_modules
    quantize, their NF4 bytes)."""
    D, inter, q, kv = d["D"], d["I"], d["q"], d["kv"]
    shapes = {"q_proj": D * q, "k_proj": D * kv, "v_proj": D * kv, "o_proj": q * D,
              "gate_proj": D * inter, "up_proj": D * inter, "down_proj": inter * D}  # fmt: skip
    targets = [t for t in cfg.get("lora_target_modules", list(shapes)) if t in shapes]
    return sum(shapes[t] for t in targets), sum(nf4_bytes(shapes[t], dtype) for t in targets)


def _kd_moments(
    moments: dict, spec: Spec, dtype: int, loss_tokens: float, vocab: float, tricks: set
) -> None:  # fmt: skip
    """Add kd's frozen teacher to `moments` (bytes, in place): its weights whole on every rank
    in the dtype (the script's `load_teacher`: not sharded, not split by tp), through the step;
    and at the end of the forward its [T, V] logits in the dtype and the KL's fp32 work, the
    student's and the teacher's log-softmax and the teacher's probabilities (under tp the
    student's vocab-sharded logits gathered whole for the KL); under lce its chunks only, two
    fp32 [T / 8, V] per model."""
    teacher = model_dims(model_config(replace(spec, model=spec.teacher or spec.model)))
    for moment in moments.values():
        moment["teacher"] = dtype * teacher["params"]
    V = teacher["V"]
    if "lce" in tricks:
        kl = loss_tokens * V * 4 * 2 * 2 / 8
    else:
        kl = loss_tokens * V * (dtype + 3 * 4) + (loss_tokens * V * dtype if spec.tp > 1 else 0)
    moments["forward"]["loss"] += kl


def _dpo_moments(
    moments: dict, cfg: dict, d: dict, dtype: int, shard: int, unwrapped: bool,
    loss_tokens: float, vocab: float, tricks: set, on_gpu: int = 1,
) -> None:  # fmt: skip
    """Add the DPO reference of the Config's ref_mode to `moments` (bytes, in place).

    A reference's no-grad forward (separate, adapters-off) runs after the policy's, with the
    policy's activations live; its loss work, the [T, V] fp32 upcast and log_softmax (8 bytes
    per logit; lce: two fp32 chunks of 1/8 of the tokens), is the size of the backward's first
    [T, V] gradients, which the "loss" part already counts (simulated: Llama 3.1 8B x8, a
    dpo-lora step peaks at the same bytes with adapters-off as with precomputed), so it adds no
    moment of its own. What it does add:

    - separate: a frozen copy in the dtype, sharded like the policy, resident through the
      step (in host memory under cpu-offload: on_gpu 0), and its root (embedding, head) left
      gathered after its forward (FSDP does not reshard a root after forward, and no backward
      comes);
    - adapters-off: nothing (the policy itself, no second model);
    - precomputed: a "reference pass" moment before training: the parameters, the gathered
      copies and that forward's loss work, no optimizer state yet (created at the first step);
    - none (loss_type simpo or orpo, whatever ref_mode says): nothing.
    """
    mode = dpo_reference_mode(cfg)
    if mode == "precomputed":
        no_grad_loss = loss_tokens * vocab * 4 * 2 / (8 if "lce" in tricks else 1)
        moments["reference pass"] = {
            "parameters": moments["forward"]["parameters"], "loss": no_grad_loss,
        }  # fmt: skip
    elif mode == "separate":
        gathered_root = 0 if unwrapped else 2 * d["root"]
        for moment in moments:
            moments[moment]["reference"] = on_gpu * dtype * d["params"] / shard + gathered_root


def estimate_fits(e: Estimate, gpu_gib: float) -> bool:
    """The estimated peak within the GPU's memory less HEADROOM."""
    return e.peak <= (1 - HEADROOM) * gpu_gib * GIB


def format_estimate(
    e: Estimate, gpu_label: str, gpu_gib: float, command: str = "", note: str = "",
    fits: bool | None = None,
) -> str:  # fmt: skip
    """`scaffold new`'s one verdict line, e.g. `fits on h100-80: ~66 GiB of 71.6 usable per GPU
    (estimate; scaffold plan ... simulates it)`; `note` replaces the parenthesis (a spec the
    planner cannot simulate); `fits` overrides the GPU's verdict (cpu-offload: the host's too)."""
    budget = (1 - HEADROOM) * gpu_gib
    verdict = "fits" if (estimate_fits(e, gpu_gib) if fits is None else fits) else "does NOT fit"
    per = "trainer GPU" if is_grpo(e.spec) else "GPU"
    return (
        f"{verdict} on {gpu_label}: ~{e.peak / GIB:.0f} GiB of {budget:.1f} usable per {per} "
        f"({note or f'estimate; `{command}` simulates it'})"
    )
