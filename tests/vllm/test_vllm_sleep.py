"""VLLMEngine's sleep mode (the colocated layout) on one CUDA GPU: a level-2 sleep frees the
engine's weights and KV cache (NVML's free memory rises by at least the weights), waking the
weights, loading a new policy and then waking the KV cache gives the new policy's scores; a
level-1 sleep brings back the same weights. vLLM's sleep mode runs on CUDA (and ROCm) only, so
on CPU (`make test-vllm` there) these are skipped with that reason."""

from __future__ import annotations

import pytest
import torch

from runtime import ModelArgs, build_model, load_hf_checkpoint, save_hf_checkpoint
from tests.helpers import TINY_CONFIG

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode is CUDA/ROCm only"),
]
ARGS = ModelArgs(**{**TINY_CONFIG, "hidden_size": 128, "head_dim": 32}, max_position_embeddings=64)
SEQUENCE, PROMPT_LEN = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], 4
LOGPROB_ATOL = 1e-4


def _runtime_logprobs(model) -> torch.Tensor:
    ids = torch.tensor([SEQUENCE])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids)[0, PROMPT_LEN - 1 : -1].float(), dim=-1)
    return logprobs.gather(-1, ids[0, PROMPT_LEN:, None])[:, 0]


def test_sleep_levels_free_and_restore(tmp_path):
    from runtime.rollout_vllm import VLLMEngine

    model = build_model(ARGS, device="cpu")
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, tmp_path, ARGS.to_hf_config())
    engine = VLLMEngine(
        str(tmp_path), dtype="float32", enforce_eager=True, max_model_len=64,
        skip_tokenizer_init=True, gpu_memory_utilization=0.2, enable_sleep_mode=True,
    )  # fmt: skip
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    torch.testing.assert_close(
        torch.tensor(engine.score([SEQUENCE], [PROMPT_LEN])[0]), _runtime_logprobs(model),
        atol=LOGPROB_ATOL, rtol=0,
    )  # fmt: skip
    # level 1: weights to host memory and back, the same scores
    assert engine.sleep(1)["freed"] >= weight_bytes
    assert engine.wake_up()["restored"] >= weight_bytes
    torch.testing.assert_close(
        torch.tensor(engine.score([SEQUENCE], [PROMPT_LEN])[0]), _runtime_logprobs(model),
        atol=LOGPROB_ATOL, rtol=0,
    )  # fmt: skip
    # level 2: both dropped; weights woken, the next policy loaded, then the KV cache
    trainer = build_model(ARGS, device="cpu")
    load_hf_checkpoint(trainer, tmp_path)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    assert engine.sleep(2)["freed"] >= weight_bytes
    engine.wake_up(["weights"])
    engine.update_weights({k: v.detach().clone() for k, v in trainer.named_parameters()}, 1)
    engine.wake_up(["kv_cache"])
    torch.testing.assert_close(
        torch.tensor(engine.score([SEQUENCE], [PROMPT_LEN])[0]), _runtime_logprobs(trainer),
        atol=LOGPROB_ATOL, rtol=0,
    )  # fmt: skip
    engine.shutdown()
