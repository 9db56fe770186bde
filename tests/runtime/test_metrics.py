"""MetricsLogger writes metrics.jsonl; `scaffold plot` turns it into a PNG; bad input is named."""

import json

import pytest
import torch
from click.testing import CliRunner

from generator.cli import cli
from runtime.metrics import MetricsLogger, peak_memory_mib, transformer_flops_per_token

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
