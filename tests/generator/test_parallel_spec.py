"""Spec validation of the parallel plan (--tp, --cp, --dp-replicate): every refused plan raises one
SpecError naming the numbers and the valid choices, before anything is rendered."""

from __future__ import annotations

import json

import pytest

from generator.spec import Spec, SpecError, validate_spec

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


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
        # context parallel: rows cut into 2*cp chunks (SmolLM2's default max_seq_len is 512)
        (Spec(gpus=3, cp=3), ["--cp 3", "max_seq_len=512", "2*cp=6", "choose --cp in [1]"]),
        (Spec(gpus=6, cp=3), ["2*cp=6", "choose --cp in [1, 2]"]),
        (Spec(gpus=4, cp=3), ["= 4 processes", "dp_replicate*cp*tp = 1*3*1 = 3"]),
        (Spec(gpus=4, cp=0), ["--cp 0: must be >= 1"]),
        # context parallel: untested pairings are refused with the reason
        # under TP each chunk is split again over tp: qwen3's default max_seq_len 2048 % (2*3*2)
        (Spec(model="qwen3-0.6b", gpus=12, cp=3, tp=2), ["2*cp*tp=12", "choose --cp in [1, 2]"]),
        (Spec(gpus=2, cp=2, tricks=("packing",)), ["--tricks packing with --cp 2", "document mask", "add --cp-mode ring"]),
        # --cp-mode: a known mode, and a ring needs cp ranks
        (Spec(gpus=2, cp=2, cp_mode="rings"), ["--cp-mode 'rings': choose one of allgather, ring"]),
        (Spec(cp_mode="ring"), ["--cp-mode ring with --cp 1", "no ring"]),
        (Spec(gpus=2, cp=2, tricks=("compile", "lce")), ["--tricks compile with --cp 2", "--tricks lce"]),
        (Spec(model="qwen3-30b-a3b", gpus=2, cp=2), ["--cp 2 with --model qwen3-30b-a3b", "dense models"]),
        # degrees >= 1
        (Spec(dp_replicate=0), ["--dp-replicate 0: must be >= 1"]),
        (Spec(tp=0), ["--tp 0: must be >= 1"]),
        # HSDP, TP and CP are wired into the SFT and DPO skeletons but not everywhere: the
        # support table's reasons (generator.features.refusal)
        (Spec(algo="qlora", model="qwen3-0.6b", gpus=2, tp=2), ["--algo qlora with --tp 2", "NF4Tensor splits only along dim 0", "use --tp 1 (FSDP over all GPUs, or HSDP with --dp-replicate)"]),
        (Spec(algo="lora", model="qwen3-0.6b", gpus=2, tp=2, peft="dora"), ["--peft dora with --tp 2", "use --peft lora or --tp 1"]),
        (Spec(algo="kd", model="qwen3-0.6b", gpus=2, tp=2, tricks=("lce",)), ["--tricks lce with --tp 2", "runtime.chunked_kd_loss", "or use --tp 1"]),
        # dpo's packed pairs under CP take the ring's document mask, as every packed row does
        (Spec(algo="dpo", gpus=2, cp=2, tricks=("packing",), dataset="dpo_en_demo.json"), ["--tricks packing with --cp 2 --cp-mode allgather", "--cp-mode ring"]),
        # GRPO's mesh is the trainer's ranks: the GPUs its engines leave
        (Spec(algo="grpo", gpus=4, engine_gpus=2, dp_replicate=4, dataset="chain_sum.jsonl"), ["(--gpus 4 - --engine-gpus 2) x --nodes 1 = 2 trainer processes", "not divisible by dp_replicate*cp*tp = 4*1*1", "one of [1, 2]"]),
        # GRPO under CP: packed rollout rows need the ring's document mask; PPO takes no packing
        (Spec(algo="grpo-lora", gpus=4, engine_gpus=0, cp=2, tricks=("ac", "packing"), dataset="chain_sum.jsonl"), ["--tricks packing with --cp 2 --cp-mode allgather", "add --cp-mode ring", "(--tricks ac)"]),
        (Spec(algo="ppo", model="qwen3-0.6b", gpus=4, engine_gpus=0, tp=2, tricks=("packing",), dataset="chain_sum.jsonl"), ["--algo ppo does not take --tricks packing", "GAE"]),
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
    hsdp_adapters = [Spec(algo=a, gpus=4, dp_replicate=2, out="o") for a in ("lora", "qlora", "kd")]
    hsdp_dpo = [
        Spec(algo=a, gpus=4, dp_replicate=2, dataset="dpo_en_demo.json", out="o")
        for a in ("dpo", "dpo-lora")
    ]
    tp_dpo = Spec(
        algo="dpo", model="qwen3-0.6b", gpus=4, tp=2, tricks=("ac", "lce", "packing"), out="o"
    )
    cp_dpo = [
        Spec(algo=a, gpus=4, cp=2, cp_mode=m, tricks=t, dataset="dpo_en_demo.json", out="o")
        for a, m, t in (("dpo", "allgather", ("ac", "lce")), ("dpo-lora", "ring", ("packing",)))
    ]
    cp_lora = Spec(algo="lora", gpus=2, cp=2, out="o")
    cp_qlora_rm = [
        Spec(algo=a, gpus=2, cp=2, cp_mode=m, dataset=d, out="o")
        for a, m, d in (
            ("qlora", "ring", "alpaca_en_demo.json"),
            ("rm", "allgather", "dpo_en_demo.json"),
        )
    ]
    cp_kd = Spec(algo="kd", gpus=2, cp=2, out="o")
    tp_kd = Spec(algo="kd", model="qwen3-0.6b", gpus=2, tp=2, tricks=("ac",), out="o")
    tp_adapters = [
        Spec(algo=a, model="qwen3-0.6b", gpus=2, tp=2, out="o") for a in ("lora", "dpo-lora")
    ]
    hsdp_adapters += [
        Spec(algo=a, gpus=g, engine_gpus=e, dp_replicate=2, dataset="chain_sum.jsonl", out="o")
        for a, g, e in (("grpo", 4, 0), ("grpo-lora", 6, 2))
    ]
    cp = Spec(gpus=2, cp=2, tricks=("ac", "lce"), out="o")
    hsdp_cp = Spec(gpus=8, cp=2, dp_replicate=2, out="o")
    tp_cp = Spec(model="qwen3-0.6b", gpus=8, cp=2, tp=2, out="o")
    ring_packing = Spec(gpus=2, cp=2, cp_mode="ring", tricks=("packing", "ac"), out="o")
    grpo_tricks = [  # lce and packing on the GRPO skeleton under TP and ring CP
        Spec(algo=a, model="qwen3-0.6b", gpus=4, engine_gpus=0, dataset="chain_sum.jsonl", out="o", **plan)
        for a in ("grpo", "grpo-lora")
        for plan in ({"tp": 2, "tricks": ("lce", "packing")}, {"cp": 2, "cp_mode": "ring", "tricks": ("lce", "packing")})
    ]  # fmt: skip
    for spec in (
        *grpo_tricks,
        tp,
        hsdp,
        cp,
        hsdp_cp,
        tp_cp,
        ring_packing,
        Spec(model="qwen3-0.6b", gpus=8, nodes=2, tp=8, dp_replicate=2),
        *hsdp_adapters,
        *hsdp_dpo,
        tp_dpo,
        *tp_adapters,
        *cp_dpo,
        cp_lora,
        *cp_qlora_rm,
        cp_kd,
        tp_kd,
    ):
        validate_spec(spec)
    assert "--gpus 4 --tp 2 --out" in tp.command() and "--cp" not in tp.command()
    assert "--gpus 4 --dp-replicate 2 --out" in hsdp.command()
    assert "--gpus 2 --cp 2 --out" in cp.command()
    assert "--gpus 2 --cp 2 --cp-mode ring --out" in ring_packing.command()


def test_old_spec_json_without_parallel_fields_loads():
    old = {
        "generator_version": "0.1.0",
        "spec": {"algo": "sft", "model": "smollm2-135m", "gpus": 2},
    }
    spec = Spec.from_json(json.dumps(old))
    assert (spec.tp, spec.cp, spec.dp_replicate) == (1, 1, 1)
