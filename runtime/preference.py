"""DPO's reference model: where the reference log-probabilities of a preference pair come from.

The DPO loss compares the policy's log-probability of each reply with a frozen reference's. The
emitted script keeps the loss and how a model scores a batch (its `sequence_logprobs`); this module
holds the rest, which does not change with the recipe: a frozen copy in host memory, the one pass
that scores every pair before training (ref_mode="precomputed"), that table's file in out_dir and
its checks on resume, and the per-batch look-up.

A scored batch holds P pairs as 2P sequences: the P chosen ones, then their P rejected ones, and
sample_ids [P] int64, the pairs' ids (row numbers in the data file). `logprob_fn(model, batch)`
returns that batch's sequence log-probs [2P] fp32 (sum over each reply's tokens) in the same order.
KTO's batches have the same layout: P examples, their P completions then their P KL sequences (the
example's prompt with another example's completion), sample_ids the examples' ids.

Shape legend: P pairs of a batch, N = the largest pair id + 1 (rows of the table).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from runtime.checkpoint import load_hf_checkpoint
from runtime.models.llama import ModelArgs, build_model
from runtime.parallel import all_reduce_sum
from runtime.train_state import ResumableDistributedSampler

LogprobFn = Callable[[nn.Module, dict], torch.Tensor]


def frozen_cpu_copy(model_args: ModelArgs, model_dir: Path, dtype: torch.dtype) -> nn.Module:
    """A frozen, unsharded copy of the checkpoint in host memory (DPO's ref_device="cpu").

    Every rank holds the whole model, stored in `dtype` (the compute dtype: half the memory in
    bf16), in eval mode, with no gradient buffers and no optimizer state.
    """
    model = build_model(model_args, device="meta")
    model.requires_grad_(False)  # never trained
    model.to_empty(device=torch.device("cpu"))
    model.init_rope()
    load_hf_checkpoint(model, model_dir)
    return model.to(dtype).eval()


@torch.no_grad()
def reference_logprobs(
    reference: nn.Module | None, table: torch.Tensor | None, batch: dict, logprob_fn: LogprobFn
) -> torch.Tensor:
    """The reference's sequence log-probs [2P] fp32 of `batch` (chosen, then rejected), on the
    device of batch["input_ids"].

    Args:
        reference: a frozen model, scored with `logprob_fn` on its own device (the batch is moved
            there and the result back: a CPU reference serves a GPU policy). Unused with a table.
        table: [N, 2] fp32 from `precompute_reference_logprobs` (row = pair id: chosen, rejected),
            read at batch["sample_ids"], or None.
        batch: tensors of P pairs, with sample_ids [P] int64.
        logprob_fn: (model, batch) -> [2P] fp32 sequence log-probs.

    Raises:
        ValueError: neither a reference nor a table.
    """
    if table is not None:
        ids = batch["sample_ids"].to(table.device)
        return torch.cat([table[ids, 0], table[ids, 1]]).to(batch["input_ids"].device)
    if reference is None:
        raise ValueError("reference_logprobs needs a reference model or a precomputed table")
    ref_device = next(reference.parameters()).device
    ref_batch = {k: v.to(ref_device) for k, v in batch.items()}
    return logprob_fn(reference, ref_batch).to(batch["input_ids"].device)


@torch.no_grad()
def precompute_reference_logprobs(
    model: nn.Module,
    examples: list[dict],
    logprob_fn: LogprobFn,
    collate_fn: Callable[[list[dict]], dict],
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """ref_mode="precomputed": one no-grad pass of `model` over every pair, before training.

    `model` is the untrained policy (with LoRA, `logprob_fn` turns its adapters off), so afterwards
    only one model is resident. Each data-parallel rank scores its shard, in order; an all-reduce
    over `group` (the data-parallel ranks, mesh["dp"]; None = all ranks, which is the same without
    tensor parallel) assembles the table on every rank. `model` is back in train mode afterwards.

    Args:
        examples: pairs ({"id": pair id, ...}) or packed rows of pairs ({"sample_ids": [pair
            ids], ...}), what `collate_fn` takes a list of.
        collate_fn: list of examples -> batch (tensors, with sample_ids [P] int64).
        batch_size: examples per forward.

    Returns:
        [N, 2] fp32 on CPU, row = pair id: the (chosen, rejected) summed log-probs; 0 for an id no
        example holds.
    """
    model.eval()
    pair_ids = [
        i for ex in examples for i in (ex["sample_ids"] if "sample_ids" in ex else [ex["id"]])
    ]
    num_ids = max(pair_ids) + 1  # pair ids, not pack ids
    table = torch.zeros(num_ids, 2, device=device)
    counts = torch.zeros(num_ids, device=device)  # the sampler repeats pairs to even out the shards
    sampler = ResumableDistributedSampler(
        examples, num_replicas=dp_size, rank=dp_rank, shuffle=False
    )
    loader = DataLoader(examples, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn)
    show = dp_rank == 0 and sys.stderr.isatty()  # a bar on a terminal only, as the training loop's
    for mb in tqdm(loader, desc="reference log-probs", disable=not show, dynamic_ncols=True):
        batch = {k: v.to(device) for k, v in mb.items()}
        logps = logprob_fn(model, batch)  # [2P]
        ids = batch["sample_ids"]
        table[ids] += logps.view(2, -1).T  # [2P] -> [P, 2]
        counts[ids] += 1
    if hasattr(model, "reshard"):  # FSDP: a no-grad forward leaves the root's parameters gathered
        model.reshard()
    model.train()
    all_reduce_sum(table, group)  # the tp ranks of one dp rank scored the same pairs
    all_reduce_sum(counts, group)
    return (table / counts.clamp(min=1)[:, None]).cpu()


def load_reference_logprobs(
    path: Path,
    computed_from: dict,
    resumed: Path | None,
    is_main: bool,
    model: nn.Module,
    examples: list[dict],
    logprob_fn: LogprobFn,
    collate_fn: Callable[[list[dict]], dict],
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """ref_mode="precomputed": the [N, 2] table, computed once and kept in `path` for resumes.

    A fresh run computes it (`precompute_reference_logprobs`, the arguments after is_main) and
    the main process saves it with `computed_from` plus {"pairs": len(examples)}. A resumed run's
    policy has moved and is no reference any more, so it reads the file back instead, and refuses
    it if one of those values changed (its rows or their tokens would belong to other data). A
    checkpoint of another run (resumed in a new out_dir, e.g. on another number of ranks) reads
    the table of the run that wrote it, `<its out_dir>/<path.name>`, and the main process copies
    it to `path` for this run's own resumes.

    Args:
        path: the table's file (the scripts': out_dir/reference_logps.pt).
        computed_from: the config fields the table depends on, e.g. model, dataset, max_seq_len,
            dtype: {name: value}.
        resumed: the checkpoint directory the run continues from (`<out_dir>/checkpoints/step_N`),
            or None for a fresh run.

    Returns:
        [N, 2] fp32 on CPU, as `precompute_reference_logprobs`.

    Raises:
        ValueError: resumed, and neither `path` nor the checkpoint's run's table exists, or the
            table was computed from other values (the message names each changed one, with its
            old and new value).
    """
    computed_from = computed_from | {"pairs": len(examples)}
    if resumed is not None:
        source = path
        if not source.is_file():  # a checkpoint of another run: its table is in that run's out_dir
            source = Path(resumed).parent.parent / path.name
        if not source.is_file():
            where = (
                path if source == path else f"{path} (nor {source}, beside the checkpoint's run)"
            )
            raise ValueError(
                f"ref_mode='precomputed' resumes from a checkpoint but {where} is missing, and the trained "
                "policy is no longer the reference; restore the file or start over with --resume none"
            )
        saved = torch.load(source)
        changed = {
            k: (v, computed_from.get(k))
            for k, v in saved["computed_from"].items()
            if computed_from.get(k) != v
        }
        if changed:
            raise ValueError(
                f"{path} was computed for other data: "
                + ", ".join(f"{k} {old!r} (now {new!r})" for k, (old, new) in changed.items())
                + "; resume with the same values, or start over in a new --out_dir (the reference is the untrained policy)"
            )
        if is_main and source != path:
            torch.save(saved, path)
        return saved["reference_logps"]
    table = precompute_reference_logprobs(
        model, examples, logprob_fn, collate_fn, batch_size, dp_rank, dp_size, device, group
    )
    if is_main:
        torch.save({"reference_logps": table, "computed_from": computed_from}, path)
    return table
