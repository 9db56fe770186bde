"""Shared, stdlib-only helpers for the peer SFT scripts: input paths and the Alpaca row format.

Every tool in the SFT benchmark sees the same conversation per Alpaca row, the same one
`runtime.data` builds for Scaffold: user = `instruction` (+ "\\n\\n" + `input` when non-empty),
assistant = `output`, no system message (SmolLM2's chat template then inserts its default system
prompt, "You are a helpful AI assistant named SmolLM, trained by Hugging Face").

This file is imported by scripts running in the peer venvs (TRL, torchtune), so it must not
import anything outside the standard library.
"""

from __future__ import annotations

import os
from pathlib import Path

MODEL_NAME = "smollm2-135m"
DATA_FILE = "alpaca_en_demo.json"
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def scaffold_home() -> Path:
    """The cache root: `$SCAFFOLD_HOME`, else `~/.cache/scaffold` (same rule as runtime.hub)."""
    return Path(os.environ.get("SCAFFOLD_HOME", "~/.cache/scaffold")).expanduser()


def model_dir() -> Path:
    """The SmolLM2-135M-Instruct Hugging Face directory in the cache."""
    return scaffold_home() / "models" / MODEL_NAME


def data_path() -> Path:
    """The Alpaca demo JSON file (999 rows of instruction/input/output) in the cache."""
    return scaffold_home() / "data" / DATA_FILE


def check_inputs() -> None:
    """Fail with a clear message when the model or data is missing from the cache."""
    missing = [p for p in (model_dir() / "config.json", data_path()) if not p.is_file()]
    if missing:
        raise SystemExit(
            f"missing benchmark inputs: {', '.join(map(str, missing))}. Run from the repo root: "
            ".venv/bin/python -c 'from generator.assets import ensure_smollm2, ensure_dataset; "
            "ensure_smollm2(); ensure_dataset()'"
        )


def user_content(row: dict) -> str:
    """The user turn of an Alpaca row: instruction, plus a blank line and input when given."""
    text = row["instruction"]
    if row.get("input"):
        text = f"{text}\n\n{row['input']}"
    return text
