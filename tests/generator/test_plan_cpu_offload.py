"""cpu-offload in the planner: the simulation refuses it (on the CPU it cannot tell host memory
from the GPU's), and the arithmetic estimate that `scaffold new` prints moves the sharded
weights, gradients and optimizer state (and DPO's separate reference) off the GPU, into a host
figure per node. Closed-form checks on Llama 3.3 70B over 8 GPUs (config only, no weights)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from click.testing import CliRunner

from generator.cli import cli
from generator.plan import GIB, PlanError, check_simulable, estimate
from generator.plan_estimate import model_dims
from generator.plan_harness import trained_bytes
from generator.plan_report import trainer_resident
from generator.render import render
from generator.spec import Spec, model_config

MODEL, GPUS = "llama3.3-70b", 8


def _estimates(algo: str, tricks: tuple[str, ...]):
    plain = Spec(algo=algo, model=MODEL, gpus=GPUS, tricks=tricks, out="o")
    offloaded = replace(plain, tricks=(*tricks, "cpu-offload"))
    return (estimate(s, render(s)) for s in (plain, offloaded))


@pytest.mark.fast
@pytest.mark.parametrize("tricks", [("ac",), ("ac", "optim-in-bwd", "adamw8bit")], ids="+".join)
def test_sft_estimate_moves_the_shards_to_host(tricks):
    """The GPU keeps the gathered blocks, activations and loss work; the host holds fp32
    weights (4 B), their gradients (4 B, none under optim-in-bwd) and the AdamW state (8 B fp32,
    2 B 8-bit: `trained_bytes`) of each rank's 1/8 of the parameters."""
    plain, off = _estimates("sft", tricks)
    n = model_dims(model_config(plain.spec))["params"]
    grads = 0 if "optim-in-bwd" in tricks else 4
    state = trained_bytes(tricks)[1]
    assert off.host == int((4 + grads + state) * n / GPUS) and plain.host == 0
    assert off.parts.get("gradients", 0) == off.parts.get("optimizer state", 0) == 0
    # every moment of the plain step holds the sharded weights and the state: the offloaded
    # peak is at least that much lower, and still holds the gathered bf16 blocks and root
    assert off.peak <= plain.peak - (4 + state) * n / GPUS + 1
    d = model_dims(model_config(plain.spec))
    assert off.parts["parameters"] == pytest.approx(2 * (d["root"] + 2 * d["block"]), abs=2)


@pytest.mark.fast
def test_dpo_separate_reference_goes_to_host_with_it():
    """DPO's separate frozen reference is offloaded with the policy (the script gives it the same
    CPUOffloadPolicy): its bf16 shard moves to host, its gathered root stays on the GPU."""
    plain, off = _estimates("dpo", ("ac",))
    n = model_dims(model_config(plain.spec))["params"]
    assert 'ref_mode: str = "separate"' in render(off.spec)
    assert off.host == int((4 + 4 + 8 + 2) * n / GPUS)
    d = model_dims(model_config(plain.spec))
    assert off.parts["reference"] == pytest.approx(2 * d["root"], abs=2)
    assert plain.parts["reference"] == pytest.approx(2 * n / GPUS + 2 * d["root"], abs=2)


@pytest.mark.fast
def test_colocated_grpo_keeps_nothing_resident_between_steps():
    """Colocated GRPO's generation and sync phases add what the trainer keeps on its GPU; under
    cpu-offload its weights, reference and optimizer state are all in host memory."""
    r = {
        "trainer_ranks": 8, "trained_params": 10, "num_params": 10, "weight_bytes_trained": 4,
        "dtype_bytes": 2, "reference": True, "offload_optimizer": False, "optimizer_bytes": 8,
    }  # fmt: skip
    assert sum(trainer_resident(r).values()) == (4 * 10 + 2 * 10 + 8 * 10) / 8
    assert set(trainer_resident({**r, "cpu_offload": True}).values()) == {0}
    plain, off = _estimates("grpo", ("ac",))
    assert off.peak < plain.peak


@pytest.mark.fast
def test_plan_refuses_cpu_offload_and_new_prints_the_estimate(tmp_path):
    """`scaffold plan` names why it cannot simulate cpu-offload (the plan without it is an upper
    bound); `scaffold new` prints the estimate's verdict with the host memory per node."""
    spec = Spec(model=MODEL, gpus=GPUS, tricks=("ac", "cpu-offload"), out="o")
    with pytest.raises(PlanError, match="cannot simulate --tricks cpu-offload .*host memory"):
        check_simulable(spec, None, None)
    args = ["new", "--model", MODEL, "--gpus", str(GPUS), "--tricks", "ac,cpu-offload"]
    result = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    (_, off) = _estimates("sft", ("ac",))
    per_node = off.host * GPUS / GIB
    assert (
        f"memory per GPU: fits on h100-80: ~{off.peak / GIB:.0f} GiB of 71.6 usable per GPU "
        "(estimate, not simulated: scaffold plan cannot simulate --tricks cpu-offload; host "
        f"memory ~{per_node:.0f} GiB per node for the offloaded shards)"
    ) in result.output


@pytest.mark.fast
def test_plan_prints_the_estimate_and_judges_the_host_memory(tmp_path):
    """`scaffold plan` (options or DIR) prints the estimate's line for cpu-offload, as `new`
    does; the offloaded shards' host memory per node is part of the verdict: 70B on 8 GPUs fits
    a 2 TB node, 405B on 8 (16 B per parameter of fp32 weights, gradients and AdamW state: about
    6 TB) does not, though its GPU share would."""
    fits = CliRunner().invoke(
        cli, ["plan", "--model", MODEL, "--gpus", "8", "--tricks", "ac,cpu-offload"]
    )
    assert fits.exit_code == 0, fits.output
    (_, off) = _estimates("sft", ("ac",))
    assert fits.output.startswith(f"memory per GPU: fits on h100-80: ~{off.peak / GIB:.0f} GiB")
    assert f"host memory ~{off.host * GPUS / GIB:.0f} GiB per node" in fits.output
    args = ["--model", "llama3.1-405b", "--gpus", "8", "--tricks", "ac,cpu-offload"]
    new = CliRunner().invoke(cli, ["new", *args, "--out", str(tmp_path / "r")])
    assert new.exit_code == 0, new.output
    spec = Spec(model="llama3.1-405b", gpus=8, tricks=("ac", "cpu-offload"), out="r")
    big = estimate(spec, render(spec))
    assert big.peak < 0.9 * 79.6 * GIB  # the GPU's share alone would fit
    per_node = big.host * 8 / GIB
    assert per_node > 0.9 * 2e12 / GIB
    line = (
        f"memory per GPU: does NOT fit: host memory ~{per_node:.0f} GiB per node for the offloaded "
        "shards, over the 1676 GiB usable of a 2 TB node; the GPU share fits h100-80 "
        f"(~{big.peak / GIB:.0f} GiB of 71.6 usable per GPU; estimate, not simulated: scaffold plan "
        "cannot simulate --tricks cpu-offload); over --nodes 4 the shards would fit the hosts"
    )
    assert math.ceil(per_node / (0.9 * 2e12 / GIB)) == 4
    assert line in new.output
    planned = CliRunner().invoke(cli, ["plan", str(tmp_path / "r")])
    assert planned.exit_code == 0 and planned.output.strip() == line, planned.output
