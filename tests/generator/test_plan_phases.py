"""The planner's phase model of each GRPO layout (`plan_report.grpo_phases`): colocated is the
max of the trainer step, the generation and the weight sync (not the trainer peak plus the
engine), split keeps its two places. The phase figures are checked against closed-form
arithmetic on SmolLM2 135M (no simulation: the trainer peak is given), for both sleep levels,
offload_optimizer on and off, the KL reference, grpo-lora, and both engines; then the verdict,
the search, the arithmetic estimate and the CLI use the same model."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from generator.cli import cli
from generator.plan import (
    GIB,
    PlanResult,
    engine_layout,
    estimate,
    fits,
    format_result,
    format_suggestion,
    suggest,
)
from generator.plan import model_dir_for as _model_dir_for
from generator.plan_report import ENGINE_CONTEXT, VLLM_GRAPH_POOLS, grpo_phases
from generator.render import render
from generator.spec import Spec, validate_spec
from runtime import ModelArgs, read_hf_config

MODEL = "smollm2-135m"  # hidden 576 (< ESTIMATE_MIN_HIDDEN: the search rules nothing out)
GPU = 80.0
LENGTHS = {"prompt_len": 256, "completion_len": 64, "prompts_per_step": 8, "num_generations": 8}


def _cfg(spec: Spec, **config):
    class Cfg:  # the script's Config fields engine_layout reads (the colocated render's defaults)
        engine, num_engines, engine_tensor_parallel_size = "vllm", spec.gpus, 1
        engine_gpu_memory_utilization, dtype, kl_coef = 0.3, "bf16", 0.0
        layout, engine_sleep_level, offload_optimizer = spec.layout, 2, False

    for k, v in config.items():
        setattr(Cfg, k, v)
    return Cfg


def _result(spec: Spec, tmp: Path, peak_gib: float, **config) -> PlanResult:
    rollout = {
        **LENGTHS, "rollouts_per_step": 64, "rollouts_on_rank": 32, "micro_batches": 8,
        "simulated_micro_batches": 2, "kl_coef": config.get("kl_coef", 0.0),
        **engine_layout(spec, _cfg(spec, **config), _model_dir_for(spec, tmp)),
    }  # fmt: skip
    peak = int(peak_gib * GIB)
    return PlanResult(
        spec=spec, micro_batch_size=4, max_seq_len=320, world_size=spec.gpus,
        categories={"temporaries": peak}, peak=peak, logits=0, seconds=0.0, rollout=rollout,
    )  # fmt: skip


def _shapes(tmp: Path) -> dict:
    config = read_hf_config(_model_dir_for(Spec(model=MODEL), tmp))
    args = ModelArgs.from_hf_config(config)
    return {"P": args.num_params(), "V": config["vocab_size"], "D": config["hidden_size"],
            "L": config["num_hidden_layers"], "kvh": config["num_key_value_heads"],
            "hd": config["hidden_size"] // config["num_attention_heads"],
            "I": config["intermediate_size"]}  # fmt: skip


def _sum(parts: dict) -> float:
    return sum(parts.values())


@pytest.mark.fast
@pytest.mark.parametrize(
    "level,offload,kl", list(itertools.product((1, 2), (False, True), (0.0, 0.05)))
)
def test_colocated_vllm_phases_are_the_closed_form(tmp_path, level, offload, kl):
    """grpo, 2 GPUs, vLLM at 0.3: every phase's figure is the arithmetic of the model's size."""
    spec = Spec(algo="grpo", model=MODEL, gpus=2, layout="colocated")
    validate_spec(spec)
    n = _shapes(tmp_path)
    P, world = n["P"], 2
    r = _result(
        spec, tmp_path, 10.0, engine_sleep_level=level, offload_optimizer=offload, kl_coef=kl
    )
    p = grpo_phases(r.rollout, r.peak, GPU)
    asleep = ENGINE_CONTEXT + VLLM_GRAPH_POOLS
    resident = 4 * P / world + (2 * P / world if kl else 0) + (0 if offload else 8 * P / world)
    assert _sum(p["phases"]["trainer step"]) == 10 * GIB + asleep
    assert _sum(p["phases"]["generation"]) == pytest.approx(
        0.3 * GPU * GIB + ENGINE_CONTEXT + resident
    )
    assert _sum(p["phases"]["weight sync"]) == pytest.approx(
        2 * P + asleep + resident + 4 * n["V"] * n["D"]  # bf16 weights, tp 1; fp32 embedding
    )
    assert p["verdict"] == max(_sum(ph) for ph in p["phases"].values())
    # host memory, per node: level 1 keeps both engines' weights; offload the AdamW state
    host = p["host"]
    assert host.get("engine weights (sleep level 1)", 0) == (2 * 2 * P if level == 1 else 0)
    assert host.get("optimizer state (offload_optimizer)", 0) == pytest.approx(
        8 * P if offload else 0
    )
    # vLLM starts beside the trainer's fp32 weights and CUDA context
    assert p["startup"]["free"] == pytest.approx(GPU * GIB - ENGINE_CONTEXT - 4 * P / world)
    assert p["startup"]["ok"]


@pytest.mark.fast
@pytest.mark.parametrize("offload", (False, True))
def test_colocated_runtime_engine_and_grpo_lora_phases(tmp_path, offload):
    """The runtime's sampler: its bf16 weights, the KV cache of its batch (2 x layers x kv heads
    x head_dim x rows x (prompt + completion) x 2 B, rows = prompts_per_step / num_engines x G)
    and its fp32 [rows, V] logits; grpo-lora keeps its bf16 base and fp32 adapters resident,
    AdamW state of the adapters only, and no reference copy at kl_coef > 0."""
    n = _shapes(tmp_path)
    P, world = n["P"], 2
    spec = Spec(algo="grpo-lora", model=MODEL, gpus=2, layout="colocated")
    validate_spec(spec)
    r = _result(spec, tmp_path, 5.0, engine="runtime", offload_optimizer=offload, kl_coef=0.05)
    q, kv, rank = n["D"], n["kvh"] * n["hd"], 8
    adapters = (
        n["L"] * rank * ((n["D"] + q) * 2 + (n["D"] + kv) * 2 + (n["D"] + n["I"]) * 3)
    )  # q, o; k, v; gate, up, down
    assert r.rollout["trained_params"] == adapters and not r.rollout["reference"]
    p = grpo_phases(r.rollout, r.peak, GPU)
    rows = 8 // 2 * 8
    kv_cache = 2 * n["L"] * n["kvh"] * n["hd"] * rows * 320 * 2
    resident = (4 * adapters + 2 * P) / world + (0 if offload else 8 * adapters / world)
    gen = p["phases"]["generation"]
    assert gen["KV cache"] == kv_cache and gen["decode logits"] == rows * n["V"] * 4
    assert _sum(gen) == pytest.approx(
        2 * P + kv_cache + rows * n["V"] * 4 + ENGINE_CONTEXT + resident
    )
    assert _sum(p["phases"]["trainer step"]) == 5 * GIB + ENGINE_CONTEXT  # no CUDA graphs
    assert p["startup"] is None and p["verdict"] == 5 * GIB + ENGINE_CONTEXT


@pytest.mark.fast
def test_split_phases_keep_todays_numbers(tmp_path):
    """split with engine GPUs: the trainer GPU carries the trainer peak, the engine GPU vLLM's
    share; engines on the trainer's GPUs (split, 1 GPU): the peak plus the awake engine."""
    spec = Spec(algo="grpo", model=MODEL, gpus=2, engine_gpus=1)
    r = _result(spec, tmp_path, 20.0, engine_gpu_memory_utilization=0.85)
    p = grpo_phases(r.rollout, r.peak, GPU)
    assert p["phases"] == {"trainer step": {"trainer peak": 20 * GIB}}
    assert p["engine_gpu"] == {"vLLM share": 0.85 * GPU * GIB} and p["verdict"] == 20 * GIB
    text = format_result(r, "80", GPU)
    assert f"  {'trainer step':16} {20.0:9.2f} GiB  (trainer peak 20.00)  on a trainer GPU" in text
    assert f"  {'generation':16} {0.85 * GPU:9.2f} GiB  (vLLM share {0.85 * GPU:.2f})  on an " \
        "engine GPU" in text  # fmt: skip
    assert "verdict: fits on 80" in text
    shared = Spec(algo="grpo", model=MODEL, gpus=1)
    r1 = _result(shared, tmp_path, 60.0, engine_gpu_memory_utilization=0.3)
    p1 = grpo_phases(r1.rollout, r1.peak, GPU)
    assert p1["verdict"] == 60 * GIB + 0.3 * GPU * GIB and not fits(r1, GPU)  # 84 > 72


@pytest.mark.fast
def test_colocated_verdict_is_the_max_not_the_sum(tmp_path):
    """A trainer peak of 40 GiB and vLLM's 24 GiB share: colocated fits an 80 GB card (the
    phases take turns: max about 40 GiB), where adding the engine to the peak (64 + context)
    would not fit 57.6 GiB of 64; the printed rows are each phase's figure and the max."""
    spec = Spec(algo="grpo", model=MODEL, gpus=2, layout="colocated")
    r = _result(spec, tmp_path, 40.0)
    p = grpo_phases(r.rollout, r.peak, GPU)
    assert p["verdict"] == _sum(p["phases"]["trainer step"])
    assert fits(r, 64.0) and r.peak + 0.3 * 64 * GIB > 0.9 * 64 * GIB
    text = format_result(r, "64", 64.0)
    p64 = grpo_phases(r.rollout, r.peak, 64.0)
    for name, parts in p64["phases"].items():
        assert f"  {name:16} {_sum(parts) / GIB:9.2f} GiB  (" in text, name
    assert f"  {'max':16} {p64['verdict'] / GIB:9.2f} GiB" in text
    assert "verdict (the largest phase): fits on 64" in text
    assert "engine_sleep_level 2, offload_optimizer off" in text
    # over the budget in the generation phase only: the verdict says no
    big = _result(spec, tmp_path, 1.0, engine_gpu_memory_utilization=0.995)
    assert not fits(big, GPU)
    assert "does NOT start" in format_result(big, "80", GPU)  # 79.6 of 80 GiB is not free


@pytest.mark.fast
def test_suggest_uses_the_phases_for_colocated(tmp_path, monkeypatch):
    """A colocated run whose trainer peak fits but whose generation phase (vLLM's share + the
    resident fp32 weights and AdamW state) does not: the search adds the cheapest trick that
    shrinks the resident state (8-bit AdamW), not lce, which only lowers the trainer peak."""
    import generator.plan as plan

    spec = Spec(algo="grpo", model=MODEL, gpus=2, layout="colocated")

    def fake_simulate(specs, mbs, seq, progress=None, kl_coef=None, config=None, until=None):
        return [_result(s, tmp_path, 0.01) for s in specs]

    monkeypatch.setattr(plan, "simulate", fake_simulate)
    (base,) = fake_simulate([spec], None, None)
    (lowbit,) = fake_simulate([replace(spec, tricks=("adamw8bit",))], None, None)
    # the smallest GPU (0.01 GiB steps) that 8-bit AdamW's resident state fits and AdamW's not
    gpu = next(g / 100 for g in range(100, 20_000) if fits(lowbit, g / 100))
    assert not fits(base, gpu) and base.peak < 0.1 * 0.9 * gpu * GIB  # the trainer peak fits
    worst = grpo_phases(base.rollout, base.peak, gpu)
    assert worst["verdict"] > _sum(worst["phases"]["trainer step"])
    s = suggest(base, gpu, None, None)
    assert s is not None and s.added_tricks == ("adamw8bit",) and fits(s.result, gpu)
    # nothing fits: one node, so no more GPUs are tried, and the line says what is left
    assert suggest(base, 0.5, None, None) is None
    line = format_suggestion(None, spec)
    assert "colocated runs on one node" in line and "offload_optimizer" in line


@pytest.mark.fast
def test_estimate_uses_the_phases_for_colocated(tmp_path):
    """The arithmetic estimate of a colocated spec is its largest phase: for SmolLM2 135M on
    2 GPUs the generation (vLLM's 0.3 share of the GPU beside the trainer's resident state);
    of the split spec, the trainer's peak alone."""
    n = _shapes(tmp_path)
    P = n["P"]
    spec = Spec(algo="grpo", model=MODEL, gpus=2, layout="colocated")
    e = estimate(spec, render(spec), gpu_gib=GPU)
    assert e.moment == "generation"
    assert e.parts["vLLM share"] == int(0.3 * GPU * GIB)
    assert e.parts["trainer weights"] == int(4 * P / 2)
    assert e.parts["optimizer state"] == int(8 * P / 2)
    assert e.peak == sum(e.parts.values())
    split = Spec(algo="grpo", model=MODEL, gpus=2, engine_gpus=1)
    es = estimate(split, render(split), gpu_gib=GPU)
    assert es.peak < e.peak and "vLLM share" not in es.parts


@pytest.mark.fast
def test_cli_new_colocated_prints_the_phase_verdict(tmp_path):
    """`scaffold new --layout colocated` prints the estimate of the largest phase."""
    spec = Spec(algo="grpo", model=MODEL, gpus=2, layout="colocated")
    e = estimate(spec, render(spec), gpu_gib=79.6)
    args = ["new", "--algo", "grpo", "--model", MODEL, "--gpus", "2", "--layout", "colocated"]
    result = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert f"fits on h100-80: ~{e.peak / GIB:.0f} GiB of 71.6 usable per trainer GPU" in (
        result.output
    )


def test_cli_plan_colocated_prints_each_phase(tiny_real_vocab_dir):
    """`scaffold plan --layout colocated` (a tiny Llama, simulated): the trainer step is the
    simulated peak + a sleeping engine, each phase printed, the verdict the largest."""
    model = ["--algo", "grpo", "--model", str(tiny_real_vocab_dir), "--gpus", "2"]
    # a 2-GPU script's prompts take max_prompt_len = 512 (its multi-GPU default): 64 to complete
    lengths = ["--micro-batch-size", "2", "--max-seq-len", "576"]
    result = CliRunner().invoke(
        cli, ["plan", *model, "--layout", "colocated", *lengths, "--gpu-memory", "24"]
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "colocated engines (engine_tp 1) asleep while it steps" in out
    assert "phases per GPU (colocated: one trainer rank and 1/1 of an engine take turns; " \
        "engine_sleep_level 2, offload_optimizer off" in out  # fmt: skip
    peak = next(line for line in out.splitlines() if line.startswith("  peak "))
    peak_gib = float(peak.split()[1])
    step = next(line for line in out.splitlines() if line.startswith("  trainer step "))
    assert f"(trainer peak {peak_gib:.2f} + sleeping engine 1.50)" in step
    rows = [
        line for line in out.splitlines() if line.startswith(("  generation ", "  weight sync "))
    ]
    figures = [float(line[19:28]) for line in [step, *rows]]  # f"  {name:16} {gib:9.2f}"
    maximum = next(line for line in out.splitlines() if line.startswith("  max "))
    assert len(figures) == 3 and float(maximum[19:28]) == max(figures)
    assert "verdict (the largest phase): fits on 24 GiB" in out
