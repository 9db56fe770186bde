"""The verdict on a simulated plan (does rank 0's peak fit a GPU?) and the text `scaffold plan`
prints: the per-rank table, the verdict, and the rollout engines' computed estimate.
"""

from __future__ import annotations

import shlex

from generator.plan_harness import GIB, PlanError, PlanResult, describe_spec
from generator.spec import Spec, engine_tp_choices, model_config

# GPU name -> total memory in GiB as nvidia-smi reports it (MiB / 1024). --gpu-memory also takes
# a number of GiB.
GPU_MEMORY_GIB = {
    "a10-24": 22.5,  # 23028 MiB
    "l4-24": 22.5,  # 23034 MiB
    "rtx4090-24": 24.0,  # 24564 MiB
    "a100-40": 40.0,  # 40960 MiB
    "a100-80": 80.0,  # 81920 MiB
    "h100-80": 79.6,  # 81559 MiB (SXM and PCIe)
    "h200-141": 140.4,  # 143771 MiB
}
# Share of the GPU's memory the verdict keeps free for what the simulation does not see: CUDA
# context, NCCL buffers, allocator fragmentation (typically 5-10% of an 80 GB card in FSDP runs).
HEADROOM = 0.10


def parse_gpu_memory(value: str) -> tuple[str, float]:
    """`--gpu-memory` as (label, GiB): a name of GPU_MEMORY_GIB or a positive number of GiB.

    Raises:
        PlanError: unknown name (the message lists the names) or a number <= 0.
    """
    key = value.strip().lower()
    if key in GPU_MEMORY_GIB:
        return key, GPU_MEMORY_GIB[key]
    try:
        gib = float(key)
    except ValueError:
        names = ", ".join(f"{n} ({g:g} GiB)" for n, g in GPU_MEMORY_GIB.items())
        raise PlanError(
            f"--gpu-memory {value!r}: not a GPU name or a number of GiB; valid names: {names}"
        ) from None
    if not gib > 0 or gib != gib or gib == float("inf"):
        raise PlanError(f"--gpu-memory {value!r}: must be a number of GiB > 0, e.g. 80")
    return f"{gib:g} GiB", gib


def plan_command(spec: Spec, gpu_memory: str) -> str:
    """The `scaffold plan` command line for `spec` (non-default options only)."""
    default = Spec()
    parts = ["scaffold", "plan", "--algo", spec.algo, "--model", spec.model]
    if spec.peft != default.peft:
        parts += ["--peft", spec.peft]
    if spec.tricks:
        parts += ["--tricks", ",".join(spec.tricks)]
    names = [n for n in spec.layout_options() if n != "ep"]  # `scaffold plan` refuses MoE models
    for name in (*names, *["dtype"] * (spec.dtype != default.dtype)):
        parts += [f"--{name.replace('_', '-')}", str(getattr(spec, name))]
    return shlex.join([*parts, "--gpu-memory", gpu_memory])


def engine_estimate(result: PlanResult, gpu_gib: float) -> dict | None:
    """The GRPO rollout engines' memory per GPU: computed from the model's size and the
    script's Config defaults, not simulated (vLLM's own profiling decides the real split).

    Engines on GPUs of their own (engine_gpus > 0): each engine GPU holds the weights / engine_tp
    (in the script's dtype, which the engines sample in); vLLM takes
    engine_gpu_memory_utilization of the GPU for weights + KV cache, so the weights must fit under
    that share and the KV cache gets the rest, at least one rollout's worth (prompt + completion
    tokens: vLLM refuses to start with less). The trainer's GPUs carry nothing of theirs.
    Engines on the trainer's GPUs (engine_gpus 0): the GPU that hosts one carries it on top of
    the trainer's peak: vLLM its share (utilization x the GPU's memory, whatever the weights), the
    runtime's sampler (1-process scripts) its weights plus the KV cache of its batch
    (ceil(prompts_per_step / num_engines) x num_generations rows of prompt + completion tokens);
    the runtime sampler's logits and its fp32 load before the cast are not counted.

    Returns:
        None for a result without engines; else (bytes) {"shared": bool, "weights_per_gpu",
        "share": what vLLM takes of one engine GPU (0 for the runtime sampler), "kv_room": the
        share left after the weights, "kv_per_token": KV cache bytes per token per engine GPU,
        "kv_needed": one rollout's KV cache (vLLM) or the batch's (runtime), "fits": the weights
        and kv_needed fit in the share (vLLM), "on_trainer_gpu": bytes added to the trainer
        GPU that hosts an engine (0 when the engines have GPUs of their own)}.
    """
    if result.rollout is None:
        return None
    return engine_estimate_of(result.rollout, gpu_gib)


def engine_estimate_of(r: dict, gpu_gib: float) -> dict:
    """`engine_estimate` of a rollout dict (`PlanResult.rollout`'s keys: the step's lengths and
    `engine_layout`'s numbers), for the arithmetic estimate, which has no PlanResult."""
    shared = r["engine_gpus"] == 0
    row = r["prompt_len"] + r["completion_len"]
    tp = r["engine_tp"]
    weights = r["weight_bytes"] / tp
    kv_per_token = _kv_per_token(r, tp)
    if r["engine"] == "vllm":
        share = r["engine_gpu_memory_utilization"] * gpu_gib * GIB
        kv_needed = row * kv_per_token
        on_trainer = share if shared else 0
    else:  # the runtime's KV-cache sampler: its weights and its batch's cache, nothing reserved
        share = 0
        rows = -(-r["prompts_per_step"] // r["num_engines"]) * r["num_generations"]
        kv_needed = rows * row * kv_per_token
        on_trainer = weights + kv_needed if shared else 0
    kv_room = share - weights
    return {
        "shared": shared, "weights_per_gpu": weights, "share": share, "kv_room": kv_room,
        "kv_per_token": kv_per_token, "kv_needed": kv_needed,
        "fits": r["engine"] != "vllm" or kv_room >= kv_needed, "on_trainer_gpu": on_trainer,
    }  # fmt: skip


def _kv_per_token(rollout: dict, engine_tp: int) -> float:
    """KV cache bytes per token on one engine GPU: vLLM splits the KV heads over its
    tensor-parallel GPUs (and replicates them when engine_tp exceeds them)."""
    heads = rollout["kv_heads"]
    return rollout["kv_bytes_per_token"] * max(heads // engine_tp, 1) / heads


def fits(result: PlanResult, gpu_gib: float) -> bool:
    """Peak within the GPU's memory less HEADROOM; for GRPO engines on the trainer's GPUs, the
    peak plus the engine's memory (`engine_estimate`) on the GPU that hosts it."""
    engines = engine_estimate(result, gpu_gib)
    extra = engines["on_trainer_gpu"] if engines else 0
    return result.peak + extra <= (1 - HEADROOM) * gpu_gib * GIB


def format_result(result: PlanResult, gpu_label: str, gpu_gib: float) -> str:
    """The per-rank table and the verdict, as `scaffold plan` prints them (GRPO: also the
    rollout engines' computed estimate)."""
    r = result
    if r.rollout:
        ro = r.rollout
        adapters = ro.get("adapters")
        if adapters:  # grpo-lora: the KL reference is the policy with its adapters off
            reference = (
                f"the KL reference is the frozen base, the policy with its adapters off (kl_coef "
                f"{ro['kl_coef']:g}: one more no-grad forward per micro-batch, no second model)"
                if ro["kl_coef"] > 0
                else "no KL reference (kl_coef 0, the script's default; --kl-coef > 0 adds a "
                "no-grad forward with the adapters off, no second model)"
            )
            kind = "DoRA" if adapters["peft"] == "dora" else "LoRA"
            reference = (
                f"{kind} adapters of rank {adapters['lora_rank']} on "
                f"{','.join(adapters['lora_target_modules'])} (the script's Config), the base "
                f"frozen (no gradients, no optimizer state); {reference}"
            )
        else:
            reference = (
                f"the frozen reference model (kl_coef {ro['kl_coef']:g})"
                if ro["kl_coef"] > 0
                else "no reference model (kl_coef 0, the script's default; --kl-coef > 0 adds it)"
            )
        step = (
            f"{ro['rollouts_per_step']} rollouts per step ({ro['prompts_per_step']} prompts x "
            f"{ro['num_generations']}), {ro['rollouts_on_rank']} on this rank in "
            f"{ro['micro_batches']} micro-batch(es) of {r.micro_batch_size} x {r.max_seq_len} "
            f"tokens ({ro['prompt_len']} prompt + {ro['completion_len']} completion, the loss on "
            f"the completion tokens; {ro['simulated_micro_batches']} simulated per step, later "
            f"ones hold the same memory); {reference}"
        )
        head = f"memory per trainer rank: {describe_spec(r.spec)}; {step}"
    else:
        head = (
            f"memory per rank: {describe_spec(r.spec)}; micro-batch {r.micro_batch_size} x "
            f"{r.max_seq_len} tokens (every position supervised)"
        )
    if r.script is not None:  # `scaffold plan DIR`: the user's script, not a fresh render
        edits = ", ".join(f"{k}={v!r}" for k, v in (r.config_edits or {}).items())
        head += (
            f"; simulated {r.script} as it is (its Config defaults that differ from a fresh "
            f"render: {edits or 'none'})"
        )
    if r.simulated_depths:  # `extrapolate_depth`: exact for identical blocks
        a, b = r.simulated_depths
        head += f"; the decoder blocks extrapolated from simulations of {a} and {b} blocks"
    lines = [
        f"{head}; 2 simulated steps ({r.seconds:.1f} s, fake tensors on CPU); what is live at the "
        "peak moment (parameters include gathered bf16 copies in flight; gradients and "
        "activations are those alive then, not their maxima)",
    ]
    for row, nbytes in r.categories.items():
        lines.append(f"  {row:16} {nbytes / GIB:9.2f} GiB")
    lines.append(
        f"  {'of which logits':16} {r.logits / GIB:9.2f} GiB  (largest lm_head output; "
        "0 = the [T, V] logits never exist)"
    )
    lines.append(f"  {'peak':16} {r.peak / GIB:9.2f} GiB  (sum of the rows at the peak)")
    engines = engine_estimate(r, gpu_gib)
    where = ""
    if engines and engines["shared"]:
        total = r.peak + engines["on_trainer_gpu"]
        lines.append(
            f"  {'+ rollout engine':16} {engines['on_trainer_gpu'] / GIB:9.2f} GiB  (computed "
            "estimate, not simulated: the engine on the trainer's GPU, see below)"
        )
        lines.append(f"  {'peak + engine':16} {total / GIB:9.2f} GiB  (the GPU that hosts it)")
        where = " for the trainer GPU that hosts the engine"
    budget = (1 - HEADROOM) * gpu_gib
    verdict = "fits" if fits(r, gpu_gib) else "does NOT fit"
    lines.append(
        f"verdict{where}: {verdict} on {gpu_label} ({gpu_gib:g} GiB; {budget:.1f} GiB usable "
        f"after {HEADROOM:.0%} headroom for CUDA context, NCCL buffers and fragmentation)"
    )
    if engines:
        lines.append(_format_engines(r, engines, gpu_label, gpu_gib))
    return "\n".join(lines)


def _format_engines(r: PlanResult, e: dict, gpu_label: str, gpu_gib: float) -> str:
    """The rollout engines' line of `format_result` (a computed estimate, labelled so)."""
    ro = r.rollout
    row = ro["prompt_len"] + ro["completion_len"]
    weights = f"{ro['dtype']} weights {ro['weight_bytes'] / GIB:.2f} GiB"
    head = "rollout engines (computed estimate, not simulated): "
    if ro["engine"] != "vllm":
        return (
            f"{head}the runtime's KV-cache sampler shares the trainer's GPU (one process: no GPU "
            f"is left for it): {weights} + the KV cache of its batch ({e['kv_needed'] / GIB:.2f} "
            f"GiB for {e['kv_needed'] / e['kv_per_token'] / row:.0f} rollouts x {row} tokens) = "
            f"{e['on_trainer_gpu'] / GIB:.2f} GiB, included in the verdict above"
        )
    util = ro["engine_gpu_memory_utilization"]
    share = (
        f"vLLM takes engine_gpu_memory_utilization = {util:g} (the script's Config) of "
        f"each engine GPU, {e['share'] / GIB:.1f} GiB of {gpu_label}, for weights + KV cache"
    )
    if e["fits"]:
        tokens = e["kv_room"] / e["kv_per_token"]
        kv = (
            f"fits: {e['kv_room'] / GIB:.1f} GiB left for the KV cache, about {tokens:,.0f} "
            f"tokens ({tokens / row:,.0f} rollouts of {row} tokens at once; vLLM's activations "
            "and CUDA graphs come out of it too)"
        )
    else:
        kv = (
            f"does NOT fit: the weights leave {max(e['kv_room'], 0) / GIB:.1f} GiB, less than "
            f"the KV cache of one rollout of {row} tokens ({e['kv_needed'] / GIB:.3f} GiB)"
        )
        if e["shared"]:
            kv += "; give the engines GPUs of their own (--engine-gpus)"
        else:
            config = model_config(r.spec)
            good = [
                t
                for t in engine_tp_choices(config, r.spec.engine_gpus)
                if e["share"] - ro["weight_bytes"] / t >= row * _kv_per_token(ro, t)
            ]
            kv += (
                f"; use --engine-tp {' or '.join(map(str, good))}"
                if good
                else "; give the engines more GPUs (--engine-gpus)"
            )
        kv += ", or raise engine_gpu_memory_utilization in the script's Config"
    if e["shared"]:
        layout = (
            f"{ro['num_engines']} vLLM engine(s) share the trainer's GPUs (--engine-gpus 0); "
            f"{share}; the trainer GPU that hosts one carries the {e['share'] / GIB:.1f} GiB "
            "(in the verdict above)"
        )
    else:
        layout = (
            f"{ro['num_engines']} vLLM engine(s) of engine_tp {ro['engine_tp']} GPU(s) on "
            f"{r.spec.engine_gpus} GPU(s) per node: {weights} / {ro['engine_tp']} = "
            f"{e['weights_per_gpu'] / GIB:.2f} GiB per engine GPU; {share}"
        )
    return f"{head}{layout}: {kv}"
