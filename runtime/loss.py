"""Token-level losses for causal LM training.

Shape legend: B batch, S sequence, D hidden, V vocab, T flattened tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = (
    -100
)  # PyTorch's and Hugging Face's default ignore_index; the one value used everywhere.


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over supervised positions.

    Args:
        logits: [B, S, V] any float dtype; upcast to fp32 for the softmax.
        labels: [B, S] int64, pre-shifted (labels[:, t] is the target of position t),
            IGNORE_INDEX = not supervised.

    Returns:
        Scalar fp32: the sum of token losses (0.0, never NaN, when nothing is supervised). Divide by
        the global number of supervised tokens of the optimizer step, not per micro-batch.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
