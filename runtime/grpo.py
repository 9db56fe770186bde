"""GRPO building blocks shared by the emitted script and the rollout engines: group-relative
advantages (group mean or leave-one-out baseline, with or without the group's std), the rollout batch layout (prompt + completion rows, pre-shifted labels) and per-token
completion log-probs under the sampling distribution: softmax(logits / temperature) restricted to
the top-k / top-p support and renormalised over it (`runtime.generate.truncate_logits`), the
convention both rollout engines record their log-probs under.

The GRPO loss itself (clipped surrogate, KL, importance weights, normalisation) lives in the
emitted script, where a researcher edits it (docs/DESIGN.md, script and runtime); this module holds the parts that
must be exactly the same in the trainer and in the engines' `score`.

Shape legend: N prompts, G completions per prompt (num_generations), M = N * G rollouts,
B rows of a micro-batch, S padded sequence length, D hidden, V vocab.

Reference: Shao et al. 2024, "DeepSeekMath" (GRPO), arXiv:2402.03300, sec. 4.1.2 (outcome
supervision: advantages = rewards normalised within their group); the variants' references are
at `group_advantages`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from runtime.generate import truncate_logits
from runtime.loss import IGNORE_INDEX, token_logprobs

ADVANTAGE_BASELINES = ("group_mean", "rloo")


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    eps: float = 1e-4,
    scale: bool = True,
    baseline: str = "group_mean",
) -> tuple[torch.Tensor, float]:
    """Group-relative advantages: (r_i - baseline_i) / (std of its group + eps), or without the
    division when `scale` is False.

    baseline "group_mean": b_i = mean of the group's G rewards (GRPO).
    baseline "rloo": b_i = mean of the other G - 1 rewards (leave-one-out), so
        r_i - b_i = G / (G - 1) * (r_i - mean): the baseline does not contain r_i itself.

    Args:
        rewards: [M] fp32 total reward per rollout, M = N * G, the G completions of one prompt
            contiguous.
        num_generations: G, the group size.
        eps: added to the std so that small spreads do not blow up.
        scale: divide by the group's std (GRPO); False keeps the raw differences (Dr. GRPO, RLOO).
        baseline: "group_mean" or "rloo".

    Returns:
        (advantages [M] fp32, frac_reward_zero_std (TRL's name): the share of groups whose rewards are all
        equal). Such a group (and any group of size 1) gets advantage exactly 0, never NaN: it
        carries no learning signal.

    Raises:
        ValueError: M is not a multiple of G, or an unknown baseline.

    Reference:
        arXiv:2402.03300 sec. 4.1.2, A_i = (r_i - mean(r)) / std(r); the std is the unbiased
        sample std (torch.std, as TRL's GRPOTrainer). No std: Liu et al. 2025, "Understanding
        R1-Zero-Like Training" (Dr. GRPO), arXiv:2503.20783 sec. 3.1. Leave-one-out: Ahmadian
        et al. 2024, "Back to Basics" (RLOO), arXiv:2402.14740 eq. 5.
    """
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of num_generations="
            f"{num_generations}; give N * G rewards, each prompt's G completions contiguous"
        )
    if baseline not in ADVANTAGE_BASELINES:
        raise ValueError(f"baseline={baseline!r}: choose one of {ADVANTAGE_BASELINES}")
    groups = rewards.float().view(-1, num_generations)  # [N, G]
    all_equal = groups.max(dim=1).values == groups.min(dim=1).values  # [N] bool
    if num_generations == 1:
        return torch.zeros_like(groups).view(-1), 1.0
    G = num_generations
    mean = groups.mean(dim=1, keepdim=True)  # [N, 1]
    if baseline == "rloo":  # the mean of the other G - 1: (sum - r_i) / (G - 1)
        advantages = groups - (groups.sum(dim=1, keepdim=True) - groups) / (G - 1)
    else:
        advantages = groups - mean
    if scale:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)  # unbiased std
    advantages = advantages.masked_fill(all_equal[:, None], 0.0)  # exact 0, whatever rounding says
    return advantages.view(-1), all_equal.float().mean().item()


def collate_rollouts(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_token_id: int,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """Right-padded rows of prompt + completion with labels on the completion tokens only.

    Args:
        prompts: B prompt token ids.
        completions: B completion token ids (the stop token, if sampled, included).
        pad_token_id: id written into padding (never attended to by a causal model).
        pad_to_multiple_of: S rounded up to a multiple of it (sequence parallel splits rows over
            tp ranks, context parallel into 2*cp chunks).

    Returns:
        input_ids [B, S] int64; labels [B, S] int64, pre-shifted (labels[t] = input_ids[t + 1]
        where that is a completion token, else IGNORE_INDEX). Position t = len(prompt) - 1 + j
        predicts completion token j: use `scatter_completion_values` for per-token values.
    """
    S = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    S = -(-S // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(prompts), S), pad_token_id, dtype=torch.long)
    labels = torch.full((len(prompts), S), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        if c:
            labels[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": input_ids, "labels": labels}


def scatter_completion_values(
    values: list[list[float]], prompt_lens: list[int], S: int
) -> torch.Tensor:
    """Per-completion-token values (e.g. the sampler's log-probs) laid out like `collate_rollouts`.

    Returns:
        [B, S] fp32, values[i][j] at [i, prompt_lens[i] - 1 + j], 0 elsewhere.
    """
    out = torch.zeros(len(values), S, dtype=torch.float32)
    for i, (v, p) in enumerate(zip(values, prompt_lens, strict=True)):
        if v:
            out[i, p - 1 : p - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def completion_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    num_chunks: int = 4,
    position_ids: torch.Tensor | None = None,
    attention_mask=None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Per-token log-probs of the completion tokens under the sampling distribution:
    log_softmax(truncate_logits(logits / temperature, top_k, top_p)), the label always kept in
    the support (`runtime.generate.truncate_logits`).

    This is the convention the rollout engines record (the CPU engine's
    `generate_with_logprobs`, vLLM's "processed_logprobs"): the distribution that actually
    generated the token, so that the importance weight exp(trainer - sampler) is 1 when the
    weights agree, whatever the temperature, top_k and top_p. The hidden states go through
    lm_head in chunks of completion tokens only (`runtime.loss.token_logprobs`), so no
    [B, S, V] logits exist; dividing the hidden states by the temperature equals dividing the
    logits (lm_head is linear, no bias).

    Args:
        model: a runtime causal LM (plain or FSDP2 with `forward_hidden` registered).
        input_ids: [B, S] int64 from `collate_rollouts` (or `runtime.packing.pack_rollouts`).
        labels: [B, S] int64, pre-shifted, IGNORE_INDEX off the completions.
        temperature: the sampling temperature (> 0); the engines report log-probs under the
            same distribution, so ratios against them compare like with like.
        num_chunks: completion tokens pass through lm_head in this many chunks.
        position_ids: [B, S] int64, packed rows only (positions restart per rollout); None =
            0..S-1 in every row.
        attention_mask: packed rows only: `document_attention_mask(document_ids, backend)`;
            None = plain causal.
        top_k: the sampling top-k (0 = off); the mask is taken from these logits, per chunk.
        top_p: the sampling nucleus mass (1.0 = off).

    Returns:
        [B, S] fp32 log-probs, 0.0 where labels == IGNORE_INDEX; differentiable.

    Raises:
        ValueError: top_k < 0 or top_p outside (0, 1].
    """
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 = off) and top_p={top_p} in (0, 1]")
    hidden = model.forward_hidden(input_ids, position_ids, attention_mask)  # [B, S, D]
    if temperature != 1.0:
        hidden = hidden / temperature
    transform = None
    if top_k > 0 or top_p < 1.0:
        transform = functools.partial(_truncate_keeping_labels, top_k=top_k, top_p=top_p)
    return token_logprobs(
        hidden, model.lm_head.weight, labels, num_chunks=num_chunks, logits_transform=transform
    )


def _truncate_keeping_labels(logits, targets, top_k: int, top_p: float):
    """`token_logprobs`' logits_transform: [C, V], [C] -> [C, V] truncated, targets kept."""
    return truncate_logits(logits, top_k, top_p, keep=targets)
