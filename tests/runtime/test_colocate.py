"""The colocated layout's runtime parts, in process (no Ray): the runtime engine's sleep / wake
cycle frees and restores the bytes it reports (counted from its parameters' storages), a level-2
engine refuses to sample until new weights arrive and then scores exactly as the trainer; the
optimizer-state move is exact and reports its bytes; the config checks of --layout."""

from __future__ import annotations

import types

import pytest
import torch

from runtime import offload_optimizer_state, restore_optimizer_state, rollout_config_errors
from runtime.grpo import collate_rollouts, completion_logprobs
from runtime.rollout import RuntimeEngine, gather_hf_state_dict

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

PROMPT, COMPLETION = [1, 2, 3, 4, 5], [10, 11, 12, 13]


def _param_bytes(model) -> int:
    """Bytes of the model's distinct parameter storages (a tied head counted once)."""
    return sum(
        {
            p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
        }.values()
    )


def _trainer_logprobs(model) -> torch.Tensor:
    batch = collate_rollouts([PROMPT], [COMPLETION], pad_token_id=0)
    with torch.no_grad():
        return completion_logprobs(model, batch["input_ids"], batch["labels"])[0, 4:8]


def test_level2_sleep_frees_the_weights_and_a_sync_restores_exact_scores(even_model_dir):
    engine = RuntimeEngine(str(even_model_dir), "float32", seed=0)
    weights = _param_bytes(engine.model)
    assert weights > 0 and engine.memory() == {"weights": weights, "host_weights": 0, "kv_cache": 0}
    before = engine.score([PROMPT + COMPLETION], [len(PROMPT)])[0]
    # the policy the trainer would push after a step: the checkpoint's weights, moved
    policy = RuntimeEngine(str(even_model_dir), "float32").model
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))

    assert engine.sleep(2) == {"freed": weights, "level": 2}
    assert engine.memory()["weights"] == 0  # every storage really shrank to 0 bytes
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([PROMPT], 1, 2, 1.0, 1.0, [], seed=0)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights(gather_hf_state_dict(policy), 1)
    with pytest.raises(ValueError, match="awake engine"):
        engine.sleep(1)

    assert engine.wake_up(["kv_cache"]) == {"restored": 0}  # vLLM's second wake: nothing here
    assert engine.wake_up() == {"restored": weights}
    assert engine.memory()["weights"] == weights
    with pytest.raises(RuntimeError, match="discarded"):  # uninitialised until a sync
        engine.score([PROMPT + COMPLETION], [len(PROMPT)])
    engine.update_weights(gather_hf_state_dict(policy), 1)
    got = engine.score([PROMPT + COMPLETION], [len(PROMPT)])[0]
    torch.testing.assert_close(torch.tensor(got), _trainer_logprobs(policy), atol=1e-6, rtol=0)
    assert max(abs(a - b) for a, b in zip(got, before, strict=True)) > 1e-3  # the sync mattered
    # sampled log-probs equal the trainer's on the sampled tokens too
    (ids, logps), = engine.generate([PROMPT], 1, 4, 1.0, 1.0, [], seed=3)[0]  # fmt: skip
    batch = collate_rollouts([PROMPT], [ids], pad_token_id=0)
    with torch.no_grad():
        want = completion_logprobs(policy, batch["input_ids"], batch["labels"])[0, 4 : 4 + len(ids)]
    torch.testing.assert_close(torch.tensor(logps), want, atol=1e-5, rtol=0)


def test_level1_sleep_on_cpu_keeps_the_weights_and_says_so(even_model_dir):
    """On a CPU engine level 1 has nowhere to move the weights (the device is host memory): it
    frees 0 bytes, reports 0, and the engine samples the same policy after waking."""
    engine = RuntimeEngine(str(even_model_dir), "float32", seed=0)
    before = engine.score([PROMPT + COMPLETION], [len(PROMPT)])[0]
    weights = engine.memory()["weights"]
    assert engine.sleep(1) == {"freed": 0, "level": 1}
    assert engine.memory()["weights"] == weights
    with pytest.raises(RuntimeError, match="asleep"):
        engine.score([PROMPT + COMPLETION], [len(PROMPT)])
    assert engine.wake_up() == {"restored": 0}
    assert engine.score([PROMPT + COMPLETION], [len(PROMPT)])[0] == before


def test_optimizer_state_offload_frees_and_restores_exactly():
    """The state's storages shrink to 0 bytes while offloaded (the bytes reported are theirs),
    come back bit for bit into the same tensor objects, and the run's steps equal one without
    offloading. On this CPU machine the "device" offloaded from is the CPU itself
    (device_type="cpu"); by default a CPU run's state stays put."""

    def run(offload: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert offload_optimizer_state(optimizer, "cpu") == []  # no state before the first step
        for _ in range(3):
            model(torch.randn(3, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if offload:
                assert offload_optimizer_state(optimizer) == []  # CPU state: stays by default
                tensors = [t for s in optimizer.state.values() for t in s.values()]
                want = [t.clone() for t in tensors]
                state_bytes = sum(t.nbytes for t in tensors)
                moved = offload_optimizer_state(optimizer, "cpu")
                assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
                assert restore_optimizer_state(moved) == state_bytes
                current = [t for s in optimizer.state.values() for t in s.values()]
                assert all(a is b for a, b in zip(current, tensors, strict=True))
                assert all(torch.equal(a, b) for a, b in zip(tensors, want, strict=True))
        return model.weight.detach().clone()

    assert torch.equal(run(True), run(False))


def _cfg(**kw):
    base = dict(
        rollout="sync", max_staleness=2, weight_sync_every_steps=1, weight_transfer="auto",
        engine="runtime", num_engines=1, engine_tensor_parallel_size=1,
        engine_gpu_memory_utilization=0.3, engine_cpu_kv_cache_gib=1.0, engine_num_cpus=1,
        num_reward_workers=1, weight_sync_timeout_s=300.0, rollout_timeout_s=1800.0,
        ray_address="", ray_num_cpus=0, dtype="fp32", device="cpu", layout="colocated",
        engine_sleep_level=2, offload_optimizer=False,
    )  # fmt: skip
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),
        ({"layout": "split"}, None),
        ({"layout": "shared"}, "layout='shared': choose one of ('split', 'colocated')"),
        ({"rollout": "async"}, "rollout='async' with layout='colocated'"),
        ({"rollout": "off-policy"}, "cannot overlap"),
        ({"weight_transfer": "collective", "engine": "vllm"}, "layout='colocated' sends weights by 'object-store'"),
        ({"engine_sleep_level": 3}, "engine_sleep_level=3: choose 1"),
        ({"ray_address": "auto"}, "needs a local Ray"),
        ({"engine": "vllm"}, "vLLM's sleep mode runs on CUDA (and ROCm) only"),
    ],
)  # fmt: skip
def test_layout_config_checks(changes, expected):
    errors = rollout_config_errors(_cfg(**changes))
    if expected is None:
        assert errors == []
    else:
        assert any(expected in e for e in errors), errors
    # a script without the colocated fields (rendered for the split layout) is split
    plain = _cfg()
    del plain.layout, plain.engine_sleep_level, plain.offload_optimizer
    assert rollout_config_errors(plain) == []
