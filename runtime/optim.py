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


def offload_optimizer_state(
    optimizer: torch.optim.Optimizer, device_type: str | None = None
) -> list:
    """Copy every tensor of the optimizer's state (AdamW's exp_avg, exp_avg_sq, ...) to host
    memory and free its device storage, e.g. while colocated rollout engines generate on the
    trainer's GPU; `restore_optimizer_state` brings the bytes back into the same tensors. The
    tensors stay the optimizer's own objects (a DTensor keeps its mesh and placements: the
    storage of its local shard is what moves), shrunk to 0 bytes in between, so the optimizer
    must not step (or be saved) until they are restored.

    Args:
        device_type: offload the tensors on devices of this type (the trainer's: "cuda"; a
            script passes its device's, so a CPU run copies its state aside too, which frees
            nothing but runs the same path); None: every tensor not in host memory.

    Returns:
        what was offloaded, for `restore_optimizer_state`: [(storage, host copy)] (empty before
        the first step: AdamW creates its state lazily).
    """
    from torch.distributed.tensor import DTensor

    moved, seen = [], set()
    for state in optimizer.state.values():
        for t in state.values():
            if not torch.is_tensor(t):
                continue
            local = t.to_local() if isinstance(t, DTensor) else t  # shares the shard's storage
            storage = local.untyped_storage()
            kind = local.device.type
            if (
                kind == "cpu" if device_type is None else kind != device_type
            ) or storage.nbytes() == 0:
                continue
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8).copy_(_bytes_of(storage))
            moved.append((storage, host))
            storage.resize_(0)
    return moved


def restore_optimizer_state(moved: list) -> int:
    """Bring back what `offload_optimizer_state` moved, bit for bit; returns the bytes restored."""
    for storage, host in moved:
        storage.resize_(host.numel())
        _bytes_of(storage).copy_(host)
    return sum(host.numel() for _, host in moved)


def _bytes_of(storage) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage` (an UntypedStorage), to copy it whole."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
