"""VLLMEngine (runtime.rollout_vllm) against the runtime's own model on the same weights.

Runs only in the vLLM venv: `make test-vllm` (scripts/vllm_venv.sh, then `pytest -m vllm
tests/vllm`). One engine is started per module (15-35 s on 2 shared CPU cores); fp32 throughout, so vLLM and
the runtime agree to float32 rounding: log-probs within LOGPROB_ATOL, greedy token ids exactly.
"""

from __future__ import annotations

import pytest
import torch

from runtime import ModelArgs, build_model, generate, load_hf_checkpoint, save_hf_checkpoint
from runtime.grpo import collate_rollouts, completion_logprobs, scatter_completion_values
from runtime.rollout_vllm import VLLMEngine
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.vllm

# fp32 on both sides; the two differ only in kernel summation order (measured max |diff|: 7.6e-6
# sampled at T=1, 1.2e-5 at T=0.7, 4.8e-6 scored), so 1e-4 nats leaves room for other CPUs
# without hiding a real mismatch (a weight update moves these log-probs by about 2).
LOGPROB_ATOL = 1e-4
INIT_STD = 0.2  # peaky next-token distributions: greedy argmax margins far above fp32 noise
MAX_MODEL_LEN = 64
# The tiny config (tests/helpers.py TINY_CONFIG), but head_dim 32: vLLM's CPU attention kernels support head sizes
# {32, 64, 80, ...} only (head_dim 16 fails at the first forward: "Unsupported CPU attention").
ARGS = ModelArgs(
    **{**TINY_CONFIG, "hidden_size": 128, "head_dim": 32}, max_position_embeddings=MAX_MODEL_LEN
)
PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 7, 7, 64, 128, 250, 31, 9], [11, 12, 13]]
UPDATE_CHUNK_BYTES = 100 * 2**10  # the q/k/v and gate/up weights are 64 KiB each


def _load_runtime_model(model_dir) -> torch.nn.Module:
    model = build_model(ARGS, device="cpu")
    load_hf_checkpoint(model, model_dir)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(engine, ref): one running VLLMEngine, and ref["model"] = the runtime model whose weights
    the engine holds now (the weight-sync test swaps it, so test order does not matter)."""
    model_dir = tmp_path_factory.mktemp("tiny_llama_vllm")
    model = build_model(ARGS, device="cpu")
    model.init_weights(std=INIT_STD, generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, model_dir, ARGS.to_hf_config())
    engine = VLLMEngine(
        str(model_dir),
        dtype="float32",
        seed=0,
        enforce_eager=True,  # no torch.compile / graph capture: fast start
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=32 * 2**20,  # 32 MiB of CPU KV cache is plenty here
        skip_tokenizer_init=True,  # token ids in and out; the directory has no tokenizer
        max_num_seqs=16,
        # updates in many RPC chunks that cut layers apart (q/k/v of one layer in different
        # chunks), as a 135M model's 256 MiB chunks do: each layer must still load whole
        update_chunk_bytes=UPDATE_CHUNK_BYTES,
    )
    yield engine, {"model": _load_runtime_model(model_dir), "dir": model_dir}
    engine.shutdown()


@torch.no_grad()
def _runtime_logprobs(model, sequence: list[int], start: int, temperature: float) -> torch.Tensor:
    """[len(sequence) - start] fp32: log softmax(logits / T) of sequence[t] given sequence[:t]."""
    ids = torch.tensor([sequence])
    # [1, S, V] -> [T, V]: the logits at t - 1 predict sequence[t], t = start .. S - 1
    logits = model(ids)[0, start - 1 : -1].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, ids[0, start:, None])[:, 0]


def test_greedy_matches_runtime_generate(setup):
    engine, ref = setup
    expected = generate(ref["model"], PROMPTS, max_new_tokens=12, temperature=0.0)
    got = engine.generate(PROMPTS, 1, 12, 0.0, 1.0, [], seed=0)
    assert [rows[0][0] for rows in got] == expected
    # with a stop token: both end at its first occurrence and keep it
    stop = expected[0][3]
    expected = generate(ref["model"], PROMPTS, 12, temperature=0.0, stop_token_ids=[stop])
    got = engine.generate(PROMPTS, 1, 12, 0.0, 1.0, [stop], seed=0)
    assert [rows[0][0] for rows in got] == expected
    assert got[0][0][0][-1] == stop


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_runtime(setup, temperature):
    engine, ref = setup
    n = 4
    got = engine.generate(PROMPTS, n, 10, temperature, 1.0, [], seed=123)
    assert [len(rows) for rows in got] == [n] * len(PROMPTS)
    max_diff = 0.0
    for prompt, rows in zip(PROMPTS, got, strict=True):
        for tokens, logprobs in rows:
            assert len(tokens) == len(logprobs) == 10
            lp = torch.tensor(logprobs)
            assert torch.isfinite(lp).all() and (lp <= 0).all()
            expected = _runtime_logprobs(ref["model"], prompt + tokens, len(prompt), temperature)
            max_diff = max(max_diff, (lp - expected).abs().max().item())
    print(f"T={temperature}: max |vLLM - runtime| sampled-token log-prob = {max_diff:.2e}")
    assert max_diff < LOGPROB_ATOL
    # different completions per prompt, and the same seed reproduces them
    assert len({tuple(t) for t, _ in got[0]}) > 1
    assert engine.generate(PROMPTS, n, 10, temperature, 1.0, [], seed=123) == got


def test_generate_reports_finished_completions(setup):
    """`on_progress` (through vLLM's progress-bar hook) gets the completions finished so far, one
    prompt's n at a time, and does not change what is sampled."""
    engine, _ = setup
    counts = []
    got = engine.generate(PROMPTS, 4, 10, 1.0, 1.0, [], seed=5, on_progress=counts.append)
    assert counts == [4, 8, 12]
    assert got == engine.generate(PROMPTS, 4, 10, 1.0, 1.0, [], seed=5)


@pytest.mark.parametrize("top_p, top_k", [(0.7, 0), (0.9, 5), (1.0, 5)])
def test_truncated_logprobs_follow_the_trainer_convention(setup, top_p, top_k):
    """With top_p < 1 or top_k > 0 vLLM returns log-probs of the distribution it sampled from:
    softmax(logits / T) cut to the top-k / top-p support and renormalised, exactly what
    `runtime.truncate_logits` (the CPU engine's and the GRPO trainer's convention) computes, so
    the importance weight against the trainer's `completion_logprobs` is 1 within 1e-3 on every
    token."""
    engine, ref = setup
    temperature = 0.8
    got = engine.generate(PROMPTS, 4, 8, temperature, top_p, [], seed=7, top_k=top_k)
    prompts = [p for p in PROMPTS for _ in range(4)]
    rows = [row for rows in got for row in rows]
    completions, sampled = [ids for ids, _ in rows], [lps for _, lps in rows]
    batch = collate_rollouts(prompts, completions, pad_token_id=0)
    ids, labels = batch["input_ids"], batch["labels"]
    with torch.no_grad():
        trainer = completion_logprobs(
            ref["model"], ids, labels, temperature, top_k=top_k, top_p=top_p
        )
        untruncated = completion_logprobs(ref["model"], ids, labels, temperature)
    sampler = scatter_completion_values(sampled, [len(p) for p in prompts], ids.shape[1])
    mask = labels != -100
    max_diff = (trainer - sampler)[mask].abs().max().item()
    print(f"top_p={top_p} top_k={top_k}: max |vLLM - trainer| log-prob = {max_diff:.2e}")
    assert max_diff < LOGPROB_ATOL
    assert (torch.exp(trainer - sampler)[mask] - 1).abs().max() <= 1e-3
    # the truncation matters here: the untruncated tempered log-probs are off by the kept mass
    assert (untruncated - sampler)[mask].abs().max() > 1e-3


def test_weight_sync_then_score_matches_trainer(setup):
    engine, ref = setup
    sequence = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
    prompt_len = 4
    before = torch.tensor(engine.score([sequence], [prompt_len])[0])
    expected_before = _runtime_logprobs(ref["model"], sequence, prompt_len, 1.0)
    torch.testing.assert_close(before, expected_before, atol=LOGPROB_ATOL, rtol=0)

    trainer = _load_runtime_model(ref["dir"])  # the "trainer": one noisy step away
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.05)
    named = {k: v.detach().clone() for k, v in trainer.named_parameters()}
    assert engine.update_weights(named, version=1) == 1
    assert engine.policy_version() == 1
    ref["model"] = trainer  # the engine now holds these weights (for the other tests)

    after = torch.tensor(engine.score([sequence], [prompt_len])[0])
    expected_after = _runtime_logprobs(trainer, sequence, prompt_len, 1.0)
    diff = (after - expected_after).abs().max().item()
    print(
        f"score after sync: max |vLLM - trainer| = {diff:.2e}; moved by "
        f"{(after - before).abs().max().item():.2e}"
    )
    torch.testing.assert_close(after, expected_after, atol=LOGPROB_ATOL, rtol=0)
    assert (after - before).abs().max() > 100 * LOGPROB_ATOL  # the update really landed
    # generation uses the new weights too
    got = engine.generate(PROMPTS, 1, 8, 0.0, 1.0, [], seed=0)
    assert [rows[0][0] for rows in got] == generate(trainer, PROMPTS, 8, temperature=0.0)


def test_sleep_needs_sleep_mode_and_leaves_the_engine_working(setup):
    """An engine started without enable_sleep_mode (every split-layout engine, and any on CPU,
    where vLLM's sleep mode does not run) refuses sleep() and keeps serving; wake_up on an awake
    engine does nothing."""
    engine, ref = setup
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        engine.sleep(1)
    assert engine.wake_up() == {"restored": 0}
    got = engine.generate(PROMPTS, 1, 4, 0.0, 1.0, [], seed=0)
    assert [rows[0][0] for rows in got] == generate(ref["model"], PROMPTS, 4, temperature=0.0)


def test_update_weights_rejects_unknown_key_bad_shape_and_partial_state(setup):
    engine, ref = setup
    version = engine.policy_version()
    q = ref["model"].model.layers[0].self_attn.q_proj.weight.detach()
    with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        engine.update_weights({"model.layers.0.self_attn.q_proj.weights": q}, version=9)
    full = {k: v.detach() for k, v in ref["model"].named_parameters()}
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({**full, "model.layers.0.self_attn.q_proj.weight": q[:, :8]}, 9)
    with pytest.raises(ValueError, match="needs every tensor"):  # partial loads give NaN
        engine.update_weights({"model.layers.0.self_attn.q_proj.weight": q}, version=9)
    assert engine.policy_version() == version  # nothing was sent


def test_cpu_head_dim_without_kernel_fails_up_front(tmp_path):
    args = ModelArgs(**TINY_CONFIG)  # head_dim 16: no vLLM CPU attention kernel
    save_hf_checkpoint(build_model(args, device="cpu"), tmp_path, args.to_hf_config())
    with pytest.raises(ValueError, match="head_dim=16"):
        VLLMEngine(str(tmp_path), enforce_eager=True, skip_tokenizer_init=True)


def _saved_model_and_engine(args: ModelArgs, model_dir, **engine_kwargs):
    """A random runtime model of `args` (INIT_STD, seed 0) saved to model_dir, and a VLLMEngine
    started on it (fp32, eager, token ids only, a 32 MiB KV cache)."""
    model = build_model(args, device="cpu")
    model.init_weights(std=INIT_STD, generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, model_dir, args.to_hf_config())
    engine = VLLMEngine(
        str(model_dir),
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=32 * 2**20,
        skip_tokenizer_init=True,
        **engine_kwargs,
    )
    return model, engine


def test_weight_sync_with_tied_embeddings(tmp_path):
    """Tied models (SmolLM2, Qwen3-0.6B): `named_parameters()` has no lm_head.weight, and vLLM's
    layerwise reload would leave its tied head on the old embedding (log-probs off by 0.8,
    measured) unless the engine sends the head too. A second engine, so about 20 s more."""
    args = ModelArgs(
        **{**TINY_CONFIG, "hidden_size": 128, "head_dim": 32},
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=True,
    )
    model, engine = _saved_model_and_engine(args, tmp_path, max_num_seqs=4)
    try:
        sequence, prompt_len = [3, 14, 15, 92, 65, 35, 89, 79], 3
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
        named = {k: v.detach().clone() for k, v in model.named_parameters()}
        assert "lm_head.weight" not in named  # tied: one Parameter, listed once
        engine.update_weights(named, version=3)
        got = torch.tensor(engine.score([sequence], [prompt_len])[0])
        expected = _runtime_logprobs(model.eval(), sequence, prompt_len, 1.0)
        torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)
    finally:
        engine.shutdown()


def test_tensor_parallel_engine_samples_and_syncs_like_the_runtime(tmp_path):
    """tensor_parallel_size=2 (two CPU worker processes, threads unpinned): each worker holds half
    of every attention head group and MLP, so the sampled-token log-probs and, after an update of
    full tensors that every worker shards for itself, the scores must still equal the runtime
    model's. A third engine, so about 25 s more."""
    model, engine = _saved_model_and_engine(
        ARGS,
        tmp_path,
        max_num_seqs=8,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",  # as make_engine_actor starts it inside a Ray actor
        update_chunk_bytes=UPDATE_CHUNK_BYTES,
    )
    try:
        model.eval()
        got = engine.generate(PROMPTS, 2, 8, 1.0, 1.0, [], seed=5)
        for prompt, rows in zip(PROMPTS, got, strict=True):
            for tokens, logprobs in rows:
                expected = _runtime_logprobs(model, prompt + tokens, len(prompt), 1.0)
                torch.testing.assert_close(
                    torch.tensor(logprobs), expected, atol=LOGPROB_ATOL, rtol=0
                )
        sequence, prompt_len = [3, 14, 15, 92, 65, 35, 89, 79, 32], 4
        before = torch.tensor(engine.score([sequence], [prompt_len])[0])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
        engine.update_weights({k: v.detach().clone() for k, v in model.named_parameters()}, 1)
        after = torch.tensor(engine.score([sequence], [prompt_len])[0])
        expected = _runtime_logprobs(model, sequence, prompt_len, 1.0)
        diff = (after - expected).abs().max().item()
        print(f"tp=2 score after sync: max |vLLM - trainer| = {diff:.2e}")
        torch.testing.assert_close(after, expected, atol=LOGPROB_ATOL, rtol=0)
        assert (after - before).abs().max() > 100 * LOGPROB_ATOL  # the update landed
        greedy = engine.generate(PROMPTS, 1, 8, 0.0, 1.0, [], seed=0)
        assert [rows[0][0] for rows in greedy] == generate(model, PROMPTS, 8, temperature=0.0)
    finally:
        engine.shutdown()
