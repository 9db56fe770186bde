"""Learning-rate schedules, torchao's AdamW variants (low-bit state, bf16 stochastic rounding),
and moving optimizer state off the GPU and back."""

from __future__ import annotations

import functools
import math
import types

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


def low_bit_state(param: torch.Tensor, block_size: int) -> bool:
    """Whether a low-bit AdamW keeps `param`'s moments in low-bit blocks (else in fp32 / its dtype).

    torchao's rule (bitsandbytes': at least 4096 values, a whole number of `block_size` blocks),
    applied to the whole parameter and to every rank's shard, so every rank of a sharded parameter
    decides alike. torchao applies it to the local shard alone: a 4096-8191-value parameter had
    8-bit state at 1 rank and fp32 at 2, and an uneven last shard (dim 0 not divisible by the
    ranks) could give one rank 8-bit state and another fp32 for the same parameter. With dim-0
    shards (FSDP2) whose sizes are multiples of `block_size`, the blocks are the 1-rank blocks, so
    the quantized numbers equal the 1-rank run's too. A parameter whose shards do not hold whole
    blocks at this world size keeps full-precision state on every rank.

    Args:
        param: a plain tensor or a DTensor (any mesh and Shard/Replicate placements).
        block_size: the optimizer's quantization block (torchao: 256 for 8-bit, 128 for 4-bit).
    """
    if param.numel() < 4096 or param.numel() % block_size:
        return False
    shapes = [list(param.shape)]
    for mesh_dim, placement in enumerate(getattr(param, "placements", ())):
        if not placement.is_shard():
            continue
        ranks, dim = param.device_mesh.size(mesh_dim), placement.dim
        sharded = []
        for shape in shapes:
            rows = -(-shape[dim] // ranks)  # torch.chunk's sizes, as DTensor and FSDP2 shard
            sizes = {min(rows, shape[dim] - r * rows) for r in range(ranks)}
            if min(sizes) <= 0:  # an empty shard: torchao's low-bit subclass has no empty form
                return False
            sharded += [shape[:dim] + [n] + shape[dim + 1 :] for n in sizes]
        shapes = sharded
    return all(math.prod(shape) % block_size == 0 for shape in shapes)


@functools.cache
def _torchao_class(state_bits: int | None) -> type:
    from torch.distributed.tensor import DTensor
    from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

    base = {8: AdamW8bit, 4: AdamW4bit, None: _AdamW}[state_bits]
    if state_bits is None:
        return base

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        # torchao's own method with the quantization decided by `low_bit_state`, not per shard
        local = p.to_local() if isinstance(p, DTensor) else p
        if low_bit_state(p, self.block_size):
            # the state's apparent dtype is fp32 even for bf16 weights: torchao 0.18's compiled step
            # cannot trace `.float()` of a bf16-typed low-bit state (aten.view.dtype); the stored
            # codes and scales are the same either way
            like = types.SimpleNamespace(
                shape=local.shape, device=local.device, dtype=torch.float32
            )
            out = self._subclass_zeros(like, signed, self.block_size)
        else:
            out = torch.zeros_like(local)
        if isinstance(p, DTensor):
            out = DTensor.from_local(
                out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return out.to(
            p.device
        )  # from_local moves to the mesh's device; CPU offload keeps it on CPU

    return type(base.__name__, (base,), {"_new_buffer": _new_buffer, "__module__": __name__})


def torchao_adamw(state_bits: int | None = None, bf16_stochastic_round: bool = False):
    """torchao's AdamW as an optimizer class: callable(params, lr=, betas=, ...).

    Args:
        state_bits: 8 (`AdamW8bit`, 4x smaller state than fp32) or 4 (`AdamW4bit`, 8x), with the
            state type of each parameter decided by `low_bit_state` (the same at 1 and N ranks);
            None: torchao's `_AdamW`, moments in the parameter's dtype (bf16 for bf16 weights).
        bf16_stochastic_round: round each new bf16 weight stochastically (the update is computed in
            fp32); ignored for fp32 parameters. Draws from torch's global RNG (inside the compiled
            step), which checkpoints save, so a resumed run rounds as the uninterrupted one.

    Raises:
        KeyError: state_bits is not 8, 4 or None.
    """
    return functools.partial(
        _torchao_class(state_bits), bf16_stochastic_round=bf16_stochastic_round
    )
