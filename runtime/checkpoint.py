"""Hugging Face safetensors checkpoint I/O for runtime models (plain tensors or FSDP2 DTensors).

Runtime modules carry HF names, so file keys equal `model.state_dict()` keys: no key map.
Loading reads one tensor at a time (peak memory = one full tensor); every rank reads the files
and keeps its own shard, so there is no communication. Saving gathers one tensor at a time
(`full_tensor()` is a collective: all ranks call it) and only rank 0 writes.

Shape legend: V vocab_size, D hidden_size.

Reference: safetensors format and HF sharding, https://huggingface.co/docs/safetensors and
`transformers.modeling_utils` (`model.safetensors.index.json` with `weight_map`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from runtime.dtensors import (
    ComputedTensor,
    copy_into,
    gather_for_save,
    global_rank,
    reshard_fsdp,
    save_dtype,
)
from runtime.models.args import ModelArgs
from runtime.models.moe import SparseMoeBlock

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
# Tied output head -> the tensor it shares; tied checkpoints store only the right-hand key.
TIED_KEYS = {"lm_head.weight": "model.embed_tokens.weight"}
# Old HF checkpoints stored RoPE buffers; ours are recomputed, so these keys are skipped.
_IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(model_dir: str | os.PathLike) -> dict:
    """Read `model_dir/config.json`.

    Returns:
        The parsed config dict.

    Raises:
        FileNotFoundError: config.json is missing.
        ValueError: config.json is not a JSON object.
    """
    path = Path(model_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; model_dir must be a Hugging Face model directory with "
            "config.json and *.safetensors (download it or fix the path)."
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-download or fix the file.") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a {type(cfg).__name__}, expected a JSON object.")
    return cfg


@contextlib.contextmanager
def _open_safetensors(path: Path):
    """`safe_open` (on CPU) whose parse errors (truncated or foreign files) name the file."""
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except SafetensorError as e:
        raise ValueError(
            f"{path}: not a valid safetensors file ({e}); the download or copy may be incomplete, "
            "so fetch or save it again."
        ) from e
    with handle as f:
        yield f


def is_tied(model: nn.Module) -> bool:
    """Whether `model.args.tie_word_embeddings` is set (the head shares the embedding)."""
    args = getattr(model, "args", None)
    return bool(getattr(args, "tie_word_embeddings", False))


def _checkpoint_index(model_dir: Path) -> tuple[dict[str, Path], str]:
    """Map every tensor key to the file holding it; also return a name for error messages."""
    index_path, single_path = model_dir / SAFETENSORS_INDEX_NAME, model_dir / SAFETENSORS_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index_path} is not a valid safetensors index ({e!r}).") from e
        return {k: model_dir / f for k, f in weight_map.items()}, str(index_path)
    if single_path.is_file():
        with _open_safetensors(single_path) as f:
            return {k: single_path for k in f.keys()}, str(single_path)
    raise FileNotFoundError(
        f"no {SAFETENSORS_NAME} or {SAFETENSORS_INDEX_NAME} in {model_dir}; only safetensors "
        "checkpoints are supported (convert *.bin with transformers' save_pretrained)."
    )


def _file_shapes(key_to_file: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from the safetensors headers, without reading any data."""
    shapes = {}
    for path in sorted(set(key_to_file.values())):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: listed in the safetensors index but missing.")
        with _open_safetensors(path) as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


_SAFETENSORS_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def checkpoint_shapes(model_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{HF key: shape} of every tensor in a safetensors checkpoint, read from the file headers
    (no tensor data is read).

    Raises:
        FileNotFoundError: no safetensors checkpoint in model_dir, or a shard the index lists.
        ValueError: an index or file that is not valid safetensors (naming it).
    """
    return _file_shapes(_checkpoint_index(Path(model_dir))[0])


def checkpoint_dtype(model_dir: str | os.PathLike) -> torch.dtype:
    """The dtype most floating tensors of a safetensors checkpoint are stored in (headers only),
    e.g. to write a merged export as the base model was shipped.

    Raises:
        FileNotFoundError: no safetensors checkpoint in model_dir.
        ValueError: it holds no float32/bfloat16/float16 tensor.
    """
    key_to_file, source = _checkpoint_index(Path(model_dir))
    counts: dict[torch.dtype, int] = {}
    for path in sorted(set(key_to_file.values())):
        with _open_safetensors(path) as f:
            for key in f.keys():
                dtype = _SAFETENSORS_FLOAT_DTYPES.get(f.get_slice(key).get_dtype())
                if dtype is not None:
                    counts[dtype] = counts.get(dtype, 0) + 1
    if not counts:
        raise ValueError(f"{source}: no float32, bfloat16 or float16 tensor")
    return max(counts, key=counts.get)


def bf16_midpoint_share(
    model_dir: str | os.PathLike, keys: Collection[str] | None = None, sample: int = 4096
) -> float:
    """Share of a checkpoint's weights that lie exactly halfway between two bf16 values (ties),
    where round-to-nearest-even sits on the even neighbour and the smallest change toward the
    other one flips the cast a whole bf16 step.

    A bf16 run computes with the bf16 cast of fp32 master weights, so at the first optimizer step
    about half of the ties (those whose update points away from the even neighbour) move a whole
    bf16 step, all along the update's sign: a much larger first step than the lr asks for
    (docs/DESIGN.md#demo-assets). Random fp32 values are ties with probability 2^-16; fp32 values
    widened from fp16 1/8 of the time (their lowest 3 of 10 mantissa bits 100); a Q4_1 GGUF
    dequantized to fp32 8% (SmolLM2-135M); bf16 values never.

    Args:
        model_dir: a safetensors checkpoint (single file or sharded with an index).
        keys: the tensors to look at (e.g. the trained parameters' HF names); None: every
            floating tensor. Keys the checkpoint lacks are skipped.
        sample: values read per tensor (its first rows; a 0-d tensor whole): enough for the
            share, cheap at 70B.

    Returns:
        The share in [0, 1]: each tensor's share among the values read, weighted by the
        tensor's size (0.0 when nothing was read).

    Raises:
        FileNotFoundError: no safetensors checkpoint in model_dir.
    """
    key_to_file, _ = _checkpoint_index(Path(model_dir))
    wanted = key_to_file.keys() if keys is None else [k for k in keys if k in key_to_file]
    hits = total = 0
    for path in sorted({key_to_file[k] for k in wanted}):
        with _open_safetensors(path) as f:
            for key in [k for k in wanted if key_to_file[k] == path]:
                piece = f.get_slice(key)
                dtype = piece.get_dtype()
                if dtype not in _SAFETENSORS_FLOAT_DTYPES:
                    continue
                shape = piece.get_shape()
                size = int(torch.Size(shape).numel())
                if size == 0:
                    continue
                if shape:  # the first rows: at least `sample` values
                    values = piece[: -(-sample // max(1, size // shape[0]))]
                else:  # a 0-d tensor (a scale): slicing does not apply
                    values = f.get_tensor(key)
                total += size
                if dtype != "BF16":  # a bf16 value is on the grid by definition
                    bits = values.float().contiguous().view(torch.int32) & 0xFFFF
                    hits += size * float((bits == 0x8000).float().mean())
    return hits / total if total else 0.0


def _plan_load(model, key_to_file, source, strict, exclude=()) -> dict[str, str]:
    """Return {model param name: file key}; raise ValueError listing every mismatch."""
    params = {
        n: p for n, p in model.named_parameters() if n not in exclude
    }  # tied head deduplicated
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    file_keys = {k for k in key_to_file if not k.endswith(_IGNORED_KEY_SUFFIXES)}
    file_keys -= experts_held_elsewhere(model)  # expert parallel: other ranks load those
    plan = {n: n for n in params if n in file_keys}
    for name, src in TIED_KEYS.items():
        if name in params and name not in file_keys and src in file_keys and is_tied(model):
            plan[name] = src  # tie broken (e.g. by to_empty): fill the head from the embedding
    missing = sorted(set(params) - set(plan))
    unexpected = sorted(file_keys - set(params) - aliases)
    shapes = _file_shapes({k: key_to_file[k] for k in set(plan.values())})
    wrong = [
        f"{n}: file {list(shapes[k])} vs model {list(params[n].shape)}"
        for n, k in plan.items()
        if shapes[k] != tuple(params[n].shape)
    ]
    if wrong or (strict and (missing or unexpected)):
        found = [
            f"{what} {_preview(items)}"
            for what, items in [
                ("missing keys", missing if strict else []),
                ("unexpected keys", unexpected if strict else []),
                ("shape mismatches", wrong),
            ]
            if items
        ]
        raise ValueError(
            f"checkpoint {source} does not match the model: {'; '.join(found)}. Check that "
            "config.json matches the weights (ModelArgs.from_hf_config), or pass strict=False "
            "to skip missing/unexpected keys."
        )
    return plan


def _preview(items: list[str], limit: int = 6) -> str:
    """At most `limit` items of a list for an error message, then how many more there are."""
    if len(items) <= limit:
        return str(items)
    return f"{items[:limit]} and {len(items) - limit} more"


def load_hf_checkpoint(
    model: nn.Module,
    model_dir: str | os.PathLike,
    strict: bool = True,
    exclude: Collection[str] = (),
) -> None:
    """Load HF safetensors weights into `model`'s parameters in place.

    Works for plain and FSDP2 (`fully_shard`, DTensor) parameters, after `to_empty` for models
    built on meta. Casts to each parameter's dtype. Tied models: files without `lm_head.weight`
    are fine (the head is the embedding's Parameter, or is filled from it). NF4 parameters
    (QLoRA) are quantized from the file's tensor one at a time (`runtime.dtensors.copy_into_nf4`), so
    the full-precision model never exists in memory.

    Args:
        model: module whose `state_dict` keys are HF keys (e.g. `LlamaForCausalLM`).
        model_dir: directory with `model.safetensors` or `model.safetensors.index.json`.
        strict: raise on missing or unexpected keys (shape mismatches always raise).
        exclude: parameter names the checkpoint does not hold and the caller initialises itself
            (e.g. `runtime.lora.adapter_param_names(model)`); left untouched, never "missing".
            `trainer_only_names(model)` are always excluded.

    Raises:
        FileNotFoundError: no safetensors checkpoint in model_dir.
        ValueError: missing / unexpected / wrong-shape keys (all listed, naming the file).
        RuntimeError: a parameter is still on the meta device afterwards.
    """
    key_to_file, source = _checkpoint_index(Path(model_dir))
    reshard_fsdp(model)
    exclude = set(exclude) | trainer_only_names(model)
    plan = _plan_load(model, key_to_file, source, strict, exclude)
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for name, key in plan.items():
        by_file.setdefault(key_to_file[key], []).append(name)
    for path, names in sorted(by_file.items()):
        with _open_safetensors(path) as f:
            for name in names:
                copy_into(params[name], f.get_tensor(plan[name]))  # one tensor at a time
    on_meta = [n for n, p in model.named_parameters() if p.is_meta and n not in exclude]
    if on_meta:
        raise RuntimeError(
            f"parameters still on the meta device after loading {source}: {on_meta}. Call "
            "model.to_empty(device=...) before load_hf_checkpoint, and initialise parameters "
            "that the checkpoint does not contain."
        )


def trainer_only_names(model: nn.Module) -> set[str]:
    """Names of the parameters only the trainer has: those under the submodules listed in
    `model.trainer_only_modules` (a tuple of module names, e.g. PPO's `("value_head",)`; none if
    the attribute is absent). The HF checkpoint holds none of them: `load_hf_checkpoint` leaves
    them to the caller, and `tensors_to_save` (the HF save, the collective weight sync) and
    `runtime.rollout.gather_hf_state_dict` (the object-store sync) leave them out, so the engines
    and `transformers` see the plain causal LM. The training checkpoint (`save_train_state`) keeps
    them like every other parameter."""
    prefixes = tuple(f"{m}." for m in getattr(model, "trainer_only_modules", ()))
    return {n for n, _ in model.named_parameters() if prefixes and n.startswith(prefixes)}


def tensors_to_save(model: nn.Module, hf_config: dict) -> dict[str, torch.Tensor]:
    """{HF key: tensor} that `save_hf_checkpoint` writes by default: parameters and persistent
    buffers (a tied head is left out, as HF does; so are `trainer_only_names`); under expert
    parallel every rank's experts as `ComputedTensor`s broadcast from their owners (see
    `expert_parallel_save_tensors`)."""
    trainer_only = trainer_only_names(model)
    tensors = {n: p for n, p in model.named_parameters() if n not in trainer_only}
    persistent = set(model.state_dict().keys())
    tensors.update({n: b for n, b in model.named_buffers() if n in persistent})
    if hf_config.get("tie_word_embeddings", False):
        for name in TIED_KEYS:
            tensors.pop(name, None)
    local_experts, all_experts = expert_parallel_save_tensors(model)
    if all_experts:  # expert parallel: every rank's experts, broadcast from their owners
        tensors = {n: t for n, t in tensors.items() if n not in local_experts}
        tensors.update(all_experts)
    return tensors


def expert_parallel_save_tensors(model: nn.Module) -> tuple[set[str], dict]:
    """For `save_hf_checkpoint`: every expert of every expert-parallel block, gathered.

    Returns:
        (names of this rank's local expert parameters, {HF key: ComputedTensor} for all E
        experts of each block in key order). `compute()` broadcasts the weight from the rank that
        holds it to the whole ep group (a collective, one tensor at a time).
    """
    local: set[str] = set()
    out: dict = {}
    for prefix, block in model.named_modules():
        if not isinstance(block, SparseMoeBlock) or block.ep_group is None:
            continue
        n_local = block.num_experts // block.ep_size
        mine = {int(e): expert for e, expert in block.experts.items()}
        template = next(iter(mine.values()))
        local.update(
            f"{prefix}.experts.{e}.{n}" for e, x in mine.items() for n, _ in x.named_parameters()
        )
        for e in range(block.num_experts):
            for name, ref in template.named_parameters():
                held = dict(mine[e].named_parameters())[name] if e in mine else None
                src = e // n_local
                out[f"{prefix}.experts.{e}.{name}"] = ComputedTensor(
                    ref.shape,
                    ref.dtype,
                    _broadcast_from(held, ref, block.ep_group, src),
                )
    return local, out


def _broadcast_from(held, ref: torch.Tensor, group, src: int):
    def compute() -> torch.Tensor:
        buf = held.detach().clone() if held is not None else torch.empty_like(ref)
        dist.broadcast(buf, group=group, group_src=src)
        return buf

    return compute


def experts_held_elsewhere(model: nn.Module) -> set[str]:
    """HF keys of the expert weights that other ranks hold (expert parallel): a checkpoint's
    keys this rank's model does not load, without them counting as unexpected."""
    keys: set[str] = set()
    for prefix, block in model.named_modules():
        if isinstance(block, SparseMoeBlock) and block.ep_group is not None:
            mine = {int(e) for e in block.experts}
            names = [n for n, _ in next(iter(block.experts.values())).named_parameters()]
            keys.update(
                f"{prefix}.experts.{e}.{n}"
                for e in range(block.num_experts)
                if e not in mine
                for n in names
            )
    return keys


def current_umask() -> int:
    """The process umask (e.g. 0o022), read without leaving it changed.

    POSIX has no call that only reads it: `os.umask` sets it and returns the old value, so it is
    set back at once. In the moment between, the mask is the restrictive 0o077, so a file another
    thread creates then comes out more private, never more public.
    """
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def apply_umask_modes(root: str | os.PathLike) -> None:
    """Give directory `root` and everything under it the modes a plain `open()` / `mkdir` would
    have given: files 0o666 & ~umask, directories 0o777 & ~umask (0o644 / 0o755 under 0o022).

    Call on a temporary directory before renaming it (or its files) into place, so the final
    names appear with these modes. Needed because `tempfile.mkdtemp` creates 0o700 and
    safetensors 0.8 writes through a 0o600 temporary file (safetensors issue #782), which left
    saved models readable by their owner only. Symlinks are not followed or changed.

    Raises:
        OSError: a chmod failed (e.g. a file belongs to another user).
    """
    mask = current_umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    os.chmod(root, dir_mode)
    for dirpath, dirnames, filenames in os.walk(root):  # walk does not follow directory links
        for names, mode in ((filenames, file_mode), (dirnames, dir_mode)):
            for name in names:
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):
                    os.chmod(path, mode)


def _plan_shards(tensors, dtype, max_shard_bytes) -> list[list[str]]:
    """Greedily group tensor names into shards of at most max_shard_bytes (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * save_dtype(t, dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_hf_checkpoint(
    model: nn.Module,
    out_dir: str | os.PathLike,
    hf_config: dict,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    tensors: dict[str, torch.Tensor | ComputedTensor] | None = None,
) -> None:
    """Write `model` as a Hugging Face directory (safetensors + config.json).

    Call on every rank: DTensor parameters are gathered with `full_tensor()` (a collective), one
    tensor at a time; only rank 0 (or a process without torch.distributed) writes. Files go to a
    temporary directory next to out_dir and are renamed into place, so readers never see a
    half-written checkpoint: a new out_dir appears whole; into an existing one each file is
    replaced atomically (other files there, e.g. the tokenizer, are kept; stale weight shards
    from an earlier save are removed).

    Args:
        model: module with HF state-dict keys (e.g. `LlamaForCausalLM`).
        out_dir: target directory.
        hf_config: config.json contents (e.g. `ModelArgs.to_hf_config()`); its "dtype" and
            "torch_dtype" are set to the saved floating dtype. A tied config
            (`tie_word_embeddings`) saves no `lm_head.weight`.
        max_shard_bytes: above this total, write `model-0000i-of-0000N.safetensors` shards plus
            `model.safetensors.index.json`; else one `model.safetensors` (bytes).
        dtype: cast floating tensors to this dtype (None = keep each parameter's dtype).
        tensors: what to write instead of the model's parameters and persistent buffers, by HF
            key (e.g. `runtime.lora.merged_hf_tensors`); `ComputedTensor` values are computed
            when their shard is written.

    Raises:
        OSError: writing failed (disk full, permissions, or safetensors' own I/O error); the
            message names out_dir. The temporary directory is removed, so a new out_dir never
            exists half-written.
    """
    out_dir = Path(out_dir)
    is_writer = global_rank() == 0
    reshard_fsdp(model)
    tensors = tensors_to_save(model, hf_config) if tensors is None else tensors
    shards = _plan_shards(tensors, dtype, max_shard_bytes)
    tmp = None
    existed = out_dir.exists()
    try:
        if is_writer:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards):
            fname = SAFETENSORS_NAME if len(shards) == 1 else _shard_name(i, len(shards))
            block = {n: gather_for_save(tensors[n], dtype, is_writer) for n in names}
            if is_writer:
                save_file(block, tmp / fname, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(names, fname))
            del block  # free this shard before gathering the next
        if is_writer:
            _write_metadata(tmp, tensors, weight_map, hf_config, dtype, sharded=len(shards) > 1)
            apply_umask_modes(tmp)  # before the rename: out_dir never appears as 0o700 / 0o600
            _move_into_place(tmp, out_dir)
    except (OSError, SafetensorError) as e:
        raise _save_error(e, out_dir, existed) from e
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves no temp dir behind
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank reads the checkpoint before rank 0 finished writing it


def _save_error(e: Exception, out_dir: Path, existed: bool) -> OSError:
    """One OSError naming out_dir for any write failure (safetensors reports I/O in its own type)."""
    code = getattr(e, "errno", None)
    if code is None:  # SafetensorError: "... I/O error: No space left on device (os error 28)"
        found = re.search(r"os error (\d+)", str(e))
        code = int(found.group(1)) if found else None
    reason = os.strerror(code) if code else str(e)
    filename = str(getattr(e, "filename", None) or "")
    named = filename and ".tmp-" not in filename and filename != str(out_dir)  # not the temp dir
    where = f" ({filename})" if named else ""
    left = (
        f"files already moved into the existing {out_dir} may be from this save"
        if existed
        else f"{out_dir} was not created"
    )
    err = OSError(
        f"could not save the checkpoint to {out_dir}: {reason}{where}; {left}, and the "
        "temporary files are removed. Free space there or save to another directory."
    )
    err.errno = code
    return err


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_metadata(tmp, tensors, weight_map, hf_config, dtype, sharded) -> None:
    """config.json (with the saved dtype) and, when sharded, the HF index json."""
    float_dtypes = {save_dtype(t, dtype) for t in tensors.values() if t.is_floating_point()}
    config = dict(hf_config)
    if len(float_dtypes) == 1:
        name = str(float_dtypes.pop()).removeprefix("torch.")
        config["dtype"] = config["torch_dtype"] = name  # 5.x and 4.x field names
    (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if sharded:
        total = sum(t.numel() * save_dtype(t, dtype).itemsize for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / SAFETENSORS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename tmp to out_dir, or (out_dir exists) replace its files one by one, config last."""
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    new_files = sorted(p.name for p in tmp.iterdir())
    weights = [n for n in new_files if n != CONFIG_NAME]
    for name in [*weights, CONFIG_NAME]:
        os.replace(tmp / name, out_dir / name)
    for old in out_dir.iterdir():
        is_weight = old.name.startswith("model") and old.name.endswith(
            (".safetensors", SAFETENSORS_INDEX_NAME)
        )
        if is_weight and old.name not in new_files:
            old.unlink()  # a stale shard or single file from an earlier save


def copy_tokenizer_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy the tokenizer / chat template / generation config files that exist in src_dir.

    Returns:
        The names of the files copied (subset of `TOKENIZER_FILES`).
    """
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            # content only: a new file with the user's umask, not the source's mode and time
            # (the cache's files may be 0o600, or 0o644 where the user asked for private files)
            shutil.copyfile(src_dir / name, dst_dir / name)
            copied.append(name)
    return copied


def prepare_out_dir(path: str | os.PathLike, name: str = "out_dir") -> Path:
    """Create the output directory now and check that files can be written in it.

    A run should fail at startup, not after loading the model or at its first save.

    Args:
        path: the directory (created with its parents when missing).
        name: the config field that set it, named in the error.

    Returns:
        `path` as a Path.

    Raises:
        OSError: path is a file, lies under a file, or cannot be created or written.
    """
    out = Path(path).expanduser()
    try:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"{out} is a file")
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # the directory exists; is it writable?
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        at = f": {e.filename}" if getattr(e, "filename", None) else ""
        raise OSError(
            f"{name}={str(path)!r}: cannot write there ({reason}{at}); expected a writable "
            f"directory, so choose another --{name}."
        ) from e
    return out


def read_model_args(model_dir: str | os.PathLike, positions: dict[str, int]) -> ModelArgs:
    """The model's dimensions from `model_dir`/config.json, checked against the run's length.

    Args:
        model_dir: a Hugging Face model directory.
        positions: the config options whose sum is the longest sequence the run builds (e.g.
            {"max_seq_len": 512}, or {"max_prompt_len": 256, "max_new_tokens": 64}).

    Raises:
        ValueError: config.json is missing or unreadable (`read_hf_config`), or the sum exceeds the
            model's max_position_embeddings (RoPE was trained up to it); the message names the
            options to lower.
    """
    path = Path(model_dir) / "config.json"
    model_args = ModelArgs.from_hf_config(read_hf_config(model_dir), source=str(path))
    needed = sum(positions.values())
    if needed > model_args.max_position_embeddings:
        names = " + ".join(positions)
        asked = f"{names}={needed}" if len(positions) == 1 else f"{names} = {needed}"
        lower = " or ".join(f"--{name}" for name in positions)
        raise ValueError(
            f"{asked} exceeds the model's max_position_embeddings="
            f"{model_args.max_position_embeddings}; lower {lower}"
        )
    return model_args


def save_hf_model(
    model: nn.Module,
    model_dir: str | os.PathLike,
    path: str | os.PathLike,
    config: dict,
    is_main: bool,
) -> None:
    """The trained model in Hugging Face layout: config.json and model.safetensors (with the
    source's config, so `transformers` loads it), the tokenizer files of `model_dir`, and the
    run's resolved config as training_config.json.

    Collective under FSDP: every rank calls it (the shards are gathered one tensor at a time);
    rank 0 (`is_main`) writes.
    """
    save_hf_checkpoint(model, path, read_hf_config(model_dir))
    if is_main:
        copy_tokenizer_files(model_dir, path)
        (Path(path) / "training_config.json").write_text(json.dumps(config, indent=2))
