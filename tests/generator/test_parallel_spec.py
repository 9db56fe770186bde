"""Spec validation of the parallel plan (--tp, --cp, --dp-replicate): every refused plan raises one
SpecError naming the numbers and the valid choices, before anything is rendered."""

from __future__ import annotations

import json

import pytest

from generator.spec import Spec, SpecError, validate_spec


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # world = gpus * nodes must be a multiple of dp_replicate * cp * tp
        (Spec(gpus=4, dp_replicate=3), ["= 4 processes", "dp_replicate*cp*tp = 3*1*1 = 3", "[1, 2, 4]"]),
        (Spec(model="qwen3-0.6b", gpus=6, tp=4), ["= 6 processes", "= 4", "[1, 2, 3, 6]"]),
        # heads (and KV heads) divisible by tp: SmolLM2-135M has 9 heads, 3 KV heads
        (Spec(gpus=2, tp=2), ["num_attention_heads=9", "num_key_value_heads=3", "pick tp in {1, 3}"]),
        # TP within a node
        (Spec(model="qwen3-0.6b", gpus=2, nodes=2, tp=4), ["--tp 4 > --gpus 2", "intra-node"]),
        # context parallel: refused, with the reason
        (Spec(gpus=2, cp=2), ["--cp 2", "no CPU sharding rule for causal SDPA"]),
        # degrees >= 1
        (Spec(dp_replicate=0), ["--dp-replicate 0: must be >= 1"]),
        (Spec(tp=0), ["--tp 0: must be >= 1"]),
        # TP / HSDP are wired into the SFT skeleton only
        (Spec(algo="dpo", model="qwen3-0.6b", gpus=2, tp=2, dataset="dpo_en_demo.json"), ["--algo dpo", "SFT skeleton only"]),
        (Spec(algo="lora", gpus=4, dp_replicate=2), ["--algo lora", "--tp 1 --dp-replicate 1"]),
        # compile of DTensor blocks is not tested here
        (Spec(model="qwen3-0.6b", gpus=2, tp=2, tricks=("compile",)), ["--tricks compile with --tp 2"]),
    ],
)  # fmt: skip
def test_refused_parallel_plans(spec, expected):
    with pytest.raises(SpecError) as e:
        validate_spec(spec)
    for part in expected:
        assert part in str(e.value), (part, str(e.value))


def test_valid_plans_pass_and_command_prints_non_defaults():
    tp = Spec(model="qwen3-0.6b", gpus=4, tp=2, out="o")
    hsdp = Spec(gpus=4, dp_replicate=2, out="o")
    for spec in (tp, hsdp, Spec(model="qwen3-0.6b", gpus=8, nodes=2, tp=8, dp_replicate=2)):
        validate_spec(spec)
    assert "--gpus 4 --tp 2 --out" in tp.command() and "--cp" not in tp.command()
    assert "--gpus 4 --dp-replicate 2 --out" in hsdp.command()


def test_old_spec_json_without_parallel_fields_loads():
    old = {
        "generator_version": "0.1.0",
        "spec": {"algo": "sft", "model": "smollm2-135m", "gpus": 2},
    }
    spec = Spec.from_json(json.dumps(old))
    assert (spec.tp, spec.cp, spec.dp_replicate) == (1, 1, 1)
