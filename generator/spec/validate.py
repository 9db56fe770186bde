"""Validation of a Spec: every option and combination checked in Python before any template is
rendered (templates only arrange text), with errors that name the option, the value and the
valid choices; and the GPU layout rules the validators and the planner share.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

from generator.catalog import MODELS
from generator.features import (
    ALGOS,
    PEFT_ALGOS,
    PEFT_METHODS,
    TRICKS,
    refusal,
)
from generator.spec.core import CP_MODES, DTYPES, LAYOUTS, ROLLOUT_ALGOS, Spec, SpecError


def validate_spec(spec: Spec) -> None:
    """Raise SpecError naming the option, the bad value and the valid choices."""
    if spec.algo not in ALGOS:
        raise SpecError(f"unknown algorithm {spec.algo!r}; valid: {', '.join(ALGOS)}")
    if spec.peft not in PEFT_METHODS:
        raise SpecError(f"--peft {spec.peft!r}; valid: {', '.join(PEFT_METHODS)}")
    if spec.teacher and spec.algo != "kd":
        raise SpecError(f"--teacher {spec.teacher} is for --algo kd (distillation); drop it")
    if spec.teacher and spec.teacher not in MODELS:
        if not (Path(spec.teacher).expanduser() / "config.json").is_file():
            raise SpecError(
                f"--teacher {spec.teacher!r}: neither a catalog model (`scaffold list models`) nor "
                "a local Hugging Face directory with config.json"
            )
    if spec.peft != Spec.peft and spec.algo not in PEFT_ALGOS:
        raise SpecError(
            f"--peft {spec.peft} needs an adapter algorithm (--algo {' or '.join(PEFT_ALGOS)}); "
            f"--algo {spec.algo} trains all parameters"
        )
    if spec.model not in MODELS and not (Path(spec.model).expanduser() / "config.json").is_file():
        raise SpecError(
            f"unknown model {spec.model!r}; valid: {', '.join(MODELS)}, "
            "or a local Hugging Face directory containing config.json"
        )
    unknown = [t for t in spec.tricks if t not in TRICKS]
    if unknown:
        raise SpecError(f"unknown trick(s) {unknown}; valid: {', '.join(TRICKS) or 'none yet'}")
    for t in spec.tricks:
        why = refusal(t, spec.algo)
        if why:
            raise SpecError(
                f"--algo {spec.algo} does not take --tricks {t}: {why}; drop it "
                f"({_tricks_flag(x for x in spec.tricks if x != t)}); the table: `scaffold list`"
            )
    if len(set(spec.tricks)) != len(spec.tricks):
        raise SpecError(f"--tricks lists a trick twice: {list(spec.tricks)}")
    for t in spec.tricks:
        for other, why in TRICKS[t].conflicts.items():
            if other in spec.tricks:
                keep_t = ",".join(x for x in spec.tricks if x != other)
                keep_other = ",".join(x for x in spec.tricks if x != t)
                raise SpecError(
                    f"--tricks {t} and {other} cannot be combined: {why}; drop one of them: "
                    f"--tricks {keep_t} or --tricks {keep_other}"
                )
        for need in TRICKS[t].requires:
            if need not in spec.tricks:
                raise SpecError(
                    f"--tricks {t} needs {need}; add it: --tricks {','.join([*spec.tricks, need])}"
                )
    if spec.dtype not in DTYPES:
        raise SpecError(f"--dtype {spec.dtype!r}; valid: {', '.join(DTYPES)}")
    if "bf16-sr" in spec.tricks and spec.dtype != "bf16":
        raise SpecError(
            f"--tricks bf16-sr stores the weights in bf16 and --dtype is {spec.dtype}: use "
            "--dtype bf16, or drop bf16-sr for fp32 weights"
        )
    if spec.gpus < 1 or spec.nodes < 1:
        raise SpecError(f"--gpus {spec.gpus} and --nodes {spec.nodes} must both be >= 1")
    if spec.ep != 1:
        _validate_ep(spec)
    if not spec.dataset.strip():
        raise SpecError(
            "--dataset is empty; give a .json/.jsonl/.parquet path or a Hugging Face dataset name"
        )
    _validate_parallel(spec)
    _validate_engines(spec)


# Which algorithm takes which plan is generator.features.SUPPORT's; what is checked here is the
# plan's own arithmetic (degrees dividing the world, the model's heads and vocab).
_TP_REFUSED_TRICKS = {
    "compile": "per-block torch.compile of DTensor (tensor-parallel) blocks is not tested here",
    "bf16-sr": "bf16 weights with the stochastic-rounding AdamW are tested under FSDP only",
    "cpu-offload": "FSDP2 CPU offload of tensor-parallel shards is not tested here",
}


@functools.cache
def model_args_class():
    """`runtime.models.args.ModelArgs` (HF config -> dims, parameter counts) without importing the
    runtime package: its __init__ imports torch and every module, about 8 s on 2 cores, which
    `scaffold new`'s arithmetic never needs. args.py itself imports no torch and nothing of the
    runtime, so it loads alone (as a module of its own name)."""
    package = importlib.util.find_spec("runtime")  # finds the package; runs no __init__
    path = Path(package.submodule_search_locations[0]) / "models" / "args.py"
    module_spec = importlib.util.spec_from_file_location("scaffold_model_args", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses look their module up while decorating
    module_spec.loader.exec_module(module)
    return module.ModelArgs


def model_config(spec: Spec) -> dict:
    """The HF config.json fields of --model (catalog entry or local directory)."""
    entry = MODELS.get(spec.model)
    if entry:
        return entry.config
    from runtime.checkpoint import read_hf_config

    try:
        return read_hf_config(Path(spec.model).expanduser())
    except (ValueError, OSError) as e:
        raise SpecError(f"--model {spec.model}: {e}") from e


def _tricks_flag(tricks) -> str:
    """`--tricks a,b`, or `no --tricks` when none are left."""
    kept = ",".join(tricks)
    return f"--tricks {kept}" if kept else "no --tricks"


def _validate_parallel(spec: Spec) -> None:
    """The parallel plan: degrees multiply to the world size, TP fits the model and one node."""
    degrees = {"tp": spec.tp, "cp": spec.cp, "dp_replicate": spec.dp_replicate}
    for name, value in degrees.items():
        if value < 1:
            raise SpecError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    world, ranks = _trainer_world(spec)
    others = spec.tp * spec.cp * spec.dp_replicate
    if world % others:
        valid = [d for d in range(1, world + 1) if world % d == 0]
        raise SpecError(
            f"{ranks} = {world} {'trainer ' * (spec.algo in ROLLOUT_ALGOS)}"
            f"process{'es' * (world != 1)} "
            f"is not divisible by dp_replicate*cp*tp = {spec.dp_replicate}*{spec.cp}*{spec.tp} = {others} "
            f"(dp_shard = world / that must be a whole number >= 1); choose degrees whose product "
            f"divides {world}: one of {valid}"
        )
    per_node = world // spec.nodes  # GRPO's trainer: the GPUs its engines do not take
    if spec.tp > 1 and spec.tp > per_node:  # (none left: the engine layout's check says so)
        gpus = f"--gpus {spec.gpus}" if per_node == spec.gpus else f"{per_node} trainer GPUs"
        raise SpecError(
            f"--tp {spec.tp} > {gpus} (per node): tensor parallel all-gathers and "
            "reduce-scatters activations in every block, which needs the intra-node links "
            f"(NVLink); keep tp <= {per_node} and scale across nodes with data parallel"
        )
    for option, value, fallback in (
        ("--tp", spec.tp, "--tp 1 (FSDP over all GPUs"),
        ("--cp", spec.cp, "--cp 1 (FSDP over all GPUs"),
        ("--dp-replicate", spec.dp_replicate, "--dp-replicate 1 (FSDP over all GPUs"),
    ):
        why = refusal(option, spec.algo) if value > 1 else None
        if why:
            hsdp = "" if refusal("--dp-replicate", spec.algo) else ", or HSDP with --dp-replicate"
            raise SpecError(
                f"--algo {spec.algo} with {option} {value}: {why}; use {fallback}"
                f"{hsdp if option != '--dp-replicate' else ''})"
            )
    if spec.cp_mode not in CP_MODES:
        raise SpecError(f"--cp-mode {spec.cp_mode!r}: choose one of {', '.join(CP_MODES)}")
    if spec.cp_mode != "allgather" and spec.cp == 1:
        raise SpecError(
            f"--cp-mode {spec.cp_mode} with --cp 1: one rank holds the whole sequence, there is "
            "no ring; set --cp > 1 or leave --cp-mode out"
        )
    if spec.cp > 1:
        _validate_cp(spec, world)
    if spec.tp > 1:
        if spec.peft == "dora":
            raise SpecError(
                f"--peft dora with --tp {spec.tp}: DoRA's magnitude divides each output row by the "
                "norm of W + s B A over its inputs, which the rowwise plan of o_proj and down_proj "
                "splits over the tp ranks (not built); use --peft lora or --tp 1"
            )
        table = dict(_TP_REFUSED_TRICKS)
        if spec.algo == "kd":
            table["lce"] = (
                "not built yet for kd: the chunked KL (runtime.chunked_kd_loss) has no "
                "vocab-parallel path for the student's vocab-sharded lm_head"
            )
        refused = [t for t in spec.tricks if t in table]
        if refused:
            raise SpecError(
                f"--tricks {refused[0]} with --tp {spec.tp}: {table[refused[0]]}; "
                f"drop it ({_tricks_flag(t for t in spec.tricks if t not in refused)}) "
                "or use --tp 1"
            )
        from runtime.parallel import check_tp_degree  # imports torch: only when TP is asked for

        config = model_config(spec)
        try:
            check_tp_degree(
                spec.tp,
                config["num_attention_heads"],
                config.get("num_key_value_heads", config["num_attention_heads"]),
                config["vocab_size"],
                config.get("model_type", "llama"),
            )
        except ValueError as e:
            raise SpecError(f"--model {spec.model} --tp {spec.tp}: {e}") from e


# bf16 weights per engine GPU at most when --engine-tp is chosen automatically: room for vLLM's KV
# cache on an 80 GB card (and most of a 141 GB one)
ENGINE_WEIGHT_GIB_PER_GPU = 40.0


def trainer_gpus(spec: Spec) -> int:
    """Trainer processes per node: the GPUs the rollout engines do not take."""
    return spec.gpus - spec.engine_gpus


def _trainer_world(spec: Spec) -> tuple[int, str]:
    """(the ranks the trainer's mesh spans, how the flags make them: "--gpus G x --nodes N", or
    "(--gpus G - --engine-gpus E) x --nodes N" where GRPO's engines take GPUs of their own)."""
    per_node = trainer_gpus(spec) if spec.algo in ROLLOUT_ALGOS else spec.gpus
    gpus = f"--gpus {spec.gpus}"
    if per_node != spec.gpus:
        gpus = f"(--gpus {spec.gpus} - --engine-gpus {spec.engine_gpus})"
    return per_node * spec.nodes, f"{gpus} x --nodes {spec.nodes}"


def engine_tp_choices(config: dict, engine_gpus: int) -> list[int]:
    """vLLM tensor_parallel_size values for an engine on `engine_gpus` GPUs: each divides the
    engine GPUs and the attention heads, and divides or is a multiple of the KV heads (vLLM
    replicates KV heads when tp exceeds them)."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    return [
        t
        for t in range(1, max(engine_gpus, 1) + 1)
        if max(engine_gpus, 1) % t == 0 and heads % t == 0 and (kv % t == 0 or t % kv == 0)
    ]


def resolve_engine_layout(
    spec: Spec, engine_gpus: int | None, engine_tp: int | None
) -> tuple[int, int]:
    """(engine_gpus, engine_tp) of a GRPO spec, choosing what was not given (None).

    engine_gpus: half of each node's GPUs (none at 1 GPU: the engines share it; none with the
    colocated layout, whose engines run on all of the trainer's GPUs). engine_tp: the
    smallest valid tensor_parallel_size that puts at most ENGINE_WEIGHT_GIB_PER_GPU of bf16
    weights on each engine GPU (the largest valid one if none does). Other algorithms: (0, 1).
    """
    if spec.algo not in ROLLOUT_ALGOS:
        return (engine_gpus or 0, engine_tp or 1)
    colocated = spec.layout == "colocated"  # the engines take no GPU: they share every one
    if engine_gpus is None:
        engine_gpus = 0 if colocated else spec.gpus // 2
    engine_span = spec.gpus if colocated else engine_gpus  # the GPUs the engines run on
    if engine_tp is None:
        engine_tp = 1
        if engine_span > 1 and (spec.model in MODELS or Path(spec.model).expanduser().is_dir()):
            ModelArgs = model_args_class()
            config = model_config(spec)
            weight_gib = 2 * ModelArgs.from_hf_config(config).num_params() / 2**30
            choices = engine_tp_choices(config, engine_span)
            fitting = [t for t in choices if weight_gib / t <= ENGINE_WEIGHT_GIB_PER_GPU]
            engine_tp = fitting[0] if fitting else choices[-1]
    return engine_gpus, engine_tp


def engine_weight_note(spec: Spec) -> str:
    """A warning when each engine GPU would hold more than ENGINE_WEIGHT_GIB_PER_GPU of bf16
    weights (an explicit --engine-gpus / --engine-tp, or no valid tensor_parallel_size that
    small), else ""."""
    if spec.algo not in ROLLOUT_ALGOS:
        return ""
    ModelArgs = model_args_class()
    weight_gib = 2 * ModelArgs.from_hf_config(model_config(spec)).num_params() / 2**30
    per_gpu = weight_gib / spec.engine_tp
    if per_gpu <= ENGINE_WEIGHT_GIB_PER_GPU:
        return ""
    where = (
        f"each of the {spec.engine_gpus} engine GPU(s) per node"
        if spec.engine_gpus
        else "each trainer GPU the colocated engines share"
        if spec.layout == "colocated"
        else "the GPU the engines share with the trainer"
    )
    return (
        f"note: {where} holds {per_gpu:.1f} GiB of bf16 weights (engine_tp {spec.engine_tp}), "
        f"more than {ENGINE_WEIGHT_GIB_PER_GPU:g} GiB, leaving little room for vLLM's KV cache on "
        "an 80 GB card; "
        + (
            "a larger --engine-tp (on --engine-gpus divisible by it) spreads them"
            if spec.engine_gpus
            else "a larger --engine-tp (dividing --gpus) spreads them"
            if spec.layout == "colocated"
            else "give the engines GPUs of their own (--engine-gpus) with --engine-tp"
        )
    )


def _validate_layout(spec: Spec) -> None:
    """--layout colocated: GRPO on one node, the engines on all of the trainer's GPUs
    (--engine-gpus 0), engine_tp dividing them."""
    if spec.layout not in LAYOUTS:
        raise SpecError(f"--layout {spec.layout}: choose one of {', '.join(LAYOUTS)}")
    if spec.layout == "split":
        return
    if spec.algo == "ppo":
        raise SpecError(
            "--layout colocated with --algo ppo: not built yet (the sleep / wake cycle with the "
            "value head and its no-grad pass is untested); use --layout split"
        )
    if spec.engine_gpus != 0:
        raise SpecError(
            f"--layout colocated with --engine-gpus {spec.engine_gpus}: colocated engines run on "
            "the trainer's own GPUs and take none of their own; drop --engine-gpus (or use "
            "--layout split)"
        )
    if spec.nodes > 1:
        raise SpecError(
            f"--layout colocated with --nodes {spec.nodes}: not done yet (the multi-node launch "
            "starts its Ray cluster over the engine GPUs of each node, which colocated has none "
            "of); use --layout split, or one node"
        )
    config = model_config(spec)
    choices = engine_tp_choices(config, spec.gpus)
    if spec.engine_tp not in choices:
        raise SpecError(
            f"--engine-tp {spec.engine_tp} with --layout colocated --gpus {spec.gpus}: each "
            "engine spans engine_tp of the trainer's GPUs, so it must divide --gpus and the "
            f"model's heads; choose one of {choices}"
        )


def _validate_engines(spec: Spec) -> None:
    """--engine-gpus / --engine-tp / --layout: GRPO only; the trainer keeps at least one GPU per
    node."""
    if spec.algo not in ROLLOUT_ALGOS:
        given = [f"--engine-gpus {spec.engine_gpus}"] * (spec.engine_gpus != 0)
        given += [f"--engine-tp {spec.engine_tp}"] * (spec.engine_tp != 1)
        given += [f"--layout {spec.layout}"] * (spec.layout != "split")
        if given:
            raise SpecError(
                f"{' '.join(given)}: rollout engines exist only for --algo "
                f"{', '.join(ROLLOUT_ALGOS)}; drop {'it' if len(given) == 1 else 'them'}"
            )
        return
    if not 0 <= spec.engine_gpus < spec.gpus:
        raise SpecError(
            f"--engine-gpus {spec.engine_gpus} with --gpus {spec.gpus}: the engines take GPUs "
            f"from each node and the trainer needs at least one; choose 0..{spec.gpus - 1} "
            "(0 = the engines share the trainer's GPUs)"
        )
    if spec.engine_tp < 1:
        raise SpecError(f"--engine-tp {spec.engine_tp}: must be >= 1")
    if spec.layout != "split":
        _validate_layout(spec)
        return
    if spec.engine_gpus == 0 and spec.engine_tp != 1:
        raise SpecError(
            f"--engine-tp {spec.engine_tp} with --engine-gpus 0: engines that share the "
            "trainer's GPUs run on one GPU each; give them GPUs of their own (--engine-gpus) "
            "or use --engine-tp 1"
        )
    if spec.engine_gpus:
        config = model_config(spec)
        choices = engine_tp_choices(config, spec.engine_gpus)
        if spec.engine_tp not in choices:
            raise SpecError(
                f"--engine-tp {spec.engine_tp} with --engine-gpus {spec.engine_gpus} and "
                f"--model {spec.model} ({config['num_attention_heads']} attention heads, "
                f"{config.get('num_key_value_heads', config['num_attention_heads'])} KV heads): "
                "tensor_parallel_size must divide the engine GPUs and the heads; choose one "
                f"of {choices}"
            )


# Context parallel (runtime.context_parallel) is tested for full SFT, alone and with FSDP, HSDP,
# TP, lce and ac (and packing in the ring mode); these pairings are refused, each with the reason.
_CP_REFUSED_TRICKS = {
    "compile": "per-block torch.compile of the K/V all-gather attention is not tested here",
    "offload": "activation offloading (CUDA) with the context-parallel attention is not tested",
    "bf16-sr": "bf16 weights with the stochastic-rounding AdamW are tested under FSDP only",
    "cpu-offload": "FSDP2 CPU offload over the dp_shard x cp mesh is not tested here",
}


def _validate_cp(spec: Spec, world: int) -> None:
    """--cp: dense models; rows split into 2*cp equal chunks (times tp under TP)."""
    table = dict(_CP_REFUSED_TRICKS)
    refused = [t for t in spec.tricks if t in table]
    if refused:
        raise SpecError(
            f"--tricks {refused[0]} with --cp {spec.cp}: {table[refused[0]]}; drop "
            f"it ({_tricks_flag(t for t in spec.tricks if t not in refused)}) or use --cp 1"
        )
    if "packing" in spec.tricks and spec.cp_mode != "ring":
        raise SpecError(
            f"--tricks packing with --cp {spec.cp} --cp-mode {spec.cp_mode}: packed rows need a "
            "block-causal document mask, which the all-gather attention does not build (not "
            "built yet); add --cp-mode ring (its K/V blocks carry their document ids), or drop "
            f"packing ({_tricks_flag(t for t in spec.tricks if t != 'packing')}), or use --cp 1"
        )
    config = model_config(spec)
    if config.get("model_type", "llama") in MOE_FAMILIES:
        raise SpecError(
            f"--cp {spec.cp} with --model {spec.model} ({config['model_type']}): context parallel "
            "is tested on dense models only (the MoE router and its load-balancing loss see "
            "each rank's tokens); use --cp 1"
        )
    if ALGOS[spec.algo].skeleton == "grpo":
        return  # rows are padded to a multiple of 2*cp*tp per micro-batch: no fixed length to divide
    entry = MODELS.get(spec.model)
    max_seq_len = (
        entry.default_max_seq_len if entry else min(2048, config["max_position_embeddings"])
    )
    # 2*cp chunks per row, each split again over tp by sequence parallel
    if max_seq_len % (2 * spec.cp * spec.tp):
        valid = [
            c
            for c in range(1, world + 1)
            if world % (c * spec.tp) == 0 and max_seq_len % (2 * c * spec.tp) == 0
        ]
        chunks = f"2*cp*tp={2 * spec.cp * spec.tp}" if spec.tp > 1 else f"2*cp={2 * spec.cp}"
        raise SpecError(
            f"--cp {spec.cp}: max_seq_len={max_seq_len} (the default of --model {spec.model}) is "
            f"not divisible by {chunks}; context parallel cuts every row into 2*cp equal chunks"
            f"{' (and sequence parallel each into tp)' if spec.tp > 1 else ''}; choose --cp in "
            f"{valid}"
        )


MOE_FAMILIES = ("qwen3_moe",)  # model families with experts (`--ep` shards them)
EP_TRICKS_REFUSED = {
    "bf16-sr": "bf16 weights with the stochastic-rounding AdamW are tested on dense models only",
    "cpu-offload": "FSDP2 CPU offload beside the expert-parallel (unsharded) experts is not tested",
    "optim-in-bwd": "it steps each parameter inside backward, before the expert-parallel "
    "gradient norm over all ranks' experts exists",
}


def _validate_ep(spec: Spec) -> None:
    """--ep: MoE model, experts divisible by ep, ep dividing the ranks (EP x FSDP: experts
    sharded over groups of ep ranks and replicated over world / ep; the other parameters
    FSDP-sharded over every rank), no other parallel dim."""
    world, ranks = _trainer_world(spec)  # GRPO's experts live on the trainer's ranks
    if spec.ep < 1:
        raise SpecError(f"--ep {spec.ep} must be >= 1 (1 = no expert parallelism)")
    why = refusal("--ep", spec.algo)
    if why:
        raise SpecError(f"--algo {spec.algo} with --ep {spec.ep}: {why}; use --ep 1")
    entry = MODELS.get(spec.model)
    if entry:
        family, num_experts = entry.family, entry.config.get("num_experts", 0)
    else:
        try:
            config = json.loads((Path(spec.model).expanduser() / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise SpecError(f"--model {spec.model}: cannot read config.json ({e})") from e
        family, num_experts = config.get("model_type"), config.get("num_experts", 0)
    if family not in MOE_FAMILIES:
        moe = [name for name, e in MODELS.items() if e.family in MOE_FAMILIES]
        raise SpecError(
            f"--ep {spec.ep} shards experts, but --model {spec.model} ({family}) has none; use "
            f"--ep 1, or a mixture-of-experts model ({', '.join(MOE_FAMILIES)} family: "
            f"{', '.join(moe)} or a local directory of that family)"
        )
    if num_experts % spec.ep:
        valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise SpecError(
            f"--ep {spec.ep} does not divide num_experts={num_experts} of {spec.model}; "
            f"valid --ep: {', '.join(map(str, valid))}"
        )
    if world % spec.ep:
        valid = [d for d in range(1, world + 1) if world % d == 0]
        raise SpecError(
            f"--ep {spec.ep} must divide the number of {'trainer ' * (world != spec.gpus * spec.nodes)}ranks, "
            f"{ranks} = {world}: the experts are sharded over groups of ep ranks and "
            f"replicated over world / ep, the other parameters FSDP-sharded over all; choose "
            f"--ep among {valid}"
        )
    others = {n: getattr(spec, n) for n in ("tp", "cp", "dp_replicate") if getattr(spec, n) != 1}
    if others:
        name, value = next(iter(others.items()))
        raise SpecError(
            f"--ep {spec.ep} with --{name.replace('_', '-')} {value}: expert parallel groups are "
            f"cut from the FSDP shard ranks spanning every rank, so it takes no other parallel dim yet; "
            f"use --{name.replace('_', '-')} 1"
        )
    refused = [t for t in spec.tricks if t in EP_TRICKS_REFUSED]
    if refused:
        raise SpecError(
            f"--ep {spec.ep} and --tricks {refused[0]} cannot be combined: "
            f"{EP_TRICKS_REFUSED[refused[0]]}; drop one of them"
        )
