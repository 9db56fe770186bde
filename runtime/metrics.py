"""Training metrics: peak memory, throughput, and loggers (metrics.jsonl; TensorBoard, W&B if installed)."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

LOGGERS = ("jsonl", "tensorboard", "wandb")


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB.

    CUDA: `torch.cuda.max_memory_allocated` (tensors only, what PyTorch's allocator handed out).
    CPU: peak resident set size (`ru_maxrss`), which includes the Python heap and libraries, and which
    glibc's malloc can keep high after tensors are freed (see benchmarks/ for by-category figures).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def transformer_flops_per_token(
    num_params: int, num_layers: int, hidden_size: int, seq_len: int
) -> float:
    """Training FLOPs per token: 6N for the weights plus 12 * L * D * S for attention scores.

    Reference: Kaplan et al. 2020 (arXiv:2001.08361) Table 1; PaLM (arXiv:2204.02311) App. B for the
    attention term. Counts forward + backward (3x forward), no recomputation.
    """
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


def logger_errors(loggers) -> list[str]:
    """What is wrong with a `loggers` list, as `validate()` messages (empty if nothing): unknown
    names, and TensorBoard / W&B asked for but not installed. Checked before any model or data
    work, so a run does not fail at its first log line after minutes of loading."""
    from importlib.util import find_spec

    errors = []
    unknown = sorted(set(loggers) - set(LOGGERS))
    if unknown:
        errors.append(f"loggers: unknown {unknown}; choose from {list(LOGGERS)}")
    for name, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if name in loggers and find_spec(package) is None:
            errors.append(
                f"loggers includes {name!r} but {package} is not installed: pip install {package}"
            )
    return errors


class MetricsLogger:
    """Writes one JSON object per logged step to `out_dir/metrics.jsonl`, and to TensorBoard / W&B.

    Only rank 0 should create one. Non-finite floats are written as null (JSON has no NaN).

    Args:
        out_dir: the run's output directory.
        loggers: any of "jsonl", "tensorboard", "wandb".
        config: the resolved config dict (W&B run config).

    Raises:
        ValueError: an unknown logger name.
        RuntimeError: tensorboard or wandb requested but not installed (names the pip package).
    """

    def __init__(self, out_dir: str | Path, loggers=("jsonl",), config: dict | None = None):
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"loggers: unknown {unknown}; choose from {list(LOGGERS)}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.out_dir / "metrics.jsonl", "a") if "jsonl" in loggers else None
        self._tb = self._wandb = None
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("loggers includes 'tensorboard': pip install tensorboard") from e
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("loggers includes 'wandb': pip install wandb") from e
            self._wandb = wandb.init(config=config or {}, dir=str(self.out_dir))

    def log(self, metrics: dict, step: int) -> None:
        """Record `metrics` at optimizer step `step`.

        Numbers go to every logger; other JSON values (e.g. the step's sample ids, a list) only
        to metrics.jsonl.
        """
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items()
        }
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._tb:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
