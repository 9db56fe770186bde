"""The emitted one-node launch file really launches: `bash launch/torchrun.sh` of a `--gpus 2`
render runs 2 training steps on 2 gloo processes (tiny random Llama, real tokenizer and data)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from generator.cli import cli

REPO = Path(__file__).resolve().parents[2]


def test_single_node_launch_file_runs_two_gloo_processes(tiny_model_dir, small_dataset, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["new", "--gpus", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    # relative paths: from the directory the launch file is run in (tmp_path), not train.py's
    args = [
        "--model", str(tiny_model_dir), "--dataset", os.path.relpath(small_dataset, tmp_path),
        "--out_dir", "out", "--device", "cpu", "--dtype", "fp32",
        "--max_steps", "2", "--warmup_steps", "0", "--max_seq_len", "64", "--micro_batch_size", "2",
        "--val_fraction", "0", "--eval_every_steps", "0", "--sample_max_new_tokens", "0",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # torchrun
        "PYTHONPATH": str(REPO),  # the runtime package
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        ["bash", str(out / "launch" / "torchrun.sh"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 process(es) on cpu" in proc.stdout
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(x == x and x > 0 for x in losses)  # finite, 2 steps
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()
    assert not (out / "out").exists()


@pytest.mark.parametrize("bad", [["--lr", "-1"], ["--learning_rate", "1e-4"]])
def test_config_error_under_torchrun_is_printed_once(bad, tmp_path):
    """A bad config is the same on every rank: rank 0 prints the one-line error, the other
    ranks exit with status 1 silently, so the message is not repeated once per process."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "examples" / "sft_smollm2" / "train.py"), *bad],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    assert ("lr=-1.0" if bad[0] == "--lr" else "unknown config key 'learning_rate'") in errors[0]
    # (torchrun's own ChildFailedError report follows; it is not ours to shorten)
