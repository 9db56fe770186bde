"""Helpers for tests: run a function on N local processes with a gloo (or NCCL) group."""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # never a hard-coded port: parallel test runs must not collide
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, fn, args, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()  # plain bytes: shared-memory tensors die with this process
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def spawn(fn, world_size: int = 2, backend: str = "gloo", args: tuple = ()) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return results in rank order.

    `fn` must be picklable (a module-level function). Raises RuntimeError with every failing
    rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [f"rank {r}:\n{msg}" for r, status, msg in results if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    ordered = sorted(results, key=lambda t: t[0])
    return [torch.load(io.BytesIO(res), weights_only=False) for _, _, res in ordered]


# The tiny random config for parity tests (HF config names): 2 layers, hidden 64, 4 heads,
# 2 KV heads, head_dim 16, intermediate 128, vocab 256. Tests add what they vary.
TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def safetensors_keys(model_dir) -> set[str]:
    """Every tensor name stored in the `*.safetensors` files of `model_dir` (single or sharded)."""
    from pathlib import Path

    from safetensors import safe_open

    keys: set[str] = set()
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            keys |= set(f.keys())
    return keys


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered if `t` is an FSDP2/TP DTensor (a collective), else `t` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
