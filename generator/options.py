"""The options that describe a Spec, declared once for `scaffold new` and `scaffold plan`, and how
their values become a Spec."""

from __future__ import annotations

from dataclasses import replace

import click

from generator.features import ALGOS, PEFT_ALGOS, PEFT_METHODS, TRICKS
from generator.spec import Spec, SpecError, resolve_engine_layout

# In --help order. `new` adds --dataset, --out, --teacher, --force and --gpu-memory;
# `plan` adds the batch shape, --kl-coef, --gpu-memory and --suggest.
SPEC_OPTIONS = [
    click.option(
        "--algo", default="sft", show_default=True, help=f"Training algorithm: {', '.join(ALGOS)}."
    ),
    click.option(
        "--peft",
        default="lora",
        show_default=True,
        help=f"Adapter type for --algo {'/'.join(PEFT_ALGOS)}: {', '.join(PEFT_METHODS)}.",
    ),
    click.option(
        "--model",
        default="smollm2-135m",
        show_default=True,
        help="Catalog name (see `scaffold list models`) or a local Hugging Face directory.",
    ),
    click.option(
        "--tricks",
        default=None,
        help=f"Comma-separated memory/speed tricks: {', '.join(TRICKS)}; `none` for none "
        "[default: none if the plain script fits the GPU (--gpu-memory, h100-80 by default), else "
        "the least lossy recipe whose estimate fits (sft, lora, grpo, grpo-lora in bf16)].",
    ),
    click.option(
        "--gpus", default=1, show_default=True, type=int, help="Processes (GPUs) per node."
    ),
    click.option("--nodes", default=1, show_default=True, type=int, help="Number of nodes."),
    click.option(
        "--tp",
        default=1,
        show_default=True,
        type=int,
        help="Tensor-parallel degree (+ sequence and loss parallel), within one node.",
    ),
    click.option(
        "--cp",
        default=1,
        show_default=True,
        type=int,
        help="Context-parallel degree: rows split into 2*cp chunks; attention reaches the other "
        "chunks' K/V as --cp-mode says.",
    ),
    click.option(
        "--cp-mode",
        default="allgather",
        show_default=True,
        help="--cp > 1: allgather (each rank gathers the whole sequence's K/V per layer) or ring "
        "(K/V blocks passed around the cp ranks, no rank holds the whole sequence's; needed for "
        "--tricks packing).",
    ),
    click.option(
        "--dp-replicate",
        default=1,
        show_default=True,
        type=int,
        help="HSDP replica groups; FSDP shards over the rest: gpus*nodes / (dp_replicate*cp*tp).",
    ),
    click.option(
        "--ep",
        default=1,
        show_default=True,
        type=int,
        help="Expert-parallel degree for MoE models (qwen3_moe): groups of ep ranks each hold "
        "num_experts/ep whole experts per layer, tokens reach them by all-to-all; any divisor of "
        "the (trainer) ranks that divides num_experts (EP x FSDP: the experts' replicas over "
        "ranks / ep sum their gradients).",
    ),
    click.option(
        "--engine-gpus",
        default=None,
        type=int,
        help="--algo grpo: GPUs per node for the rollout engines; the trainer runs on the other "
        "--gpus minus these [default: half of --gpus; 0 at --gpus 1: the engines share its GPU].",
    ),
    click.option(
        "--engine-tp",
        default=None,
        type=int,
        help="--algo grpo: GPUs per vLLM engine (tensor_parallel_size) [default: the fewest that "
        "hold at most 40 GiB of bf16 weights each].",
    ),
    click.option(
        "--layout",
        default=None,
        help="--algo grpo: split (the engines on GPUs of their own; at --engine-gpus 0 they share "
        "the trainer's, both awake) or colocated (the engines on every trainer GPU, asleep while it "
        "steps: their KV cache and, at engine_sleep_level 2, their weights freed; sync rollouts) "
        "[default: split, or colocated where only it fits when --tricks, --engine-gpus and "
        "--engine-tp are not given].",
    ),
    click.option(
        "--dtype",
        default="bf16",
        show_default=True,
        help="bf16 (bf16 compute, fp32 master weights and optimizer state) or fp32.",
    ),
]


def spec_options(command):
    """Decorate a click command with SPEC_OPTIONS (algo, peft, model, tricks, GPU layout, GRPO's
    layout, dtype)."""
    for option in reversed(SPEC_OPTIONS):  # decorators apply bottom-up
        command = option(command)
    return command


def spec_from_options(
    algo, peft, model, tricks, gpus, nodes, tp, cp, dp_replicate, ep, dtype, dataset=None, out=None,
    engine_gpus=None, engine_tp=None, teacher="", layout=None, fit_gpu=None, cp_mode="allgather",
) -> Spec:  # fmt: skip
    """The Spec of `scaffold new` / `scaffold plan` options: --tricks split on commas (`none`: no
    tricks), --dataset defaulting to the algorithm's demo set, GRPO's engine GPUs chosen when not
    given. tricks None (not given) with `fit_gpu` (name, GiB): the default recipe for that GPU
    (`generator.recipe.choose_recipe`; GRPO's layout too where layout and the engine GPUs were
    not given either)."""
    names = tuple(t.strip() for t in (tricks or "").split(",") if t.strip())
    if "none" in names:
        if len(names) > 1:
            raise SpecError(
                f"--tricks {tricks}: `none` means no tricks and cannot be combined with others"
            )
        names = ()
    spec = Spec(
        algo=algo,
        peft=peft,
        model=model,
        tricks=names,
        gpus=gpus,
        nodes=nodes,
        tp=tp,
        cp=cp,
        cp_mode=cp_mode,
        dp_replicate=dp_replicate,
        ep=ep,
        dtype=dtype,
        dataset=dataset or (ALGOS[algo].dataset if algo in ALGOS else Spec.dataset),
        out=out,
        teacher=teacher,
        layout=layout or "split",
    )
    if algo not in ALGOS or gpus < 1:  # validate_spec names the bad option
        return spec
    resolved = resolve_engine_layout(spec, engine_gpus, engine_tp)
    spec = replace(spec, engine_gpus=resolved[0], engine_tp=resolved[1])
    if tricks is None and fit_gpu is not None:
        from generator.recipe import choose_recipe

        vary_layout = layout is None and engine_gpus is None and engine_tp is None
        spec = choose_recipe(spec, fit_gpu, vary_layout)
    return spec


# their parameter names (`scaffold plan DIR` refuses them: DIR's spec is recorded); click's
# option decorators collect the parameters on the function they decorate
SPEC_OPTION_NAMES = frozenset(p.name for p in spec_options(lambda: None).__click_params__)
