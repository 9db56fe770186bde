"""Scaffold runtime: the thin, numerically verified library that emitted train.py scripts import.

Public API = the names below; scripts import only these, so any change shows in examples/.
"""

from runtime.checkpoint import (
    copy_tokenizer_files,
    load_hf_checkpoint,
    read_hf_config,
    save_hf_checkpoint,
)
from runtime.cli import ConfigError
from runtime.cli import parse as parse_config
from runtime.data import load_rows, split_train_val, to_messages
from runtime.generate import generate
from runtime.hub import resolve_data_path, resolve_model_dir, scaffold_home
from runtime.loss import IGNORE_INDEX, cross_entropy_sum, linear_cross_entropy
from runtime.metrics import MetricsLogger, peak_memory_mib, transformer_flops_per_token
from runtime.models.llama import CausalLM, KVCache, LlamaForCausalLM, ModelArgs, build_model
from runtime.models.moe import load_balancing_loss
from runtime.offload import offload_activations
from runtime.optim import cosine_schedule_with_warmup
from runtime.optim_in_backward import setup_optimizer_in_backward
from runtime.packing import (
    document_attention_mask,
    pack_examples,
    packed_position_ids,
    packing_efficiency,
)
from runtime.parallel import (
    DistInfo,
    all_reduce_sum,
    build_mesh,
    destroy_distributed,
    disable_fsdp_gradient_division,
    init_distributed,
)
from runtime.tokenizer import Tokenizer

__all__ = [
    "IGNORE_INDEX",
    "CausalLM",
    "ConfigError",
    "DistInfo",
    "KVCache",
    "LlamaForCausalLM",
    "MetricsLogger",
    "ModelArgs",
    "Tokenizer",
    "all_reduce_sum",
    "build_mesh",
    "build_model",
    "copy_tokenizer_files",
    "cosine_schedule_with_warmup",
    "cross_entropy_sum",
    "destroy_distributed",
    "disable_fsdp_gradient_division",
    "document_attention_mask",
    "generate",
    "init_distributed",
    "linear_cross_entropy",
    "load_balancing_loss",
    "load_hf_checkpoint",
    "load_rows",
    "pack_examples",
    "packed_position_ids",
    "packing_efficiency",
    "offload_activations",
    "parse_config",
    "peak_memory_mib",
    "read_hf_config",
    "resolve_data_path",
    "resolve_model_dir",
    "save_hf_checkpoint",
    "scaffold_home",
    "setup_optimizer_in_backward",
    "split_train_val",
    "to_messages",
    "transformer_flops_per_token",
]
