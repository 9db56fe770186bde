"""`scaffold plot`: training curves from a run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from generator.spec import ScaffoldError

PANELS = [("loss", "val_loss"), ("lr",), ("tokens_per_s",), ("grad_norm",)]
# drawn when the run logs them: DPO's (TRL's names) and GRPO's mean reward
EXTRA_PANELS = [("rewards/accuracies",), ("rewards/margins",), ("reward",)]


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


def curves(rows: list[dict]) -> dict[tuple[str, ...], dict[str, list[tuple[int, float]]]]:
    """The panels to draw (PANELS, then the EXTRA_PANELS the rows log) and, per key, its (step,
    value) points in step order. A resumed run logs again the steps after its checkpoint: the
    last value logged for a step is the one drawn."""
    panels = PANELS + [p for p in EXTRA_PANELS if any(r.get(p[0]) is not None for r in rows)]
    out = {}
    for keys in panels:
        out[keys] = {}
        for key in keys:
            by_step = {r["step"]: r[key] for r in rows if r.get(key) is not None}
            out[keys][key] = sorted(by_step.items())
    return out


def plot_metrics(run_dir: Path, out: Path | None = None) -> Path:
    """Write a PNG with loss/val_loss, lr, tokens/s and grad-norm panels (plus DPO's reward
    accuracy and margin, GRPO's reward, when logged); returns its path. A step logged twice (a run
    resumed from an earlier checkpoint) is drawn with its last value.

    Looks for metrics.jsonl in RUN_DIR or RUN_DIR/out (the script's default out_dir).
    """
    candidates = [run_dir / "metrics.jsonl", run_dir / "out" / "metrics.jsonl"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ScaffoldError(
            f"no metrics.jsonl in {run_dir} or {run_dir / 'out'}; run train.py first"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ScaffoldError("scaffold plot needs matplotlib: pip install 'scaffold[plot]'") from e
    panels = curves(read_metrics(path))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (keys, points) in zip(axes, panels.items()):
        for key in keys:
            pts = points[key]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key == "val_loss" else None, ms=3, label=key)
        ax.set_xlabel("step")
        ax.set_title(" / ".join(keys))
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    fig.tight_layout()
    out = out or path.parent / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
