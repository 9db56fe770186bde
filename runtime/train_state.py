"""Resumable training checkpoints: atomic, complete, sharded (torch.distributed.checkpoint).

A checkpoint directory `step_000120/` holds everything needed to continue bit-exactly:

    dcp/                      model + optimizer state (DCP: each rank writes its own shards)
    rng_rank{r}.pt            torch CPU (+ CUDA) and Python `random` RNG states of rank r
    scheduler.pt              the LR scheduler's state_dict
    trainer_state.json        step, data position (epoch, samples consumed), world size, config
    COMPLETE                  written last: a directory without it is not a checkpoint

Atomicity: everything is written into `step_000120.tmp/`, every file is fsynced, rank 0 writes
COMPLETE (fsynced), renames the directory to `step_000120/` (one atomic rename on POSIX) and
fsyncs the parent. A crash at any point leaves either the previous checkpoints untouched plus a
`.tmp` directory (ignored and removed by the next save), or a complete new checkpoint.

Model state: the trainable parameters (all of them in full fine-tuning; only the adapters under
LoRA/QLoRA, whose frozen base the script reloads from the model directory).
Optimizer state: `torch.distributed.checkpoint.state_dict.get_state_dict`, keyed by parameter
names, so the checkpoint is independent of parameter order and of the sharding (a checkpoint
written by 4 ranks loads on 2). The same call covers torch optimizers, torchao's low-bit
optimizers and the per-parameter optimizers of `OptimizerInBackward` (their `optimizers` list).

Resuming on a different number of ranks (resharding): DCP re-slices every parameter and optimizer
state to the new sharding, so the full tensors are exactly the saved ones. The data position is
global (`samples_consumed` of the epoch's one permutation, which does not depend on the number of
ranks; see `ResumableDistributedSampler`), so the resumed run uses exactly the examples the saved
run had not used yet, in the same order. With the same global batch (micro_batch_size x
gradient_accumulation_steps x data-parallel ranks) every later step sees the same examples as an
uninterrupted run, and the losses agree up to float summation order (tested: 2 ranks -> 1 and 4);
with a different global batch the steps group the examples differently. RNG states continue
exactly only at the same world size; a rank without its own saved state takes rank
(r mod saved world size)'s (all ranks start from the same seed).

Reference: torchtitan's `CheckpointManager` (DCP + a step-numbered folder per save), PyTorch
"Getting started with distributed checkpoint" tutorial.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.utils.data import DistributedSampler

from runtime.checkpoint import prepare_out_dir

COMPLETE_MARKER = "COMPLETE"
# Frozen parameters (a LoRA/QLoRA base) are not saved: the script reloads them from the model
# directory before resuming, so checkpoints hold only what training changes.
# Loading: the trainable keys come from this model's own state dict (dcp.load fails if the
# checkpoint lacks one), and the frozen ones are not in the checkpoint, hence strict=False here.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainState:
    """Where training stands after `step` optimizer steps.

    Attributes:
        step: optimizer steps done.
        epoch: current epoch of the data loader (0-based).
        samples_consumed: examples of `epoch`'s global order already used, by all data-parallel
            ranks together (micro-batches per rank x micro_batch_size x data-parallel ranks), so
            the position means the same on any number of ranks.
        path: the checkpoint this state was read from (None for a fresh start).
        config_changes: a resumed run's config against its checkpoint's, {key: [old, new]} as
            JSON holds them ({} for a fresh start or an unchanged config).
    """

    step: int = 0
    epoch: int = 0
    samples_consumed: int = 0
    path: Path | None = None
    config_changes: dict = field(default_factory=dict)


class RunInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM (`kill`, a scheduler's preemption) arrived: raised in the main
    thread by the handlers `entry_point` installs. A KeyboardInterrupt, so code that lets one
    through lets this through too.

    Attributes:
        signum: the signal's number (signal.SIGINT or signal.SIGTERM).
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Progress:
    """What an interrupt report needs to know of the running script: its TrainState (the steps
    done, the last complete checkpoint), the checkpoint directory, and the checkpoint being
    written, if any. `resume_training` and `save_train_state` keep it; one per process."""

    state: TrainState | None = None
    ckpt_dir: Path | None = None
    saving: Path | None = None
    interrupted: int | None = None  # the signal `entry_point`'s handler received


PROGRESS = _Progress()


def interrupt_report(signal_name: str, command: str) -> str:
    """The one line a run prints when SIGINT or SIGTERM ends it (`entry_point`): what was
    interrupted, the last complete checkpoint and the command that resumes, e.g. `interrupted
    by SIGINT after 7 steps; last complete checkpoint: out/checkpoints/step_000006; resume
    with: python train.py --max_steps 20`.

    Args:
        signal_name: "SIGINT" or "SIGTERM".
        command: the command that resumes (the run's own, without --overwrite or --resume:
            `--resume auto`, the default, continues from the newest complete checkpoint).
    """
    state = PROGRESS.state
    if PROGRESS.saving is not None:
        what = f"while saving {PROGRESS.saving} (not completed: nothing of it counts)"
    elif state is None:
        what = "before the first step"
    else:
        what = f"after {state.step} step{'s' if state.step != 1 else ''}"
    last = None
    if PROGRESS.ckpt_dir is not None:
        complete = checkpoint_dirs(PROGRESS.ckpt_dir)
        last = complete[-1] if complete else None
    if last is None:
        return (
            f"interrupted by {signal_name} {what}; no complete checkpoint yet (--save_every_steps "
            f"sets how often one is written); start again with: {command}"
        )
    return (
        f"interrupted by {signal_name} {what}; last complete checkpoint: {last}; "
        f"resume with: {command}"
    )


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` that can start an epoch part-way through, on any number of ranks.

    The epoch's global order is one permutation of the dataset that depends only on (seed,
    epoch), as in `DistributedSampler`; rank r takes every num_replicas-th index of it from r on.
    `set_position(epoch, start_index)` skips the first `start_index` indices of the global order
    (without loading or collating them) and deals the rest out the same way. After k
    micro-batches of b examples on each of R ranks, exactly the first k*b*R indices were used, so
    a resume with start_index = k*b*R continues where the run stopped, also with a different
    number of ranks. With the same number of ranks every rank gets exactly the indices it would
    have had without the interruption.

    Differs from `DistributedSampler`: drop_last trims the *remaining* indices to a multiple of
    num_replicas (the same as trimming the whole epoch when start_index is a multiple of it).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def set_position(self, epoch: int, start_index: int) -> None:
        """Next iteration yields epoch `epoch`'s global order from index `start_index` on
        (start_index counts examples used by all ranks together)."""
        self.set_epoch(epoch)
        self.start_index = start_index

    def global_order(self) -> list[int]:
        """The epoch's dataset indices in the order all ranks together consume them."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # DistributedSampler's generator and seed
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def __iter__(self):
        order = self.global_order()[self.start_index :]
        if self.drop_last:
            order = order[: len(order) - len(order) % self.num_replicas]
        elif order and len(order) % self.num_replicas:  # pad by repeating, as DistributedSampler
            padding = self.num_replicas - len(order) % self.num_replicas
            order += (order * math.ceil(padding / len(order)))[:padding]
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        remaining = max(len(self.dataset) - self.start_index, 0)
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _on_ranks(fn, only_rank0: bool = False) -> None:
    """Run fn (on every rank, or on rank 0 only), then agree: if it raised OSError on any rank,
    every rank raises it. Replaces a barrier, so a failed write never leaves the other ranks
    waiting in a collective until the process-group timeout."""
    error = None
    if not only_rank0 or _rank() == 0:
        try:
            fn()
        except OSError as e:
            error = (e.errno, e.strerror or str(e), getattr(e, "filename", None))
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise OSError(*error)


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch Optimizer instances behind `optimizer` (OptimizerInBackward: its per-parameter
    optimizers)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def _fsync_tree(root: Path) -> None:
    """fsync every file under root, then every directory (so the names are durable too)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dirs(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under root (those with the COMPLETE marker), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def resolve_resume(resume: str, root: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from.

    Args:
        resume: "auto" (the newest complete checkpoint under root, or None), "none" (start
            fresh even if checkpoints exist), or the path of one checkpoint directory.
        root: the run's checkpoint directory (`out_dir/checkpoints`).

    Raises:
        ValueError: resume is a path that is not a complete checkpoint (names what is missing).
    """
    if resume == "none":
        return None
    if resume == "auto":
        found = checkpoint_dirs(root)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(
            f"resume={resume!r}: no such checkpoint directory; use auto, none or a step_N dir"
        )
    if not (path / COMPLETE_MARKER).is_file():
        raise ValueError(
            f"resume={resume!r}: {path / COMPLETE_MARKER} is missing, so this checkpoint was not "
            "finished (the run stopped while writing it); resume from an earlier one"
        )
    return path


# What a run writes into its out_dir (metrics, the run's command line, the plot, checkpoints, the
# final model, TensorBoard events, DPO's reference table): the files that tell an earlier run is there.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "run.json",
    "metrics.png",
    "checkpoints",
    "model",
    "tensorboard",
    "reference_logps.pt",
)


def claim_out_dir(out_dir: str | os.PathLike, resume: str, overwrite: bool, is_main: bool) -> Path:
    """Create `out_dir` (writable: `prepare_out_dir`) and make sure this run's outputs never mix
    with an earlier run's there.

    A run into out_dir is one of: a fresh run into a directory with none of `RUN_OUTPUTS`; a resume
    (`resolve_resume` finds a checkpoint: the run continues, and `MetricsLogger` keeps its
    metrics up to the resumed step); or, with `overwrite`, a fresh run that first deletes the
    earlier run's outputs. An earlier run's outputs with nothing to resume (it saved no
    checkpoint, or `resume="none"`) are refused: a second run would otherwise append to its
    metrics.jsonl (and `scaffold plot` draw both) and overwrite its model without a word.

    Collective under a process group: call it on every rank after the group is up. Every rank
    decides from the same files, and a barrier holds them until all have: before rank 0 deletes
    anything (with `overwrite`), and before rank 0 writes this run's first file.

    Args:
        out_dir: the run's output directory (created if missing).
        resume: the run's `resume` setting ("auto", "none" or a checkpoint directory).
        overwrite: start fresh, deleting the earlier run's `RUN_OUTPUTS` (nothing else in out_dir).
        is_main: this is rank 0, the one that deletes.

    Returns:
        out_dir as a Path.

    Raises:
        OSError: out_dir cannot be created or written (`prepare_out_dir`: at startup, not at the
            first save).
        FileExistsError: out_dir holds an earlier run and there is no checkpoint to resume; the
            message names the files found and both ways out (--out_dir, --overwrite).
        ValueError: overwrite with `resume` naming a checkpoint (from `resolve_resume`, or the two
            asked together).
    """
    out = prepare_out_dir(out_dir)
    found = [name for name in RUN_OUTPUTS if _nonempty(out / name)]
    if overwrite and resume not in ("auto", "none"):
        raise ValueError(
            f"overwrite=True starts a fresh run, but resume={resume!r} asks to continue one; "
            "drop one of the two"
        )
    allowed = overwrite or not found or resolve_resume(resume, out / "checkpoints") is not None
    if overwrite and is_main:
        for name in found:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    if dist.is_available() and dist.is_initialized():
        # every rank has read out_dir before rank 0 deletes or writes there (its run.json comes
        # next): a rank that looked later would take this run's own files for an earlier run's
        dist.barrier()
    if allowed:
        return out
    why = "resume='none'" if resume == "none" else "no complete checkpoint to resume from"
    raise FileExistsError(
        f"out_dir {out} holds an earlier run ({', '.join(found)}) and {why}: pass --out_dir "
        "with a new directory, or --overwrite to delete that run's outputs and start fresh"
    )


def _nonempty(path: Path) -> bool:
    """A file with content, or a directory with an entry (an empty one is no earlier run)."""
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def save_train_state(
    root: str | os.PathLike,
    state: TrainState,
    model: nn.Module,
    optimizer,
    scheduler,
    config: dict,
    keep_last: int = 2,
) -> Path:
    """Write a complete resumable checkpoint `root/step_{state.step:06d}` atomically.

    Collective: every rank must call it (each writes its shards and RNG state).

    Args:
        root: the checkpoint directory (created if missing).
        state: step and data position after that step.
        model: the (FSDP2-sharded or plain) model.
        optimizer: a torch/torchao optimizer or an OptimizerInBackward.
        scheduler: the LR scheduler (its state_dict is saved).
        config: the resolved run config (JSON-serialisable), saved for reference and comparison.
        keep_last: complete checkpoints to keep (older ones are deleted after this one is
            complete); >= 1.

    Returns:
        The final checkpoint directory.

    Raises:
        OSError: writing failed (e.g. disk full); the partial directory is removed and the
            earlier checkpoints are untouched. The message names the path.
    """
    root = Path(root)
    final = root / f"step_{state.step:06d}"
    tmp = root / f"step_{state.step:06d}.tmp"
    rank = _rank()

    def prepare() -> None:
        for stale in root.glob("step_*.tmp"):  # leftovers of a run killed mid-save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)

    def write_rank_files() -> None:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            trainer_state = {
                "step": state.step,
                "epoch": state.epoch,
                "samples_consumed": state.samples_consumed,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "config": config,
            }
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        _fsync_tree(tmp)  # every rank its own files (rank 0 walks all: harmless)

    def commit() -> None:
        if final.exists():  # a complete checkpoint of the same step (a repeated save)
            shutil.rmtree(final)
        (tmp / COMPLETE_MARKER).write_text(f"step {state.step}\n")
        _fsync_tree(tmp)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in checkpoint_dirs(root)[: -max(keep_last, 1)]:
            shutil.rmtree(old, ignore_errors=True)

    PROGRESS.ckpt_dir, PROGRESS.saving = root, final
    try:
        _on_ranks(prepare, only_rank0=True)
        model_sd, optim_sd = get_state_dict(model, _torch_optimizers(optimizer), options=_OPTIONS)
        # DCP coordinates the ranks itself: a failure on any rank raises on every rank
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        _on_ranks(write_rank_files)
        _on_ranks(commit, only_rank0=True)
    except (OSError, CheckpointException, RuntimeError, KeyboardInterrupt) as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # a signal, not the disk: torch.save's writer reports it as another error, and C++ drops
        # the cause, so the handler's record (`entry_point`) is what tells
        if PROGRESS.interrupted is not None:
            raise RunInterrupted(PROGRESS.interrupted) from None
        if isinstance(e, (RuntimeError, KeyboardInterrupt)) and not isinstance(
            e, CheckpointException
        ):
            raise
        reason = getattr(e, "strerror", None) or str(e).strip().splitlines()[-1]
        raise OSError(
            getattr(e, "errno", None),
            f"saving checkpoint {final} failed ({reason}); nothing was overwritten, the "
            f"last complete checkpoint is still in {root}",
        ) from e
    PROGRESS.saving = None
    return final


def load_train_state(path: str | os.PathLike, model: nn.Module, optimizer, scheduler) -> TrainState:
    """Restore model, optimizer, scheduler and this rank's RNG states from a checkpoint.

    Collective (every rank). Build the model, optimizer and scheduler exactly as for a fresh
    run first; their state is overwritten here.

    Returns:
        TrainState with the step and data position to continue from.

    Raises:
        ValueError: the checkpoint is incomplete or does not match the model/optimizer (the
            message names the checkpoint and the first mismatching keys).
    """
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise ValueError(f"{path}: no {COMPLETE_MARKER} marker; not a finished checkpoint")
    # this run's hyperparameters (lr, betas, weight_decay, ...) as built from its config
    # (cloned: torchao keeps lr as a tensor, which loading overwrites in place)
    fresh_groups = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]
    optimizers = _torch_optimizers(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizers, options=_OPTIONS)
    state_dict = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state_dict, checkpoint_id=str(path / "dcp"))
    except (CheckpointException, ValueError, RuntimeError) as e:  # CheckpointException wraps
        # each rank's failure and is a BaseException, not an Exception
        raise ValueError(
            f"{path / 'dcp'}: does not match this model/optimizer ({str(e).strip().splitlines()[-1][:300]}); "
            "resume with the same model, trainable parameters and optimizer, or --resume none"
        ) from e
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state_dict["model"],
        optim_state_dict=state_dict["optim"],
        options=_LOAD_OPTIONS,
    )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    _keep_this_runs_schedule(optimizer, scheduler, fresh_groups)
    meta = json.loads((path / "trainer_state.json").read_text())
    saved_world = meta.get("world_size", 1)
    # more ranks than saved: a new rank takes rank (r mod saved)'s state (every rank started from
    # the same seed); exact only at the same world size
    rng_file = path / f"rng_rank{_rank() % saved_world}.pt"
    if not rng_file.is_file():
        raise ValueError(
            f"{rng_file} is missing although trainer_state.json says {saved_world} ranks wrote "
            "this checkpoint; it is damaged, resume from another one"
        )
    rng = torch.load(rng_file, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if (
        "cuda" in rng
        and torch.cuda.is_available()
        and len(rng["cuda"]) == torch.cuda.device_count()
    ):
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "samples_consumed" in meta:
        samples = meta["samples_consumed"]
    else:  # written before the position was global: micro-batches of one rank, all ranks data-parallel
        samples = meta["batches_consumed"] * meta["config"]["micro_batch_size"] * saved_world
    return TrainState(meta["step"], meta["epoch"], samples, path)


def _keep_this_runs_schedule(optimizer, scheduler, fresh_groups: list[dict]) -> None:
    """After loading: the checkpoint gives the state (moments, step counts, the schedule's
    position), this run's config gives the hyperparameters.

    `set_state_dict` and `LRScheduler.load_state_dict` restore the saved param-group values and
    base lrs, so a resume with a new `--max_steps` (or `--lr`, `--weight_decay`) would silently
    keep the old ones, and its next lr would be the old schedule's (0 after its last step). This
    puts back the groups built from this run's config and, for a LambdaLR (the scripts' warmup +
    cosine), sets each lr to `base_lr * lr_lambda(last_epoch)`: the lr of the next step under this
    run's schedule (bit-identical to the saved lr when nothing changed). Other schedulers keep the
    checkpoint's lr until their next step.
    """
    for group, fresh in zip(optimizer.param_groups, fresh_groups, strict=True):
        group.update(fresh)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    scheduler.base_lrs = [float(group["initial_lr"]) for group in optimizer.param_groups]
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        lr = base * fn(scheduler.last_epoch)
        if isinstance(group["lr"], torch.Tensor):  # torchao's low-bit AdamW keeps lr as a tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def read_checkpoint_config(path: str | os.PathLike) -> dict:
    """The config a checkpoint was written with (trainer_state.json's "config")."""
    return json.loads((Path(path) / "trainer_state.json").read_text())["config"]


def resume_training(
    resume: str | os.PathLike,
    ckpt_dir: str | os.PathLike,
    model: nn.Module,
    optimizer,
    scheduler,
    config: dict,
    is_main: bool,
) -> TrainState:
    """Continue from the checkpoint `resume` names, or start fresh; what every script runs once
    after building its model, optimizer and scheduler.

    Collective when there is a checkpoint (every rank loads its shards): call it on every rank.
    Rank 0 (`is_main`) prints one line, e.g. `resuming from out/checkpoints/step_000010: step 10,
    epoch 0, sample 80; config changed: lr 1e-05 -> 2e-05, max_steps 10 -> 20`, and says so when
    the checkpoint is already at max_steps (a finished run rerun: no step to train).

    Args:
        resume: "auto", "none" or a checkpoint directory (`resolve_resume`).
        ckpt_dir: the run's checkpoint directory (`out_dir/checkpoints`).
        model, optimizer, scheduler: built as for a fresh run; overwritten from the checkpoint.
        config: this run's resolved config (`dataclasses.asdict(cfg)`), compared with the saved.
        is_main: this rank prints.

    Returns:
        The checkpoint's TrainState, or a fresh `TrainState()` when there is none to resume.

    Raises:
        ValueError: `resume` is not a complete checkpoint, or the checkpoint does not match the
            model/optimizer (from `resolve_resume` / `load_train_state`).
    """
    PROGRESS.ckpt_dir = Path(ckpt_dir)
    path = resolve_resume(str(resume), ckpt_dir)
    if path is None:
        PROGRESS.state = TrainState()
        return PROGRESS.state
    state = PROGRESS.state = load_train_state(path, model, optimizer, scheduler)
    state.config_changes = _config_changes(read_checkpoint_config(path), config)
    if is_main:
        changed = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in _shown(state.config_changes))
        done = config.get("max_steps") is not None and state.step >= config["max_steps"]
        print(
            f"resuming from {path}: step {state.step}, epoch {state.epoch}, "
            f"sample {state.samples_consumed}"
            + (f"; config changed: {changed}" if changed else "")
            + (
                f"; max_steps={config['max_steps']} is reached: no step to train (raise "
                "--max_steps to train on, or pass --overwrite to start anew)"
                if done
                else ""
            )
        )
    return state


def _shown(changes: dict) -> list[tuple[str, tuple[str, str]]]:
    """(key, (old, new)) of `_config_changes` as printed: values as repr, `(missing)` for none."""
    return [
        (k, tuple("(missing)" if v is _MISSING else repr(v) for v in pair))
        for k, pair in changes.items()
    ]


_MISSING = "<missing>"  # a key only one config has (`_config_changes`)


def final_model_config(
    config: dict, state: TrainState, start_step: int, model_path: str | os.PathLike
) -> dict | None:
    """The config the end-of-run save records beside the weights (training_config.json), or None
    when the save must not write.

    A run that trained a step in this invocation (`state.step > start_step`, the step it resumed
    at) writes its model and its own `config`. A rerun that found max_steps reached trained
    nothing: its weights are the checkpoint's, so a complete saved model (`model_path` with its
    training_config.json, written last) stays as it is, even when this invocation was started
    with another lr; a missing one (the run stopped between its last checkpoint and the save) is
    written with the config the checkpoint was trained with. Rank 0 decides and every rank gets
    its answer (the save is collective).

    Args:
        config: this invocation's resolved config (`dataclasses.asdict(cfg)`).
        state: the TrainState after the loop; `state.path` its last checkpoint.
        start_step: `state.step` right after `resume_training`.
        model_path: the final save's directory (`out_dir/model`).
    """
    if state.step > start_step:
        return config
    complete = [(Path(model_path) / "training_config.json").is_file()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(complete, src=0)
    if complete[0]:
        return None
    return read_checkpoint_config(state.path) if state.path else config


def _config_changes(saved: dict, config: dict) -> dict:
    """{key: [old, new]} for each key whose value differs, sorted by key ({} if none).

    Values are compared as JSON holds them (the saved config went through JSON: a tuple is a
    list there). A key only one side has shows `_MISSING` on the other.
    """
    config = json.loads(json.dumps(config, default=str))
    changes = {}
    for key in sorted(saved.keys() | config.keys()):
        old, new = saved.get(key, _MISSING), config.get(key, _MISSING)
        if old != new:
            changes[key] = [old, new]
    return changes
