"""The layout of a run directory that `scaffold new` writes and `scaffold regen` / `diff` read.

DIR/train.py                       the script the user edits
DIR/launch/...                     launch files (torchrun, Slurm), also user-editable
DIR/.scaffold/spec.json            the Spec it was rendered from (`Spec.to_json`)
DIR/.scaffold/train.py.base        the pristine render: regen's 3-way merge base for train.py
DIR/.scaffold/launch/...           the pristine launch files, the merge bases for those
DIR/train.py.orig                  the user's train.py before a regen that left conflicts
                                   (DIR/launch/<name>.orig likewise for a conflicted launch file)
DIR/.scaffold/pending/             a regen that left conflicts, until `--continue` or `--abort`:
    regen.json                     what it wrote (each file's name, whether it existed, its mode)
    spec.json, train.py.base,      the new spec and merge bases, promoted over DIR/.scaffold/ by
    launch/...                     `scaffold regen DIR --continue`
    before/...                     every file the regen overwrote or created, as it was, which
                                   `scaffold regen DIR --abort` puts back
"""

from __future__ import annotations

import shutil
from pathlib import Path

from generator.spec import ScaffoldError, Spec

STATE_DIR = Path(".scaffold")
SCRIPT = "train.py"
ORIG = "train.py.orig"
SPEC_FILE = STATE_DIR / "spec.json"
BASE_FILE = STATE_DIR / "train.py.base"
# pristine render of each launch file (`launch/slurm.sbatch` -> `.scaffold/launch/slurm.sbatch`):
# the merge base for `scaffold regen`, as BASE_FILE is for train.py
LAUNCH_BASE_DIR = STATE_DIR
# a conflicted regen's staged state (docs/DESIGN.md#regen): the spec and bases it will promote,
# the files it overwrote as they were, and its manifest (the one file whose presence means "a
# regen is in progress")
PENDING_DIR = STATE_DIR / "pending"
PENDING_MANIFEST = PENDING_DIR / "regen.json"
PENDING_BEFORE = PENDING_DIR / "before"


def rendered_files(text: str, launch: dict[str, str]) -> dict[str, str]:
    """{path relative to the run directory: content} of a fresh render: train.py, its merge base,
    and every launch file with its merge base (the spec file is not included)."""
    files = {SCRIPT: text, str(BASE_FILE): text}
    for name, content in launch.items():
        files[name] = files[str(LAUNCH_BASE_DIR / name)] = content
    return files


def find_run_dirs(paths) -> list[Path]:
    """The run directories (those holding SPEC_FILE) at or below any of `paths`, sorted."""
    return sorted({p.parent.parent for path in paths for p in Path(path).glob(f"**/{SPEC_FILE}")})


def write_run_dir(out_dir: Path, spec: Spec, text: str, launch: dict[str, str]) -> None:
    """Write train.py and the launch files, plus the spec and the pristine renders that
    `scaffold regen` merges against.

    Raises:
        ScaffoldError: out_dir is not writable (names the path and the OS error).
    """
    try:
        # `new --force` over a directory with a pending regen: what it staged is of the old files
        shutil.rmtree(out_dir / PENDING_DIR, ignore_errors=True)
        (out_dir / STATE_DIR).mkdir(parents=True, exist_ok=True)
        for name, content in rendered_files(text, launch).items():
            path = out_dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        for name in launch:
            (out_dir / name).chmod(0o755)  # ./launch/torchrun.sh works as well as bash ...
        (out_dir / SPEC_FILE).write_text(spec.to_json())
    except OSError as e:
        raise ScaffoldError(
            f"--out {out_dir}: cannot write there ({e.strerror or e}: {e.filename}); "
            "choose a writable directory"
        ) from e
