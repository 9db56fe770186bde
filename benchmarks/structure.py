"""The composition figures of the templates: which (algorithm, trick) pairs `scaffold new` accepts,
the size of each skeleton's default script and its functions over 60 lines, and how many lines the
three skeleton templates still share with each other.

Usage (from the repo root, with the venv; for an old commit run it from a checkout of that commit
with PYTHONPATH set to it, as benchmarks/RESULTS.md shows):
    python benchmarks/structure.py
"""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

from generator.features import ALGOS, TRICKS
from generator.render import render, templates_dir
from generator.spec import Spec, SpecError

DEFAULT_SCRIPTS = {"sft": "sft", "dpo": "dpo", "grpo": "grpo"}  # skeleton -> its default algo


def accepted_matrix() -> list[str]:
    """A markdown table: yes where `--algo A --tricks T` renders, no where it is refused."""
    lines = ["| algo | " + " | ".join(TRICKS) + " |", "|---|" + "---|" * len(TRICKS)]
    accepted = 0
    for algo in ALGOS:
        row = []
        for trick in TRICKS:
            try:
                render(Spec(algo=algo, tricks=(trick,), out="o"))
                row.append("yes")
                accepted += 1
            except SpecError:
                row.append("no")
        lines.append(f"| {algo} | " + " | ".join(row) + " |")
    lines.append(f"\naccepted: {accepted} of {len(ALGOS) * len(TRICKS)} (algorithm, trick) pairs")
    return lines


def script_sizes() -> list[str]:
    """Lines of each skeleton's default script, and its functions longer than 60 lines."""
    out = []
    for skeleton, algo in DEFAULT_SCRIPTS.items():
        text = render(Spec(algo=algo, out="o"))
        tree = ast.parse(text)
        long = [
            f"{f.name} ({f.end_lineno - f.lineno + 1})"
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > 60
        ]
        out.append(f"{skeleton}: {len(text.splitlines())} lines; over 60 lines: {', '.join(long)}")
    return out


def shared_template_lines() -> list[str]:
    """Non-blank lines two skeleton templates have in common (difflib's matching blocks)."""
    recipes = templates_dir() / "recipes"

    def lines(name: str) -> list[str]:
        return [
            line for line in (recipes / f"{name}.py.jinja").read_text().splitlines() if line.strip()
        ]

    out = []
    for a, b in (("sft", "dpo"), ("sft", "grpo"), ("dpo", "grpo")):
        la, lb = lines(a), lines(b)
        matcher = difflib.SequenceMatcher(None, la, lb, autojunk=False)
        shared = sum(m.size for m in matcher.get_matching_blocks())
        out.append(f"{a} ~ {b}: {shared} shared of {len(la)} / {len(lb)} non-blank lines")
    partials = (
        sorted(Path(recipes / "partials").glob("*.jinja"))
        if (recipes / "partials").is_dir()
        else []
    )
    out.append(
        f"partials: {len(partials)} files, {sum(len(p.read_text().splitlines()) for p in partials)} lines"
    )
    return out


if __name__ == "__main__":
    print("\n".join(accepted_matrix()))
    print()
    print("\n".join(script_sizes()))
    print()
    print("\n".join(shared_template_lines()))
