"""The verdict on a simulated plan (does rank 0's peak fit a GPU?) and the text `scaffold plan`
prints: the per-rank table, the verdict, and the rollout engines' computed estimate.
"""

from __future__ import annotations

import shlex

from generator.plan_harness import GIB, PlanError, PlanResult, describe_spec, is_rm
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
    """The `scaffold plan` command line for `spec` (non-default options only); a spec whose
    recipe `scaffold new` chose (`fit_for`) is planned from its directory, whose script holds
    what the options cannot say (dpo's chosen reference mode), as is kd's with a --teacher
    (`scaffold plan` has no such option: its options plan the student as its own teacher)."""
    if spec.fit_for or (spec.teacher and spec.out):
        return shlex.join(["scaffold", "plan", spec.out, "--gpu-memory", gpu_memory])
    default = Spec()
    parts = ["scaffold", "plan", "--algo", spec.algo, "--model", spec.model]
    if spec.peft != default.peft:
        parts += ["--peft", spec.peft]
    if spec.tricks:
        parts += ["--tricks", ",".join(spec.tricks)]
    for name in (*spec.layout_options(), *["dtype"] * (spec.dtype != default.dtype)):
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


# What a sleeping colocated engine keeps on its GPU (`grpo_phases`): its process's CUDA context
# and small buffers; vLLM also its CUDA-graph pools (its sleep frees only the weights and the KV
# cache; the script does not set enforce_eager, so the graphs are captured)
ENGINE_CONTEXT = int(0.5 * GIB)
VLLM_GRAPH_POOLS = 1 * GIB


def trainer_resident(r: dict) -> dict:
    """What a trainer rank keeps on its GPU between steps (bytes; the colocated generation and
    sync phases): its parameter shards (fp32 master weights of what is trained, a LoRA base in
    the dtype), the frozen reference's shards (grpo with kl_coef > 0; grpo-lora's reference is
    the policy with its adapters off), the optimizer state (AdamW 8 B per trained parameter,
    8-bit 2, 4-bit 1; 0 with offload_optimizer, which moves it to host memory). Gradients are
    freed after the step and the activations released (the weight sync empties the cache).
    Under cpu-offload (r["cpu_offload"]) all three live in host memory: nothing stays."""
    world, trained, full = r["trainer_ranks"], r["trained_params"], r["num_params"]
    frozen = full if trained != full else 0  # LoRA: the whole base, frozen, beside the adapters
    if r.get("cpu_offload"):
        return {"trainer weights": 0, "reference": 0, "optimizer state": 0}
    return {
        "trainer weights": (r["weight_bytes_trained"] * trained + r["dtype_bytes"] * frozen)
        / world,
        "reference": r["dtype_bytes"] * full / world if r["reference"] else 0,
        "optimizer state": 0 if r["offload_optimizer"] else r["optimizer_bytes"] * trained / world,
    }


def grpo_phases(r: dict, trainer_peak: int, gpu_gib: float) -> dict:
    """The memory of each phase of a GRPO layout, per GPU (bytes): the verdict is the largest
    phase on the trainer's GPU, not a sum (the phases take turns).

    colocated (every GPU holds one trainer rank and 1/engine_tp of an engine, taking turns):
    - "trainer step": the simulated trainer peak + what a sleeping engine keeps (ENGINE_CONTEXT;
      vLLM: VLLM_GRAPH_POOLS); sleep level 1 moves its weights to host, 2 discards them.
    - "generation": the awake engine (vLLM: engine_gpu_memory_utilization x the GPU for weights
      + KV cache; the runtime's sampler: weights / engine_tp in the dtype, the KV cache of its
      batch, its fp32 [B, V] logits) + its context + `trainer_resident`.
    - "weight sync": `trainer_resident` + the engine's weights (its KV cache still asleep) + its
      context + one gathered full tensor per rank (the largest parameter, in the trained weights'
      dtype: fp32, bf16 under bf16-sr).
    Host memory (not in the verdict): level 1 the engines' weights, offload_optimizer the
    optimizer state, per node. vLLM start-up: utilization x the GPU must be free when it starts
    (the trainer's weights and CUDA context already resident, its optimizer state not yet).
    split: today's numbers as two places: the trainer's GPUs carry the trainer peak (plus the
    awake engine where one shares them, engine_gpus 0), the engine GPUs the engine.

    Returns:
        {"layout", "phases": {name: {part: bytes}} of the trainer's GPU, "verdict": the
        largest phase's bytes, "engine_ok": colocated vLLM starts and its share holds its
        weights and one rollout's KV cache (split: True, its engine line says), "engine_gpu":
        {part: bytes} or None, "host": {name: bytes}, "startup": {"needed", "free", "ok"} or
        None}.
    """
    e = engine_estimate_of(r, gpu_gib)
    vllm = r["engine"] == "vllm"
    if r.get("layout") != "colocated":
        if e["shared"]:
            step = {"trainer peak": trainer_peak, "awake engine": e["on_trainer_gpu"]}
            phases, engine_gpu = {"trainer step + engine": step}, None
        else:
            phases = {"trainer step": {"trainer peak": trainer_peak}}
            engine_gpu = (
                {"vLLM share": e["share"]} if vllm
                else {"engine weights": e["weights_per_gpu"], "KV cache": e["kv_needed"]}
            )  # fmt: skip
        verdict = max(sum(p.values()) for p in phases.values())
        return {"layout": "split", "phases": phases, "verdict": verdict, "engine_ok": True,
                "engine_gpu": engine_gpu, "host": {}, "startup": None}  # fmt: skip
    asleep = ENGINE_CONTEXT + (VLLM_GRAPH_POOLS if vllm else 0)
    resident = {k: v for k, v in trainer_resident(r).items() if v}
    if vllm:
        awake = {"vLLM share": e["share"]}
    else:
        rows = -(-r["prompts_per_step"] // r["num_engines"]) * r["num_generations"]
        awake = {
            "engine weights": e["weights_per_gpu"], "KV cache": e["kv_needed"],
            "decode logits": rows * r["vocab_size"] * 4,
        }  # fmt: skip
    phases = {
        "trainer step": {"trainer peak": trainer_peak, "sleeping engine": asleep},
        # vLLM's CUDA graphs come out of its share while it is awake
        "generation": {**awake, "engine context": ENGINE_CONTEXT, **resident},
        "weight sync": {
            "engine weights": e["weights_per_gpu"],
            "sleeping engine": asleep,
            **resident,
            "gathered tensor": r["weight_bytes_trained"] * r["largest_param"],
        },
    }
    ranks_per_node = r["trainer_ranks"]  # colocated is one node: a trainer rank per GPU
    host = {}
    if r["engine_sleep_level"] == 1:
        host["engine weights (sleep level 1)"] = r["num_engines"] * r["weight_bytes"]
    if r["offload_optimizer"]:
        host["optimizer state (offload_optimizer)"] = (
            r["optimizer_bytes"] * r["trained_params"] / r["trainer_ranks"] * ranks_per_node
        )
    startup = None
    if vllm:
        free = gpu_gib * GIB - ENGINE_CONTEXT - trainer_resident(r)["trainer weights"]
        startup = {"needed": e["share"], "free": free, "ok": e["share"] <= free}
    verdict = max(sum(p.values()) for p in phases.values())
    # colocated vLLM must start (its share free) and hold its weights + one rollout's KV cache
    # in its share (`engine_estimate_of`'s "fits"), or it refuses to run on the trainer's GPU
    engine_ok = e["fits"] and (startup is None or startup["ok"])
    return {"layout": "colocated", "phases": phases, "verdict": verdict, "engine_ok": engine_ok,
            "engine_gpu": None, "host": host, "startup": startup}  # fmt: skip


def _kv_per_token(rollout: dict, engine_tp: int) -> float:
    """KV cache bytes per token on one engine GPU: vLLM splits the KV heads over its
    tensor-parallel GPUs (and replicates them when engine_tp exceeds them)."""
    heads = rollout["kv_heads"]
    return rollout["kv_bytes_per_token"] * max(heads // engine_tp, 1) / heads


def fits(result: PlanResult, gpu_gib: float) -> bool:
    """Peak within the GPU's memory less HEADROOM; GRPO: the largest phase of its layout on the
    trainer's GPU (`grpo_phases`: split with engines on the trainer's GPUs, the peak plus the
    engine; colocated, the max of trainer step, generation and weight sync), and vLLM able to
    start there (colocated)."""
    budget = (1 - HEADROOM) * gpu_gib * GIB
    if result.rollout is None:
        return result.peak <= budget
    p = grpo_phases(result.rollout, result.peak, gpu_gib)
    return p["verdict"] <= budget and p["engine_ok"]


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
                else "no reference model (kl_coef 0; --kl-coef > 0 adds it)"
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
    elif r.dpo:
        head = (
            f"memory per rank: {describe_spec(r.spec)}; micro-batch {r.dpo['pairs']} pair(s) = "
            f"{r.dpo['sequences']} sequences (chosen + rejected) x {r.max_seq_len} tokens (every "
            f"position supervised); {_dpo_reference(r)}"
        )
    elif is_rm(r.spec):
        head = (
            f"memory per rank: {describe_spec(r.spec)}; micro-batch {r.micro_batch_size} pair(s) "
            f"= {2 * r.micro_batch_size} sequences (chosen + rejected) x {r.max_seq_len} tokens, "
            "one score each (no lm_head)"
        )
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
    moe = model_config(r.spec)
    if moe.get("num_experts"):  # the figure rests on the routing assumption: say which
        E, k = moe["num_experts"], moe["num_experts_per_tok"]
        head += (
            f"; mixture of experts routed as balanced (the plan's assumption: each of the {E} "
            f"experts gets tokens x {k} / {E} of a rank's (token, expert) assignments, the "
            "expectation under a load-balanced router; a real router's imbalance adds to the "
            "expert batches and, under --ep, to the tokens a rank receives)"
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
    if engines:
        phases = grpo_phases(r.rollout, r.peak, gpu_gib)
        lines += _format_phases(phases, r.rollout)
        if phases["layout"] == "colocated":
            where = " (the largest phase)"
        elif engines["shared"]:
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


def _dpo_reference(r: PlanResult) -> str:
    """The DPO plan's reference clause: what the Config's ref_mode holds, and for precomputed
    which stage the peak below is (the larger one)."""
    mode = r.dpo["ref_mode"]
    change = "(the script's Config ref_mode; `scaffold plan DIR` plans an edited one)"
    if mode == "none":
        return (
            "reference: none (the Config's loss_type is simpo or orpo, which score the policy "
            "alone; `scaffold plan DIR` plans an edited one)"
        )
    if mode == "separate":
        return (
            f"reference: separate {change}, a frozen copy sharded like the policy in the compute "
            "dtype, one no-grad forward per micro-batch"
        )
    if mode == "adapters-off":
        return (
            f"reference: adapters-off {change}, the policy with its adapters off, one more "
            "no-grad forward per micro-batch, no second model"
        )
    stages = r.stages
    ref, step = stages["reference pass"]["peak"], stages["training step"]["peak"]
    larger = "the reference pass" if ref > step else "the training step"
    return (
        f"reference: precomputed {change}, one no-grad pass of the untrained policy over every "
        f"pair before training (its peak {ref / GIB:.2f} GiB; the training step's "
        f"{step / GIB:.2f} GiB), then only the policy is resident; the rows below are {larger}'s"
    )


def _format_phases(p: dict, ro: dict) -> list[str]:
    """The phase rows of `format_result` (`grpo_phases`): each phase's total and its parts."""

    def row(name: str, parts: dict) -> str:
        what = " + ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items())
        return f"  {name:16} {sum(parts.values()) / GIB:9.2f} GiB  ({what})"

    if p["layout"] == "split":
        where = "on GPUs of their own" if p["engine_gpu"] else "on the trainer's GPUs"
        lines = [
            f"phases per GPU (split: the engines awake {where}, beside the trainer; the trainer "
            "peak simulated, the engine computed):"
        ]
        for name, parts in p["phases"].items():
            lines.append(row(name, parts) + "  on a trainer GPU")
        if p["engine_gpu"]:
            lines.append(row("generation", p["engine_gpu"]) + "  on an engine GPU")
        return lines
    level = ro["engine_sleep_level"]
    offload = "on" if ro["offload_optimizer"] else "off"
    lines = [
        f"phases per GPU (colocated: one trainer rank and 1/{ro['engine_tp']} of an engine take "
        f"turns; engine_sleep_level {level}, offload_optimizer {offload}; the trainer peak "
        "simulated, the rest computed; the verdict is the largest):"
    ]
    for name, parts in p["phases"].items():
        lines.append(row(name, parts))
    lines.append(f"  {'max':16} {p['verdict'] / GIB:9.2f} GiB")
    if p["host"]:
        host = "; ".join(f"{k} {v / GIB:.2f} GiB" for k, v in p["host"].items())
        lines.append(f"host memory per node (not in the verdict): {host}")
    if p["startup"]:
        st = p["startup"]
        lines.append(
            f"vLLM start-up: needs {st['needed'] / GIB:.2f} GiB free "
            f"(engine_gpu_memory_utilization x the GPU), {st['free'] / GIB:.2f} GiB is (the "
            f"trainer's weights and CUDA context resident): {'ok' if st['ok'] else 'does NOT start'}"
        )
    return lines


def _format_engines(r: PlanResult, e: dict, gpu_label: str, gpu_gib: float) -> str:
    """The rollout engines' line of `format_result` (a computed estimate, labelled so)."""
    ro = r.rollout
    row = ro["prompt_len"] + ro["completion_len"]
    weights = f"{ro['dtype']} weights {ro['weight_bytes'] / GIB:.2f} GiB"
    head = "rollout engines (computed estimate, not simulated): "
    if ro["engine"] != "vllm" and ro.get("layout") == "colocated":
        return (
            f"{head}the runtime's KV-cache sampler, {ro['num_engines']} engine(s), one on each "
            f"trainer GPU, asleep while it steps: {weights} + the KV cache of its batch "
            f"({e['kv_needed'] / GIB:.2f} GiB for {e['kv_needed'] / e['kv_per_token'] / row:.0f} "
            f"rollouts x {row} tokens), in the generation phase above"
        )
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
        if ro.get("layout") == "colocated":
            kv += " (so the verdict above says no); use a larger --engine-tp"
        elif e["shared"]:
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
    if ro.get("layout") == "colocated":
        layout = (
            f"{ro['num_engines']} vLLM engine(s) of engine_tp {ro['engine_tp']} on the trainer's "
            f"GPUs (colocated): {weights} / {ro['engine_tp']} = {e['weights_per_gpu'] / GIB:.2f} "
            f"GiB per GPU; {share} (in the generation phase above)"
        )
    elif e["shared"]:
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
