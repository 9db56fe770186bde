"""The config checks every recipe shares, as `validate()` messages.

A script's `validate(cfg)` collects `common_config_errors(cfg)` plus its own loop's checks and
raises one `ConfigError` listing them all, before any model, data or Ray work. Each check here
applies only when the script's `Config` has the fields it reads, so one function serves configs
with different fields:

| fields | SFT | DPO | GRPO |
|---|---|---|---|
| dp_replicate | yes | - | - |
| max_seq_len, gradient_accumulation_steps, val_fraction, eval_every_steps, sample_max_new_tokens | yes | yes | - |
| dtype, device, micro_batch_size, max_steps, warmup_steps, lr, max_grad_norm, betas, min_lr_ratio, log_every_steps, save_every_steps, keep_last_checkpoints, loggers | yes | yes | yes |

The messages are the skeletons' own (the bad-input corpus in tests/bad_inputs matches them).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from runtime.checkpoint import bf16_midpoint_share
from runtime.metrics import logger_errors

DTYPE_NAMES = ("bf16", "fp32")  # the scripts' DTYPES keys
DEVICES = ("auto", "cuda", "cpu")
POSITIVE = ("max_seq_len", "micro_batch_size", "gradient_accumulation_steps", "max_steps")
NON_NEGATIVE = ("log_every_steps", "eval_every_steps", "save_every_steps", "sample_max_new_tokens")


def common_config_errors(cfg) -> list[str]:
    """What is wrong with the fields every recipe's config shares (empty list: nothing).

    Checks, each only when `cfg` has its fields: dp_replicate divides env WORLD_SIZE (1 without
    torchrun); dtype is bf16 or fp32; device is auto, cuda or cpu, and cuda only where torch sees
    a CUDA device; max_seq_len, micro_batch_size, gradient_accumulation_steps, max_steps >= 1;
    warmup_steps >= 0 (one longer than the run is clamped, `config_notes`); lr > 0; max_grad_norm >= 0; betas has two values;
    min_lr_ratio in [0, 1]; val_fraction in [0, 1); log_every_steps, eval_every_steps,
    save_every_steps, sample_max_new_tokens >= 0; keep_last_checkpoints >= 1; the loggers
    (`logger_errors`: known names, their packages installed). A NaN fails the float checks.

    Args:
        cfg: a script's `Config` (a dataclass instance, its fields already of their types).

    Returns:
        One message per failed check, in the order above, each naming the field and its value.

    Raises:
        TypeError: cfg is not a dataclass instance.
    """
    has = {f.name for f in dataclasses.fields(cfg)}
    return (
        _placement_errors(cfg, has)
        + _count_errors(cfg, has)
        + _optimizer_errors(cfg, has)
        + _cadence_errors(cfg, has)
        + (logger_errors(cfg.loggers) if "loggers" in has else [])
    )


def config_notes(cfg) -> list[str]:
    """What a valid config does differently from what it says, one line each (empty: nothing).

    Today one case: a warmup longer than the run (`python train.py --max_steps 3` with the default
    warmup_steps=10, the first command everyone tries). TRL and torchtune run it, so the script
    does too: `cosine_schedule_with_warmup` clamps the warmup to max_steps, and rank 0 prints this
    note at startup so the shorter warmup is not a surprise.

    Args:
        cfg: a script's `Config` (a dataclass instance); fields it lacks are not checked.
    """
    has = {f.name for f in dataclasses.fields(cfg)}
    notes = []
    if {"warmup_steps", "max_steps"} <= has and cfg.warmup_steps > cfg.max_steps >= 1:
        notes.append(
            f"warmup_steps={cfg.warmup_steps} is longer than max_steps={cfg.max_steps}: the lr "
            f"warms up over the whole run ({cfg.max_steps} step{'s' * (cfg.max_steps != 1)}; "
            "set --warmup_steps to choose)"
        )
    return notes


# a checkpoint with more of its trained weights on bf16 rounding midpoints than this gets a warning
# in bf16 runs (random fp32 values: 0.0015%; fp16-widened: 12.5%; a dequantized Q4_1 GGUF: 8%)
MIDPOINT_WARNING_SHARE = 0.01


def bf16_master_warnings(cfg, model: torch.nn.Module, model_dir) -> list[str]:
    """One line when a bf16 run trains fp32 master weights loaded from a checkpoint with more than
    MIDPOINT_WARNING_SHARE of them on bf16 rounding midpoints (`bf16_midpoint_share`): about half
    of their bf16 casts jump a whole bf16 step at the first update, however small the lr (a GRPO
    run's KL to its reference went from 0 to 0.84 in one 1e-7 step on such a checkpoint). Empty
    otherwise, and for fp32 runs, frozen weights (LoRA's base: cast once, never updated) and a
    model_dir without a safetensors checkpoint.

    Args:
        cfg: the script's Config (its `dtype`, "bf16" or "fp32"; a config without one: fp32).
        model: the trained model; its trainable fp32 parameters' names are the HF keys read.
        model_dir: the checkpoint the model was loaded from.
    """
    if getattr(cfg, "dtype", "fp32") != "bf16":
        return []
    # the model's names are the checkpoint's keys (the scripts load by them: load_hf_checkpoint)
    keys = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float32]
    try:
        share = bf16_midpoint_share(model_dir, keys)
    except (FileNotFoundError, ValueError):  # no checkpoint there (a test model, a bad path)
        return []
    if share <= MIDPOINT_WARNING_SHARE:
        return []
    return [
        f"{share:.1%} of the trained weights in {model_dir} lie exactly halfway between two bf16 "
        "values (a checkpoint dequantized or widened from fp16?): bf16 compute rounds the fp32 masters, "
        "so a fresh run's first update, however small, moves about half of those a whole bf16 step "
        "along its sign, a far larger step than the lr asks for (RL at a small lr feels it most). "
        "Run --dtype fp32, or save the checkpoint in bf16 first (`model.to(torch.bfloat16)"
        ".save_pretrained(dir)`; small updates then wait to add up to half a bf16 step)"
    ]


def _placement_errors(cfg, has: set[str]) -> list[str]:
    """dp_replicate, dtype, device."""
    errors = []
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; 1 for `python train.py`
    if "dp_replicate" in has and (cfg.dp_replicate < 1 or world_size % cfg.dp_replicate):
        errors.append(
            f"dp_replicate={cfg.dp_replicate}: must divide the world size {world_size}; choose "
            f"one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    if "dtype" in has and cfg.dtype not in DTYPE_NAMES:
        errors.append(f"dtype={cfg.dtype!r}: choose one of {sorted(DTYPE_NAMES)}")
    if "device" in has and cfg.device not in DEVICES:
        errors.append(f"device={cfg.device!r}: choose auto, cuda or cpu")
    if "device" in has and cfg.device == "cuda" and not torch.cuda.is_available():
        errors.append("device='cuda' but torch sees no CUDA device: use --device cpu (or auto)")
    return errors


def _count_errors(cfg, has: set[str]) -> list[str]:
    """The sizes and step counts that must be >= 1, and a warmup that is not negative."""
    errors = [
        f"{name}={getattr(cfg, name)}: must be >= 1"
        for name in POSITIVE
        if name in has and getattr(cfg, name) < 1
    ]
    if "warmup_steps" in has and cfg.warmup_steps < 0:
        errors.append(f"warmup_steps={cfg.warmup_steps}: must be >= 0 (0 = no warmup)")
    return errors


def _optimizer_errors(cfg, has: set[str]) -> list[str]:
    """lr, max_grad_norm, betas, min_lr_ratio, val_fraction. Written as "not (holds)", so a NaN
    (which --lr nan parses to) fails them too."""
    errors = []
    if "lr" in has and not cfg.lr > 0:
        errors.append(f"lr={cfg.lr}: must be > 0")
    if "max_grad_norm" in has and not cfg.max_grad_norm >= 0:
        errors.append(f"max_grad_norm={cfg.max_grad_norm}: must be >= 0 (0 = no clipping)")
    if "betas" in has and len(cfg.betas) != 2:
        errors.append(f"betas={cfg.betas}: AdamW's two floats, e.g. --betas 0.9,0.95")
    if "min_lr_ratio" in has and not 0 <= cfg.min_lr_ratio <= 1:
        errors.append(f"min_lr_ratio={cfg.min_lr_ratio}: must be in [0, 1]")
    if "val_fraction" in has and not 0 <= cfg.val_fraction < 1:
        errors.append(f"val_fraction={cfg.val_fraction}: must be in [0, 1)")
    return errors


def _cadence_errors(cfg, has: set[str]) -> list[str]:
    """Logging, evaluation, checkpoint and sample cadences (0 = off), kept checkpoints."""
    errors = [
        f"{name}={getattr(cfg, name)}: must be >= 0"
        for name in NON_NEGATIVE
        if name in has and getattr(cfg, name) < 0
    ]
    if "keep_last_checkpoints" in has and cfg.keep_last_checkpoints < 1:
        errors.append(f"keep_last_checkpoints={cfg.keep_last_checkpoints}: must be >= 1")
    return errors


def config_diff(cfg) -> dict:
    """{field: value} of the Config dataclass `cfg`'s fields whose value is not the script's
    default, in field order; values as the command line takes them (a list joined by commas)."""
    out = {}
    for f in dataclasses.fields(cfg):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(cfg, f.name)
        if value != default:
            out[f.name] = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    return out


def run_summary(
    cfg, model: torch.nn.Module, model_dir, world_size: int, device, details: str
) -> str:
    """What rank 0 prints before the first step: one `config | ...` line of what differs from the
    script's defaults (`config_diff`; the whole resolved config is in out_dir/run.json), a
    `note | ...` line for each of `config_notes(cfg)`, a `warning | ...` line for each of
    `bf16_master_warnings`, and one line of the model, the data, the checkpoint cadence
    (`cfg.save_every_steps`) and the processes.

    Args:
        cfg: the script's Config dataclass.
        model: the trained model (parameter counts are global also under FSDP: DTensor.numel()).
        model_dir: where the weights came from.
        world_size: trainer processes.
        device: torch.device of this rank.
        details: the script's own part of the line (data, batch, reference or engines).
    """
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    changed = ", ".join(f"{k} {v}" for k, v in config_diff(cfg).items()) or "the defaults"
    lines = [f"config | {changed} (all of it: run.json in out_dir)"]
    lines += [f"note | {note}" for note in config_notes(cfg)]
    lines += [f"warning | {w}" for w in bf16_master_warnings(cfg, model, model_dir)]
    # whether a crash loses the run: multi-GPU scripts checkpoint every 50 steps by default
    saves = (
        f"checkpoint every {cfg.save_every_steps} steps"
        if cfg.save_every_steps
        else "no periodic checkpoint (save_every_steps 0)"
    )
    lines.append(
        f"model {model_dir} | {n_params / 1e6:.1f}M params, {n_trainable / 1e6:.2f}M trainable "
        f"({100 * n_trainable / max(n_params, 1):.2f}%) | {details} | {saves} | "
        f"{world_size} process(es) on {device.type}"
    )
    return "\n".join(lines)
