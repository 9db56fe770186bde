"""Batched KV-cache generation for runtime models: the CPU/test stand-in for vLLM rollouts.

Prompts of different lengths are left-padded; an explicit attention mask hides the padding and
position ids count only real tokens, so a padded row decodes exactly like the same prompt alone.

Shape legend: B batch (prompts), P padded prompt length, S_kv cached + new keys, V vocab_size.

Reference: Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration",
https://arxiv.org/abs/1904.09751 sec. 3.1 (nucleus / top-p sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.models.llama import KVCache

if TYPE_CHECKING:
    from runtime.tokenizer import Tokenizer


def _left_pad(prompts: list[list[int]], pad_token_id: int, device):
    """-> (input_ids [B, P] int64, valid [B, P] bool), prompts right-aligned."""
    P = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), P), pad_token_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        input_ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        valid[i, P - len(p) :] = True
    return input_ids.to(device), valid.to(device)


def _prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """valid: [B, P] bool -> [B, 1, P, P] bool, causal AND key-not-padding.

    Padding queries may also see themselves: a row with no visible key makes SDPA return NaN,
    and NaN values would leak through (0 * NaN) into real rows. Real queries never see padding.
    """
    P = valid.shape[1]
    causal = torch.ones(P, P, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(P, dtype=torch.bool, device=valid.device)
    mask = (causal & valid[:, None, :]) | eye  # [P, P] & [B, 1, P] -> [B, P, P]
    return mask[:, None]  # [B, P, P] -> [B, 1, P, P]


def sample_next_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: [B, V] next-token logits, any float dtype.
        temperature: 0 = greedy argmax; else softmax(logits / temperature).
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (always at
            least the top token); 1.0 = no truncation.
        generator: RNG on logits' device, for reproducible sampling.

    Returns:
        [B] int64 token ids.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V] fp32
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [B, V] each
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # outside the nucleus
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def _validate(prompts, max_new_tokens, temperature, top_p) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(
            f"generate needs at least one prompt and no empty prompt (got lengths "
            f"{[len(p) for p in prompts]}); drop empty prompts or add a BOS token."
        )
    if max_new_tokens < 0 or temperature < 0.0 or not 0.0 < top_p <= 1.0:
        raise ValueError(
            f"bad sampling settings max_new_tokens={max_new_tokens}, temperature={temperature}, "
            f"top_p={top_p}; need max_new_tokens >= 0, temperature >= 0 (0 = greedy) and "
            "0 < top_p <= 1."
        )


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # blocks compiled for training (trick "compile") would
# recompile for every decoding shape (S = 1, growing S_kv); decoding runs them eagerly instead
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Generate continuations of a batch of token-id prompts with a KV cache.

    Args:
        model: a runtime causal LM (`LlamaForCausalLM`, plain or FSDP2-sharded) with `.args`
            and `forward(input_ids, position_ids, attention_mask, kv_cache) -> [B, S, V]`.
        prompts: B lists of token ids (lengths may differ; they are left-padded).
        max_new_tokens: generated tokens per row at most.
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass (1.0 = off); only used when temperature > 0.
        stop_token_ids: a row ends at its first one of these (kept in the output).
        pad_token_id: id fed for padding (never attended to, so any valid id works).
        generator: torch.Generator on the model's device, for reproducible sampling.

    Returns:
        B lists with only the generated token ids.

    Raises:
        ValueError: empty prompts or out-of-range sampling settings.
    """
    rows = _decode(
        model, prompts, max_new_tokens, temperature, top_p, stop_token_ids, pad_token_id, generator
    )
    return [tokens for tokens, _ in rows]


def sample(
    model: nn.Module, tokenizer: Tokenizer, prompt: str | list[dict], max_new_tokens: int
) -> str:
    """The model's greedy reply to one prompt, rendered with the chat template.

    Collective under FSDP (every forward gathers the shards): call it on every rank; all ranks
    get the same reply. The model runs in eval mode and gets its previous mode back.

    Args:
        model: a runtime causal LM, plain or FSDP2-sharded (as for `generate`).
        tokenizer: the model's tokenizer; it must have a chat template.
        prompt: one user message, or chat messages ([{"role", "content"}, ...], e.g. an example's
            "prompt": its conversation before the reply) to answer.
        max_new_tokens: reply length cap in tokens (0 = ""); it ends earlier at a stop token.

    Returns:
        The decoded reply, special tokens (the end-of-turn one) skipped.

    Raises:
        ValueError: the tokenizer has no chat template, or max_new_tokens < 0.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # one prompt is never padded, so any id will do when the tokenizer has no pad or eos token
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    try:
        (out,) = generate(
            model,
            [tokenizer.encode(text)],
            max_new_tokens=max_new_tokens,
            stop_token_ids=tokenizer.stop_token_ids,
            pad_token_id=pad_token_id,
        )
    finally:
        model.train(was_training)
    return tokenizer.decode(out)


def last_user_message(prompt: str | list[dict]) -> str:
    """What `sample`'s printout shows as the question: the prompt itself, or the content of the
    last user message among chat messages ("" when there is none)."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # as `generate`
def generate_with_logprobs(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> list[tuple[list[int], list[float]]]:
    """`generate`, also returning each sampled token's log-prob under softmax(logits /
    temperature) (temperature 0: under softmax(logits)); the RL rollouts' CPU engine.

    The log-prob is of the full tempered distribution, before top-p truncation (vLLM's
    `logprobs` convention), so it is comparable with the trainer's `completion_logprobs`.

    Args:
        on_progress: called after every decoding step with the number of rows that have
            produced a stop token so far, and once more with B when decoding ends (rows cut
            at max_new_tokens are finished then); the rollout engines report it to the driver.
        (the others as `generate`)

    Returns:
        per prompt: (completion ids, stop token kept; log-probs [C] as floats).

    Raises:
        ValueError: empty prompts or out-of-range sampling settings.
    """
    sampling = (max_new_tokens, temperature, top_p, stop_token_ids, pad_token_id, generator)
    return _decode(model, prompts, *sampling, with_logprobs=True, on_progress=on_progress)


def _decode(
    model, prompts, max_new_tokens, temperature, top_p, stop_token_ids, pad_token_id, generator,
    with_logprobs: bool = False, on_progress: Callable[[int], None] | None = None,
) -> list[tuple[list[int], list[float]]]:  # fmt: skip
    """The KV-cache decoding loop of both entry points: per prompt (tokens, log-probs or [])."""
    _validate(prompts, max_new_tokens, temperature, top_p)
    if max_new_tokens == 0:
        if on_progress is not None:
            on_progress(len(prompts))
        return [([], []) for _ in prompts]
    weight = model.model.embed_tokens.weight  # a DTensor under FSDP2: same device and dtype
    input_ids, valid = _left_pad(prompts, pad_token_id, weight.device)
    B, P = input_ids.shape
    cache = _new_cache(model.args, B, P + max_new_tokens, weight.dtype, weight.device)
    position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [B, P]; padding gets 0
    mask = _prefill_mask(valid)  # [B, 1, P, P]
    logits = model(input_ids, position_ids=position_ids, attention_mask=mask, kv_cache=cache)
    key_valid = torch.cat([valid, valid.new_ones(B, max_new_tokens)], dim=1)  # [B, P + new]
    next_pos = position_ids[:, -1:] + 1  # [B, 1]
    stop = torch.tensor(list(stop_token_ids), dtype=torch.long, device=weight.device)
    finished = torch.zeros(B, dtype=torch.bool, device=weight.device)
    tokens, logps = [], []
    for step in range(max_new_tokens):
        # fp32 before sampling: the same token either way (sampling upcasts itself), and the
        # log-probs need it
        last = logits[:, -1].float()  # [B, V]
        token = sample_next_token(last, temperature, top_p, generator)  # [B]
        if with_logprobs:
            scaled = last / temperature if temperature > 0 else last
            logps.append(torch.log_softmax(scaled, dim=-1).gather(1, token[:, None]).squeeze(1))
        tokens.append(token)
        finished |= torch.isin(token, stop)
        if on_progress is not None:  # one more host sync per step, as the break test below
            on_progress(int(finished.sum()))
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        mask = key_valid[:, None, None, : cache.seq_len + 1]  # [B, S_kv] -> [B, 1, 1, S_kv]
        logits = model(token[:, None], position_ids=next_pos, attention_mask=mask, kv_cache=cache)
        next_pos = next_pos + 1
    if on_progress is not None:
        on_progress(B)  # rows cut at max_new_tokens are finished too
    rows = torch.stack(tokens, dim=1).tolist()
    row_logps = torch.stack(logps, dim=1).tolist() if with_logprobs else [[] for _ in rows]
    stop_set = set(stop_token_ids)
    out = []
    for row, row_logp in zip(rows, row_logps, strict=True):
        end = next((i + 1 for i, t in enumerate(row) if t in stop_set), len(row))
        out.append((row[:end], row_logp[:end]))
    return out


def _new_cache(args, batch_size: int, max_seq_len: int, dtype, device) -> KVCache:
    """A KVCache sized for `args` (a `ModelArgs`); the cache casts to the compute dtype on read."""
    return KVCache(
        args.num_hidden_layers,
        batch_size,
        max_seq_len,
        args.num_key_value_heads,
        args.head_dim,
        dtype,
        device,
    )
