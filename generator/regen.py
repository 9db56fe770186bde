"""`scaffold regen` and `scaffold diff`: merge a new render into a script the user has edited.

A 3-way line merge in the spirit of `copier update` (`merge3`): base = the pristine render the user
started from (`.scaffold/train.py.base`), ours = the user's `train.py`, theirs = the render of the
(possibly `--set`-changed) spec with the installed templates. Regions only one side changed are taken
from that side; regions both changed differently (or changes that touch, with no unchanged line
between them) become a conflict, written with diff3-style markers (yours / base / new render), so a
user's edit is never dropped silently.

Merge base after a conflict: `.scaffold/train.py.base` and `spec.json` move to the new render at once,
exactly as after a clean merge. The marked `train.py` already contains every line of the new render
(clean regions, or the `new render` side of each conflict), so once the user resolves the markers,
whatever differs from the new render is by definition the user's choice, and the next regen must
merge against the new render. Keeping the old base would re-apply the same option change to the
resolved file and conflict (or duplicate lines) a second time. To back out instead, restore
`train.py.orig` and run `scaffold regen DIR --set` with the old values: that merge reverts the
option on both sides and keeps the edits.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import merge3

from generator import __version__
from generator.rundir import BASE_FILE, LAUNCH_BASE_DIR, ORIG, SCRIPT, SPEC_FILE
from generator.spec import (
    ROLLOUT_ALGOS,
    ScaffoldError,
    Spec,
    SpecError,
    resolve_engine_layout,
    validate_spec,
)

SETTABLE = (
    "algo",
    "dataset",
    "dtype",
    "gpus",
    "model",
    "nodes",
    "tp",
    "cp",
    "dp_replicate",
    "ep",
    "engine_gpus",
    "engine_tp",
    "peft",
    "teacher",
    "tricks",
)  # Spec fields for --set
LABEL_OURS, LABEL_BASE, LABEL_THEIRS = "yours", "base (last render)", "new render"
_MARKER = re.compile(r"^(<{7}|\|{7}|={7}|>{7})( |\r?\n|$)")
_BANNER = re.compile(r"^# === .* ===\s*$")
HEADER = "header docstring"  # the "section" of lines above the first banner


class ConflictError(ScaffoldError):
    """A regen left conflict markers (the summary lines were already printed), or markers remain."""


class _LineMatcher(difflib.SequenceMatcher):
    """difflib without the "popular line" heuristic: in a ~500-line script, blank lines and `)`
    exceed 1% and would be treated as junk, which gives needlessly coarse (conflicting) regions."""

    def __init__(self, isjunk=None, a="", b=""):
        super().__init__(isjunk, a, b, autojunk=False)


@dataclass(frozen=True)
class Conflict:
    """One conflicting region of the merged file: 1-based line numbers of its markers."""

    start: int  # the `<<<<<<<` line
    end: int  # the `>>>>>>>` line
    sections: tuple[str, ...]  # banner(s) the region falls in, e.g. ("# === 2. Config ===",)
    ours: int  # lines on the "yours" side
    theirs: int  # lines on the "new render" side

    def describe(self, path: str) -> str:
        where = (
            self.sections[0]
            if len(self.sections) == 1
            else f"{self.sections[0]} .. {self.sections[-1]}"
        )
        return (
            f"{path}:{self.start}-{self.end}: conflict in {where} "
            f"(yours: {self.ours} line(s), new render: {self.theirs} line(s))"
        )


@dataclass(frozen=True)
class MergeResult:
    text: str
    conflicts: tuple[Conflict, ...]


def merge(base: str, ours: str, theirs: str) -> MergeResult:
    """3-way merge of whole texts; conflicts get `<<<<<<< yours`, `||||||| base`, `=======`,
    `>>>>>>> new render` markers (each on its own line)."""
    a, z, b = (_lines(t) for t in (ours, base, theirs))
    m = merge3.Merge3(z, a, b, sequence_matcher=_LineMatcher)
    out: list[str] = []
    conflicts = []
    for group in m.merge_groups():
        if group[0] != "conflict":
            out.extend(group[1])
            continue
        _, z_lines, a_lines, b_lines = group
        start = len(out) + 1
        out.append(f"<<<<<<< {LABEL_OURS}\n")
        out.extend(a_lines)
        out.append(f"||||||| {LABEL_BASE}\n")
        out.extend(z_lines)
        out.append("=======\n")
        out.extend(b_lines)
        out.append(f">>>>>>> {LABEL_THEIRS}\n")
        conflicts.append((start, len(out), len(a_lines), len(b_lines)))
    sections = section_of_lines(out)
    result = tuple(
        Conflict(s, e, tuple(dict.fromkeys(sections[s - 1 : e])), n_a, n_b)
        for s, e, n_a, n_b in conflicts
    )
    return MergeResult("".join(out), result)


def _lines(text: str) -> list[str]:
    """Lines split at "\n" only, as editors and Python count them (`str.splitlines` would also
    split at form feeds, U+2028, ...), each with its newline; a missing final newline is added, so
    every conflict marker starts a line."""
    if text and not text.endswith("\n"):
        text += "\n"
    return [line + "\n" for line in text.split("\n")[:-1]]


def section_of_lines(lines: list[str]) -> list[str]:
    """For each line, the `# === N. ... ===` banner it falls under (HEADER above the first)."""
    current, out = HEADER, []
    for line in lines:
        if _BANNER.match(line):
            current = line.strip()
        out.append(current)
    return out


def marker_lines(text: str) -> list[int]:
    """1-based numbers of lines that are conflict markers. A lone `=======` (an RST underline in
    a docstring) does not count unless a `<<<<<<<`, `|||||||` or `>>>>>>>` line is there too."""
    found = [
        (i, m.group(1)) for i, line in enumerate(text.split("\n"), 1) if (m := _MARKER.match(line))
    ]
    if all(kind == "=======" for _, kind in found):
        return []
    return [i for i, _ in found]


def parse_settings(settings: tuple[str, ...] | list[str], spec: Spec) -> Spec:
    """Apply `--set key=value` strings to `spec`; validated like `scaffold new` options."""
    changes: dict = {}
    for item in settings:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise SpecError(
                f"--set {item!r}: expected key=value; valid keys: {', '.join(SETTABLE)}"
            )
        if key not in SETTABLE:
            raise SpecError(f"--set: unknown key {key!r}; valid keys: {', '.join(SETTABLE)}")
        if key in changes:
            raise SpecError(f"--set {key} given twice")
        if key == "tricks":
            changes[key] = tuple(t.strip() for t in value.split(",") if t.strip())
        elif key in ("gpus", "nodes", "tp", "cp", "dp_replicate", "ep", "engine_gpus", "engine_tp"):
            try:
                changes[key] = int(value)
            except ValueError:
                raise SpecError(f"--set {key}={value!r}: not an integer") from None
        else:
            changes[key] = value
    new = dataclasses.replace(spec, **changes)
    layout = {"algo", "gpus", "model", "engine_gpus", "engine_tp"}
    if layout & set(changes) and new.algo in ROLLOUT_ALGOS:
        # GRPO's engine layout: what was not set here is chosen again for the new spec, as
        # `scaffold new` chooses it (the stored values were chosen for the old one)
        engine_gpus, engine_tp = resolve_engine_layout(
            new, changes.get("engine_gpus"), changes.get("engine_tp")
        )
        new = dataclasses.replace(new, engine_gpus=engine_gpus, engine_tp=engine_tp)
    elif new.algo not in ROLLOUT_ALGOS and not {"engine_gpus", "engine_tp"} & set(changes):
        new = dataclasses.replace(new, engine_gpus=0, engine_tp=1)  # e.g. --set algo=sft
    if new.algo != "kd" and "teacher" not in changes:
        new = dataclasses.replace(new, teacher="")  # --set algo=sft on a kd run: no teacher
    validate_spec(new)
    return new


@dataclass(frozen=True)
class LaunchMerge:
    """The 3-way merge of one launch file (`launch/slurm.sbatch`, ...), by train.py's rules.

    base None: the directory predates launch files (merged against an empty base, so a file the
    user wrote there is never overwritten: it conflicts unless equal to the render). ours None
    with a base: the user deleted the file; it stays deleted (result None).
    """

    name: str  # path relative to the directory
    base: str | None  # .scaffold/<name>, the last pristine render
    ours: str | None  # the user's file
    theirs: str  # the new render
    result: MergeResult | None


def _merge_launch(d: Path, name: str, theirs: str) -> LaunchMerge:
    base_path, path = d / LAUNCH_BASE_DIR / name, d / name
    base = base_path.read_text() if base_path.is_file() else None
    ours = path.read_text() if path.is_file() else None
    if ours is None:
        result = None if base is not None else MergeResult(theirs, ())
    else:
        markers = marker_lines(ours)
        if markers:
            raise ConflictError(
                f"{path} still has conflict markers at line(s) {', '.join(map(str, markers))}: "
                f"resolve them first (your previous file is {path}.orig)"
            )
        result = merge(base or "", ours, theirs)
    return LaunchMerge(name, base, ours, theirs, result)


@dataclass(frozen=True)
class Plan:
    """Everything a regen would do, computed without writing."""

    directory: Path
    old_spec: Spec
    new_spec: Spec
    recorded_version: str
    base: str
    ours: str
    theirs: str
    result: MergeResult
    launch: tuple[LaunchMerge, ...] = ()

    @property
    def up_to_date(self) -> bool:
        return (
            self.theirs == self.base
            and all(m.base == m.theirs for m in self.launch)
            and self.new_spec == self.old_spec
            and self.recorded_version == __version__
        )

    def conflicts(self) -> list[tuple[Path, Conflict]]:
        """(file, conflict) for train.py and every launch file, in that order."""
        found = [(self.directory / SCRIPT, c) for c in self.result.conflicts]
        for m in self.launch:
            if m.result is not None:
                found += [(self.directory / m.name, c) for c in m.result.conflicts]
        return found

    def spec_changes(self) -> list[str]:
        out = [
            f"{f.name}: {_show(getattr(self.old_spec, f.name))} -> {_show(getattr(self.new_spec, f.name))}"
            for f in dataclasses.fields(Spec)
            if getattr(self.old_spec, f.name) != getattr(self.new_spec, f.name)
        ]
        if self.recorded_version != __version__:
            out.append(f"generator: {self.recorded_version} -> {__version__}")
        return out


def _show(value) -> str:
    return (",".join(value) or "(none)") if isinstance(value, tuple) else repr(value)


def plan(directory: str | Path, settings=(), to_version: str = "current") -> Plan:
    """Read DIR's spec, merge base and train.py, render the new spec and merge; write nothing.

    Raises:
        ScaffoldError: missing files, conflict markers still in train.py, or an invalid --set.
    """
    from generator.render import render, render_launch

    if to_version != "current":
        raise SpecError(
            f"--to-version {to_version!r}: only 'current' (scaffold {__version__}) can be rendered"
        )
    d = Path(directory)
    script, spec_path, base_path = d / SCRIPT, d / SPEC_FILE, d / BASE_FILE
    for path in (spec_path, base_path):
        if not path.is_file():
            raise ScaffoldError(
                f"{path} is missing: {d} was not written by `scaffold new` (nothing to merge against)"
            )
    if not script.is_file():
        raise ScaffoldError(
            f"{script} is missing; restore it or re-create it with `scaffold new --out {d} --force`"
        )
    with open(script, newline="") as f:  # as is: keep \r\n visible (read_text translates it)
        ours = f.read()
    markers = marker_lines(ours)
    if markers:
        raise ConflictError(
            f"{script} still has conflict markers at line(s) {', '.join(map(str, markers))}: "
            f"resolve them first (your previous file is {d / ORIG})"
        )
    spec_text = spec_path.read_text()
    old_spec = Spec.from_json(spec_text, source=str(spec_path))
    recorded_version = json.loads(spec_text).get("generator_version", "unknown")  # parsed above
    new_spec = parse_settings(settings, old_spec)
    base = base_path.read_text()
    theirs = render(new_spec)
    crlf = "\r\n" in ours and ours.count("\r\n") == ours.count("\n")  # all CRLF, not mixed
    merged = merge(base, ours.replace("\r\n", "\n") if crlf else ours, theirs)
    if crlf:  # a Windows editor rewrote the line endings: merge on \n, give the file back in CRLF
        merged = MergeResult(merged.text.replace("\n", "\r\n"), merged.conflicts)
    launch = tuple(_merge_launch(d, n, t) for n, t in render_launch(new_spec).items())
    return Plan(d, old_spec, new_spec, recorded_version, base, ours, theirs, merged, launch)


def apply(p: Plan) -> None:
    """Write the merge: train.py (+ train.py.orig on conflict), then the new base and spec."""
    d = p.directory
    if p.result.conflicts:
        _write(d / ORIG, p.ours)
    if p.result.text != p.ours:
        _write(d / SCRIPT, p.result.text)
    for m in p.launch:
        path = d / m.name
        if m.result is not None and m.result.conflicts:
            _write(path.with_name(path.name + ".orig"), m.ours)
        if m.result is not None and m.result.text != m.ours:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write(path, m.result.text)
            path.chmod(0o755)
        if m.base != m.theirs:
            (d / LAUNCH_BASE_DIR / m.name).parent.mkdir(parents=True, exist_ok=True)
            _write(d / LAUNCH_BASE_DIR / m.name, m.theirs)
    _write(d / BASE_FILE, p.theirs)
    _write(d / SPEC_FILE, p.new_spec.to_json())


def _write(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so an interrupted regen never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:  # newline="": keep the text's own line endings
        f.write(text)
    os.replace(tmp, path)


def unified_diff(old: str, new: str, old_label: str, new_label: str) -> str:
    return "".join(difflib.unified_diff(_lines(old), _lines(new), old_label, new_label))


def lines_changed(old: str, new: str) -> tuple[int, int, list[str]]:
    """(lines added, lines removed, sections touched in order) between two renders."""
    a, b = _lines(old), _lines(new)
    sec_a, sec_b = section_of_lines(a), section_of_lines(b)
    added = removed = 0
    touched: dict[str, None] = {}
    for tag, i1, i2, j1, j2 in _LineMatcher(None, a, b).get_opcodes():
        if tag == "equal":
            continue
        removed += i2 - i1
        added += j2 - j1
        for s in sec_a[i1:i2] + sec_b[j1:j2]:
            touched[s] = None
    return added, removed, list(touched)


def option_table(base: Spec | None = None) -> str:
    """Markdown table: lines of train.py that change when one option of `base` changes."""
    from generator.features import TRICKS
    from generator.render import render

    base = base or Spec(out="runs/x")
    lora = dataclasses.replace(base, algo="lora")
    variants = [
        (f"tricks: +{t}", base, dataclasses.replace(base, tricks=(*base.tricks, t))) for t in TRICKS
    ]
    variants += [
        ("algo: sft -> lora", base, lora),
        ("algo: sft -> qlora", base, dataclasses.replace(base, algo="qlora")),
        ("algo: lora -> qlora", lora, dataclasses.replace(base, algo="qlora")),
        ("peft: lora -> dora (algo lora)", lora, dataclasses.replace(lora, peft="dora")),
        ("dtype: bf16 -> fp32", base, dataclasses.replace(base, dtype="fp32")),
        ("gpus: 1 -> 8", base, dataclasses.replace(base, gpus=8)),
        ("nodes: 1 -> 2", base, dataclasses.replace(base, nodes=2)),
        ("dataset: other file", base, dataclasses.replace(base, dataset="my_data.jsonl")),
    ]
    rows = [
        "| option change | lines added | lines removed | sections touched |",
        "|---|---:|---:|---|",
    ]
    for name, old, new in variants:
        added, removed, touched = lines_changed(render(old), render(new))
        short = ", ".join("header" if s == HEADER else s.strip("# =").strip() for s in touched)
        rows.append(f"| {name} | {added} | {removed} | {short} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m generator.regen: the "lines changed per option" table
    print(option_table(), end="")
