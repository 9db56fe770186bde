"""The answers: every value the templates print, computed once from a validated Spec."""

from __future__ import annotations

from pathlib import Path

from generator import __version__
from generator.catalog import MODELS
from generator.features import (
    ALGOS,
    CHOSEN_REF_MODE,
    PARALLEL_FEATURES,
    REF_MODE_HELP,
    REF_MODES,
    TRICKS,
)
from generator.spec.core import Spec, SpecError
from generator.spec.validate import model_config, trainer_gpus, validate_spec


def _local_model_answers(path: Path) -> dict:
    """Answers for `--model DIR`: its config.json (model_type llama, qwen2, qwen3 or qwen3_moe)
    selects the family; an unsupported or broken config is a SpecError naming the file."""
    from runtime.checkpoint import read_hf_config
    from runtime.models.llama import ModelArgs

    config_path = path / "config.json"
    try:  # read_hf_config's errors name config.json (invalid JSON, not an object)
        args = ModelArgs.from_hf_config(read_hf_config(path), source=str(config_path))
    except (ValueError, OSError) as e:
        raise SpecError(f"--model {path}: {e}") from e
    return {
        "model_name": path.name,
        "model_path": str(path.resolve()),
        "hf_repo_id": "",
        "family": args.model_type,
        "max_seq_len": min(2048, args.max_position_embeddings),
        "lr": 2e-5,
        "micro_batch_size": 4,
    }


def _row_multiple(spec: Spec) -> str:
    """What every row's length is padded to a multiple of: rows split over tp (sequence
    parallel) and into 2*cp chunks (cp); "" without either."""
    if spec.cp > 1:
        return "2 * cfg.cp" + (" * cfg.tp" if spec.tp > 1 else "")
    return "cfg.tp" if spec.tp > 1 else ""


def _collate_args(spec: Spec) -> str:
    """collate's padding argument (`_row_multiple`)."""
    multiple = _row_multiple(spec)
    return f", pad_to_multiple_of={multiple}" if multiple else ""


def _parallelize_steps(spec: Spec) -> str:
    """The steps `parallelize` runs for this spec, in its fixed order, as the docstring names them."""
    steps = [
        ("tensor parallel", spec.tp > 1),
        ("context parallel", spec.cp > 1),
        ("expert parallel", spec.ep > 1),
        ("activation checkpointing", "ac" in spec.tricks),
        ("activation offloading", "offload" in spec.tricks),
        ("compile", "compile" in spec.tricks),
    ]
    return ", ".join([name for name, on in steps if on] + ["FSDP2"])


def _bytes_per_param(spec: Spec) -> str:
    """The header's memory line: bytes per trained parameter (weights, gradients, AdamW state),
    and per frozen parameter where the algorithm keeps one (LoRA's base, a reference, a teacher).

    Low-bit states count their fp32 block scales (one per 256 values at 8 bits, 128 at 4 bits);
    an optimizer-in-backward gradient lives only until its parameter steps (the last micro-batch).
    The planner measures the same terms (scaffold plan), with activations and gathered blocks.
    """
    tricks = spec.tricks
    half = spec.dtype == "bf16"
    if "bf16-sr" in tricks:
        weights = (2, "bf16")
    else:
        weights = (4, "fp32 master" if half else "fp32")
    grads = (0, "freed in backward") if "optim-in-bwd" in tricks else (weights[0], weights[1][:4])
    if "adamw8bit" in tricks:
        state = (2 * (1 + 4 / 256), "8-bit")
    elif "adamw4bit" in tricks:
        state = (2 * (0.5 + 4 / 128), "4-bit")
    elif "bf16-sr" in tricks:
        state = (4, "bf16")
    else:
        state = (8, "fp32")
    total = weights[0] + grads[0] + state[0]
    where = "CPU, cpu-offload" if "cpu-offload" in tricks else "GPU"
    line = (
        f"- Bytes per trained parameter (FSDP-sharded, {where}): weights "
        f"{weights[0]} ({weights[1]}) + gradients {grads[0]} ({grads[1]}) + AdamW state "
        f"{state[0]:.3g} ({state[1]}) = {total:.3g}"
    )
    algo = ALGOS[spec.algo]
    frozen = "0.5 (NF4)" if spec.algo == "qlora" else ("2 (bf16)" if half else "4 (fp32)")
    if algo.template == "lora":
        line += f"; frozen base {frozen}"
    elif algo.template == "kd":
        line += f"; frozen teacher {frozen}"
    elif algo.skeleton in ("dpo", "grpo"):
        # cpu-offload shards the frozen reference with the same CPUOffloadPolicy (model.jinja)
        where = ", in host memory too" if "cpu-offload" in tricks else ""
        # the DPO script's reference-free losses (SimPO, ORPO) build none
        none = "; none for loss_type simpo, orpo" if algo.skeleton == "dpo" else ""
        line += f"; a separate frozen reference {frozen}{where}{none}"
    return line + "."


def _recipe_lines(spec: Spec) -> str:
    """The header's why of a recipe `scaffold new` chose (`spec.fit_note`, written by
    `generator.recipe` when it chose it), wrapped to the header's width."""
    import textwrap

    return "\n".join(
        textwrap.fill(line, 98, subsequent_indent="    " if i else "  ")
        for i, line in enumerate(spec.fit_note)
    )


def build_answers(spec: Spec) -> dict:
    """Every value the templates print, computed once (after `validate_spec`)."""
    validate_spec(spec)
    entry = MODELS.get(spec.model)
    if entry:
        model = {
            "model_name": entry.name,
            "model_path": entry.name,
            "hf_repo_id": entry.hf_repo_id,
            "family": entry.family,
            "max_seq_len": entry.default_max_seq_len,
            "lr": entry.default_lr,
            "micro_batch_size": entry.default_micro_batch_size,
        }
    else:
        model = _local_model_answers(Path(spec.model).expanduser())
    # kd's teacher: a catalog name keeps its Hub id; a directory its absolute path; none = the model
    if spec.teacher in MODELS:
        model["teacher_path"], model["teacher_hf_repo_id"] = (
            spec.teacher,
            MODELS[spec.teacher].hf_repo_id,
        )
    elif spec.teacher:
        model["teacher_path"] = str(Path(spec.teacher).expanduser().resolve())
        model["teacher_hf_repo_id"] = ""
    else:
        model["teacher_path"], model["teacher_hf_repo_id"] = (
            model["model_path"],
            model["hf_repo_id"],
        )
    # The algorithm's template first (it adds the adapters before tricks wrap the blocks), then the
    # tricks in registry order, not CLI order.
    algo = ALGOS[spec.algo]
    ordered_tricks = [name for name in TRICKS if name in spec.tricks]
    features = [algo.template] if algo.template else []
    # the parallel plan next: TP before activation checkpointing, compile and FSDP (torchtitan)
    features += [name for name, on in PARALLEL_FEATURES.items() if on(spec)]
    features += [TRICKS[name].template for name in ordered_tricks]
    if algo.lr is not None:
        model["lr"] = algo.lr
    ref_modes = REF_MODES.get(spec.algo, ())
    multi_gpu = spec.gpus * spec.nodes > 1
    # reasoning-length GRPO rows only where the model's context holds them (else the demo's)
    long_rows = multi_gpu and model_config(spec)["max_position_embeddings"] >= 512 + 1024
    return {
        **model,
        "algo": spec.algo,
        "peft": spec.peft,
        "dataset": spec.dataset,
        "dtype": spec.dtype,
        "gpus": spec.gpus,
        "nodes": spec.nodes,
        "ep": spec.ep,
        "world_size": trainer_gpus(spec) * spec.nodes,
        # GRPO: the trainer's processes per node, and the rollout engines' GPU layout
        "trainer_gpus": trainer_gpus(spec),
        "engine_gpus": spec.engine_gpus,
        "engine_tp": spec.engine_tp,
        # colocated: one engine per engine_tp of the trainer's GPUs, each asleep while it steps
        "num_engines": (
            spec.gpus // spec.engine_tp
            if spec.layout == "colocated"
            else max(1, spec.nodes * spec.engine_gpus // spec.engine_tp)
        ),
        "colocated": spec.layout == "colocated",
        "tp": spec.tp,
        "cp": spec.cp,
        "cp_mode": spec.cp_mode,
        "dp_replicate": spec.dp_replicate,
        # extra build_mesh arguments and collate padding of the parallel features
        "mesh_args": (", cp=cfg.cp" if spec.cp > 1 else "")
        + (", tp=cfg.tp" if spec.tp > 1 else ""),
        "collate_args": _collate_args(spec),
        "row_multiple": _row_multiple(spec),
        # FSDP's shard dim: under cp the cp ranks hold weight shards too (torchtitan's dp_shard_cp)
        "fsdp_shard_dim": "dp_shard_cp" if spec.cp > 1 else "dp_shard",
        # decoding feeds 1 token per step, which sequence / context parallel cannot split
        "sample_max_new_tokens": 0 if spec.tp > 1 or spec.cp > 1 else 48,
        "gradient_accumulation_steps": 1,
        "warmup_steps": 10,
        "max_steps": 100,
        "eval_every_steps": 25,
        # a multi-GPU run is a real run: a crash there costs GPU-hours, so it checkpoints every
        # 50 steps (twice in the default 100; resume="auto" picks the newest up); one process
        # (the CPU demo, a single-GPU trial) writes none unless asked
        "save_every_steps": 50 if multi_gpu else 0,
        # GRPO rows: reasoning-task lengths for a multi-GPU run (TRL's max_prompt_length 512;
        # a chain of thought needs far more than the toy data's 64 tokens); one process keeps the
        # chain_sum demo's short ones (its prompts are under 100 tokens, its answers one number)
        "max_prompt_len": 512 if long_rows else 256,
        "max_new_tokens": 1024 if long_rows else 64,
        # DAPO's overlong_buffer (L_cache): a quarter of max_new_tokens (DAPO: 4096 of 20480)
        "overlong_buffer": 256 if long_rows else 16,
        "skeleton": algo.skeleton,
        "adapters": algo.template == "lora",
        # PPO: the GRPO skeleton with a value head, GAE and the value loss
        "ppo": spec.algo == "ppo",
        "ref_modes": list(ref_modes),
        "ref_modes_literal": repr(tuple(ref_modes)),
        # a recipe chosen for the GPU (`generator.recipe`): dpo's reference that fits with it
        "ref_mode": (
            CHOSEN_REF_MODE.get(spec.algo, ref_modes[0] if ref_modes else "")
            if spec.fit_for
            else (ref_modes[0] if ref_modes else "")
        ),
        "ref_mode_help": {m: REF_MODE_HELP[m] for m in ref_modes},
        # GRPO's default generator engine: the runtime's KV-cache sampler for one process (CPU
        # or a single GPU), vLLM (one GPU per engine actor) for multi-GPU specs
        "engine": "vllm" if multi_gpu else "runtime",
        # the feature templates, in order; generator.render adds the slots each one fills
        "features": features,
        # the enabled tricks: the Model section's `parallelize` applies them in its fixed order
        "tricks": ordered_tricks,
        "parallelize_steps": _parallelize_steps(spec),
        "bytes_per_param": _bytes_per_param(spec),
        "recipe_lines": _recipe_lines(spec),
        # a frozen copy of the checkpoint is built (DPO's separate reference, GRPO's KL reference)
        "frozen_copy": algo.skeleton == "dpo"
        or (algo.skeleton == "grpo" and algo.template != "lora"),
        # compiled blocks are specialised to one shape (dynamic=False): pad every batch to it
        "pad_to_max_seq_len": "compile" in spec.tricks,
        "version": __version__,
        "command": spec.command(),
    }
