"""The emitted GRPO script (examples/grpo_smollm2) with `--engine vllm`: vLLM engines as Ray
actors, generation, reward workers, training and weight sync, end to end on a tiny random Llama
(SmolLM2's tokenizer, head_dim 32 for vLLM's CPU kernels), fp32.

Weights reach the engines by the collective transfer (runtime.weight_transfer over gloo). In
sync mode every batch is sampled by the policy it trains, so the sampler's log-probs stored with
each sample must equal the trainer's own (`old_logprobs`) up to kernel rounding at every step:
after step 1 that holds only if each transfer reached the engine. The lr is large: with
`--rollout async`, whose samples from step 2 on are one policy version old, the gaps are above 0.1
(measured 0.70 and 0.81 with the object-store push; sync: at most 1.9e-6).
tensor_parallel_size=2: the engine's two vLLM workers are processes of its Ray actor. Runs only
under `make test-vllm` (the vLLM venv, with ray), about 1 minute per case on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [{"question": f"{a} + {b} =", "answer": a + b} for a in range(3, 7) for b in (2, 5)]

DRIVER = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.helpers import even_token_reward, import_script


if __name__ == "__main__":  # vLLM spawns its engine core: the script must be importable
    script = import_script(Path(sys.argv[1]) / "examples/grpo_smollm2/train.py", "grpo_vllm")
    gaps = []  # per micro-batch: max |trainer log-prob - sampler log-prob| over completion tokens
    loss = script.grpo_loss

    def recording(logprobs, old_logprobs, sampler_logprobs, advantages, mask, *args, **kwargs):
        gaps.append(((old_logprobs - sampler_logprobs).abs() * mask).max().item())
        return loss(logprobs, old_logprobs, sampler_logprobs, advantages, mask, *args, **kwargs)

    script.grpo_loss = recording
    history = script.main(sys.argv[3:], reward_funcs=[even_token_reward])
    keep = ("reward", "loss", "grad_norm", "policy_versions", "sampling/importance_sampling_ratio/mean")
    rows = [{k: m[k] for k in keep} for m in history]
    Path(sys.argv[2]).write_text(json.dumps({"history": rows, "gaps": gaps}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> Path:
    out = tmp_path_factory.mktemp("tiny_llama_grpo_vllm")
    args = ModelArgs(
        **{**TINY_CONFIG, "hidden_size": 128, "head_dim": 32, "vocab_size": 49152},
        max_position_embeddings=512,
    )
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, out, args.to_hf_config())
    copy_tokenizer_files(smollm2_dir, out)
    return out


# sync samples with temperature 0.7, top_p 0.9 and top_k 5: vLLM's processed log-probs and the
# trainer's truncated ones must describe the same distribution (the log-prob convention)
TRUNCATED = ("--temperature", "0.7", "--top_p", "0.9", "--top_k", "5")


@pytest.mark.parametrize(("tp", "rollout", "sampling"), [(2, "sync", TRUNCATED), (1, "async", ())])
def test_grpo_with_vllm_engines_and_collective_weight_transfer(
    model_dir, tmp_path, tp, rollout, sampling
):
    """Weights reach the engines by vLLM's weight-transfer engine over gloo (--weight_transfer
    collective, the default for vllm): rank 0 broadcasts one tensor at a time to the engine's
    workers. sync: every sample on-policy, sampler log-probs equal the trainer's at every step
    (importance weight 1 within 1e-3 on every token), under temperature, top-p and top-k
    truncation. async: the transfer waits for the batch already generating, which keeps the
    version it was submitted with: steps 1-3 train versions 0, 0, 1."""
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "driver.py").write_text(DRIVER)
    result = tmp_path / "result.json"
    args = [
        "--model", str(model_dir), "--dataset", str(data), "--out_dir", str(tmp_path / "out"),
        "--engine", "vllm", "--engine_tensor_parallel_size", str(tp), "--rollout", rollout,
        "--weight_transfer", "collective",
        "--dtype", "fp32", "--num_generations", "4", "--prompts_per_step", "2",
        "--max_new_tokens", "6", "--micro_batch_size", "8", "--lr", "1e-2", "--warmup_steps", "0",
        "--max_steps", "3", "--reward_weights", "1.0", "--save_final_model", "false",
        "--resume", "none", "--ray_num_cpus", "2", *sampling,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), str(REPO), str(result), *args],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stderr + proc.stdout)[-4000:]
    # the engine actor's start and the first batch are announced before step 1's line
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("rollout |", "step "))]
    first = [r"rollout \| starting 1 engine\(s\)", r"rollout \| engine 0 ready \([\d.]+ s\)"]
    first += [r"rollout \| step 1: (8/8|scored 8) completions \([\d.]+ s\)"] * 2 + [
        r"step +1 \| .*"
    ]
    assert len(lines) > len(first), lines
    assert all(re.fullmatch(p, line) for p, line in zip(first, lines, strict=False)), lines
    out = json.loads(result.read_text())
    history, gaps = out["history"], out["gaps"]
    versions = [0, 1, 2] if rollout == "sync" else [0, 0, 1]
    assert [m["policy_versions"] for m in history] == [[v] * 8 for v in versions]
    # the policy moved at steps 1 and 2, so the on-policy gaps of steps 2 and 3 check real syncs;
    # step 3's update is never sampled, and a group all-correct by then (truncated sampling learns
    # the tiny reward in 3 steps: zero-std groups 1.00) has grad_norm 0
    assert all(m["grad_norm"] > 0 for m in history[:-1])
    print(f"{rollout}: max |trainer - vLLM sampler| log-prob per micro-batch: {gaps}")
    assert len(gaps) == 3
    on_policy = [g for g, v, step in zip(gaps, versions, range(3), strict=True) if v == step]
    assert max(on_policy) < 1e-3, gaps  # sync: every step; async: step 1
    if rollout == "async":  # a stale batch really is stale (the lr is large)
        assert min(gaps[1:]) > 0.1, gaps
