"""The GRPO script's rollout plumbing: what its config means for the Ray pipeline, and the calls
that start the pipeline, send it the policy's weights and share its rollouts between ranks.

A GRPO script keeps the algorithm (log-probs, loss, advantages, rewards, prompts, train_step and
the loop); this module turns its config into engines, reward workers and a `RolloutPipeline`,
which owns the scheduling (the loop asks it for each step's groups with `next_groups`).

Every function takes the script's config `cfg` (duck-typed: any object with these fields):
    rollout ("sync" | "async" | "off-policy"), max_staleness, weight_sync_every_steps,
    weight_transfer ("auto" | "collective" | "object-store"), engine ("runtime" | "vllm"),
    num_engines, engine_tensor_parallel_size, engine_gpu_memory_utilization,
    engine_cpu_kv_cache_gib, engine_num_cpus, num_reward_workers, weight_sync_timeout_s,
    rollout_timeout_s, ray_address, ray_num_cpus, and for sampling num_generations,
    max_new_tokens, temperature, top_p, max_prompt_len, seed, reward_weights; dtype
    ("bf16" | "fp32") and device ("auto" | "cuda" | "cpu"); top_k is optional (absent = 0, off:
    scripts rendered before it existed). A script rendered for the colocated
    layout also has layout ("split" | "colocated"), engine_sleep_level (1 | 2) and
    offload_optimizer (bool); one without them is split (`layout_of`).

Layouts: "split" gives the engines GPUs of their own (or, with none left, lets them share the
trainer's, both awake); "colocated" puts them on the trainer's GPUs and alternates: the engines
generate a batch, sleep (`RolloutPipeline.sleep_engines`: level 1 moves their weights to host
memory and drops the KV cache, level 2 drops both), the trainer steps, and the next weight sync
wakes them and loads the new policy. Only sync rollouts fit that alternation.
"""

from __future__ import annotations

import os
import time
from importlib.util import find_spec
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from runtime.rollout import (
    HFWeightSource,
    Rollout,
    RolloutPipeline,
    check_ray_resources,
    engine_gpu_ids,
    gather_hf_state_dict,
    gather_merged_hf_state_dict,
    init_ray,
    make_engine_actor,
    make_reward_workers,
)

ROLLOUTS = ("sync", "async", "off-policy")
LAYOUTS = ("split", "colocated")
ENGINES = ("runtime", "vllm")
WEIGHT_TRANSFERS = ("auto", "collective", "object-store")
ENGINE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}  # cfg.dtype -> the engines' dtype name
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # cfg.dtype -> the weights sent


def staleness_bound(cfg) -> int:
    """Policy versions a trained sample may lag behind the policy it updates: sync 0, async 1,
    off-policy cfg.max_staleness."""
    return {"sync": 0, "async": 1}.get(cfg.rollout, cfg.max_staleness)


def layout_of(cfg) -> str:
    """cfg.layout, or "split" for a config without the field (a script rendered split)."""
    return getattr(cfg, "layout", "split")


def colocated(cfg) -> bool:
    """Whether the engines sleep on the trainer's GPUs while it steps (cfg.layout "colocated")."""
    return layout_of(cfg) == "colocated"


def engines_share_gpus(cfg) -> bool:
    """Whether a local Ray's engines get the trainer's own GPUs: none of this node's GPUs is left
    after its trainer processes (env LOCAL_WORLD_SIZE, 1 without torchrun). False with
    cfg.ray_address (a cluster has its own GPUs), on CPU, or without CUDA."""
    if cfg.ray_address or cfg.device == "cpu" or not torch.cuda.is_available():
        return False
    return engine_gpu_ids(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())[1]


def resolve_weight_transfer(cfg) -> str:
    """ "collective" or "object-store": how weights reach the engines. cfg.weight_transfer "auto" is
    collective for vllm, except when the engines share the trainer's GPUs (one NCCL group cannot
    hold two ranks on one GPU); any other value is returned as it is (`rollout_config_errors`
    checks it)."""
    if cfg.weight_transfer == "auto":
        shared = engines_share_gpus(cfg) or colocated(cfg)
        return "collective" if cfg.engine == "vllm" and not shared else "object-store"
    return cfg.weight_transfer


def transfer_backend(cfg) -> str:
    """The collective transfer's backend: "nccl" when the trainer runs on CUDA (init_distributed's
    rule), else "gloo"."""
    return "nccl" if cfg.device != "cpu" and torch.cuda.is_available() else "gloo"


def rollout_config_errors(cfg) -> list[str]:
    """What is wrong with cfg's rollout fields (empty list: nothing), as `validate()` messages.

    Checks: num_engines, num_reward_workers, weight_sync_every_steps, engine_tensor_parallel_size
    >= 1; rollout, engine and weight_transfer are known choices; a collective transfer has the vllm
    engine and engines on GPUs of their own; engine "vllm" imports here (unless a cluster runs the
    engines and the transfer is object-store); tensor parallelism only with vllm;
    engine_gpu_memory_utilization in (0, 1] and engine_cpu_kv_cache_gib > 0; off-policy
    max_staleness >= 1; weight_sync_every_steps > 1 only off-policy and at most max_staleness + 1;
    both timeouts > 0. A misspelt weight_transfer gets only its own message.

    Returns:
        One message per failed check, in the order above, each naming the field and its value.
    """
    positive = (
        "num_engines",
        "num_reward_workers",
        "weight_sync_every_steps",
        "engine_tensor_parallel_size",
    )
    transfer = resolve_weight_transfer(cfg)
    checks = [  # (holds, message when it does not)
        *((getattr(cfg, n) >= 1, f"{n}={getattr(cfg, n)}: must be >= 1") for n in positive),
        (cfg.rollout in ROLLOUTS, f"rollout={cfg.rollout!r}: choose one of {ROLLOUTS}"),
        (cfg.engine in ENGINES, f"engine={cfg.engine!r}: choose one of {ENGINES}"),
        (cfg.weight_transfer in WEIGHT_TRANSFERS, f"weight_transfer={cfg.weight_transfer!r}: choose one of {WEIGHT_TRANSFERS}"),
        (transfer != "collective" or cfg.engine == "vllm",
         "weight_transfer='collective' needs engine='vllm' (vLLM's weight-transfer engine); the runtime engine uses 'object-store'"),
        (transfer != "collective" or not engines_share_gpus(cfg),
         "weight_transfer='collective' with the engines on the trainer's GPU(s): one NCCL group cannot hold two ranks on one "
         "GPU; use --weight_transfer object-store, or give the engines GPUs of their own (`scaffold new --engine-gpus`)"),
        # a local Ray starts the engines from this Python, and the collective transfer's sender is vLLM's: vllm must
        # import here (the nodes of a cluster have their own)
        (cfg.engine != "vllm" or (bool(cfg.ray_address) and transfer != "collective") or find_spec("vllm") is not None,
         "engine='vllm' but vllm is not installed in this Python; install it in its own venv (CUDA: `pip install vllm`; CPU: "
         "the scaffold repository's scripts/vllm_venv.sh) and run train.py with that venv's python, or use --engine runtime"
         + (" (or --weight_transfer object-store: with --ray_address only the cluster needs vllm then)" if cfg.ray_address else "")),
        (cfg.engine_tensor_parallel_size == 1 or cfg.engine == "vllm",
         f"engine_tensor_parallel_size={cfg.engine_tensor_parallel_size}: > 1 needs engine='vllm' (the runtime engine runs on one device)"),
        (0 < cfg.engine_gpu_memory_utilization <= 1 and cfg.engine_cpu_kv_cache_gib > 0,
         f"engine_gpu_memory_utilization={cfg.engine_gpu_memory_utilization} must be in (0, 1], engine_cpu_kv_cache_gib={cfg.engine_cpu_kv_cache_gib} > 0"),
        (cfg.rollout != "off-policy" or cfg.max_staleness >= 1,
         f"max_staleness={cfg.max_staleness} with rollout='off-policy': must be >= 1 (0 is --rollout sync)"),
        (cfg.weight_sync_every_steps == 1 or (cfg.rollout == "off-policy" and cfg.weight_sync_every_steps <= cfg.max_staleness + 1),
         f"weight_sync_every_steps={cfg.weight_sync_every_steps}: > 1 only with rollout='off-policy' and at most "
         f"max_staleness + 1 = {cfg.max_staleness + 1} (older samples could never be trained)"),
        (cfg.weight_sync_timeout_s > 0 and cfg.rollout_timeout_s > 0, "weight_sync_timeout_s and rollout_timeout_s must be > 0"),
    ]  # fmt: skip
    return [message for holds, message in checks if not holds] + _layout_errors(cfg, transfer)


def _layout_errors(cfg, transfer: str) -> list[str]:
    """The colocated layout's checks (none for split): a known layout; sync rollouts only; the
    object-store transfer; sleep level 1 or 2; a local Ray; vllm's sleep mode needs CUDA."""
    layout = layout_of(cfg)
    if layout not in LAYOUTS:
        return [f"layout={layout!r}: choose one of {LAYOUTS}"]
    if layout == "split":
        return []
    level = getattr(cfg, "engine_sleep_level", 1)
    checks = [
        (cfg.rollout == "sync",
         f"rollout={cfg.rollout!r} with layout='colocated': the engines sleep on the trainer's GPUs while it steps, so "
         "generation cannot overlap training (async, off-policy); use --rollout sync, or --layout split "
         "(engines awake beside the trainer, on GPUs of their own)"),
        (transfer == "object-store",
         "weight_transfer='collective' with layout='colocated': one NCCL group cannot hold two ranks on one GPU; "
         "layout='colocated' sends weights by 'object-store'"),
        (level in (1, 2), f"engine_sleep_level={level}: choose 1 (weights to host memory, KV cache dropped) or 2 (both dropped)"),
        (not cfg.ray_address,
         f"ray_address={cfg.ray_address!r} with layout='colocated': the engines must land on the trainer's own GPUs, "
         "which needs a local Ray (leave --ray_address empty)"),
        (cfg.engine != "vllm" or cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()),
         "engine='vllm' with layout='colocated' on CPU: vLLM's sleep mode runs on CUDA (and ROCm) only; "
         "use --engine runtime on CPU"),
    ]  # fmt: skip
    return [message for holds, message in checks if not holds]


def vllm_engine_kwargs(cfg) -> dict | None:
    """vLLM's engine arguments (None for the runtime engine): a KV cache sized for these sequences
    (max_model_len = max_prompt_len + max_new_tokens tokens), not for the model's full context; on
    CUDA the share of each engine GPU it takes, on CPU engine_cpu_kv_cache_gib of host memory; and
    with the collective transfer its backend (`transfer_backend`)."""
    if cfg.engine != "vllm":
        return None
    kwargs = dict(max_model_len=cfg.max_prompt_len + cfg.max_new_tokens, skip_tokenizer_init=True)
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = cfg.engine_gpu_memory_utilization
    else:  # vLLM CPU would otherwise reserve gpu_memory_utilization (0.92) of the host's memory
        kwargs["kv_cache_memory_bytes"] = int(cfg.engine_cpu_kv_cache_gib * 2**30)
    if colocated(cfg):  # sleep() / wake_up() between batches (CUDA: _layout_errors checks it)
        kwargs["enable_sleep_mode"] = True
    if resolve_weight_transfer(cfg) == "collective":  # the trainer broadcasts from its own device
        kwargs["weight_transfer_config"] = {"backend": transfer_backend(cfg)}
    return kwargs


def start_rollout(cfg, model_dir: str | Path, tokenizer, reward_funcs: list) -> RolloutPipeline:
    """Start (or join) Ray, cfg.num_engines generator engines and cfg.num_reward_workers reward
    workers, and the `RolloutPipeline` over them; returns once every engine has started (rank 0
    only: it is the Ray driver).

    A Ray already initialised in this process (tests, notebooks) is used and left running;
    otherwise a local Ray gets this node's GPUs after the trainer's (`engine_gpu_ids`), or joins
    cfg.ray_address, and `pipeline.shutdown()` stops it. Engines start from the checkpoint in
    model_dir, engine i seeded cfg.seed + i. Colocated (cfg.layout): a local Ray gets exactly the
    trainer's GPUs, and the pipeline puts the engines to sleep (cfg.engine_sleep_level) after each
    batch and wakes them at the next weight push.

    Args:
        model_dir: the HF checkpoint (and tokenizer) directory the engines and reward workers load.
        tokenizer: its `stop_token_ids` end every completion.
        reward_funcs: called per completion (`RewardWorker`), weighted by cfg.reward_weights.

    Raises:
        ValueError: the Ray cluster lacks the CPUs or GPUs the actors need (`check_ray_resources`).
        ConnectionError: no Ray cluster answers at cfg.ray_address (`init_ray`).
        TimeoutError, ray.exceptions.RayActorError: an engine did not start (`wait_engines`).
    """
    import ray

    owns_ray = not ray.is_initialized()  # tests and notebooks may have started it already
    if owns_ray:
        # a local Ray gets this node's GPUs after the trainer's (local ranks use cuda:0..); with
        # none left the engines share the trainer's
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        gpu_ids, shared = engine_gpu_ids(local, torch.cuda.device_count())
        if colocated(cfg):  # exactly the trainer's GPUs, even where more are left
            gpu_ids, shared = list(range(min(local, torch.cuda.device_count()))), False
        init_ray(cfg.ray_address, cfg.ray_num_cpus, gpu_ids)
        if shared and not cfg.ray_address:
            print(
                f"rollout engines share the trainer's GPU(s) {gpu_ids}: no GPU is left after the trainer's"
            )
    tp = cfg.engine_tensor_parallel_size if cfg.engine == "vllm" else 1  # GPUs per engine on CUDA
    gpus_per_engine = tp if torch.cuda.is_available() else 0  # what make_engine_actor reserves
    check_ray_resources(
        cfg.num_engines * cfg.engine_num_cpus + 0.5 * cfg.num_reward_workers,
        cfg.num_engines * gpus_per_engine,
    )
    engine_kwargs = vllm_engine_kwargs(cfg)
    engines = [
        make_engine_actor(cfg.engine, str(model_dir), ENGINE_DTYPES[cfg.dtype], cfg.seed + i, cfg.engine_num_cpus, tp, engine_kwargs)
        for i in range(cfg.num_engines)
    ]  # fmt: skip
    workers = make_reward_workers(
        reward_funcs, cfg.reward_weights, str(model_dir), cfg.num_reward_workers
    )
    sampling = dict(
        n=cfg.num_generations, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, top_k=getattr(cfg, "top_k", 0), stop_token_ids=tokenizer.stop_token_ids,
    )  # fmt: skip
    pipeline = RolloutPipeline(
        engines,
        workers,
        sampling,
        cfg.rollout_timeout_s,
        cfg.weight_sync_timeout_s,
        owns_ray=owns_ray,
        sleep_level=getattr(cfg, "engine_sleep_level", 1) if colocated(cfg) else 0,
    )
    pipeline.wait_engines()  # prints each engine's start; a failed start stops the run here
    return pipeline


def weight_source(
    cfg, model: nn.Module, device: torch.device, merged: bool = False
) -> HFWeightSource | None:
    """The collective transfer's source (`HFWeightSource` of `model` in cfg.dtype, on `device` for
    NCCL or the CPU for gloo), made once and read afresh at every sync; None with the object-store
    transfer. merged: a LoRA/DoRA policy sends W + lora_scale * B A under the base's names."""
    if resolve_weight_transfer(cfg) != "collective":
        return None
    source_device = device if transfer_backend(cfg) == "nccl" else torch.device("cpu")
    return HFWeightSource(model, TORCH_DTYPES[cfg.dtype], source_device, merged=merged)


def sync_weights(
    pipeline: RolloutPipeline | None,
    model: nn.Module,
    cfg,
    version: int,
    source: HFWeightSource | None = None,
    merged: bool = False,
    wait: bool | None = None,
) -> float:
    """Send the policy to the engines as `version`. Every trainer rank calls it (the gathers are
    collectives); rank 0 passes its pipeline, the others None.

    source given (`weight_source`, the collective transfer): rank 0 broadcasts it one tensor at a
    time to every engine worker while the other ranks take part in its gathers; it returns once
    the engines have the weights. None (object-store): the full weights, cast to cfg.dtype, are
    gathered to rank 0's host memory only and pushed through the Ray object store.

    Args:
        merged: object-store only: a LoRA/DoRA policy sends its merged weights W + lora_scale * B A
            (DoRA rescaled per row) under the base checkpoint's HF names (the engines hold a plain
            model); with a source, its own `merged` decides.
        wait: object-store only: block until every engine has loaded the push. None: only with
            cfg.rollout "sync" (its next batch needs them); the others let the push queue behind
            the batches already generating.

    Colocated (cfg.layout): first empties this process's CUDA caching allocator (the engines wake
    into that memory); the pipeline wakes the sleeping engines around the push.

    Returns:
        seconds spent.

    Raises:
        TimeoutError: an engine did not load the weights within cfg.weight_sync_timeout_s (names it).
    """
    start = time.perf_counter()
    if colocated(cfg) and torch.cuda.is_available():
        # the engines wake into this GPU memory: what the trainer's caching allocator keeps
        # reserved (the step's activations, an offloaded optimizer state) goes back to the driver
        torch.cuda.empty_cache()
    if source is not None:
        if pipeline is not None:
            pipeline.transfer_weights(source, version)
        else:
            for _ in source:  # the gathers are collectives: every rank iterates
                pass
        return time.perf_counter() - start
    gather = gather_merged_hf_state_dict if merged else gather_hf_state_dict
    # every rank takes part in the gathers; rank 0 (the one with the pipeline) keeps the tensors
    state = gather(model, TORCH_DTYPES[cfg.dtype], keep=pipeline is not None)
    if pipeline is not None:
        pipeline.push_weights(state, version)
        if wait or (wait is None and cfg.rollout == "sync"):
            pipeline.wait_weight_sync()
    return time.perf_counter() - start


def share_rollouts(
    groups: list[list[Rollout]] | None, position: tuple[int, int] | None, world_size: int
) -> tuple[list[list[Rollout]], tuple[int, int]]:
    """Rank 0's groups and data position (epoch, prompts consumed) on every rank: one
    `broadcast_object_list` from rank 0 of the default group when world_size > 1; the other
    ranks pass None for both. Every rank gets all of them, also the tp / cp ranks that hold no
    data-parallel share of their own (the script splits them over the dp ranks). world_size 1
    returns them unchanged."""
    if world_size > 1:
        box = [(groups, position)]
        dist.broadcast_object_list(box, src=0)
        groups, position = box[0]
    return groups, position


def rollout_stats(groups: list[list[Rollout]], version: int) -> dict:
    """Bookkeeping of a step's N * G rollouts (the advantages and mean reward are the script's),
    under TRL's GRPOTrainer names: rewards/<function name>/mean and /std (each reward function's
    mean and sample std, Bessel-corrected as TRL's `nanstd` and the script's reward_std, over
    the completions; 0.0 for a single completion), completions/mean_length, /min_length and
    /max_length (completion tokens); and staleness_max (versions the oldest lags `version`, the
    policy being trained) and policy_versions (each completion's, in order)."""
    flat = [r for g in groups for r in g]
    lengths = [len(r.completion_ids) for r in flat]
    per_function = {}
    for name in flat[0].rewards:
        values = torch.tensor([float(r.rewards[name]) for r in flat], dtype=torch.float64)
        per_function[f"rewards/{name}/mean"] = values.mean().item()
        per_function[f"rewards/{name}/std"] = values.std().item() if len(values) > 1 else 0.0
    return {
        **per_function,
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": min(lengths),
        "completions/max_length": max(lengths),
        "staleness_max": max(version - r.policy_version for r in flat),
        "policy_versions": [r.policy_version for r in flat],
    }
