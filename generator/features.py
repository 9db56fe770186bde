"""Registry of algorithms and tricks: which template fills which slots, in what order, and which
combinations are refused.

Adding a trick = one `templates/features/<name>.py.jinja` (macros named after the slots it fills:
`imports`, `config_fields`, `validate`, `model_setup`, `step`, `docstring_notes`) plus one entry here.
The skeleton calls the slots of the enabled features in the order of `TRICKS`.
"""

from __future__ import annotations

from dataclasses import dataclass

ALGOS = {"sft": "full-parameter supervised fine-tuning on chat / instruction data"}


@dataclass(frozen=True)
class Trick:
    name: str
    template: str  # file stem under templates/features/
    summary: str
    conflicts: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()


TRICKS: dict[str, Trick] = {
    t.name: t
    for t in [
        Trick(
            "ac",
            "activation_checkpointing",
            "activation checkpointing per transformer block (recompute in backward)",
        ),
        Trick(
            "lce",
            "linear_cross_entropy",
            "chunked linear cross-entropy: no [B, S, V] logits (forward or backward)",
        ),
        Trick(
            "optim-in-bwd",
            "optimizer_in_backward",
            "optimizer step inside backward per parameter; gradients freed at once",
        ),
        # adamw4bit is not offered yet: torchao 0.18's AdamW4bit over FSDP2 DTensor parameters
        # fails on CPU in its compiled step ("wrong number of dimensions1"), plain tensors work.
        Trick(
            "adamw8bit",
            "adamw8bit",
            "torchao AdamW with 8-bit optimizer state (4x smaller)",
        ),
    ]
}
