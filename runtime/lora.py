"""LoRA, DoRA and QLoRA adapters on `nn.Linear`, with PEFT-layout save/load and merged HF export.

`add_lora(model, ["q_proj", "v_proj"], rank=8, alpha=16)` replaces every targeted `nn.Linear` (HF
module names) by a `LoRALinear` that keeps the base `weight` / `bias` under the same names, so the
base still loads 1:1 from HF checkpoints (`model.layers.0.self_attn.q_proj.weight`), and adds

    lora_A.weight            [r, D_in]    kaiming-uniform(a=sqrt(5)), as PEFT
    lora_B.weight            [D_out, r]   zeros, so the adapted model starts equal to the base
    lora_magnitude_vector    [D_out]      DoRA only: ||W||_row at init

The adapter parameter names are PEFT's without the `base_model.model.` prefix and the adapter name
(`default`), so `adapter_model.safetensors` keys are `"base_model.model." + name` (and PEFT stores
DoRA's magnitude as `...lora_magnitude_vector`, exactly our parameter name).

Forward (scale = lora_alpha / lora_rank, computed once in `LoRALinear.__init__`):
    LoRA:  y = x W^T + b + scale * dropout(x) A^T B^T
    DoRA:  y = (m / ||W + scale B A||_row) * (x W^T + scale * x A^T B^T) + b, the norm detached
           (DoRA paper sec. 4.3, and PEFT's `DoraLinearLayer`); with dropout active PEFT's form
           x W^T + b + (m/n - 1) * dropout(x) W^T + (m/n) * scale * dropout(x) A^T B^T.

QLoRA: `add_lora(..., quantize_base=True)` stores each targeted base weight as a frozen torchao
`NF4Tensor` (4-bit NormalFloat, block size 64, double-quantized scalers); the forward dequantizes it
to the input's dtype in each forward and backward (`dequantize_nf4`), adapters stay in the parameter dtype. On the meta device no data
is quantized: the NF4 layout is created empty, and `load_hf_checkpoint` fills it tensor by tensor
(read one full-precision tensor, quantize, keep this rank's shard, free it), so the full-precision
model never exists: peak memory during load = the NF4 model + one full-precision tensor + the
quantization temporaries of at most 2^20 elements at a time (torchao quantizes in chunks).

FSDP2: adapters and NF4 weights are sharded like any parameter (torchao's NF4Tensor implements
FSDP2's all-gather extension), except where FSDP cannot shard NF4: see
`nf4_params_fsdp_cannot_shard`.

Shape legend: B batch, S sequence, D_in in_features, D_out out_features, r lora_rank.

References:
    Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.
    Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", arXiv:2402.09353 (eq. 5, 4.3).
    Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314 (NF4,
    double quantization).
    Hugging Face PEFT 0.21 (`peft/tuners/lora/layer.py`, `dora.py`, `utils/save_and_load.py`):
    init, DoRA convention, adapter_config.json and adapter_model.safetensors layout.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.checkpoint import apply_umask_modes, tensors_to_save
from runtime.dtensors import ComputedTensor, copy_into, global_rank, reshard_fsdp

# HF module names a LoRA adapter may target (the decoder's linear layers and the output head).
LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
)  # fmt: skip
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_KEY_PREFIX = "base_model.model."  # PEFT's PeftModel -> LoraModel -> the transformers model
_ADAPTER_PARAM_SUFFIXES = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")
NF4_BLOCK_SIZE = 64  # QLoRA's block size: one absmax scaler per 64 weights
_NF4_MAX_SCALER_BLOCK = 256  # QLoRA's double-quantization block (scalers per fp32 factor)


def is_adapter_param(name: str) -> bool:
    """True for LoRA/DoRA adapter parameter names (`...q_proj.lora_A.weight`, ...)."""
    return name.endswith(_ADAPTER_PARAM_SUFFIXES)


def _is_nf4(t: torch.Tensor) -> bool:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return type(local).__name__ == "NF4Tensor"


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered if a DTensor (a collective: every rank must call), dequantized
    (to the NF4 tensor's dtype) if NF4."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if type(t).__name__ == "NF4Tensor":
        t = dequantize_nf4(t, t.dtype)
    return t.detach()


def _nf4_scaler_block_size(numel: int, name: str) -> int:
    """Largest double-quantization block <= 256 that divides the number of 64-weight blocks.

    QLoRA uses 256; torchao requires it to divide the block count, which 576-wide models
    (SmolLM2) do not give, so e.g. 576 x 576 weights use 216 (a finer, slightly larger scaler
    quantization: 1 fp32 factor per 216 instead of 256 int8 scalers)."""
    if numel % NF4_BLOCK_SIZE:
        raise ValueError(
            f"{name}: {numel} weights are not a multiple of the NF4 block size {NF4_BLOCK_SIZE}; "
            "QLoRA cannot quantize it; leave it out of lora_target_modules or use --algo lora"
        )
    n_blocks = numel // NF4_BLOCK_SIZE
    return next(s for s in range(min(_NF4_MAX_SCALER_BLOCK, n_blocks), 0, -1) if n_blocks % s == 0)


def to_nf4_param(weight: torch.Tensor, name: str = "weight") -> nn.Parameter:
    """Quantize a [D_out, D_in] weight to a frozen NF4 Parameter (QLoRA, Dettmers et al. 2023).

    On the meta device this only creates the NF4 layout (no data); `load_hf_checkpoint` fills it.
    The NF4 tensor keeps `weight.dtype` as its dequantization dtype.

    Raises:
        ValueError: the weight's size is not a multiple of the NF4 block size (64).
    """
    from torchao.quantization import to_nf4

    scaler_block = _nf4_scaler_block_size(weight.numel(), name)
    nf4 = to_nf4(weight.detach().contiguous(), NF4_BLOCK_SIZE, scaler_block)
    return nn.Parameter(nf4, requires_grad=False)


def dequantize_nf4(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An NF4Tensor [D_out, D_in] back to a dense tensor in `dtype`; equals torchao's
    `get_original_weight().to(dtype)` bit for bit, about 2x faster on CPU: one lookup of both
    4-bit codes of each byte in a 256-entry table instead of two lookups, a stack and a cat."""
    levels = weight.nf4.to(weight.dtype)  # [16] NormalFloat levels
    pairs = torch.stack([levels.repeat_interleave(16), levels.repeat(16)], dim=-1)  # [256, 2]
    values = pairs.index_select(0, weight.quantized_data.int())  # [numel / 2, 2]
    scalers = weight.dequantize_scalers(
        weight.quantized_scalers, weight.quantization_factor, weight.scaler_block_size
    )  # [numel / block_size], one absmax per block
    dense = values.view(-1, weight.block_size) * scalers[:, None]  # [n_blocks, block_size]
    return dense.view(weight.shape).to(dtype)


class _LinearNF4(torch.autograd.Function):
    """x W^T for a frozen NF4 W: dequantize in forward and again in backward (nothing dense is
    kept between them, as torchao's `LinearNF4`); no gradient for W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight  # not save_for_backward: the NF4 subclass holds no autograd state
        return F.linear(x, dequantize_nf4(weight, x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out @ dequantize_nf4(ctx.weight, grad_out.dtype), None


class LoRALinear(nn.Module):
    """An `nn.Linear` with a trainable low-rank update (LoRA), optionally DoRA and/or an NF4 base.

    Takes over `base.weight` and `base.bias` (same Parameter objects and names), so state-dict
    keys of the base stay HF's. Adapter parameters are created on the base's device (meta stays
    meta) in `base.weight.dtype`, uninitialised: call `reset_lora_parameters` (or `init_lora`).

    Args:
        base: the linear layer to adapt (in place: use `add_lora` to swap it into a model).
        rank: r >= 1.
        alpha: lora_alpha; the update is scaled by `scale = alpha / rank`.
        dropout: dropout probability on the adapter's input (training only).
        use_dora: add DoRA's magnitude vector [D_out].
        quantize_base: store the base weight as a frozen torchao NF4Tensor (QLoRA).

    Raises:
        ValueError: rank < 1, dropout outside [0, 1), or an NF4-incompatible weight size.
    """

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_dora: bool = False,
        quantize_base: bool = False,
        name: str = "linear",
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"lora_rank={rank}: must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"lora_dropout={dropout}: must be in [0, 1)")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.dropout_p, self.use_dora = rank, alpha, dropout, use_dora
        self.scale = alpha / rank  # the one place the LoRA scale is computed
        self.adapters_disabled = False  # True inside `adapters_disabled(model)`: base only
        weight = base.weight
        self.weight = to_nf4_param(weight, name) if quantize_base else weight
        self.bias = base.bias
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        factory = {"device": weight.device, "dtype": weight.dtype}
        # skip_init: no random init now (it would consume the global RNG and is overwritten anyway)
        self.lora_A = nn.utils.skip_init(nn.Linear, self.in_features, rank, bias=False, **factory)
        self.lora_B = nn.utils.skip_init(nn.Linear, rank, self.out_features, bias=False, **factory)
        if use_dora:
            self.lora_magnitude_vector = nn.Parameter(torch.empty(self.out_features, **factory))

    @property
    def is_nf4(self) -> bool:
        return _is_nf4(self.weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha}, dropout={self.dropout_p}, dora={self.use_dora}, nf4={self.is_nf4}"
        )

    def _base_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without bias; an NF4 weight is dequantized to x's dtype (`dequantize_nf4`)."""
        if self.is_nf4:
            return _LinearNF4.apply(x, self.weight)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D_in] -> [..., D_out] in x's dtype (see the module docstring for the math)."""
        base = self._base_linear(x)  # [..., D_out]
        if self.adapters_disabled:  # the base alone (`adapters_disabled`: DPO's reference)
            return base + self.bias if self.bias is not None else base
        dropped = self.lora_dropout(x)
        lora = (
            self.lora_B(self.lora_A(dropped)) * self.scale
        )  # [..., D_in] -> [..., r] -> [..., D_out]
        if not self.use_dora:
            out = base + lora
        else:
            magnitude = self.lora_magnitude_vector / self._weight_norm(x.dtype)  # [D_out]
            if isinstance(self.lora_dropout, nn.Identity) or not self.training:
                out = magnitude * (base + lora)
            else:  # PEFT's form: the magnitude rescales W applied to the dropped-out input
                out = base + (magnitude - 1) * self._base_linear(dropped) + magnitude * lora
        return out + self.bias if self.bias is not None else out

    def _weight_norm(self, dtype: torch.dtype) -> torch.Tensor:
        """||W + scale * B A|| over D_in for each output row: [D_out], detached (DoRA sec. 4.3)."""
        with torch.no_grad():
            weight = dequantize_nf4(self.weight, dtype) if self.is_nf4 else self.weight.to(dtype)
            lora_weight = (self.lora_B.weight @ self.lora_A.weight).to(dtype)  # [D_out, D_in]
            return torch.linalg.norm(weight + self.scale * lora_weight, dim=1).to(dtype)

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """A ~ kaiming_uniform(a=sqrt(5)) (PEFT's default), B = 0, DoRA magnitude = ||W||_row.

        The full A is drawn on CPU in fp32 from `generator` and each rank keeps its shard, so the
        init is the same on every device, process count and rank. Reads the base weight (for
        DoRA): call after the base weights are loaded. Collective under FSDP2 (DoRA gathers W).
        """
        A = torch.empty(self.rank, self.in_features)  # [r, D_in]
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
        copy_into(self.lora_A.weight, A)
        copy_into(self.lora_B.weight, torch.zeros(self.out_features, self.rank))
        if self.use_dora:
            weight = _full(self.weight).float()
            copy_into(self.lora_magnitude_vector, torch.linalg.norm(weight, dim=1))

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A: [D_out, D_in], full (gathered under FSDP2: a collective)."""
        return self.scale * (_full(self.lora_B.weight) @ _full(self.lora_A.weight))

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The weight of an equivalent plain nn.Linear: [D_out, D_in], full, in the adapter dtype.

        LoRA: W + scale * B A. DoRA: (m / ||W + scale * B A||_row) * (W + scale * B A), as PEFT's
        merge. An NF4 base is dequantized first. Collective under FSDP2 (gathers every tensor).
        """
        delta = self.delta_weight()
        weight = _full(self.weight).to(delta.dtype) + delta
        if self.use_dora:
            magnitude = _full(self.lora_magnitude_vector).to(delta.dtype)
            weight = (magnitude / torch.linalg.norm(weight, dim=1))[:, None] * weight
        return weight


def add_lora(
    model: nn.Module,
    target_modules: Iterable[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> list[str]:
    """Replace every `nn.Linear` whose last name component is in `target_modules` by a LoRALinear.

    Works on the meta device (before `fully_shard`) and on real weights. Does not change
    `requires_grad`: the script freezes what it wants (`is_adapter_param`).

    Args:
        model: a runtime `CausalLM` (HF module names).
        target_modules: names from `LORA_TARGET_MODULES` (e.g. "q_proj", "lm_head").
        rank, alpha, dropout, use_dora, quantize_base: see `LoRALinear`.

    Returns:
        The qualified names of the adapted modules, in model order.

    Raises:
        ValueError: an unknown target name (lists the valid ones), a target that matches no module,
            "lm_head" on a model with tied embeddings (the head is the embedding matrix: an adapter
            on it would either corrupt the tie or silently apply to the input embedding too), or
            a bad rank/dropout/NF4 size; a target that names only a mixture of experts' expert
            projections (not adapted: see the message).
    """
    targets = list(dict.fromkeys(target_modules))
    unknown = [t for t in targets if t not in LORA_TARGET_MODULES]
    if unknown or not targets:
        raise ValueError(
            f"lora_target_modules={targets}: unknown {unknown or '(empty list)'}; valid: "
            f"{', '.join(LORA_TARGET_MODULES)}"
        )
    if "lm_head" in targets and getattr(getattr(model, "args", None), "tie_word_embeddings", False):
        raise ValueError(
            "lora_target_modules includes 'lm_head', but this model ties lm_head to embed_tokens "
            "(tie_word_embeddings=True); remove 'lm_head' from --lora_target_modules"
        )
    adapted = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets and type(module) is nn.Linear:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            lora = LoRALinear(module, rank, alpha, dropout, use_dora, quantize_base, name=name)
            setattr(parent, leaf, lora)
            adapted.append(name)
    missing = [t for t in targets if not any(n.rsplit(".", 1)[-1] == t for n in adapted)]
    experts = [
        t
        for t in missing
        if any(".experts." in n and n.endswith("." + t) for n, _ in model.named_modules())
    ]
    if experts:  # type() above: an expert's projection is an nn.Linear subclass, left alone
        raise ValueError(
            f"lora_target_modules: {experts} are only the MoE experts' projections in this model, "
            "which LoRA does not adapt (transformers 5 fuses experts into [E, ...] parameters, onto "
            "which PEFT loads no per-expert adapters); target attention (q_proj, k_proj, v_proj, o_proj)"
        )
    if missing:
        raise ValueError(
            f"lora_target_modules: {missing} match no nn.Linear in this model; remove them"
        )
    return adapted


@contextlib.contextmanager
def adapters_disabled(model: nn.Module, check_frozen_base: bool = True):
    """Within the block the model computes its frozen base: every `LoRALinear` skips its adapter.

    DPO's `ref_mode="adapters-off"` uses it to get the reference model's log-probabilities from
    the policy itself, with no second copy of the weights (as PEFT's `disable_adapter()`), at
    every step; `ref_mode="precomputed"` once, before the first step.

    Args:
        check_frozen_base: refuse a trainable non-adapter parameter (below). False for a pass that
            runs before any update (the precomputed reference): such a parameter has not moved
            yet, so the base is still the untrained policy.

    Raises:
        ValueError: the model has no LoRA adapters, or (check_frozen_base) a parameter that is not
            an adapter is trainable (then the "base" drifts during training and is no fixed
            reference).
    """
    modules = lora_modules(model)
    drifting = [
        n
        for n, p in model.named_parameters()
        if check_frozen_base and p.requires_grad and not is_adapter_param(n)
    ]
    if not modules or drifting:
        what = (
            "the model has no LoRA adapters"
            if not modules
            else (f"{len(drifting)} non-adapter parameters are trainable (e.g. {drifting[0]})")
        )
        raise ValueError(
            f"ref_mode='adapters-off' uses the frozen base as the DPO reference, but {what}, so "
            "the reference would drift; use LoRA DPO (`scaffold new --algo dpo-lora`) with only the "
            "adapters trainable, or set --ref_mode separate (a frozen copy) or precomputed"
        )
    for _, module in modules:
        module.adapters_disabled = True
    try:
        yield model
    finally:
        for _, module in modules:
            module.adapters_disabled = False


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(qualified name, module) of every LoRALinear, in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def adapter_param_names(model: nn.Module) -> set[str]:
    """Names of the adapter parameters (not in HF base checkpoints; skip them when loading)."""
    return {n for n, _ in model.named_parameters() if is_adapter_param(n)}


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """Initialise every adapter (see `LoRALinear.reset_lora_parameters`) from one CPU generator
    seeded with `seed`, module by module in model order: identical on every rank and device.
    Call after `to_empty` and after loading the base weights (DoRA reads them)."""
    generator = torch.Generator().manual_seed(seed)
    for _, module in lora_modules(model):
        module.reset_lora_parameters(generator)


def nf4_params_fsdp_cannot_shard(model: nn.Module, shard_world_size: int) -> set[nn.Parameter]:
    """NF4 weights to pass to `fully_shard(..., ignored_params=...)`: they stay whole on every rank.

    - 1 process: all of them. FSDP2's world-size-1 fast path (torch 2.13) copies only the first
      of the three tensors NF4's `fsdp_pre_all_gather` returns, and the forward fails with
      "not enough values to unpack (expected 3, got 1)" (pytorch/pytorch PR #197999, open).
      There is nothing to shard at 1 process anyway.
    - N processes: those whose rows, 64-weight blocks or scaler blocks do not split evenly over N
      (NF4 shards cannot be padded as FSDP pads plain tensors).

    Args:
        shard_world_size: the ranks FSDP shards over: the size of its mesh's shard dim (dp_shard,
            or dp_shard x cp under context parallel; HSDP replicates over the other dim).
    """
    ignored = set()
    for _, module in lora_modules(model):
        weight = module.weight
        if not _is_nf4(weight):
            continue
        rows, numel = weight.shape[0], weight.numel()
        n_blocks = numel // NF4_BLOCK_SIZE
        n_scaler_blocks = n_blocks // _nf4_scaler_block_size(numel, "weight")
        if shard_world_size == 1 or any(
            n % shard_world_size for n in (rows, n_blocks, n_scaler_blocks)
        ):
            ignored.add(weight)
    return ignored


# --- PEFT layout -------------------------------------------------------------------------------


def adapter_config(model: nn.Module, base_model_name_or_path: str) -> dict:
    """The PEFT `adapter_config.json` contents describing `model`'s adapters.

    Raises:
        ValueError: no adapters, or adapters with different rank/alpha/dropout/DoRA settings
            (one PEFT LoraConfig holds one setting).
    """
    modules = lora_modules(model)
    settings = {(m.rank, m.alpha, m.dropout_p, m.use_dora) for _, m in modules}
    if len(settings) != 1:
        raise ValueError(
            f"adapter_config: expected one (rank, alpha, dropout, dora) setting, got {sorted(settings)}"
        )
    rank, alpha, dropout, use_dora = settings.pop()
    targets = sorted({n.rsplit(".", 1)[-1] for n, _ in modules})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "use_dora": use_dora,
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_adapter(
    model: nn.Module, out_dir: str | os.PathLike, base_model_name_or_path: str
) -> None:
    """Write the adapters in PEFT layout: `adapter_config.json` + `adapter_model.safetensors`.

    Keys are PEFT's (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
    `...lora_magnitude_vector` for DoRA), so `peft.PeftModel.from_pretrained(hf_model, out_dir)`
    loads it. Call on every rank: DTensor adapters are gathered (`full_tensor`, a collective);
    rank 0 writes, into a temporary directory renamed into place file by file.
    """
    out_dir = Path(out_dir)
    is_writer = global_rank() == 0
    config = adapter_config(model, base_model_name_or_path)
    reshard_fsdp(model)
    tensors = {}
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            full = _full(param)  # collective for DTensors: every rank runs it
            if is_writer:
                tensors[PEFT_KEY_PREFIX + name] = full.to("cpu", copy=True).contiguous()
    if is_writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            save_file(tensors, tmp / ADAPTER_WEIGHTS_NAME, metadata={"format": "pt"})
            (tmp / ADAPTER_CONFIG_NAME).write_text(
                json.dumps(config, indent=2, sort_keys=True) + "\n"
            )
            apply_umask_modes(tmp)  # safetensors writes 0o600; the user's umask decides
            for name in (ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME):
                os.replace(tmp / name, out_dir / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank reads the adapter before rank 0 finished writing it


def load_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> None:
    """Load a PEFT-layout adapter (ours or PEFT's own) into `model`'s adapters, strictly.

    Every adapter parameter must be in the file and every file key must be an adapter
    parameter; rank, alpha and DoRA must match `adapter_config.json`. DTensor parameters keep
    their shard (every rank reads the file; no communication).

    Raises:
        FileNotFoundError: adapter_config.json or adapter_model.safetensors is missing.
        ValueError: missing / unexpected keys or shape mismatches (all listed, naming the file),
            or a config that disagrees with the model's adapters.
    """
    adapter_dir = Path(adapter_dir)
    config_path, weights_path = (
        adapter_dir / ADAPTER_CONFIG_NAME,
        adapter_dir / ADAPTER_WEIGHTS_NAME,
    )
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"resume_adapter: {path} not found; give a directory written by save_adapter or "
                "peft's save_pretrained (adapter_config.json + adapter_model.safetensors)"
            )
    saved = json.loads(config_path.read_text())
    expected = adapter_config(model, saved.get("base_model_name_or_path", ""))
    wrong = [
        f"{k}={saved.get(k)!r} (model: {expected[k]!r})"
        for k in ("r", "lora_alpha", "use_dora")
        if saved.get(k, False if k == "use_dora" else None) != expected[k]
    ]
    if wrong:
        raise ValueError(f"{config_path} does not match the model's adapters: {', '.join(wrong)}")
    reshard_fsdp(model)
    params = {n: p for n, p in model.named_parameters() if is_adapter_param(n)}
    with safe_open(weights_path, framework="pt", device="cpu") as f:
        keys = {k.removeprefix(PEFT_KEY_PREFIX): k for k in f.keys()}
        missing = sorted(set(params) - set(keys))
        unexpected = sorted(keys[k] for k in set(keys) - set(params))
        shapes = {n: tuple(f.get_slice(keys[n]).get_shape()) for n in params if n in keys}
        wrong_shape = [
            f"{n}: file {list(s)} vs model {list(params[n].shape)}"
            for n, s in shapes.items()
            if s != tuple(params[n].shape)
        ]
        if missing or unexpected or wrong_shape:
            raise ValueError(
                f"{weights_path} does not match the model's adapters: missing keys {missing}, "
                f"unexpected keys {unexpected}, shape mismatches {wrong_shape}; check "
                "lora_target_modules, lora_rank and use_dora against the saved adapter_config.json"
            )
        for name, param in params.items():
            copy_into(param, f.get_tensor(keys[name]))


def merged_hf_tensors(model: nn.Module, hf_config: dict) -> dict:
    """What `save_hf_checkpoint(..., tensors=...)` writes for a merged export: the base tensors
    under HF names, every LoRALinear weight replaced by its merged weight (computed when written,
    one at a time), no adapter tensors. A model whose saved file equals the plain model with
    `W <- merged_weight()`, loadable by any HF reader."""
    tensors = {
        n: t for n, t in tensors_to_save(model, hf_config).items() if not is_adapter_param(n)
    }
    for name, module in lora_modules(model):
        dtype = module.lora_A.weight.dtype
        shape = torch.Size((module.out_features, module.in_features))
        tensors[f"{name}.weight"] = ComputedTensor(shape, dtype, module.merged_weight)
    return tensors
