"""MetricsLogger writes metrics.jsonl; `scaffold plot` turns it into a PNG; bad input is named."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from generator.cli import cli
from runtime.config_checks import run_summary
from runtime.metrics import (
    MetricsLogger,
    check_finite,
    launch_command,
    peak_memory_mib,
    progress_bar,
    step_line,
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


def test_micro_batch_progress_shows_a_bar_on_a_terminal_only(monkeypatch):
    """Every micro-batch comes through unchanged; on a terminal (rank 0) a bar counts them with
    their tokens per second (a dict's num_tokens, or the rollouts' prompt and completion tokens
    of the GRPO skeleton's tuples), and it is gone when the step ends; redirected, nothing."""
    import io
    import types

    from runtime.metrics import micro_batch_progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    rollout = types.SimpleNamespace(prompt_ids=[1, 2, 3], completion_ids=[4, 5])
    batches = {
        "dicts": [{"num_tokens": torch.tensor(96)}, {"num_tokens": 32}],
        "rollouts": [([rollout, rollout], None), ([rollout], None)],
    }
    for kind, micro_batches in batches.items():
        terminal = Terminal()
        monkeypatch.setattr("sys.stderr", terminal)
        assert list(micro_batch_progress(micro_batches)) == micro_batches, kind
        drawn = terminal.getvalue()
        assert "2/2" in drawn and "tok/s" in drawn, (kind, drawn)
        assert drawn.endswith("\r") or drawn.endswith("\x1b[A"), drawn[
            -20:
        ]  # cleared (leave=False)
        log = io.StringIO()
        monkeypatch.setattr("sys.stderr", log)
        assert list(micro_batch_progress(micro_batches)) == micro_batches
        assert log.getvalue() == ""


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


def test_run_summary_counts_parameters_and_prints_the_notes():
    @dataclasses.dataclass
    class Cfg:
        lr: float = 1e-4
        warmup_steps: int = 10
        max_steps: int = 3
        save_every_steps: int = 0

    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))
    model[0].requires_grad_(False)  # 1,001,000 frozen of 1,011,010
    text = run_summary(Cfg(), model, "/m", 2, torch.device("cpu"), "40 train examples")
    assert text.splitlines()[0] == "config | the defaults (all of it: run.json in out_dir)"
    changed = run_summary(Cfg(lr=3e-4, max_steps=5), model, "/m", 2, torch.device("cpu"), "x")
    assert (
        changed.splitlines()[0]
        == "config | lr 0.0003, max_steps 5 (all of it: run.json in out_dir)"
    )
    assert "\nnote | warmup_steps=10 is longer than max_steps=3" in text
    assert text.splitlines()[-1] == (
        "model /m | 1.0M params, 0.01M trainable (0.99%) | 40 train examples | no periodic "
        "checkpoint (save_every_steps 0) | 2 process(es) on cpu"
    )
    every = run_summary(Cfg(save_every_steps=50), model, "/m", 2, torch.device("cpu"), "40 rows")
    assert "| 40 rows | checkpoint every 50 steps | 2 process(es)" in every


def test_check_finite_names_the_last_checkpoint_and_step_line_the_figures():
    good = {
        "loss": 1.5,
        "grad_norm": 0.25,
        "lr": 2e-5,
        "tokens_per_s": 1234.4,
        "peak_mem_mib": 99.6,
    }
    check_finite(3, good, None)  # finite: nothing happens
    with pytest.raises(
        FloatingPointError,
        match=r"^step 4: loss nan, grad_norm 0.25 is not finite; .*last good checkpoint: none \(set --save_every_steps\)\); lower --lr or check the data$",
    ):
        check_finite(4, {**good, "loss": float("nan")}, None)
    with pytest.raises(FloatingPointError, match=r"checkpoint: out/step_2\); lower --lr$"):
        check_finite(4, {**good, "grad_norm": float("inf")}, "out/step_2", hint="lower --lr")
    assert step_line(7, good, " | acc 0.50") == (
        "step     7 | loss 1.5000 | acc 0.50 | lr 2.00e-05 | grad_norm 0.250 | 1234 tok/s | peak 100 MiB"
    )
    assert " | val_loss 2.0000 | lr" in step_line(7, {**good, "val_loss": 2.0})


def test_progress_bar_is_off_in_a_redirected_log(monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    bar = progress_bar(2, 5, is_main=True)
    assert list(bar) == [3, 4, 5] and bar.disable  # resumed after step 2: steps 3..5, no bar
