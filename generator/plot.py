"""`scaffold plot`: training curves from a run's metrics.jsonl.

The rows decide what is drawn, not the algorithm's name: every numeric key a run logged is
drawn, except the bookkeeping in `BOOKKEEPING` (counters, timings, memory). Keys that belong
together share a panel (`PANELS`, in this order: the loss, the algorithm's own curves, then the
schedule, throughput and gradient norm); any other key gets a panel of its own, between the
algorithm's panels and the schedule, in the order the run first logged it. So each algorithm's
figure shows what its skeleton logs, under the names TRL uses:

- SFT, LoRA, QLoRA, KD (`templates/recipes/sft.py.jinja`, `partials/loop.jinja`): loss with
  val_loss, lr, tokens_per_s, grad_norm.
- DPO and its loss types (`templates/recipes/dpo.py.jinja`): loss with val_loss,
  rewards/accuracies with val_rewards/accuracies, rewards/margins, rewards/chosen with
  rewards/rejected, logps/chosen with logps/rejected, ORPO's nll_loss, log_odds_ratio and
  log_odds_chosen, lr, tokens_per_s, grad_norm.
- GRPO (`templates/recipes/grpo.py.jinja`): loss, reward with each reward function's
  rewards/<name>/mean, kl, clip_ratio/low_mean, /high_mean and /region_mean,
  completions/mean_length with /min_length and /max_length, reward_std, frac_reward_zero_std,
  completions/clipped_ratio, sampling/importance_sampling_ratio/mean, DAPO's dropped_groups
  with num_refills, lr, samples_per_s, grad_norm.

A validation key `val_<key>` is drawn as points in `<key>`'s panel. Noisy training curves are
drawn faint, with a smoothed line over them: TensorBoard's exponential moving average with
Adam-style debiasing (`ema`), so the first points are not pulled toward 0 and a short run's
trend is visible at once. Validation values are drawn as points, unsmoothed (they are already
means over the whole validation set). Steps are integers on every axis. The figure's title is
the command that started the run, from `run.json` beside metrics.jsonl, when the run wrote one.
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


# The panels of keys drawn together, in figure order; None marks where the panels of the keys
# no entry names go (after the algorithm's curves, before the schedule and throughput)
PANELS = [
    Panel(("loss",)),
    Panel(("reward",)),  # GRPO; its reward functions' rewards/<name>/mean are added (`panels`)
    Panel(("rewards/accuracies",)),
    Panel(("rewards/margins",)),
    Panel(("rewards/chosen", "rewards/rejected")),
    Panel(("logps/chosen", "logps/rejected")),
    Panel(("kl",)),
    Panel(("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean")),
    Panel(("completions/mean_length", "completions/min_length", "completions/max_length")),
    Panel(("dropped_groups", "num_refills")),
    None,
    Panel(("lr",), smooth=False),  # the schedule: exact, nothing to smooth
    Panel(("tokens_per_s",), smooth=False),
    Panel(("samples_per_s",), smooth=False),
    Panel(("grad_norm",)),
]
# Logged to read, not to draw: step counters, sizes, timings, memory, rollout bookkeeping
BOOKKEEPING = {
    "step", "epoch", "num_tokens", "num_supervised", "num_pairs", "num_examples", "step_time_s", "peak_mem_mib", "train_s",
    "rollout_wait_s", "weight_sync_s", "staleness_max", "dropped_stale", "count/chosen",
    "count/rejected",
}  # fmt: skip
VAL = "val_"  # a validation key's prefix: drawn as points in its training key's panel


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


def _drawn(key: str) -> bool:
    """A key `panels` draws: not bookkeeping, not a reward function's spread (rewards/<name>/std,
    read beside its mean in metrics.jsonl), not a validation key (drawn with its training key)."""
    spread = key.startswith("rewards/") and key.endswith("/std")
    return key not in BOOKKEEPING and not spread and not key.startswith(VAL)


def panels(rows: list[dict]) -> list[Panel]:
    """The panels of the numeric keys these rows log (`PANELS`' that log at least one key, then
    one per key no entry names), with GRPO's per-function rewards (rewards/<name>/mean, the
    overlong penalty's too, as TRL's soft overlong punishment is a reward function) added to its
    reward panel and each `val_<key>` as points beside its key."""
    logged = {}  # key -> None, in the order first logged
    for row in rows:
        logged.update((k, None) for k, v in row.items() if _is_number(v))
    named = {k for panel in PANELS if panel for k in panel.keys}
    function_means = tuple(k for k in logged if k.startswith("rewards/") and k.endswith("/mean"))
    named.update(function_means)
    own = [Panel((k,)) for k in logged if k not in named and _drawn(k)]
    # a validation key without its training key (nothing to sit beside): points of its own
    own += [
        Panel((k,), points=(k,))
        for k in logged
        if k.startswith(VAL) and k[len(VAL) :] not in logged
    ]
    out = []
    for panel in PANELS:
        for p in own if panel is None else [panel]:
            keys = p.keys + (tuple(sorted(function_means)) if p.keys == ("reward",) else ())
            keys = tuple(k for k in keys if k in logged)
            points = p.points + tuple(
                VAL + k for k in keys if VAL + k in logged and VAL + k not in keys
            )
            if keys:
                out.append(Panel(keys + points[len(p.points) :], p.smooth, points))
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
