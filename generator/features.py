"""Registry of algorithms and tricks: which template fills which slots, in what order, and which
combinations are refused.

Adding a trick or an algorithm = one `templates/features/<name>.py.jinja` (macros named after the
slots it fills, see `generator.render.SLOTS`) plus one entry here. Each skeleton
(`templates/recipes/<skeleton>.py.jinja`, built from the partials in `templates/recipes/partials/`)
calls the slots of the algorithm's template first, then those of the enabled tricks in the order
of `TRICKS`. An algorithm without a template is its skeleton's defaults. `REFUSED` (with `refusal` and `support_table`) is the one table
of which trick and which parallel plan works with which algorithm, and why not where it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Algo:
    name: str
    template: str | None  # file stem under templates/features/, or None: the skeleton's defaults
    summary: str
    lr: float | None = None  # default peak lr; None = the model catalog's (full fine-tuning) lr
    skeleton: str = "sft"  # templates/recipes/<skeleton>.py.jinja
    dataset: str = "alpaca_en_demo.json"  # `scaffold new`'s default --dataset


ALGOS: dict[str, Algo] = {
    a.name: a
    for a in [
        Algo("sft", None, "full-parameter supervised fine-tuning on chat / instruction data"),
        # LoRA learns a rank-r update: 10x the full fine-tuning lr is the usual default (PEFT/TRL
        # examples, torchtune's LoRA configs use 1e-4 to 3e-4)
        Algo("lora", "lora", "SFT of low-rank adapters (LoRA; --peft dora for DoRA)", lr=2e-4),
        Algo("qlora", "lora", "LoRA over a frozen 4-bit NF4 base (QLoRA, torchao)", lr=2e-4),
        # DPO: TRL's DPOConfig default lr (1e-6) for full parameters; 10x smaller steps than SFT
        # because the reference anchors the policy. Its own skeleton (pairs, reference, metrics).
        Algo(
            "dpo",
            None,
            "DPO on preference pairs, all parameters (reference: separate or precomputed)",
            lr=1e-6,
            skeleton="dpo",
            dataset="dpo_en_demo.json",
        ),
        # LoRA DPO: the lora template's slots in the dpo skeleton; the frozen base is the reference
        Algo(
            "dpo-lora",
            "lora",
            "DPO of LoRA adapters (reference: the base with adapters off)",
            lr=5e-5,
            skeleton="dpo",
            dataset="dpo_en_demo.json",
        ),
        # GRPO: its own skeleton (rollouts on Ray, reward functions, the GRPO loss); TRL's
        # GRPOConfig default lr (1e-6) for full parameters.
        Algo(
            "grpo",
            None,
            "GRPO: online RL with verifiable rewards, rollouts on Ray (sync / async / off-policy)",
            lr=1e-6,
            skeleton="grpo",
            dataset="chain_sum.jsonl",
        ),
        # LoRA GRPO: the lora template's slots in the grpo skeleton; the engines get merged weights
        # and the KL reference is the base with the adapters off. lr: LoRA's best lr is about 10x
        # full fine-tuning's, in RL as in SFT (Schulman et al. 2025, "LoRA Without Regret",
        # Thinking Machines; the same ratio as lora's 2e-4 to sft's 2e-5), so 10x grpo's 1e-6.
        Algo(
            "grpo-lora",
            "lora",
            "GRPO of LoRA adapters (engines get merged weights; KL reference: the base with "
            "adapters off)",
            lr=1e-5,
            skeleton="grpo",
            dataset="chain_sum.jsonl",
        ),
        # PPO with a critic: the GRPO skeleton's rollout pipeline and loop (its `ppo` branches:
        # GAE, the value loss), the value head from templates/features/ppo.py.jinja. lr: TRL's
        # PPOConfig default (3e-6) is for 7B-scale RLHF; the GRPO skeleton's 1e-6 is kept.
        Algo(
            "ppo",
            "ppo",
            "PPO with a value head on the policy (GAE, clipped value loss), rollouts on Ray",
            lr=1e-6,
            skeleton="grpo",
            dataset="chain_sum.jsonl",
        ),
        # RM: Bradley-Terry reward model on the DPO data, its own small skeleton (a score head, no
        # reference, an HF sequence-classification save). lr: TRL's full-parameter reward-model
        # command (examples/scripts/reward_modeling.py, --learning_rate 1.0e-5); RewardConfig's
        # own default, 1e-4, is the one of its LoRA command.
        Algo(
            "rm",
            None,
            "reward model (Bradley-Terry) on preference pairs; saved for transformers and GRPO",
            lr=1e-5,
            skeleton="rm",
            dataset="dpo_en_demo.json",
        ),
        # KD: a feature of the SFT skeleton (its loss slot: CE + KL to the teacher)
        Algo(
            "kd",
            "kd",
            "knowledge distillation: KL to a frozen teacher (same tokenizer) mixed with CE",
        ),
    ]
}
# --peft: the adapter type of the lora/qlora algorithms.
PEFT_METHODS = {
    "lora": "LoRA: W + (lora_alpha / lora_rank) * B A",
    "dora": "DoRA: LoRA plus a learned magnitude per output row (Liu et al. 2024)",
}
PEFT_ALGOS = ("lora", "qlora", "dpo-lora", "grpo-lora")
# DPO reference modes (config ref_mode) per algorithm; the first is the default.
REF_MODES = {
    "dpo": ("separate", "precomputed"),
    "dpo-lora": ("adapters-off", "separate", "precomputed"),
}
# dpo's reference under a recipe `scaffold new` chose for the GPU (generator.recipe): the
# precomputed log-probs (one pass before training, then only the policy is resident), not the
# separate frozen copy (a second model's shards). dpo-lora's default, adapters-off, has no copy.
CHOSEN_REF_MODE = {"dpo": "precomputed"}
REF_MODE_HELP = {
    "separate": "a frozen copy of the checkpoint (--ref_device cpu keeps it in host memory)",
    "adapters-off": "the policy's own frozen base with the LoRA adapters skipped: no second copy",
    "precomputed": "one pass over the data before training caches the reference log-probs per "
    "pair, then only the policy is resident",
}


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
        # ac before compile before FSDP (docs/DESIGN.md, the script's sections): the model_setup slot runs in
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
        # bf16-sr after the low-bit optimizers: its optimizer text reads which state they chose.
        # torchao's `_AdamW` / `AdamW8bit` / `AdamW4bit` with bf16_stochastic_round=True (Zamirai
        # et al. 2020, arXiv:2010.06192: stochastic rounding keeps small updates in expectation)
        Trick(
            "bf16-sr",
            "bf16_stochastic_round",
            "bf16 weights and gradients (no fp32 master copy), AdamW rounding stochastically to bf16",
        ),
        # FSDP2's CPUOffloadPolicy, as torchtune's fsdp_cpu_offload and torchtitan's
        # enable_cpu_offload: sharded weights, gradients and the optimizer (its state and step) on CPU
        Trick(
            "cpu-offload",
            "cpu_offload",
            "FSDP2 CPUOffloadPolicy: weights, gradients and optimizer state in CPU memory",
        ),
    ]
}


# Parallel-plan templates, rendered when the spec asks for them (after the algorithm's template,
# before the tricks: TP and CP -> activation checkpointing -> compile -> FSDP, docs/DESIGN.md).
# file stem -> predicate on the Spec. HSDP (dp_replicate) is the skeleton's own FSDP mesh choice.
PARALLEL_FEATURES = {
    "tensor_parallel": lambda spec: spec.tp > 1,
    "context_parallel": lambda spec: spec.cp > 1,
}


# Parallel plans, by the option that turns them on (the support table's plan rows).
PLANS = {
    "--gpus N": "FSDP2 over N processes (the default plan: every algorithm)",
    "--dp-replicate": "HSDP: replica groups of FSDP shards",
    "--tp": "tensor + sequence parallel, loss parallel",
    "--cp": "context parallel (K/V all-gather, or a ring with --cp-mode ring)",
    "--ep": "expert parallel (MoE)",
}

# What the SFT, DPO and GRPO skeletons' algorithms do not take yet, and why (HSDP, CP and EP are
# built for all of them, TP for all but qlora).
_NF4_TP = (
    "torchao 0.18's NF4Tensor splits only along dim 0 (aten.split on another dim raises "
    "NotImplementedError), and the rowwise TP plan of o_proj and down_proj shards their weight "
    "along dim 1; use --algo lora (a bf16 base takes TP) or FSDP/HSDP for qlora"
)


# Why not for adapters: a technical reason, nothing to gain.
_BF16_SR_ADAPTERS = (
    "the trained parameters are the adapters (under 1% of the weights), so their fp32 master "
    "copy and fp32 AdamW state cost little; the frozen base is already stored in bf16 (or NF4), "
    "and bf16 adapters would only lose small updates"
)
_OFFLOAD_ADAPTERS = (
    "not built yet: FSDP2 CPU offload of the frozen bf16/NF4 base with adapters is untested "
    "(the frozen base has no gradients or optimizer state, so offload would move the weights only)"
)


def _refusals() -> dict[tuple[str, str], str]:
    """(trick or plan, algorithm) -> why that algorithm does not take it. Absent: supported."""
    out = {}
    for name, algo in ALGOS.items():
        if algo.skeleton == "rm":
            # HSDP: the score head is one more FSDP-sharded weight on the 2-D mesh; TP: the
            # decoder's plan, the score head replicated on the tp ranks (runtime.replicate_over_mesh);
            # CP: each row scored on the cp rank holding its last token, summed over the cp ranks;
            # EP: the experts sharded as for a causal LM, the score head FSDP-sharded beside them
            out["packing", name] = (
                "not built for reward models yet: a packed row would need one scored position "
                "per document and a per-document score gather"
            )
            out["lce", name] = (
                "a reward model has no lm_head: its head is one [D] -> 1 projection of one "
                "token per sequence, so there are no [B, S, V] logits to chunk"
            )
        if name == "qlora":
            out["--tp", name] = _NF4_TP
        if name == "ppo":
            out["lce", name] = (
                "not built yet: the value head reads the same final hidden states as lm_head, and "
                "the chunked path (completion_logprobs) would need a second forward for them"
            )
            out["packing", name] = (
                "not built yet: GAE runs over each completion's tokens in a row of its own; packed "
                "rows (several completions per row) are untested there"
            )
        if algo.template == "lora":
            out["bf16-sr", name] = _BF16_SR_ADAPTERS
            out["cpu-offload", name] = _OFFLOAD_ADAPTERS
    return out


REFUSED = _refusals()


def refusal(feature: str, algo: str) -> str | None:
    """Why `algo` does not take `feature` (a trick name or a plan option), or None if it does."""
    return REFUSED.get((feature, algo))


def support_table() -> list[tuple[str, dict[str, str | None]]]:
    """The rows `scaffold list` prints: (trick or plan, {algorithm: None or the refusal})."""
    rows = [*TRICKS, *PLANS]
    return [(row, {algo: refusal(row, algo) for algo in ALGOS}) for row in rows]
