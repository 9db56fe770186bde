"""runtime.rollout_setup, the GRPO script's rollout plumbing: the config-derived choices (staleness
bound, weight transfer, its backend, shared GPUs, vLLM's engine arguments), every rollout config
check, the weights `sync_weights` sends (plain and merged LoRA, object store and collective source)
on a real tiny model, the rollouts `share_rollouts` broadcasts over two gloo ranks, the bookkeeping
of `rollout_stats`, and, on a local Ray (2 CPUs), a pipeline from `start_rollout` that generates
and scores one step and loads pushed weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime import (
    ModelArgs,
    Tokenizer,
    add_lora,
    build_model,
    gather_hf_state_dict,
    gather_merged_hf_state_dict,
    init_lora,
    is_adapter_param,
    load_hf_checkpoint,
    read_hf_config,
)
from runtime import rollout_setup as rs
from runtime.rollout import HFWeightSource, Rollout
from tests.helpers import even_token_reward, spawn

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


@dataclasses.dataclass
class Cfg:
    """The fields the functions read, at the GRPO script's defaults (runtime engine, CPU)."""

    rollout: str = "async"
    max_staleness: int = 2
    weight_sync_every_steps: int = 1
    weight_transfer: str = "auto"
    engine: str = "runtime"
    num_engines: int = 1
    engine_tensor_parallel_size: int = 1
    engine_gpu_memory_utilization: float = 0.3
    engine_cpu_kv_cache_gib: float = 1.0
    engine_num_cpus: float = 1
    num_reward_workers: int = 1
    weight_sync_timeout_s: float = 300.0
    rollout_timeout_s: float = 1800.0
    ray_address: str = ""
    ray_num_cpus: int = 0
    num_generations: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_len: int = 256
    seed: int = 0
    reward_weights: list = dataclasses.field(default_factory=lambda: [1.0])
    dtype: str = "fp32"
    device: str = "cpu"


def _gpus(monkeypatch, count: int, local_world_size: int = 1) -> None:
    """Pretend this node has `count` CUDA devices and torchrun started `local_world_size` trainers."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))


def test_staleness_bound_by_mode():
    assert [rs.staleness_bound(Cfg(rollout=m, max_staleness=3)) for m in rs.ROLLOUTS] == [0, 1, 3]


def test_auto_transfer_is_collective_for_vllm_unless_the_engines_share_the_trainers_gpus(
    monkeypatch,
):
    vllm = Cfg(engine="vllm", device="auto")
    _gpus(monkeypatch, 2)  # 1 trainer process: the engines get GPU 1
    assert not rs.engines_share_gpus(vllm)
    assert rs.resolve_weight_transfer(vllm) == "collective" and rs.transfer_backend(vllm) == "nccl"
    assert rs.resolve_weight_transfer(Cfg(device="auto")) == "object-store"  # runtime engine
    _gpus(monkeypatch, 2, local_world_size=2)  # no GPU left: the engines share the trainer's
    assert rs.engines_share_gpus(vllm) and rs.resolve_weight_transfer(vllm) == "object-store"
    assert not rs.engines_share_gpus(dataclasses.replace(vllm, ray_address="auto"))  # a cluster's
    explicit = dataclasses.replace(vllm, weight_transfer="collective")
    assert rs.resolve_weight_transfer(explicit) == "collective"  # as asked (validate refuses it)
    monkeypatch.setattr(rs, "find_spec", lambda name: object())  # vllm installed
    assert rs.rollout_config_errors(explicit) == [
        "weight_transfer='collective' with the engines on the trainer's GPU(s): one NCCL group "
        "cannot hold two ranks on one GPU; use --weight_transfer object-store, or give the engines "
        "GPUs of their own (`scaffold new --engine-gpus`)"
    ]
    _gpus(monkeypatch, 0)
    assert not rs.engines_share_gpus(vllm) and rs.transfer_backend(vllm) == "gloo"
    assert rs.resolve_weight_transfer(Cfg(engine="vllm")) == "collective"  # vLLM CPU: gloo


def test_vllm_engine_kwargs_size_the_kv_cache_and_name_the_backend(monkeypatch):
    _gpus(monkeypatch, 0)
    assert rs.vllm_engine_kwargs(Cfg()) is None  # runtime engine
    cfg = Cfg(engine="vllm", max_prompt_len=100, max_new_tokens=28, engine_cpu_kv_cache_gib=0.5)
    assert rs.vllm_engine_kwargs(cfg) == {
        "max_model_len": 128,
        "skip_tokenizer_init": True,
        "kv_cache_memory_bytes": 2**29,
        "weight_transfer_config": {"backend": "gloo"},
    }
    _gpus(monkeypatch, 2)
    cfg = dataclasses.replace(cfg, weight_transfer="object-store", device="auto")
    assert rs.vllm_engine_kwargs(cfg) == {
        "max_model_len": 128,
        "skip_tokenizer_init": True,
        "gpu_memory_utilization": 0.3,
    }


@pytest.mark.parametrize(
    "fields, messages",
    [
        ({}, []),
        ({"num_engines": 0, "num_reward_workers": 0}, ["num_engines=0: must be >= 1", "num_reward_workers=0: must be >= 1"]),
        ({"rollout": "overlap"}, ["rollout='overlap': choose one of ('sync', 'async', 'off-policy')"]),
        ({"engine": "sglang"}, ["engine='sglang': choose one of ('runtime', 'vllm')"]),
        # a misspelt transfer gets one message, not a second about the collective one
        ({"weight_transfer": "nccl"}, ["weight_transfer='nccl': choose one of ('auto', 'collective', 'object-store')"]),
        ({"weight_transfer": "collective"}, ["weight_transfer='collective' needs engine='vllm' (vLLM's weight-transfer engine); the runtime engine uses 'object-store'"]),
        ({"engine_tensor_parallel_size": 2}, ["engine_tensor_parallel_size=2: > 1 needs engine='vllm' (the runtime engine runs on one device)"]),
        ({"engine_gpu_memory_utilization": 1.5}, ["engine_gpu_memory_utilization=1.5 must be in (0, 1], engine_cpu_kv_cache_gib=1.0 > 0"]),
        ({"rollout": "off-policy", "max_staleness": 0}, ["max_staleness=0 with rollout='off-policy': must be >= 1 (0 is --rollout sync)"]),
        ({"rollout": "off-policy", "weight_sync_every_steps": 4},
         ["weight_sync_every_steps=4: > 1 only with rollout='off-policy' and at most max_staleness + 1 = 3 (older samples could never be trained)"]),
        ({"weight_sync_every_steps": 2},
         ["weight_sync_every_steps=2: > 1 only with rollout='off-policy' and at most max_staleness + 1 = 3 (older samples could never be trained)"]),
        ({"rollout_timeout_s": 0}, ["weight_sync_timeout_s and rollout_timeout_s must be > 0"]),
    ],
)  # fmt: skip
def test_rollout_config_errors(monkeypatch, fields, messages):
    _gpus(monkeypatch, 0)
    assert rs.rollout_config_errors(Cfg(**fields)) == messages
    assert rs.rollout_config_errors(Cfg(rollout="off-policy", weight_sync_every_steps=3)) == []


def test_vllm_must_import_here_unless_a_cluster_runs_it_over_the_object_store(monkeypatch):
    _gpus(monkeypatch, 0)
    monkeypatch.setattr(rs, "find_spec", lambda name: None)  # vllm not installed
    local = rs.rollout_config_errors(Cfg(engine="vllm"))
    assert len(local) == 1 and local[0].startswith("engine='vllm' but vllm is not installed")
    assert local[0].endswith("or use --engine runtime")
    cluster = rs.rollout_config_errors(Cfg(engine="vllm", ray_address="auto"))  # auto: collective
    assert cluster[0].endswith(
        "(or --weight_transfer object-store: with --ray_address only the cluster needs vllm then)"
    )
    assert rs.rollout_config_errors(Cfg(engine="vllm", ray_address="auto", weight_transfer="object-store")) == []  # fmt: skip
    monkeypatch.setattr(rs, "find_spec", lambda name: object())  # installed
    assert rs.rollout_config_errors(Cfg(engine="vllm", engine_tensor_parallel_size=2)) == []


def _policy(model_dir, lora: bool = False) -> torch.nn.Module:
    """The checkpoint with every weight moved (and, with lora, q/v adapters of nonzero B)."""
    model = build_model(ModelArgs.from_hf_config(read_hf_config(model_dir)), device="cpu")
    load_hf_checkpoint(model, model_dir)
    if lora:
        add_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8)
        init_lora(model, seed=0)  # B = 0; the moves below make it nonzero
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


class RecordingPipeline:
    """Stands in for the RolloutPipeline: records what sync_weights hands it."""

    def __init__(self):
        self.pushed, self.transferred, self.waits = [], [], 0

    def push_weights(self, state, version):
        self.pushed.append((state, version))

    def transfer_weights(self, source, version):
        self.transferred.append(([(n, t.clone()) for n, t in source], version))

    def wait_weight_sync(self):
        self.waits += 1


def test_sync_weights_pushes_the_gathered_policy_in_the_engines_dtype(tiny_model_dir):
    model = _policy(tiny_model_dir)
    pipeline = RecordingPipeline()
    seconds = rs.sync_weights(pipeline, model, Cfg(dtype="bf16"), version=4)
    (state, version), = pipeline.pushed  # fmt: skip
    want = gather_hf_state_dict(model, torch.bfloat16)
    assert version == 4 and seconds >= 0 and state.keys() == want.keys()
    assert all(state[k].dtype == torch.bfloat16 and torch.equal(state[k], want[k]) for k in want)
    assert pipeline.waits == 0  # async: the push queues behind the batches generating
    rs.sync_weights(pipeline, model, Cfg(rollout="sync"), version=5)
    rs.sync_weights(pipeline, model, Cfg(), version=6, wait=True)  # a resumed run's first push
    assert pipeline.waits == 2 and [v for _, v in pipeline.pushed] == [4, 5, 6]
    assert rs.sync_weights(None, model, Cfg(), version=7) >= 0  # another rank: gathers only


def test_sync_weights_sends_a_lora_policy_merged(tiny_model_dir):
    model = _policy(tiny_model_dir, lora=True)
    pipeline = RecordingPipeline()
    rs.sync_weights(pipeline, model, Cfg(), version=1, merged=True)
    state = pipeline.pushed[0][0]
    want = gather_merged_hf_state_dict(model, torch.float32)
    assert state.keys() == want.keys() and not any(is_adapter_param(k) for k in state)
    assert all(torch.equal(state[k], want[k]) for k in want)
    q = model.model.layers[0].self_attn.q_proj
    name = "model.layers.0.self_attn.q_proj.weight"
    with torch.no_grad():  # W + lora_scale * B A, not the base weight
        torch.testing.assert_close(state[name], q.merged_weight(), atol=0, rtol=0)
        assert (state[name] - q.weight).abs().max() > 1e-3


def test_collective_source_is_read_afresh_at_every_sync(tiny_model_dir):
    model = _policy(tiny_model_dir)
    assert rs.weight_source(Cfg(), model, torch.device("cpu")) is None  # runtime: object store
    cfg = Cfg(engine="vllm", dtype="bf16")
    source = rs.weight_source(cfg, model, torch.device("cpu"))
    assert isinstance(source, HFWeightSource) and source.dtype == torch.bfloat16
    assert source.device == torch.device("cpu")  # gloo on CPU
    pipeline = RecordingPipeline()
    rs.sync_weights(pipeline, model, cfg, 1, source)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    rs.sync_weights(pipeline, model, cfg, 2, source)
    (first, v1), (second, v2) = pipeline.transferred
    name = "model.embed_tokens.weight"
    assert (v1, v2) == (1, 2) and pipeline.pushed == [] and pipeline.waits == 0
    assert torch.equal(dict(second)[name], model.model.embed_tokens.weight.to(torch.bfloat16))
    assert not torch.equal(dict(first)[name], dict(second)[name])
    assert rs.weight_source(cfg, model, torch.device("cpu"), merged=True).merged


def _groups(version_of_group: list[int]) -> list[list[Rollout]]:
    return [
        [
            Rollout([1, 2], [3] * (g + i + 1), [-0.5] * (g + i + 1), 0.5 * i, {"a": 1.0 * i, "b": 2.0}, v, g)
            for i in range(2)
        ]
        for g, v in enumerate(version_of_group)
    ]  # fmt: skip


def test_rollout_stats():
    stats = rs.rollout_stats(_groups([3, 1]), version=4)
    # completions of 1, 2 (group 0) and 2, 3 (group 1) tokens; rewards "a" 0, 1, 0, 1 (sample
    # std, as TRL's nanstd: sqrt(4 x 0.25 / 3)), "b" all 2.0 (std 0)
    assert stats == {
        "rewards/a/mean": 0.5,
        "rewards/a/std": pytest.approx(3**-0.5),
        "rewards/b/mean": 2.0,
        "rewards/b/std": 0.0,
        "completions/mean_length": 2.0,
        "completions/min_length": 1,
        "completions/max_length": 3,
        "staleness_max": 3,
        "policy_versions": [3, 3, 1, 1],
    }


def _share(rank: int, world_size: int) -> tuple:
    import torch.distributed as dist

    groups, position = (_groups([0, 2]), (1, 6)) if rank == 0 else (None, None)
    groups, position = rs.share_rollouts(groups, position, dist.get_world_size())
    return [[(r.completion_ids, r.policy_version) for r in g] for g in groups], position


def test_share_rollouts_broadcasts_rank_0s_groups_and_position():
    groups = _groups([0, 2])
    assert rs.share_rollouts(groups, (0, 2), world_size=1) == (groups, (0, 2))  # one rank: as is
    want = [[(r.completion_ids, r.policy_version) for r in g] for g in groups]
    assert spawn(_share, world_size=2) == [(want, (1, 6))] * 2


def test_start_rollout_generates_scores_and_loads_pushed_weights(ray_session, even_model_dir):
    ray = ray_session
    cfg = Cfg(rollout="sync", num_generations=3, max_new_tokens=4, seed=5)
    tokenizer = Tokenizer.from_dir(even_model_dir)
    with pytest.raises(
        ValueError, match=r"need 3\.5 CPUs and 0 GPUs but the Ray cluster has 2 CPUs"
    ):
        rs.start_rollout(Cfg(num_engines=3), even_model_dir, tokenizer, [even_token_reward])
    pipeline = rs.start_rollout(cfg, even_model_dir, tokenizer, [even_token_reward])
    try:
        assert not pipeline.owns_ray and len(pipeline.engines) == len(pipeline.reward_workers) == 1
        assert pipeline.sampling == dict(
            n=3, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,  # Cfg has no top_k: off
            stop_token_ids=tokenizer.stop_token_ids,
        )  # fmt: skip
        prompts = [{"prompt_ids": [1, 2, 3 + i], "prompt": "p", "answer": "0"} for i in range(2)]
        batches = iter([((0, 2), prompts)])
        groups, dropped, _, position, filtered, _ = pipeline.next_groups(batches, 2, 0, rs.staleness_bound(cfg), cfg.seed)  # fmt: skip
        assert (
            position == (0, 2) and dropped == filtered == 0 and [len(g) for g in groups] == [3, 3]
        )
        for group, prompt in zip(groups, prompts, strict=True):
            for r in group:
                assert r.prompt_ids == prompt["prompt_ids"] and 1 <= len(r.completion_ids) <= 4
                assert r.reward == pytest.approx(even_token_reward(r.completion_ids))
                assert len(r.sampler_logprobs) == len(r.completion_ids) and r.policy_version == 0
                # truncated: no stop token at the end (the completion hit max_new_tokens)
                ended = r.completion_ids[-1] in tokenizer.stop_token_ids
                assert r.truncated == (not ended) and (ended or len(r.completion_ids) == 4)
        model = _policy(even_model_dir)
        rs.sync_weights(pipeline, model, cfg, version=1)  # sync: waits for the engines
        assert (
            ray.get(pipeline.engines[0].policy_version.remote()) == 1 and pipeline.sync_refs == []
        )
    finally:
        pipeline.shutdown()
