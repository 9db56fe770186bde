"""Registry of algorithms and tricks: which template fills which slots, in what order, and which
combinations are refused.

Adding a trick = one `templates/features/<name>.py.jinja` (macros named after the slots it fills:
`imports`, `config_fields`, `validate`, `model_setup`, `step`, `docstring_notes`) plus one entry here.
The skeleton calls the slots of the enabled features in the order of `TRICKS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALGOS = {"sft": "full-parameter supervised fine-tuning on chat / instruction data"}


@dataclass(frozen=True)
class Trick:
    name: str
    template: str  # file stem under templates/features/
    summary: str
    # other trick -> why both cannot be on (the validator names both and how to fix it)
    conflicts: dict[str, str] = field(default_factory=dict)
    requires: tuple[str, ...] = ()


TRICKS: dict[str, Trick] = {
    t.name: t
    for t in [
        Trick(
            "packing",
            "packing",
            "pack documents into max_seq_len rows; per-document positions, block-causal attention",
        ),
        # ac before compile before FSDP (STYLE.md §2, section 4): the model_setup slot runs in
        # registry order
        Trick(
            "ac",
            "activation_checkpointing",
            "activation checkpointing per transformer block (recompute in backward)",
            conflicts={
                "offload": "with activation checkpointing each block keeps only its input, held "
                "by the checkpoint itself, so offloading has nothing left to move (and would "
                "bypass the recompute); ac trades compute for memory, offload trades PCIe "
                "transfers",
            },
        ),
        Trick(
            "offload",
            "offload",
            "activation offloading to pinned CPU memory per block (CUDA; refused on CPU runs)",
            conflicts={
                "ac": "with activation checkpointing each block keeps only its input, held by the "
                "checkpoint itself, so offloading has nothing left to move (and would bypass the "
                "recompute); ac trades compute for memory, offload trades PCIe transfers",
            },
        ),
        Trick(
            "compile",
            "compile",
            "torch.compile per transformer block and the loss (fixed shapes, no recompiles)",
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
        Trick(
            "adamw8bit",
            "adamw8bit",
            "torchao AdamW with 8-bit optimizer state (4x smaller)",
            conflicts={
                "adamw4bit": "both choose the optimizer (8-bit and 4-bit AdamW states)",
            },
        ),
        # adamw4bit works over FSDP2 DTensor parameters once PyTorch's on-disk AOTAutograd cache
        # is off for the optimizer (its key ignores the torchao subclass inside a DTensor, so an
        # 8-bit step compiled earlier was served to the 4-bit optimizer: "wrong number of
        # dimensions"); both low-bit templates switch that cache off.
        Trick(
            "adamw4bit",
            "adamw4bit",
            "torchao AdamW with 4-bit optimizer state (8x smaller)",
            conflicts={
                "adamw8bit": "both choose the optimizer (8-bit and 4-bit AdamW states)",
            },
        ),
    ]
}
