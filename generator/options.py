"""The options that describe a Spec, declared once for `scaffold new` and `scaffold plan`, and how
their values become a Spec."""

from __future__ import annotations

from dataclasses import replace

import click

from generator.features import ALGOS, PEFT_ALGOS, PEFT_METHODS, TRICKS
from generator.spec import Spec, resolve_engine_layout

# In --help order. `new` adds --ep, --dataset, --out, --teacher, --force and --gpu-memory;
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
        "--tricks", default="", help=f"Comma-separated memory/speed tricks: {', '.join(TRICKS)}."
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
        help="Context-parallel degree: rows split into 2*cp chunks, K/V all-gathered in attention.",
    ),
    click.option(
        "--dp-replicate",
        default=1,
        show_default=True,
        type=int,
        help="HSDP replica groups; FSDP shards over the rest: gpus*nodes / (dp_replicate*cp*tp).",
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
        default="split",
        show_default=True,
        help="--algo grpo: split (the engines on GPUs of their own; at --engine-gpus 0 they share "
        "the trainer's, both awake) or colocated (the engines on every trainer GPU, asleep while it "
        "steps: their KV cache and, at engine_sleep_level 2, their weights freed; sync rollouts).",
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
    engine_gpus=None, engine_tp=None, teacher="", layout="split",
) -> Spec:  # fmt: skip
    """The Spec of `scaffold new` / `scaffold plan` options: --tricks split on commas, --dataset
    defaulting to the algorithm's demo set, GRPO's engine GPUs chosen when not given."""
    spec = Spec(
        algo=algo,
        peft=peft,
        model=model,
        tricks=tuple(t.strip() for t in tricks.split(",") if t.strip()),
        gpus=gpus,
        nodes=nodes,
        tp=tp,
        cp=cp,
        dp_replicate=dp_replicate,
        ep=ep,
        dtype=dtype,
        dataset=dataset or (ALGOS[algo].dataset if algo in ALGOS else Spec.dataset),
        out=out,
        teacher=teacher,
        layout=layout,
    )
    if algo not in ALGOS or gpus < 1:  # validate_spec names the bad option
        return spec
    engine_gpus, engine_tp = resolve_engine_layout(spec, engine_gpus, engine_tp)
    return replace(spec, engine_gpus=engine_gpus, engine_tp=engine_tp)


# their parameter names (`scaffold plan DIR` refuses them: DIR's spec is recorded); click's
# option decorators collect the parameters on the function they decorate
SPEC_OPTION_NAMES = frozenset(p.name for p in spec_options(lambda: None).__click_params__)
