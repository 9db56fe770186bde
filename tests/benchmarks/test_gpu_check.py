"""The prepared GPU check (benchmarks/gpu_check.py, scripts/gpu_check.sh) on CPU: its --smoke mode
runs the same driver (prepare, model, run, plan, table) with a tiny model, so the check is known to
work before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DRIVER = str(ROOT / "benchmarks" / "gpu_check.py")


def _row(table: str, case: str) -> list[str]:
    (line,) = [ln for ln in table.splitlines() if ln.startswith(f"| {case} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_smoke_run_writes_measured_and_planned_figures(tmp_path):
    prepared, out = tmp_path / "prepared", tmp_path / "out"
    out.mkdir()
    cases = ["sft-bf16", "sft-bf16-offload", "grpo-colocated-vllm"]
    subprocess.run([sys.executable, DRIVER, "--prepare", "--no-wheels", "--prepared", str(prepared),
                    "--cases", *cases], check=True, cwd=ROOT)  # fmt: skip
    assert (prepared / "scripts" / "sft-bf16" / "train.py").is_file()
    colocated = (prepared / "scripts" / "grpo-colocated-vllm" / "train.py").read_text()
    assert 'layout: str = "colocated"' in colocated  # the rendered layout the case's name says
    results = tmp_path / "RESULTS.md"
    results.write_text("# earlier figures\n")
    proc = subprocess.run(
        [sys.executable, DRIVER, "--smoke", "--prepared", str(prepared), "--work", str(tmp_path / "w"),
         "--results", str(results), "--cases", *cases],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OUT": str(out)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "runtime probe: bf16 forward + backward on cpu ok" in proc.stdout
    text = results.read_text()
    assert (
        text.startswith("# earlier figures\n") and "## GPU check, CPU smoke run (" in text
    )  # appended
    assert (out / "gpu_check.md").read_text().strip() in text
    case, status, steps, rate, peak, planned, ratio, _, note = _row(text, "sft-bf16")
    assert (status, steps) == ("pass", "3")
    assert float(rate.replace(",", "")) > 0 and float(peak.replace(",", "")) > 0
    # the planner simulated the same spec on the same tiny model: tens of MiB, not the 135M's GiBs
    assert 1 < float(planned.replace(",", "")) < 1000
    assert "CPU peak is RSS: not compared with the plan" in note
    skipped = _row(text, "sft-bf16-offload")
    assert skipped[1] == "skip" and "offload is CUDA only" in skipped[-1]
    skipped = _row(text, "grpo-colocated-vllm")  # vLLM's sleep mode: never run on CPU
    assert skipped[1] == "skip" and "runs on CUDA only" in skipped[-1]
    rows = {r["case"]: r for r in json.loads((out / "gpu_check.json").read_text())["rows"]}
    sft = rows["sft-bf16"]
    assert sft["ratio"] == pytest.approx(sft["peak_mib"] / sft["planned_mib"])
    assert f"{sft['peak_mib']:,.0f}" == peak and f"{sft['planned_mib']:,.0f}" == planned


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_check_refuses_without_cuda_in_one_line():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"gpu_check: no CUDA GPU visible to {sys.executable}'s torch; on CPU run: python benchmarks/gpu_check.py --smoke"
    ]


def _driver():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", DRIVER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "peak, bound, status",
    [(1050, False, "pass"), (920, False, "pass"), (1200, False, "fail"), (850, False, "fail"),
     (500, True, "pass"), (1090, True, "pass"), (1200, True, "fail")],
)  # fmt: skip
def test_cuda_peak_is_judged_against_the_plan(peak, bound, status):
    """On CUDA a run passes within 10% of its plan; against an upper bound (compile, planned
    without it) only above 1.10x fails."""
    g = _driver()
    row = g.Row("c", status="pass", steps=10, peak_mib=peak, planned_mib=1000)
    row.extra = {"plan": "planned in 3 s", "bound": bound}
    g.judge(row, "cuda")
    assert row.status == status
    if status == "fail":
        bar = "at most 1.10x" if bound else "within 10%"
        assert row.note == f"peak {peak / 1000:.2f}x the plan (bar: {bar}); planned in 3 s"


@pytest.mark.parametrize(
    "peak, status", [(1140, "pass"), (860, "pass"), (1160, "fail"), (840, "fail")]
)
def test_cpu_offload_is_judged_against_the_estimate(peak, status):
    """cpu-offload is not simulated: its run is held to `scaffold new`'s arithmetic estimate
    within the estimate's own tolerance (15%), which the check keeps equal to the generator's."""
    from generator.plan_estimate import ESTIMATE_TOLERANCE

    g = _driver()
    assert g.ESTIMATE_TOLERANCE == ESTIMATE_TOLERANCE
    assert any("cpu-offload" in c.new_args for c in g.CASES)
    row = g.Row("c", status="pass", steps=10, peak_mib=peak, planned_mib=1000)
    row.extra = {"plan": "estimated", "estimate": True}
    g.judge(row, "cuda")
    assert row.status == status
    if status == "fail":
        assert row.note == f"peak {peak / 1000:.2f}x the plan (bar: within 15%); estimated"


@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_full_rows_are_the_case_the_plan_simulates(algo, tmp_path, smollm2_dir):
    """The GPU check's SFT and DPO data, through the scripts' own loading at the check's
    max_seq_len: every row is max_seq_len tokens long and all of it but the chat template's prompt
    tokens is supervised, as the planner's synthetic batch (the first GPU run, on the demo rows,
    peaked at 0.48x the plan: most of the plan's logits were of positions the data did not train)."""
    from generator.assets import ensure_dataset
    from generator.plan_harness import import_script
    from runtime import IGNORE_INDEX, Tokenizer

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for name in gpu_check.DATA_FILES[:2]:
        (tmp_path / name).write_bytes(ensure_dataset(name).read_bytes())
    gpu_check.write_full_rows(tmp_path)
    name = {"sft": "alpaca_full_rows.json", "dpo": "dpo_full_rows.json"}[algo]
    assert {c.dataset for c in gpu_check.CASES if c.new_args[1] == algo} == {name}
    script = import_script(ROOT / "examples" / f"{algo}_smollm2" / "train.py", f"full_rows_{algo}")
    seq = gpu_check.GPU_SIZES.max_seq_len
    cfg = script.Config(
        model=str(smollm2_dir), dataset=str(tmp_path / name), max_seq_len=seq, val_fraction=0.0
    )
    train, _ = script.build_datasets(cfg, Tokenizer.from_dir(smollm2_dir))
    assert len(train) == gpu_check.FULL_ROWS[name]
    rows = [
        ex
        for item in train
        for ex in ((item["chosen"], item["rejected"]) if algo == "dpo" else (item,))
    ]
    for ex in rows:
        supervised = sum(t != IGNORE_INDEX for t in ex["labels"])
        assert len(ex["input_ids"]) == seq and supervised >= seq - 32, supervised


def test_gpu_check_names_a_python_without_torch_in_one_line(tmp_path):
    """A python with no torch (a machine's bare python3) gets the line saying how to get one, not
    the no-CUDA line."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    python = str(bare / "bin" / "python")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": python, "PYTHONPATH": ""})  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        f"gpu_check: {python} has no torch: build the GPU environment with make gpu-env"
    )
