"""Training metrics: peak memory, throughput, and loggers (metrics.jsonl; TensorBoard, W&B if installed)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

from runtime.config import launch_command

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

    metrics.jsonl holds one run: a fresh run (start_step 0) starts the file anew, and a resumed
    run keeps the rows up to its checkpoint's step and drops the later ones, which the crashed
    or stopped attempt logged and this one logs again (`claim_out_dir` refuses a fresh run into
    a used out_dir first). `out_dir/run.json` records how the run was started, for `scaffold
    plot`'s title, the resolved config and its history: {"command": ..., "started": ISO time,
    "config": {...}, "resumed": [{"step",
    "command", "started", "config_changes": {key: [old, new]}}, ...]}. A resume's config changes
    are kept there, not in the saved model's training_config.json, which describes the weights
    beside it (`final_model_config`).

    Only rank 0 should create one. Non-finite floats are written as null (JSON has no NaN).

    Args:
        out_dir: the run's output directory.
        loggers: any of "jsonl", "tensorboard", "wandb".
        config: the resolved config, a dict or the script's Config dataclass (W&B run config).
        start_step: the step the run resumes from (0 = a fresh run).
        argv: the script's arguments if `main(argv)` got them (for run.json's command line).
        config_changes: a resumed run's changes against its checkpoint's config
            (`TrainState.config_changes`), recorded in run.json's entry of this resume.

    Raises:
        ValueError: an unknown logger name.
        RuntimeError: tensorboard or wandb requested but not installed (names the pip package).
    """

    def __init__(
        self,
        out_dir: str | Path,
        loggers=("jsonl",),
        config=None,
        start_step: int = 0,
        argv: list[str] | None = None,
        config_changes: dict | None = None,
    ):
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"loggers: unknown {unknown}; choose from {list(LOGGERS)}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if dataclasses.is_dataclass(config):
            config = dataclasses.asdict(config)
        _record_run(
            self.out_dir / "run.json", start_step, launch_command(argv), config, config_changes
        )
        self._jsonl = None
        if "jsonl" in loggers:
            path = self.out_dir / "metrics.jsonl"
            # written aside and renamed: a crash here leaves the old history, never half of it
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(_rows_up_to(path, start_step) if start_step else "")
            os.replace(tmp, path)
            self._jsonl = open(path, "a")
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
            if dataclasses.is_dataclass(config):
                config = dataclasses.asdict(config)
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


def _record_run(
    path: Path, start_step: int, command: str, config: dict | None, config_changes: dict | None
) -> None:
    """run.json: a fresh run's command and resolved config, or one more entry under "resumed"."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    run = json.loads(path.read_text()) if start_step and path.is_file() else {}
    if start_step:
        run.setdefault("command", None)  # a run resumed from a checkpoint older than run.json
        run.setdefault("resumed", []).append(
            {
                "step": start_step,
                "command": command,
                "started": started,
                "config_changes": config_changes or {},
            }
        )
    else:
        run = {"command": command, "started": started, "config": config}
    path.write_text(json.dumps(run, indent=2, default=str) + "\n")


def _rows_up_to(path: Path, step: int) -> str:
    """The lines of metrics.jsonl whose step is <= `step` (a resumed run's kept history). A torn
    last line (the process died mid-write) is dropped with the rest."""
    if not path.is_file():
        return ""
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    return "".join(kept)


def progress_bar(start_step: int, max_steps: int, is_main: bool):
    """The steps start_step + 1 .. max_steps as a tqdm bar, drawn on rank 0 and on a terminal only:
    in a redirected log its carriage returns would garble the step lines (`tqdm.write` keeps
    them whole either way)."""
    from tqdm import tqdm

    return tqdm(
        range(start_step + 1, max_steps + 1),
        initial=start_step,
        total=max_steps,
        disable=not (is_main and sys.stderr.isatty()),
        desc="train",
        dynamic_ncols=True,
    )


def micro_batch_progress(micro_batches: list, what: str = "step"):
    """Yield `micro_batches`, with a transient bar of those done and their tokens per second on
    rank 0 when stderr is a terminal: a step of many micro-batches (a GRPO step on a CPU, a 70B
    step of 16 accumulated micro-batches) otherwise shows nothing for minutes. The bar goes when
    the step ends (the step line follows); nothing is drawn in a redirected log.

    Args:
        micro_batches: the step's micro-batches. Tokens/s counts a dict one's "num_tokens" (int
            or 0-d tensor), or the prompt and completion tokens of the rollouts in a tuple one's
            first item (the GRPO skeleton's (rollouts, advantages, ...)).
        what: the bar's label.
    """
    from tqdm import tqdm

    shown = int(os.environ.get("RANK", "0")) == 0 and sys.stderr.isatty()
    with tqdm(
        total=len(micro_batches), desc=f"  {what}", unit="micro-batch", leave=False,
        disable=not shown, dynamic_ncols=True, mininterval=0,  # a micro-batch takes seconds
    ) as bar:  # fmt: skip
        start, tokens = time.perf_counter(), 0
        for micro_batch in micro_batches:
            yield micro_batch
            tokens += _tokens(micro_batch)
            if tokens:
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s")
            bar.update(1)


def _tokens(micro_batch) -> int:
    """The tokens of one micro-batch as `micro_batch_progress` counts them (0 when unknown)."""
    if isinstance(micro_batch, dict):
        return int(micro_batch.get("num_tokens", 0))
    if isinstance(micro_batch, tuple) and micro_batch and isinstance(micro_batch[0], list):
        rollouts = [r for r in micro_batch[0] if hasattr(r, "completion_ids")]
        return sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    return 0


def check_finite(
    step: int, metrics: dict, last_checkpoint, hint: str = "lower --lr or check the data"
) -> None:
    """Stop the run at a non-finite loss or gradient norm, before anything of the step is saved.

    The step's update was already skipped (the weights never see a NaN/inf; with
    optimizer-in-backward and no clipping, the parameters stepped before the bad gradient arrived
    keep their update in memory: `OptimizerInBackward.backward_passes`), and nothing of it is
    saved; this names the last checkpoint, which holds the weights before the step, where a
    rerun resumes.

    Args:
        metrics: the step's metrics, with "loss" and "grad_norm" floats.
        last_checkpoint: `TrainState.path` (None when no checkpoint was saved).

    Raises:
        FloatingPointError: loss or grad_norm is NaN or inf.
    """
    if math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]):
        return
    last_good = last_checkpoint or "none (set --save_every_steps)"
    raise FloatingPointError(
        f"step {step}: loss {metrics['loss']}, grad_norm {metrics['grad_norm']} is not finite; "
        f"stopped without saving this step (last good checkpoint: {last_good}); {hint}"
    )


def step_line(step: int, metrics: dict, extra: str = "") -> str:
    """The printed line of an offline step: loss, `extra` (the algorithm's own figures, already
    formatted as " | name value"), val_loss when evaluated, lr, grad_norm, tokens/s and peak
    memory (MiB)."""
    return (
        f"step {step:5d} | loss {metrics['loss']:.4f}{extra}"
        + (f" | val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else "")
        + f" | lr {metrics['lr']:.2e} | grad_norm {metrics['grad_norm']:.3f}"
        f" | {metrics['tokens_per_s']:.0f} tok/s | peak {metrics['peak_mem_mib']:.0f} MiB"
    )
