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


def truncate_logits(
    logits: torch.Tensor,
    top_k: int = 0,
    top_p: float = 1.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tempered logits with every token outside the top-k / top-p support set to -inf.

    `log_softmax` of the result is the sampled-token log-prob convention of both engines and of
    the GRPO trainer: the log-prob under the distribution that actually generated the token (the
    tempered softmax restricted to the support and renormalised over it), which is what vLLM
    returns with `logprobs_mode="processed_logprobs"`. The rules are vLLM's
    (`vllm/v1/sample/ops/topk_topp_sampler.py`, `apply_top_k_top_p`), so that a token near the
    boundary is in or out for every engine alike:
    - top-k first: keep every token whose logit is >= the k-th largest (ties at the boundary are
      all kept, so the support may exceed k);
    - then top-p on the probabilities renormalised after top-k: sorted ascending, a token is
      dropped when its cumulative mass (itself and every smaller token) is <= 1 - top_p; the
      largest is always kept. Equivalently: the smallest set of most likely tokens whose mass
      reaches top_p, the token that crosses the threshold included.

    Args:
        logits: [R, V] float logits, already divided by the temperature (fp32 or fp64; any grad
            flows through the kept entries, the mask itself is computed without grad).
        top_k: keep the k most likely tokens; 0 = off (as TRL and vLLM); k >= V is off too.
        top_p: nucleus mass in (0, 1]; 1.0 = off.
        keep: [R] int64 token ids kept in the support whatever the rules say (the trainer's
            labels): a sampled token was in the sampler's support, and when the trainer's own
            logits put it just outside (numerics, or a policy that moved since sampling) a
            finite log-prob is the meaningful one, where -inf would zero the importance ratio
            and make the KL to the reference infinite.

    Returns:
        [R, V] same dtype; `logits` itself (no copy) when both top_k and top_p are off.

    Raises:
        ValueError: top_k < 0 or top_p outside (0, 1].
    """
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 = off) and top_p={top_p} in (0, 1]")
    V = logits.shape[-1]
    use_k, use_p = 0 < top_k < V, top_p < 1.0
    if not (use_k or use_p):
        return logits
    with torch.no_grad():
        x = logits.detach()
        removed = torch.zeros_like(x, dtype=torch.bool)  # [R, V]
        if use_k:
            kth = x.topk(top_k, dim=-1).values[:, -1:]  # [R, 1] the k-th largest logit
            removed = x < kth
        if use_p:
            x_sorted, order = x.masked_fill(removed, float("-inf")).sort(dim=-1)  # ascending
            mass = x_sorted.softmax(dim=-1).cumsum(dim=-1)  # [R, V] mass up to and incl. each
            drop_sorted = mass <= 1.0 - top_p
            drop_sorted[:, -1] = False  # the most likely token always stays
            removed = removed | torch.zeros_like(removed).scatter(-1, order, drop_sorted)
        if keep is not None:
            removed = removed.scatter(-1, keep[:, None], False)
    return logits.masked_fill(removed, float("-inf"))


def sample_next_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None = None,
    top_k: int = 0,
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: [B, V] next-token logits, any float dtype.
        temperature: 0 = greedy argmax; else softmax(logits / temperature).
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (always at
            least the top token); 1.0 = no truncation.
        generator: RNG on logits' device, for reproducible sampling.
        top_k: keep the k most likely tokens (before top-p); 0 = off. See `truncate_logits`.

    Returns:
        [B] int64 token ids.
    """
    return _sample(logits, temperature, top_p, top_k, generator)[0]


def _sample(logits, temperature, top_p, top_k, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [B] int64, processed logits [B, V] fp32 they were drawn from: the tempered,
    truncated logits; for temperature 0 the raw ones, whose log-softmax vLLM reports too)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1), logits.float()
    processed = truncate_logits(logits.float() / temperature, top_k, top_p)  # [B, V] fp32
    probs = torch.softmax(processed, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1), processed


def _validate(prompts, max_new_tokens, temperature, top_p, top_k) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(
            f"generate needs at least one prompt and no empty prompt (got lengths "
            f"{[len(p) for p in prompts]}); drop empty prompts or add a BOS token."
        )
    if max_new_tokens < 0 or temperature < 0.0 or not 0.0 < top_p <= 1.0 or top_k < 0:
        raise ValueError(
            f"bad sampling settings max_new_tokens={max_new_tokens}, temperature={temperature}, "
            f"top_p={top_p}, top_k={top_k}; need max_new_tokens >= 0, temperature >= 0 "
            "(0 = greedy), 0 < top_p <= 1 and top_k >= 0 (0 = off)."
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
    top_k: int = 0,
) -> list[list[int]]:
    """Generate continuations of a batch of token-id prompts with a KV cache.

    Args:
        model: a runtime causal LM (`LlamaForCausalLM`, plain or FSDP2-sharded) with `.args`
            and `forward(input_ids, position_ids, attention_mask, kv_cache, logits_mask)`.
            Under FSDP2 every forward is collective: call it on every rank with the same
            prompts, settings and generator seed, so that every rank draws the same tokens and
            stops decoding at the same step (different prompts per rank would hang).
        prompts: B lists of token ids (lengths may differ; they are left-padded).
        max_new_tokens: generated tokens per row at most.
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass (1.0 = off); only used when temperature > 0.
        stop_token_ids: a row ends at its first one of these (kept in the output).
        pad_token_id: id fed for padding (never attended to, so any valid id works).
        generator: torch.Generator on the model's device, for reproducible sampling.
        top_k: keep the k most likely tokens before top-p (0 = off); only used when
            temperature > 0. See `truncate_logits`.

    Returns:
        B lists with only the generated token ids.

    Raises:
        ValueError: empty prompts or out-of-range sampling settings.
    """
    rows = _decode(
        model, prompts, max_new_tokens, temperature, top_p, stop_token_ids, pad_token_id, generator,
        top_k=top_k,
    )  # fmt: skip
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
    top_k: int = 0,
    num_samples: int = 1,
) -> list[tuple[list[int], list[float]]]:
    """`generate`, also returning each sampled token's log-prob under the distribution it was
    drawn from; the RL rollouts' CPU engine. With `num_samples` > 1 each prompt is sampled that
    many times from one prefill: its KV cache is computed once and copied to its samples.

    The log-prob is `log_softmax(truncate_logits(logits / temperature, top_k, top_p))` of the
    sampled token: the tempered distribution restricted to the top-k / top-p support and
    renormalised over it (temperature 0: log softmax(logits)). This is vLLM's
    `logprobs_mode="processed_logprobs"` and what the GRPO trainer's `completion_logprobs`
    computes with the same temperature, top_k and top_p, so the importance weight between
    sampler and trainer is 1 when their weights agree.

    Args:
        on_progress: called after every decoding step with the number of rows that have
            produced a stop token so far, and once more with B when decoding ends (rows cut
            at max_new_tokens are finished then); the rollout engines report it to the driver.
        num_samples: completions per prompt (>= 1); B = len(prompts) * num_samples rows.
        (the others as `generate`)

    Returns:
        B rows, each prompt's num_samples contiguous: (completion ids, stop token kept;
        log-probs [C] as floats).

    Raises:
        ValueError: empty prompts, num_samples < 1 or out-of-range sampling settings.
    """
    sampling = (max_new_tokens, temperature, top_p, stop_token_ids, pad_token_id, generator)
    return _decode(
        model, prompts, *sampling, with_logprobs=True, on_progress=on_progress, top_k=top_k,
        num_samples=num_samples,
    )  # fmt: skip


def _decode(
    model, prompts, max_new_tokens, temperature, top_p, stop_token_ids, pad_token_id, generator,
    with_logprobs: bool = False, on_progress: Callable[[int], None] | None = None, top_k: int = 0,
    num_samples: int = 1,
) -> list[tuple[list[int], list[float]]]:  # fmt: skip
    """The KV-cache decoding loop of both entry points: per row (tokens, log-probs or []), each
    prompt's `num_samples` rows contiguous."""
    _validate(prompts, max_new_tokens, temperature, top_p, top_k)
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: need at least 1 completion per prompt")
    B = len(prompts) * num_samples
    if max_new_tokens == 0:
        if on_progress is not None:
            on_progress(B)
        return [([], []) for _ in range(B)]
    weight = model.model.embed_tokens.weight  # a DTensor under FSDP2: same device and dtype
    input_ids, valid = _left_pad(prompts, pad_token_id, weight.device)  # [U, P], U prompts
    U, P = input_ids.shape
    cache = _new_cache(model.args, U, P + max_new_tokens, weight.dtype, weight.device)
    position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [U, P]; padding gets 0
    mask = _prefill_mask(valid)  # [U, 1, P, P]
    # left padding ends every prompt at column P - 1: only there does lm_head run (no [U, P, V]
    # logits: at a 128k vocabulary they would outweigh the KV cache many times)
    at_end = torch.zeros_like(valid)
    at_end[:, -1] = True
    logits = model(
        input_ids,
        position_ids=position_ids,
        attention_mask=mask,
        kv_cache=cache,
        logits_mask=at_end,
    )  # [U, V]: each prompt's next-token logits
    if num_samples > 1:  # the samples of a prompt share its prefill (vLLM: prefix caching)
        cache.repeat_interleave(num_samples)
        logits = logits.repeat_interleave(num_samples, dim=0)  # [B, V]
        valid = valid.repeat_interleave(num_samples, dim=0)  # [B, P]
        position_ids = position_ids.repeat_interleave(num_samples, dim=0)
    key_valid = torch.cat([valid, valid.new_ones(B, max_new_tokens)], dim=1)  # [B, P + new]
    next_pos = position_ids[:, -1:] + 1  # [B, 1]
    stop = torch.tensor(list(stop_token_ids), dtype=torch.long, device=weight.device)
    finished = torch.zeros(B, dtype=torch.bool, device=weight.device)
    tokens, logps = [], []
    for step in range(max_new_tokens):
        # fp32 before sampling: the same token either way (sampling upcasts itself), and the
        # log-probs need it
        last = logits.float()  # [B, V]
        token, processed = _sample(last, temperature, top_p, top_k, generator)  # [B], [B, V]
        if with_logprobs:  # under the distribution the token was drawn from (truncate_logits)
            logps.append(torch.log_softmax(processed, dim=-1).gather(1, token[:, None]).squeeze(1))
        tokens.append(token)
        finished |= torch.isin(token, stop)
        if on_progress is not None:  # one more host sync per step, as the break test below
            on_progress(int(finished.sum()))
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        mask = key_valid[:, None, None, : cache.seq_len + 1]  # [B, S_kv] -> [B, 1, 1, S_kv]
        step_logits = model(
            token[:, None], position_ids=next_pos, attention_mask=mask, kv_cache=cache
        )
        logits = step_logits[:, -1]  # [B, 1, V] -> [B, V]
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
