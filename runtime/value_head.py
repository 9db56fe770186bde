"""PPO's critic as a value head on the policy: a Linear(D, 1) on the final-norm hidden states.

The head is a submodule of the causal LM (`model.value_head`), so FSDP2 shards it with the root
unit, the optimizer steps it with the policy and the training checkpoint (`save_train_state`)
saves and resumes it like every other parameter. It is listed in `model.trainer_only_modules`, so
the HF checkpoint never holds it: `load_hf_checkpoint` leaves it to `init_value_head`, and the HF
save and both weight syncs leave it out (`runtime.checkpoint.trainer_only_names`): the engines
and `transformers` see the plain causal LM. (TRL's PPOTrainer uses a separate value model,
`AutoModelForSequenceClassification` with a score head; a head on the policy shares its trunk:
one forward gives log-probs and values, no second model's weights or optimizer state.)
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.dtensors import copy_into

VALUE_HEAD = "value_head"


def add_value_head(model: nn.Module) -> None:
    """Attach `model.value_head = Linear(hidden_size, 1)` (with bias) on the meta device, before
    the model is parallelized, and mark it trainer-only. Its parameters are fp32 like the
    policy's master weights (FSDP's mixed precision casts them for the forward)."""
    hidden = model.args.hidden_size
    setattr(model, VALUE_HEAD, nn.Linear(hidden, 1, bias=True, device="meta"))
    model.trainer_only_modules = (*getattr(model, "trainer_only_modules", ()), VALUE_HEAD)


def init_value_head(model: nn.Module, seed: int, std: float = 0.0) -> None:
    """Initialise the value head after `to_empty`: weight ~ N(0, std^2) from a CPU generator
    seeded with `seed` (the same on every rank; each copies its shard), bias 0. std 0 (the
    default) starts every value at 0: the first advantages are then the plain returns, and the
    head's gradient is still non-zero (it is the hidden state times the value error).

    Raises:
        AttributeError: the model has no value head (`add_value_head` first).
    """
    head = getattr(model, VALUE_HEAD)
    weight = torch.zeros(head.weight.shape)
    if std > 0:
        weight.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        copy_into(head.weight, weight)
        copy_into(head.bias, torch.zeros(head.bias.shape))


def token_values(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """V(s_t) [B, S] fp32 from the final-norm hidden states [B, S, D] (`forward_hidden`): at
    position t, the value of the prefix up to t, the state in which token t + 1 is sampled (the
    position whose logits score that token)."""
    return getattr(model, VALUE_HEAD)(hidden).squeeze(-1).float()
