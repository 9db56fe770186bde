"""Learning-rate schedules, and moving optimizer state off the GPU and back."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def cosine_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup from 0 to the base lr over `warmup_steps`, then cosine decay to `min_lr_ratio`.

    The multiplier at optimizer step s (0-based, i.e. before the (s+1)-th update) is
    `(s + 1) / (warmup_steps + 1)` during warmup, so the first update uses a non-zero lr (torchtune
    and HF start at 0, which wastes one step), then
    `min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(pi * progress))`.

    Args:
        optimizer: any torch optimizer (the schedule multiplies each group's initial lr).
        warmup_steps: steps of linear warmup (0 = none); more than max_steps is clamped to
            max_steps (the whole run warms up), so a short smoke run needs no --warmup_steps.
        max_steps: total optimizer steps; progress = (s - warmup) / (max_steps - warmup).
        min_lr_ratio: final lr as a fraction of the peak lr.

    Returns:
        A LambdaLR; call `.step()` once after every optimizer step.

    Reference:
        Loshchilov & Hutter, SGDR (arXiv:1608.03983), eq. 5, without restarts.
    """

    warmup_steps = min(warmup_steps, max_steps)

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, multiplier)


def offload_optimizer_state(optimizer: torch.optim.Optimizer, host: str = "cpu") -> list:
    """Move every tensor of the optimizer's state (AdamW's exp_avg, exp_avg_sq, ...) that is not
    in host memory there, exactly (a copy of the bytes, dtypes kept): e.g. while colocated rollout
    engines generate on the trainer's GPU. `restore_optimizer_state` puts each back where it was;
    the optimizer must not step in between. A DTensor (FSDP2) keeps its mesh and placements: its
    local shard moves. Tensors already in host memory (AdamW's CPU `step`, a CPU run) stay.

    Returns:
        what moved, for `restore_optimizer_state`: [(state dict, key, original device)] (empty
        before the first step: AdamW creates its state lazily, and on CPU).
    """
    moved = []
    for state in optimizer.state.values():
        for key, t in state.items():
            if torch.is_tensor(t) and _local(t).device != torch.device(host):
                moved.append((state, key, _local(t).device))
                state[key] = _moved(t, host)
    return moved


def restore_optimizer_state(moved: list) -> int:
    """Put back what `offload_optimizer_state` moved (exactly); returns the bytes moved back."""
    total = 0
    for state, key, device in moved:
        state[key] = _moved(state[key], device)
        total += _local(state[key]).nbytes
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _moved(t: torch.Tensor, device) -> torch.Tensor:
    """`t` with its bytes on `device` (a DTensor: its local shard, same mesh and placements)."""
    from torch.distributed.tensor import DTensor

    new = _local(t).to(device, copy=True)
    if isinstance(t, DTensor):
        new = DTensor.from_local(
            new, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return new
