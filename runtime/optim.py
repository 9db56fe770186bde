"""Learning-rate schedules."""

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
