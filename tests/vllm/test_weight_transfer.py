"""The collective weight transfer (runtime.weight_transfer, gloo on CPU) into vLLM engines that
are Ray actors, against the runtime model it sends.

Two engines of one tied-embedding model: tensor_parallel_size=2 and 1, so the transfer group has
the trainer (rank 0) and three workers, and each engine's workers need their own ranks. Runs only
in the vLLM venv (`make test-vllm`); the engines take about 30 s to start on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

from runtime import HFWeightSource, ModelArgs, build_model, save_hf_checkpoint
from runtime.rollout import RolloutPipeline, make_engine_actor
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.vllm
ray = pytest.importorskip("ray")

LOGPROB_ATOL = 1e-4  # fp32 on both sides (see test_vllm_engine.py)
MAX_MODEL_LEN = 64
ARGS = ModelArgs(
    **{**TINY_CONFIG, "hidden_size": 128, "head_dim": 32},
    max_position_embeddings=MAX_MODEL_LEN,
    tie_word_embeddings=True,  # the source must send the tied head too
)
SEQUENCE, PROMPT_LEN = [3, 14, 15, 92, 65, 35, 89, 79, 32], 3


@torch.no_grad()
def _logprobs(model) -> torch.Tensor:
    ids = torch.tensor([SEQUENCE])
    logits = model.eval()(ids)[0, PROMPT_LEN - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, PROMPT_LEN:, None])[:, 0]


def _perturb(model, seed: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)


def test_two_engines_receive_broadcast_weights_and_score_like_the_trainer(tmp_path):
    model = build_model(ARGS, device="cpu")
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, tmp_path, ARGS.to_hf_config())
    ray.init(num_cpus=4, include_dashboard=False)
    kwargs = dict(
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=32 * 2**20,
        skip_tokenizer_init=True,
        max_num_seqs=4,
        weight_transfer_config={"backend": "gloo"},
    )
    engines = [
        make_engine_actor("vllm", str(tmp_path), "float32", 0, 1, 2, kwargs),
        make_engine_actor("vllm", str(tmp_path), "float32", 1, 1, 1, kwargs),
    ]
    pipeline = RolloutPipeline(engines, [], {}, weight_sync_timeout_s=120, owns_ray=True)
    try:
        # a bad update list is refused on the engine before anything is received
        bad = {"names": ["model.embed_tokens.weights"], "dtype_names": ["float32"], "shapes": [[1]]}
        with pytest.raises(KeyError, match="embed_tokens"):
            ray.get(engines[1].receive_weights.remote(bad))
        before = torch.tensor(ray.get(engines[0].score.remote([SEQUENCE], [PROMPT_LEN]))[0])
        torch.testing.assert_close(before, _logprobs(model), atol=LOGPROB_ATOL, rtol=0)
        source = HFWeightSource(model, torch.float32, torch.device("cpu"))
        for version in (1, 2):  # the group is opened once and reused
            _perturb(model, seed=version)
            pipeline.transfer_weights(source, version)
            expected = _logprobs(model)
            for i, engine in enumerate(engines):
                got = torch.tensor(ray.get(engine.score.remote([SEQUENCE], [PROMPT_LEN]))[0])
                print(
                    f"v{version} engine {i}: max |vLLM - trainer| = {(got - expected).abs().max():.2e}"
                )
                torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)
                assert ray.get(engine.policy_version.remote()) == version
            assert (expected - before).abs().max() > 100 * LOGPROB_ATOL  # the weights moved
        with pytest.raises(ValueError, match="same HFWeightSource"):
            pipeline.transfer_weights(HFWeightSource(model, torch.float32, torch.device("cpu")), 3)
    finally:
        pipeline.shutdown()
