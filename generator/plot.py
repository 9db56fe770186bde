"""`scaffold plot`: training curves from a run's metrics.jsonl.

One panel per quantity the run logged (the rows decide, not the algorithm's name), so each
algorithm's figure shows what its skeleton logs:

- SFT, LoRA, QLoRA, KD (`templates/recipes/sft.py.jinja`, `partials/loop.jinja`): loss with
  val_loss, lr, tokens_per_s, grad_norm.
- DPO (`templates/recipes/dpo.py.jinja`, TRL's names): loss with val_loss, rewards/accuracies with
  val_rewards/accuracies, rewards/margins, rewards/chosen with rewards/rejected, lr, tokens_per_s,
  grad_norm.
- GRPO (`templates/recipes/grpo.py.jinja`): loss, reward with each reward function's
  rewards/<name>, kl, clip_frac, completion_len, lr, samples_per_s, grad_norm.

Noisy training curves are drawn faint, with a smoothed line over them: TensorBoard's exponential
moving average with Adam-style debiasing (`ema`), so the first points are not pulled toward 0
and a short run's trend is visible at once. Validation values are drawn as points, unsmoothed
(they are already means over the whole validation set). Steps are integers on every axis. The
figure's title is the command that started the run, from `run.json` beside metrics.jsonl, when
the run wrote one.
"""

from __future__ import annotations

import json
import math
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from generator.spec import ScaffoldError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# 0.9: a time constant of about 10 logged points, long enough to show the trend of a 40-step
# demo's per-batch loss, short enough to follow a 1000-step run's
SMOOTHING = 0.9
COLUMNS = 4  # panels per row of the figure


@dataclass(frozen=True)
class Panel:
    """One axes: `keys` drawn together (in this order); `smooth`: an EMA over the faint raw
    line; `points`: keys drawn as markers (validation values), never smoothed."""

    keys: tuple[str, ...]
    smooth: bool = True
    points: tuple[str, ...] = ()


PANELS = [
    Panel(("loss", "val_loss"), points=("val_loss",)),
    Panel(("reward",)),  # GRPO; its reward functions' rewards/<name> are added (`panels`)
    Panel(("rewards/accuracies", "val_rewards/accuracies"), points=("val_rewards/accuracies",)),
    Panel(("rewards/margins",)),
    Panel(("rewards/chosen", "rewards/rejected")),
    Panel(("kl",)),
    Panel(("clip_frac",)),
    Panel(("completion_len",)),
    Panel(("lr",), smooth=False),  # the schedule: exact, nothing to smooth
    Panel(("tokens_per_s",), smooth=False),
    Panel(("samples_per_s",), smooth=False),
    Panel(("grad_norm",)),
]
DPO_REWARDS = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"}


def read_metrics(path: Path) -> list[dict]:
    """Rows of metrics.jsonl; raises ScaffoldError naming the file and line on bad JSON."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ScaffoldError(f"{path}:{i}: invalid JSON ({e})") from e
    if not rows:
        raise ScaffoldError(f"{path}: no metrics logged yet")
    return rows


def read_command(path: Path) -> str | None:
    """The command line that started the run, from its run.json (None: no such file, a run
    from before run.json was written).

    Raises:
        ScaffoldError: run.json is not JSON, or its "command" is not a string (or list of
            strings, joined as a shell would read them).
    """
    if not path.is_file():
        return None
    try:
        run = json.loads(path.read_text())
    except ValueError as e:
        raise ScaffoldError(f"{path}: invalid JSON ({e})") from e
    command = run.get("command") if isinstance(run, dict) else None
    if isinstance(command, list) and all(isinstance(c, str) for c in command):
        return shlex.join(command)
    if not isinstance(command, str):
        raise ScaffoldError(f'{path}: expected {{"command": "<command line>", ...}}')
    return command


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def panels(rows: list[dict]) -> list[Panel]:
    """The PANELS these rows log at least one value of, with GRPO's per-function rewards
    (rewards/<name>, when `reward` is logged) added to its reward panel."""
    logged = {k for r in rows for k, v in r.items() if _is_number(v)}
    out = []
    for panel in PANELS:
        keys = panel.keys
        if keys == ("reward",):
            keys += tuple(
                sorted(k for k in logged if k.startswith("rewards/")) if "reward" in logged else ()
            )
            keys = tuple(k for k in keys if k not in DPO_REWARDS)
        keys = tuple(k for k in keys if k in logged)
        if keys:
            out.append(Panel(keys, panel.smooth, tuple(k for k in panel.points if k in keys)))
    return out


def curves(rows: list[dict]) -> dict[Panel, dict[str, list[tuple[int, float]]]]:
    """Per panel to draw (`panels`), per key, its (step, value) points in step order. A resumed
    run logs again the steps after its checkpoint: the last value logged for a step is the one
    drawn. Non-finite values (logged as null) are left out."""
    out = {}
    for panel in panels(rows):
        out[panel] = {}
        for key in panel.keys:
            by_step = {r["step"]: r[key] for r in rows if _is_number(r.get(key))}
            out[panel][key] = sorted(by_step.items())
    return out


def ema(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's smoothing: s_k = weight * s_{k-1} + (1 - weight) * v_k from s_0 = 0, each
    divided by 1 - weight**k (the debiasing of Adam's moments: the first points are not pulled
    toward the zero start). weight 0 returns the values.

    Raises:
        ValueError: weight outside [0, 1).
    """
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight {weight}: expected 0 <= weight < 1")
    out, acc = [], 0.0
    for k, v in enumerate(values, start=1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight**k))
    return out


def make_figure(
    rows: list[dict], command: str | None = None, smoothing: float = SMOOTHING
) -> Figure:
    """The figure of these metrics rows: one panel per `panels(rows)`, COLUMNS per row, titled
    with `command` (wrapped) when given.

    Each panel is titled with the keys it draws (a legend when more than one); a smoothed key is
    a faint raw line under its `ema(smoothing)` line (labelled "KEY (EMA 0.9)", explained under
    the panels); validation keys are points; the step axis takes integer ticks only.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    drawn = curves(rows)
    cols = min(COLUMNS, len(drawn))
    n_rows = math.ceil(len(drawn) / cols)
    fig = Figure(figsize=(4 * cols, 3.2 * n_rows + (0.5 if command else 0)), layout="constrained")
    axes = fig.subplots(n_rows, cols, squeeze=False).flatten()
    for ax in axes[len(drawn) :]:
        ax.remove()  # the last row's unused cells: no empty panels
    for ax, (panel, points) in zip(axes, drawn.items(), strict=False):
        for i, key in enumerate(panel.keys):
            steps, values = zip(*points[key], strict=True)
            color = f"C{i}"
            if len(steps) == 1:  # a 1-step run: a line through one point would draw nothing
                ax.plot(steps, values, "o", color=color, ms=5, label=key)
            elif key in panel.points:
                ax.plot(steps, values, "o--", color=color, ms=4, lw=1, label=key)
            elif panel.smooth and smoothing > 0:
                ax.plot(steps, values, color=color, alpha=0.3, lw=1, label=key)
                ax.plot(
                    steps,
                    ema(list(values), smoothing),
                    color=color,
                    lw=1.8,
                    label=f"{key} (EMA {smoothing:g})",
                )
            else:
                ax.plot(steps, values, color=color, lw=1.5, label=key)
        ax.set_title(textwrap.fill(" / ".join(panel.keys), 40), fontsize="medium")
        ax.set_xlabel("step")
        first, last = min(p[0][0] for p in points.values()), max(p[-1][0] for p in points.values())
        if last - first < 2:  # matplotlib pads one step to 0.95..1.05, which holds no integer tick
            ax.set_xlim(first - 1, last + 1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(panel.keys) > 1:
            ax.legend(fontsize="small")
    if command:
        fig.suptitle(textwrap.fill(command, width=40 * cols), fontsize="medium")
    if smoothing > 0 and any(p.smooth for p in drawn):
        fig.supxlabel(
            f"faint: logged values; solid: their EMA (weight {smoothing:g}, debiased)",
            fontsize="small",
        )
    return fig


def run_figure(run_dir: Path, smoothing: float = SMOOTHING) -> tuple[Figure, Path]:
    """The figure of a run (`make_figure`, titled with run.json's command when there is one) and
    the metrics.jsonl it was drawn from.

    Args:
        run_dir: a run directory; metrics.jsonl is looked for in it and in run_dir/out (the
            script's default out_dir), with run.json beside it.
        smoothing: the EMA weight of the smoothed lines (0: raw lines only).

    Raises:
        ScaffoldError: no metrics.jsonl, bad JSON in it or in run.json, or no matplotlib.
    """
    candidates = [run_dir / "metrics.jsonl", run_dir / "out" / "metrics.jsonl"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ScaffoldError(
            f"no metrics.jsonl in {run_dir} or {run_dir / 'out'}; run train.py first"
        )
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ScaffoldError("scaffold plot needs matplotlib: pip install 'scaffold[plot]'") from e
    rows = read_metrics(path)
    return make_figure(rows, read_command(path.parent / "run.json"), smoothing), path


def plot_metrics(run_dir: Path, out: Path | None = None, smoothing: float = SMOOTHING) -> Path:
    """Write `run_figure(run_dir, smoothing)` as a PNG to `out` (default: metrics.png beside
    metrics.jsonl); returns its path. Raises ScaffoldError as `run_figure`."""
    fig, path = run_figure(run_dir, smoothing)
    out = out or path.parent / "metrics.png"
    fig.savefig(out, dpi=100)
    return out
