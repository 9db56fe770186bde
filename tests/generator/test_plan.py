"""`scaffold plan`: the fake-tensor simulation of the emitted step agrees with the same step run on
real tensors (PyTorch's MemTracker on CPU; 1 process and 2 gloo ranks), and the verdict and the
suggestions follow from the simulated numbers."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from generator.cli import cli
from generator.plan import (
    GIB,
    PlanError,
    PlanResult,
    _candidate_trick_sets,
    check_simulable,
    fits,
    format_result,
    import_script,
    measure_step,
    parse_gpu_memory,
    simulate,
    suggest,
)
from generator.render import render
from generator.spec import Spec
from runtime.testing import spawn

TOLERANCE = 0.10  # the bar: simulated peak within 10% of the measured one


def _measure_real(spec: Spec, model_dir: Path, mbs: int, seq: int, tmp: Path) -> dict:
    """The same two steps on real CPU tensors in this process (a process group must exist)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "train.py").write_text(render(spec))
    script = import_script(tmp / "train.py", f"plan_real_{tmp.name}")
    return measure_step(script, model_dir, mbs, seq, spec, fake=False)


def _real_rank(rank, world_size, spec_json, model_dir, mbs, seq, tmp):
    data = json.loads(spec_json)
    spec = Spec(**dict(data, tricks=tuple(data["tricks"])))
    return _measure_real(spec, Path(model_dir), mbs, seq, Path(tmp) / f"rank{rank}")


def _assert_agrees(sim: PlanResult, real: dict) -> None:
    rel = abs(sim.peak - real["peak"]) / real["peak"]
    print(f"plan {sim.spec.model} {sim.spec.tricks} x{sim.world_size}: simulated peak "
          f"{sim.peak / GIB:.4f} GiB, measured {real['peak'] / GIB:.4f} GiB, {rel:.2%} off")  # fmt: skip
    assert rel <= TOLERANCE, (sim.peak / GIB, real["peak"] / GIB, sim.categories, real)
    for row in ("parameters", "optimizer state"):  # the resident rows are exact, not just close
        assert sim.categories[row] == pytest.approx(real["categories"][row], rel=0.01), row
    assert sim.logits == real["logits"]


def test_one_rank_simulation_matches_real_step(
    process_group, tiny_model_dir, smollm2_dir, tmp_path
):
    """1 rank, bf16 under fully_shard, 1 x 128 tokens: the tiny random model (its peak is the
    [T, V] logits and activations) with and without ac + lce (+ optim-in-bwd, whose per-parameter
    AdamW state is created inside backward hooks), and the real SmolLM2-135M (its peak
    is the optimizer step: fp32 master weights, gradients and AdamW state). The 1-process fp32 script
    leaves its model unwrapped (no fully_shard): the plan models that too."""
    mbs, seq = 1, 128
    cases = [
        (Spec(model=str(tiny_model_dir)), tiny_model_dir),
        (Spec(model=str(tiny_model_dir), dtype="fp32"), tiny_model_dir),  # left unwrapped
        (Spec(model=str(tiny_model_dir), tricks=("ac", "lce")), tiny_model_dir),
        (Spec(model=str(tiny_model_dir), tricks=("ac", "lce", "optim-in-bwd")), tiny_model_dir),
        (Spec(algo="lora", model=str(tiny_model_dir)), tiny_model_dir),  # frozen base
        (Spec(model=str(smollm2_dir)), smollm2_dir),
    ]
    simulated = simulate([spec for spec, _ in cases], mbs, seq)  # one child process for all
    for i, ((spec, model_dir), sim) in enumerate(zip(cases, simulated, strict=True)):
        real = _measure_real(spec, model_dir, mbs, seq, tmp_path / f"real{i}")
        _assert_agrees(sim, real)
        if "lce" in spec.tricks:
            assert sim.logits == 0  # the [T, V] logits never exist
        else:
            assert sim.logits == mbs * seq * 49152 * (4 if spec.dtype == "fp32" else 2)


def test_two_rank_simulation_matches_two_gloo_ranks(tiny_model_dir, tmp_path):
    spec = Spec(model=str(tiny_model_dir), gpus=2, tricks=("ac",))
    sim, one_rank = simulate([spec, replace(spec, gpus=1)], 2, 128)
    args = (json.dumps(asdict(spec)), str(tiny_model_dir), 2, 128, str(tmp_path))
    real = spawn(_real_rank, world_size=2, args=args)
    assert sim.world_size == 2 and sim.categories["parameters"] < one_rank.categories["parameters"]
    for rank_result in real:
        _assert_agrees(sim, rank_result)


def test_tp_cp_and_hsdp_simulations_match_four_gloo_ranks(tiny_model_dir, tmp_path):
    """TP 2 x FSDP 2 with lce (sequence parallel, vocab-sharded lm_head and loss), CP 2 x FSDP 2
    with lce (K/V all-gather attention) and HSDP 2 x 2 with ac: the simulated rank is within the
    tolerance of every real gloo rank (when written: TP and HSDP exact, CP 0.04% off)."""
    specs = [
        Spec(model=str(tiny_model_dir), gpus=4, tp=2, tricks=("lce",)),
        Spec(model=str(tiny_model_dir), gpus=4, cp=2, tricks=("lce",)),
        Spec(model=str(tiny_model_dir), gpus=4, dp_replicate=2, tricks=("ac",)),
    ]
    simulated = simulate(specs, 2, 128)
    for i, (spec, sim) in enumerate(zip(specs, simulated, strict=True)):
        args = (json.dumps(asdict(spec)), str(tiny_model_dir), 2, 128, str(tmp_path / f"s{i}"))
        for rank_result in spawn(_real_rank, world_size=4, args=args):
            _assert_agrees(sim, rank_result)


def test_plan_refuses_what_it_has_not_been_checked_on(tiny_model_dir):
    for spec, flag in [
        (Spec(model="qwen3-30b-a3b", gpus=8), "mixture-of-experts"),
        (Spec(model="qwen3-30b-a3b", gpus=2, ep=2), "mixture-of-experts"),
        (Spec(model=str(tiny_model_dir), tricks=("compile",)), "--tricks compile"),
    ]:
        with pytest.raises(PlanError, match=f"not simulate {flag}"):
            check_simulable(spec, 1, 128)


def test_tp_rows_are_padded_like_the_script_pads_them():
    """TP 3 (SmolLM2: 9 heads, 3 KV heads) at 128 tokens: the script's collate pads rows to a
    multiple of tp (129) for sequence parallel, and so does the plan's synthetic batch."""
    (result,) = simulate([Spec(model="smollm2-135m", gpus=3, tp=3, tricks=("lce",))], 1, 128)
    assert result.world_size == 3 and result.peak > 0


def test_verdict_and_cheapest_fitting_tricks(tiny_model_dir):
    """On a GPU just too small for the plain run, the suggestion is lce alone: the cheapest trick,
    and the one that removes the [T, V] logits."""
    spec = Spec(model=str(tiny_model_dir))
    base, with_lce = simulate([spec, replace(spec, tricks=("lce",))], 2, 128)
    assert with_lce.peak < base.peak
    gpu_gib = (base.peak + with_lce.peak) / 2 / GIB / 0.9  # between the two, after headroom
    assert not fits(base, gpu_gib) and fits(with_lce, gpu_gib)
    assert "does NOT fit" in format_result(base, "test", gpu_gib)
    assert "verdict: fits" in format_result(with_lce, "test", gpu_gib)
    s = suggest(base, gpu_gib, 2, 128)
    assert s.added_tricks == ("lce",) and s.gpus == 1 and s.result.peak == with_lce.peak


def test_candidate_tricks_cheapest_first_and_compatible():
    sets = _candidate_trick_sets(Spec(tricks=("ac",)))
    assert sets[0] == ("lce",)
    assert all("ac" not in s for s in sets)
    assert not any({"adamw8bit", "adamw4bit"} <= set(s) for s in sets)
    assert [len(s) for s in sets] == sorted(len(s) for s in sets)
    assert (
        _candidate_trick_sets(Spec(algo="lora", tricks=("lce", "ac", "optim-in-bwd", "adamw4bit")))
        == []
    )


def test_cli_plan_prints_rows_and_verdict(tiny_model_dir):
    args = [
        "plan",
        "--model",
        str(tiny_model_dir),
        "--micro-batch-size",
        "2",
        "--max-seq-len",
        "64",
    ]
    result = CliRunner().invoke(cli, [*args, "--gpu-memory", "a100-80"])
    assert result.exit_code == 0, result.output
    for row in ("parameters", "gradients", "optimizer state", "activations", "temporaries", "peak"):
        assert row in result.output
    assert "verdict: fits on a100-80 (80 GiB" in result.output


def test_gpu_memory_names_and_bad_values():
    assert parse_gpu_memory("H200-141") == ("h200-141", 140.4)
    assert parse_gpu_memory("24") == ("24 GiB", 24.0)
    with pytest.raises(PlanError, match=r"valid names: .*a100-80"):
        parse_gpu_memory("v100")
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(PlanError, match=r"must be a number of GiB > 0"):
            parse_gpu_memory(bad)


def test_new_prints_the_plan_summary(tiny_model_dir, tmp_path):
    """`scaffold new --gpu-memory` simulates the script it wrote; without it, the plan command is
    printed; a spec the planner refuses still gets its script and a line saying why."""
    model = ["--model", str(tiny_model_dir)]
    result = CliRunner().invoke(
        cli, ["new", *model, "--out", str(tmp_path / "a"), "--gpu-memory", "24"]
    )
    assert result.exit_code == 0, result.output
    assert "peak" in result.output and "verdict: fits on 24 GiB" in result.output
    result = CliRunner().invoke(cli, ["new", *model, "--out", str(tmp_path / "b")])
    assert f"memory per GPU: scaffold plan --algo sft --model {tiny_model_dir}" in result.output
    assert "--gpu-memory h100-80" in result.output
    result = CliRunner().invoke(
        cli, ["new", "--algo", "dpo", *model, "--out", str(tmp_path / "c"), "--gpu-memory", "24"]
    )
    assert result.exit_code == 0 and (tmp_path / "c" / "train.py").exists(), result.output
    assert (
        "memory per GPU: not simulated: scaffold plan cannot simulate --algo dpo" in result.output
    )
