"""The runtime rollout engine's prefill, before and after its two savings, in one run: lm_head on
each prompt's last position only (before: on every prompt position, a [B, P, V] logits tensor),
and one prefill per prompt shared by its samples (before: each of a prompt's n samples
prefilled it again).

    python benchmarks/rollout_prefill.py [--prompts 4] [--num_samples 4] [--threads 1] [--repeats 3]

SmolLM2-135M (the real weights of `scaffold assets`), the first --prompts chain_sum questions in
the chat template, --num_samples completions each of <= 12 tokens at temperature 1 (the real-task
tests' GRPO shape: 4 x 4), fp32, --threads torch threads (1: what a test worker and a CPU rollout
actor get). Rows, each the best of --repeats:
- prefill: one forward over the B = prompts x num_samples left-padded rows with the KV cache,
  lm_head on all B x P positions (the old prefill), on the B last positions, and on the U =
  prompts last positions of U rows (the new prefill, before its cache is copied n times);
- rollout: the whole `generate_with_logprobs` call, repeated prompts (num_samples 1) against
  num_samples (one prefill per prompt), with the same seed: the same tokens are checked.
The logits bytes are those of the prefill's fp32 logits. Figures: benchmarks/RESULTS.md ("Rollout
prefill").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from process_start import matmul_gflops  # noqa: E402  (benchmarks/ is sys.path[0])

from generator.assets import ensure_chain_sum, ensure_smollm2  # noqa: E402
from runtime.generate import (  # noqa: E402
    _left_pad,
    _new_cache,
    _prefill_mask,
    generate_with_logprobs,
)
from runtime.rollout import RuntimeEngine  # noqa: E402
from runtime.tokenizer import Tokenizer  # noqa: E402

MAX_NEW_TOKENS = 12


def best_of(repeats: int, fn) -> tuple[float, object]:
    """(the fastest of `repeats` calls of fn in seconds, the last call's result)."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


@torch.no_grad()
def prefill(model, prompts: list[list[int]], logits_at: str) -> torch.Tensor:
    """One KV-cache prefill of `prompts` (left-padded); logits at "all" positions or the "last"."""
    input_ids, valid = _left_pad(prompts, 0, torch.device("cpu"))
    B, P = input_ids.shape
    cache = _new_cache(model.args, B, P + MAX_NEW_TOKENS, torch.float32, "cpu")
    kwargs = dict(
        position_ids=(valid.long().cumsum(-1) - 1).clamp(min=0),
        attention_mask=_prefill_mask(valid),
        kv_cache=cache,
    )
    if logits_at == "all":
        return model(input_ids, **kwargs)
    at_end = torch.zeros_like(valid)
    at_end[:, -1] = True
    return model(input_ids, **kwargs, logits_mask=at_end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--num_samples", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(ensure_smollm2())
    model = RuntimeEngine(model_dir, "float32").model
    tokenizer = Tokenizer.from_dir(model_dir)
    rows = [json.loads(line) for line in ensure_chain_sum().read_text().splitlines()]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": row["question"]}], add_generation_prompt=True
            )
        )
        for row in rows[: args.prompts]
    ]
    n = args.num_samples
    repeated = [p for p in prompts for _ in range(n)]
    U, B, P = len(prompts), len(repeated), max(len(p) for p in prompts)
    V = model.args.vocab_size
    print(
        f"SmolLM2-135M fp32, {args.threads} thread(s), {U} prompts x {n} samples (P = {P} "
        f"tokens), <= {MAX_NEW_TOKENS} new tokens; fp32 torch.mm 2048^2 at {args.threads} "
        f"thread(s): {matmul_gflops():.0f} GFLOP/s; best of {args.repeats}\n"
    )
    print("| what | rows | lm_head rows | prefill logits | seconds |")
    print("|---|---|---|---|---|")
    for name, batch, at in (
        ("prefill, logits at every position (before)", repeated, "all"),
        ("prefill, logits at the last position", repeated, "last"),
        ("prefill, one per prompt, logits at the last position (after)", prompts, "last"),
    ):
        seconds, logits = best_of(args.repeats, lambda b=batch, a=at: prefill(model, b, a))
        rows_out = logits.shape[0] * (logits.shape[1] if logits.dim() == 3 else 1)
        print(
            f"| {name} | {len(batch)} | {rows_out} | {logits.numel() * 4 / 2**20:.1f} MiB "
            f"| {seconds:.3f} |",
            flush=True,
        )

    def rollout(batch: list[list[int]], num_samples: int):
        return generate_with_logprobs(
            model, batch, MAX_NEW_TOKENS, 1.0, 1.0, tokenizer.stop_token_ids, 0,
            torch.Generator().manual_seed(0), num_samples=num_samples,
        )  # fmt: skip

    before, out_before = best_of(args.repeats, lambda: rollout(repeated, 1))
    after, out_after = best_of(args.repeats, lambda: rollout(prompts, n))
    same = [ids for ids, _ in out_before] == [ids for ids, _ in out_after]
    print(
        f"| rollout, repeated prompts | {B} | | | {before:.3f} |\n"
        f"| rollout, num_samples={n} (one prefill per prompt) | {B} | | | {after:.3f} |\n\n"
        f"rollout speed-up {before / after:.2f}x; the same sampled tokens: {same}; "
        f"[B, P, V] fp32 logits at B={B}, P={P}, V={V}: {B * P * V * 4 / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
