"""Scaffold runtime: the thin, numerically verified library that emitted train.py scripts import.

Public API = the names below; scripts import only these, so any change shows in examples/.
"""

from runtime.checkpoint import (
    checkpoint_dtype,
    copy_tokenizer_files,
    load_hf_checkpoint,
    prepare_out_dir,
    read_hf_config,
    save_hf_checkpoint,
)
from runtime.config import ConfigError, entry_point
from runtime.config import parse as parse_config
from runtime.config_checks import common_config_errors
from runtime.context_parallel import (
    apply_context_parallel,
    context_parallel_chunks,
    shard_for_context_parallel,
)
from runtime.data import (
    infinite_batches,
    load_rows,
    pad_with_unsupervised_copies,
    split_train_val,
    to_messages,
    to_preference,
)
from runtime.dtensors import ComputedTensor
from runtime.expert_parallel import apply_expert_parallel
from runtime.generate import generate, sample
from runtime.grpo import (
    collate_rollouts,
    completion_logprobs,
    group_advantages,
    scatter_completion_values,
)
from runtime.hub import (
    base_model_id,
    hub_repo_id,
    resolve_data_path,
    resolve_model_dir,
    scaffold_home,
)
from runtime.lora import (
    LORA_TARGET_MODULES,
    LoRALinear,
    adapter_param_names,
    adapters_disabled,
    add_lora,
    init_lora,
    is_adapter_param,
    load_adapter,
    merged_hf_tensors,
    nf4_params_fsdp_cannot_shard,
    save_adapter,
)
from runtime.loss import (
    IGNORE_INDEX,
    chunked_kd_loss,
    cross_entropy_sum,
    kd_kl_sum,
    linear_cross_entropy,
    token_logprobs,
    vocab_parallel_cross_entropy_sum,
)
from runtime.metrics import (
    MetricsLogger,
    logger_errors,
    peak_memory_mib,
    transformer_flops_per_token,
)
from runtime.models.llama import CausalLM, KVCache, LlamaForCausalLM, ModelArgs, build_model
from runtime.models.moe import load_balancing_loss
from runtime.offload import offload_activations
from runtime.optim import cosine_schedule_with_warmup
from runtime.optim_in_backward import setup_optimizer_in_backward
from runtime.packing import (
    collate_preference_packs,
    document_attention_mask,
    expand_to_tokens,
    pack_examples,
    pack_preference_pairs,
    pack_rollouts,
    packed_completion_values,
    packed_position_ids,
    packing_efficiency,
    sequence_sums,
)
from runtime.parallel import (
    DistInfo,
    all_reduce_sum,
    build_mesh,
    cast_frozen_params,
    check_tp_degree,
    clip_grad_norm,
    destroy_distributed,
    disable_fsdp_gradient_division,
    init_distributed,
    llama_block_tp_plan,
    llama_tp_plan,
)
from runtime.quiet import silence_known_noise
from runtime.rollout import (
    HFWeightSource,
    ReplayBuffer,
    Rollout,
    RolloutPipeline,
    RolloutStep,
    RuntimeEngine,
    check_ray_resources,
    engine_gpu_ids,
    gather_hf_state_dict,
    gather_merged_hf_state_dict,
    init_ray,
    make_engine_actor,
    make_reward_workers,
    sampling_seed,
)
from runtime.tokenizer import Tokenizer, check_same_tokenizer, check_vocab_fits
from runtime.train_state import (
    ResumableDistributedSampler,
    TrainState,
    load_train_state,
    read_checkpoint_config,
    resolve_resume,
    resume_training,
    save_train_state,
)

# no module above imports torchao at import time, so this still runs before torchao's first import
silence_known_noise()

__all__ = [
    "ReplayBuffer",
    "Rollout",
    "RolloutPipeline",
    "RolloutStep",
    "RuntimeEngine",
    "check_ray_resources",
    "engine_gpu_ids",
    "collate_rollouts",
    "completion_logprobs",
    "HFWeightSource",
    "gather_hf_state_dict",
    "gather_merged_hf_state_dict",
    "init_ray",
    "group_advantages",
    "make_engine_actor",
    "make_reward_workers",
    "sampling_seed",
    "scatter_completion_values",
    "clip_grad_norm",
    "common_config_errors",
    "entry_point",
    "infinite_batches",
    "resume_training",
    "sample",
    "apply_expert_parallel",
    "IGNORE_INDEX",
    "LORA_TARGET_MODULES",
    "CausalLM",
    "ComputedTensor",
    "ConfigError",
    "DistInfo",
    "KVCache",
    "LlamaForCausalLM",
    "LoRALinear",
    "MetricsLogger",
    "logger_errors",
    "ResumableDistributedSampler",
    "ModelArgs",
    "Tokenizer",
    "TrainState",
    "adapter_param_names",
    "adapters_disabled",
    "add_lora",
    "all_reduce_sum",
    "apply_context_parallel",
    "build_mesh",
    "cast_frozen_params",
    "build_model",
    "check_tp_degree",
    "check_same_tokenizer",
    "check_vocab_fits",
    "context_parallel_chunks",
    "checkpoint_dtype",
    "copy_tokenizer_files",
    "cosine_schedule_with_warmup",
    "chunked_kd_loss",
    "kd_kl_sum",
    "cross_entropy_sum",
    "destroy_distributed",
    "disable_fsdp_gradient_division",
    "document_attention_mask",
    "generate",
    "init_distributed",
    "init_lora",
    "is_adapter_param",
    "linear_cross_entropy",
    "llama_block_tp_plan",
    "llama_tp_plan",
    "load_balancing_loss",
    "load_adapter",
    "load_hf_checkpoint",
    "load_rows",
    "load_train_state",
    "merged_hf_tensors",
    "nf4_params_fsdp_cannot_shard",
    "pack_examples",
    "pack_preference_pairs",
    "pack_rollouts",
    "packed_completion_values",
    "packed_position_ids",
    "packing_efficiency",
    "collate_preference_packs",
    "expand_to_tokens",
    "sequence_sums",
    "offload_activations",
    "parse_config",
    "peak_memory_mib",
    "prepare_out_dir",
    "read_checkpoint_config",
    "read_hf_config",
    "resolve_resume",
    "resolve_data_path",
    "resolve_model_dir",
    "hub_repo_id",
    "base_model_id",
    "save_adapter",
    "save_hf_checkpoint",
    "save_train_state",
    "scaffold_home",
    "setup_optimizer_in_backward",
    "shard_for_context_parallel",
    "pad_with_unsupervised_copies",
    "split_train_val",
    "to_messages",
    "to_preference",
    "token_logprobs",
    "transformer_flops_per_token",
    "vocab_parallel_cross_entropy_sum",
]
