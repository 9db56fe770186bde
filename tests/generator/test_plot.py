"""`scaffold plot` (generator/plot.py) on rows shaped as each skeleton logs them: the panels each
algorithm gets (none empty) and their titles, integer step ticks, the smoothed line against a
hand-computed EMA, validation values as points, the run's command (run.json) in the title, and
the last value of a step logged twice. The Figure is inspected, not the PNG's pixels."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from generator.cli import cli
from generator.plot import curves, ema, make_figure, read_command, run_figure

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)
pytest.importorskip("matplotlib")


def _sft_row(step: int) -> dict:
    """What partials/loop.jinja logs for the SFT skeleton (sft, lora, qlora, kd): train_step's
    dict, then step_time_s, tokens_per_s, peak_mem_mib; val_loss on evaluation steps."""
    row = {
        "step": step,
        "sample_ids": [2 * step, 2 * step + 1],
        "loss": 2.0 - 0.05 * step + 0.1 * (step % 2),
    }
    row |= {
        "grad_norm": 1.5,
        "lr": 1e-4 * min(1, step / 3),
        "num_tokens": 512,
        "num_supervised": 300,
    }
    row |= {"step_time_s": 0.5, "tokens_per_s": 1024.0, "peak_mem_mib": 900.0}
    return row | ({"val_loss": 2.1 - 0.04 * step} if step % 4 == 0 else {})


def _dpo_row(step: int) -> dict:
    """What the DPO skeleton logs: TRL's rewards/* and logps/* means, then the loop's keys."""
    row = {
        "step": step,
        "sample_ids": [step],
        "loss": 0.69 - 0.01 * step,
        "grad_norm": 3.0,
        "lr": 5e-7,
    }
    row |= {"rewards/chosen": 0.01 * step, "rewards/rejected": -0.01 * step}
    row |= {"rewards/accuracies": min(1.0, 0.1 * step), "rewards/margins": 0.02 * step}
    row |= {"logps/chosen": -40.0, "logps/rejected": -45.0, "num_tokens": 900, "num_pairs": 4}
    row |= {"step_time_s": 1.0, "tokens_per_s": 900.0, "peak_mem_mib": 1200.0}
    if step % 4 == 0:
        row |= {"val_loss": 0.7 - 0.01 * step, "val_rewards/accuracies": 0.5}
    return row


def _orpo_row(step: int) -> dict:
    """DPO's skeleton under --loss_type orpo: the pair metrics plus TRL's ORPO terms."""
    row = _dpo_row(step)
    return row | {"nll_loss": 1.5, "log_odds_ratio": -0.6, "log_odds_chosen": 0.1 * step}


def _grpo_row(step: int, last: int) -> dict:
    """What the GRPO skeleton's main logs (TRL's names): rollout_metrics (the script's two reward
    functions), train_step, the weight sync (not after the last step) and the timings; no
    validation."""
    row = {"step": step, "reward": 0.1 * step, "reward_std": 0.2, "frac_reward_zero_std": 0.25}
    row |= {"completions/clipped_ratio": 0.1}
    row |= {"rewards/math_answer_reward/mean": 0.1 * step, "rewards/math_answer_reward/std": 0.3}
    row |= {"rewards/format_reward/mean": 0.5, "rewards/format_reward/std": 0.5}
    row |= {"completions/mean_length": 40.0, "completions/min_length": 3}
    row |= {"completions/max_length": 64, "staleness_max": 0, "loss": 0.01}
    row |= {"clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0}
    row |= {
        "clip_ratio/region_mean": 0.0,
        "kl": 0.0,
        "sampling/importance_sampling_ratio/mean": 1.0,
    }
    row |= {"grad_norm": 0.3, "lr": 1e-6, "dropped_stale": 0, "dropped_groups": 0, "num_refills": 0}
    row |= {"rollout_wait_s": 5.0, "train_s": 2.0}
    row |= {"step_time_s": 8.0, "samples_per_s": 8.0, "peak_mem_mib": 2000.0}
    return row | ({"weight_sync_s": 1.0} if step < last else {})


ALGOS = {
    "sft": (
        [_sft_row(s) for s in range(1, 13)],
        ["loss / val_loss", "lr", "tokens_per_s", "grad_norm"],
    ),
    "dpo": (
        [_dpo_row(s) for s in range(1, 9)],
        [
            "loss / val_loss",
            "rewards/accuracies / val_rewards/accuracies",
            "rewards/margins",
            "rewards/chosen / rewards/rejected",
            "logps/chosen / logps/rejected",
            "lr",
            "tokens_per_s",
            "grad_norm",
        ],
    ),
    "orpo": (
        [_orpo_row(s) for s in range(1, 9)],
        [
            "loss / val_loss",
            "rewards/accuracies / val_rewards/accuracies",
            "rewards/margins",
            "rewards/chosen / rewards/rejected",
            "logps/chosen / logps/rejected",
            "nll_loss",
            "log_odds_ratio",
            "log_odds_chosen",
            "lr",
            "tokens_per_s",
            "grad_norm",
        ],
    ),
    "grpo": (
        [_grpo_row(s, 3) for s in range(1, 4)],
        [
            "loss",
            "reward / rewards/format_reward/mean / rewards/math_answer_reward/mean",
            "kl",
            "clip_ratio/region_mean / clip_ratio/low_mean / clip_ratio/high_mean",
            "completions/mean_length / completions/min_length / completions/max_length",
            "dropped_groups / num_refills",
            "reward_std",
            "frac_reward_zero_std",
            "completions/clipped_ratio",
            "sampling/importance_sampling_ratio/mean",
            "lr",
            "samples_per_s",
            "grad_norm",
        ],
    ),
}


@pytest.mark.parametrize("algo", list(ALGOS))
def test_each_algorithm_draws_what_it_logs_with_integer_steps(algo):
    rows, titles = ALGOS[algo]
    fig = make_figure(rows)
    assert [ax.get_title().replace("\n", " ") for ax in fig.axes] == titles  # long ones wrap
    for ax in fig.axes:
        assert ax.get_lines() and all(len(line.get_xdata()) for line in ax.get_lines())
        ticks = [t for t in ax.get_xticks() if 1 <= t <= len(rows)]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (
            ax.get_title(),
            ticks,
        )
    if algo == "grpo":  # 13 panels: three full rows of four, one on the fourth, no empty cell
        assert len(fig.axes) == 13 and fig.axes[4].get_subplotspec().rowspan.start == 1


@pytest.mark.parametrize("algo", list(ALGOS))
def test_a_one_step_run_draws_a_marker_on_integer_ticks(algo):
    """`--max_steps 1`, what a newcomer runs first: every panel shows its point, and the step
    axis has whole-number ticks around it."""
    rows = ALGOS[algo][0][:1]
    fig = make_figure(rows)
    assert fig.axes
    for ax in fig.axes:
        lines = ax.get_lines()
        assert lines and all(line.get_marker() == "o" for line in lines), ax.get_title()
        assert [list(line.get_xdata()) for line in lines] == [[1]] * len(lines)
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert 1 in ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)


def test_smoothed_line_is_the_debiased_ema_over_the_faint_raw_line():
    losses = [2.0, 1.0, 3.0, 0.5]
    rows = [{"step": s, "loss": v} for s, v in enumerate(losses, start=1)]
    rows[3]["val_loss"] = 1.9
    # by hand, weight 0.5: s_k = 0.5 s_{k-1} + 0.5 v_k from 0, divided by 1 - 0.5**k
    want = [1.0 / 0.5, 1.0 / 0.75, 2.0 / 0.875, 1.25 / 0.9375]
    assert ema(losses, 0.5) == pytest.approx(want)
    assert ema(losses, 0.0) == losses
    (ax,) = make_figure(rows, smoothing=0.5).axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"loss", "loss (EMA 0.5)", "val_loss"}
    assert list(lines["loss"].get_ydata()) == losses and lines["loss"].get_alpha() == 0.3
    assert list(lines["loss (EMA 0.5)"].get_ydata()) == pytest.approx(want)
    assert lines["loss (EMA 0.5)"].get_alpha() is None  # drawn solid over the raw line
    # validation: points, unsmoothed
    assert lines["val_loss"].get_marker() == "o" and list(lines["val_loss"].get_ydata()) == [1.9]
    with pytest.raises(ValueError, match="smoothing weight 1"):
        ema(losses, 1)


def test_command_from_run_json_titles_the_figure(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps(_sft_row(s)) + "\n" for s in (1, 2, 3, 4))
    )
    fig, path = run_figure(tmp_path)  # a run from before run.json: no title
    assert path == out / "metrics.jsonl" and fig.get_suptitle() == ""
    command = "python runs/demo/train.py --dtype fp32 --max_steps 40"
    (out / "run.json").write_text(json.dumps({"command": command, "started": "2026-01-01"}))
    fig, _ = run_figure(tmp_path)
    assert fig.get_suptitle() == command
    (out / "run.json").write_text(
        json.dumps({"command": ["torchrun", "--nproc-per-node", "2", "my train.py"]})
    )
    assert read_command(out / "run.json") == "torchrun --nproc-per-node 2 'my train.py'"
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 0 and (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "run.json: invalid JSON"),
        ('{"cmd": "python train.py"}', 'run.json: expected {"command": "<command line>", ...}'),
    ],
)
def test_bad_run_json_is_one_line_naming_it(tmp_path, text, message):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / "run.json").write_text(text)
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_a_relogged_step_is_drawn_with_its_last_value():
    rows = [
        {"step": 1, "loss": 0.69, "rewards/accuracies": 0.0, "rewards/margins": 0.0},
        {"step": 2, "loss": 0.65, "rewards/accuracies": 0.5, "rewards/margins": 0.1},
        {"step": 3, "loss": 9.9},  # killed after logging step 3, resumed from step 2's checkpoint
        {"step": 3, "loss": 0.60, "rewards/accuracies": 1.0, "rewards/margins": 0.3},
        {"step": 4, "loss": None},  # a non-finite loss is logged as null: left out
    ]
    drawn = {panel.keys: points for panel, points in curves(rows).items()}
    assert list(drawn) == [("loss",), ("rewards/accuracies",), ("rewards/margins",)]
    assert drawn[("loss",)]["loss"] == [(1, 0.69), (2, 0.65), (3, 0.60)]


def test_a_key_no_panel_names_is_drawn_alone_and_bookkeeping_is_not():
    """Any numeric key gets a panel (a new algorithm's metrics need no entry here), in the order
    first logged, before the schedule; its val_ key sits beside it as points; a validation key
    without its training key is drawn alone; counters, timings and reward spreads are not."""
    rows = [
        {"step": 1, "loss": 1.0, "lr": 1e-5, "value_loss": 0.5, "accuracy": 0.4, "num_tokens": 9},
        {
            "step": 2,
            "loss": 0.9,
            "lr": 1e-5,
            "value_loss": 0.4,
            "accuracy": 0.6,
            "val_accuracy": 0.5,
        },
        {"step": 3, "loss": 0.8, "val_only": 0.3, "rewards/f/std": 0.1, "peak_mem_mib": 1.0},
    ]
    drawn = list(curves(rows))
    assert [p.keys for p in drawn] == [
        ("loss",), ("value_loss",), ("accuracy", "val_accuracy"), ("val_only",), ("lr",),
    ]  # fmt: skip
    assert [p.points for p in drawn] == [(), (), ("val_accuracy",), ("val_only",), ()]
