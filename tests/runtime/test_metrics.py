"""MetricsLogger writes metrics.jsonl; `scaffold plot` turns it into a PNG; bad input is named."""

import json

import pytest
import torch
from click.testing import CliRunner

from generator.cli import cli
from runtime.metrics import (
    MetricsLogger,
    launch_command,
    peak_memory_mib,
    transformer_flops_per_token,
)

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


def test_jsonl_logger_and_plot(tmp_path):
    logger = MetricsLogger(tmp_path, ["jsonl"])
    for step in range(1, 6):
        metrics = {"loss": 2.0 / step, "lr": 1e-4, "tokens_per_s": 100.0 + step, "grad_norm": 1.0}
        if step % 2 == 0:
            metrics["val_loss"] = 2.5 / step
        logger.log(metrics, step)
    logger.log({"loss": float("nan")}, 6)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[1]["val_loss"] == 1.25 and rows[5]["loss"] is None  # NaN -> null, still valid JSON
    pytest.importorskip("matplotlib")
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert (
        result.exit_code == 1
        and "no metrics.jsonl" in result.output
        and "Traceback" not in result.output
    )
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{not json\n')
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 1 and "metrics.jsonl:2: invalid JSON" in result.output


def test_unknown_logger_and_memory():
    with pytest.raises(ValueError, match=r"loggers: unknown \['mlflow'\]"):
        MetricsLogger("/tmp/unused", ["jsonl", "mlflow"])
    assert peak_memory_mib(torch.device("cpu")) > 10  # a Python process with torch loaded
    assert transformer_flops_per_token(100, 2, 8, 16) == 6 * 100 + 12 * 2 * 8 * 16


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_metrics_hold_one_run_a_resume_drops_the_steps_after_its_checkpoint(tmp_path):
    """A fresh run starts metrics.jsonl anew; a resume from step 3 keeps steps 1-3 of the
    attempt that logged up to 5 (4 and 5 are logged again by the resumed run); run.json has the
    first command and one entry per resume."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "loss": 9.0}\n')  # claim_out_dir's call
    first = MetricsLogger(tmp_path, ["jsonl"], argv=["--max_steps", "5"])
    for step in range(1, 6):
        first.log({"loss": 1.0 / step}, step)
    first.close()
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # the process died mid-line
    resumed = MetricsLogger(tmp_path, ["jsonl"], start_step=3, argv=["--max_steps", "6"])
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3]
    for step in (4, 5, 6):
        resumed.log({"loss": 0.5 / step}, step)
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[3]["loss"] == 0.5 / 4
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["command"].endswith("--max_steps 5")
    assert [(r["step"], r["command"].split()[-1]) for r in run["resumed"]] == [(3, "6")]
    MetricsLogger(tmp_path, ["jsonl"], argv=[]).close()  # fresh again: one run, no resumes
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert "resumed" not in json.loads((tmp_path / "run.json").read_text())


def test_launch_command_names_python_or_torchrun(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py", "--lr", "1e-4"])
    for var in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert launch_command() == "python train.py --lr 1e-4"
    assert (
        launch_command(["--sample_prompt", "Hi there"])
        == "python train.py --sample_prompt 'Hi there'"
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert launch_command([]) == "torchrun --nproc-per-node 8 --nnodes 2 train.py"
