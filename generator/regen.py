"""`scaffold regen` and `scaffold diff`: merge a new render into a script the user has edited.

A 3-way line merge in the spirit of `copier update` (`merge3`): base = the pristine render the user
started from (`.scaffold/train.py.base`), ours = the user's `train.py`, theirs = the render of the
(possibly `--set`-changed) spec with the installed templates. Regions only one side changed are taken
from that side; regions both changed differently (or changes that touch, with no unchanged line
between them) become a conflict, written with diff3-style markers (yours / base / new render), so a
user's edit is never dropped silently. The launch files are merged by the same rules, each against
its own base under `.scaffold/launch/`.

A clean merge moves `spec.json` and the bases to the new render at once. A merge with conflicts
does not: like `git rebase`, it writes the marked files (and each one's `.orig`) and stages the new
spec and bases in `.scaffold/pending/`, beside a copy of every file it overwrote or created. The
directory's recorded state is then still the old render's, so nothing can merge against a base
the user has not reached yet:

- `scaffold regen DIR --continue`, once no marker is left, promotes the staged spec and bases
  (the resolved file contains the new render's lines, so later regens must merge against it;
  keeping the old base would re-apply the same option change and conflict a second time).
- `scaffold regen DIR --abort` puts every file back byte for byte (script, launch files, `.orig`
  files, modes) and drops the staged state: spec and bases were never touched.
- Until one of them runs, `regen`, `diff` and `plan` on DIR refuse, naming both; `regen --check`
  reports the directory as unfinished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import merge3

from generator import __version__
from generator.rundir import (
    BASE_FILE,
    LAUNCH_BASE_DIR,
    ORIG,
    PENDING_BEFORE,
    PENDING_DIR,
    PENDING_MANIFEST,
    SCRIPT,
    SPEC_FILE,
    STATE_DIR,
)
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
    "cp_mode",
    "dp_replicate",
    "ep",
    "engine_gpus",
    "engine_tp",
    "layout",
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
    layout = {"algo", "gpus", "model", "engine_gpus", "engine_tp", "layout"}
    if layout & set(changes) and new.algo in ROLLOUT_ALGOS:
        # GRPO's engine layout: what was not set here is chosen again for the new spec, as
        # `scaffold new` chooses it (the stored values were chosen for the old one)
        engine_gpus, engine_tp = resolve_engine_layout(
            new, changes.get("engine_gpus"), changes.get("engine_tp")
        )
        new = dataclasses.replace(new, engine_gpus=engine_gpus, engine_tp=engine_tp)
    elif new.algo not in ROLLOUT_ALGOS and not {"engine_gpus", "engine_tp"} & set(changes):
        new = dataclasses.replace(new, engine_gpus=0, engine_tp=1)  # e.g. --set algo=sft
    if new.algo not in ROLLOUT_ALGOS and "layout" not in changes:
        new = dataclasses.replace(new, layout="split")
    if new.algo != "kd" and "teacher" not in changes:
        new = dataclasses.replace(new, teacher="")  # --set algo=sft on a kd run: no teacher
    if "tricks" in changes:  # the tricks are the user's now, as `scaffold new --tricks` records
        new = dataclasses.replace(new, fit_for="", fit_note=())
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

    def default_changes(self) -> list[str]:
        """The Config defaults the new render changed and the merged train.py took, because you
        had not edited them ("save_every_steps: 0 -> 50"): a regen that changes no option of
        yours can still change what a run does (a new scaffold's defaults, or --set gpus=8's
        multi-GPU ones), so the summary says which. A default you had edited keeps your value
        (or is a conflict) and is not listed, nor one that --set changed by name (dataset). Empty with conflicts (the marked file is not
        Python) or where a file's Config cannot be read."""
        from generator.plan_estimate import config_defaults

        if self.result.conflicts:
            return []
        try:
            base, theirs, merged = (
                config_defaults(text) for text in (self.base, self.theirs, self.result.text)
            )
        except (SyntaxError, ValueError):  # no single `class Config`: nothing to compare
            return []
        asked = {  # fields --set changed by name (dataset, dtype, ...): spec_changes lists those
            f.name
            for f in dataclasses.fields(Spec)
            if getattr(self.old_spec, f.name) != getattr(self.new_spec, f.name)
        }
        return [
            f"{name}: {base[name]!r} -> {value!r}"
            for name, value in theirs.items()
            if name in base
            and name not in asked
            and base[name] != value
            and merged.get(name, base[name]) == value
        ]


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
    refuse_if_pending(d)
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
    """Write the merge. Without conflicts: the merged files, then the new bases and spec. With
    conflicts: first stage the new spec and bases and a copy of every file about to be
    overwritten or created in `.scaffold/pending/` (`PENDING_MANIFEST` last: it marks the staging
    complete), then the marked files and their `.orig`; spec and bases stay as they are until
    `continue_regen`."""
    d = p.directory
    files: dict[str, tuple[str, int | None]] = {}  # user file -> (new text, mode to set)
    if p.result.conflicts:
        files[ORIG] = (p.ours, None)
    if p.result.text != p.ours:
        files[SCRIPT] = (p.result.text, None)
    state = {str(BASE_FILE): p.theirs}  # the new spec and merge bases
    for m in p.launch:
        if m.result is not None and m.result.conflicts:
            files[m.name + ".orig"] = (m.ours, None)
        if m.result is not None and m.result.text != m.ours:
            files[m.name] = (m.result.text, 0o755)
        if m.base != m.theirs:
            state[str(LAUNCH_BASE_DIR / m.name)] = m.theirs
    state[str(SPEC_FILE)] = p.new_spec.to_json()  # last: a spec is never newer than its bases
    if p.conflicts():
        _stage(d, files, state, "; ".join(p.spec_changes()) or "template update only")
        state = {}  # promoted by continue_regen
    for name, (text, mode) in files.items():
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, text)
        if mode is not None:
            path.chmod(mode)
    for name, text in state.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        _write(d / name, text)


@dataclass(frozen=True)
class Pending:
    """A regen that left conflicts (`.scaffold/pending/regen.json`)."""

    directory: Path
    changes: str  # the spec changes it merged, as `Plan.spec_changes` printed them
    conflicted: tuple[str, ...]  # files (relative to directory) that got conflict markers
    written: dict  # file it wrote -> {"existed": bool, "mode": int | None}: what --abort undoes
    created_dirs: tuple[str, ...] = ()  # directories it created for them (launch/ of an old DIR)

    def markers_left(self) -> list[tuple[Path, list[int]]]:
        """(file, 1-based marker lines) of each conflicted file that still has markers."""
        left = []
        for name in self.conflicted:
            path = self.directory / name
            if path.is_file():
                with open(path, newline="") as f:
                    lines = marker_lines(f.read().replace("\r\n", "\n"))
                if lines:
                    left.append((path, lines))
        return left

    def ways_out(self) -> str:
        d = self.directory
        return (
            f"`scaffold regen {d} --continue` once the markers are gone, or "
            f"`scaffold regen {d} --abort` to put {d} back as it was before the regen"
        )


def _stage(d: Path, files: dict, state: dict, changes: str) -> None:
    """Write `.scaffold/pending/`: the new state files, each user file in `files` as it is now
    (bytes and mode; or that it does not exist), then the manifest."""
    pending = d / PENDING_DIR
    if pending.exists():  # an interrupted staging (no manifest: refuse_if_pending let it through)
        shutil.rmtree(pending)
    written = {}
    created_dirs = sorted(
        {str(parent.relative_to(d)) for name in files for parent in (d / name).parents
         if parent != d and d in parent.parents and not parent.exists()}
    )  # fmt: skip
    for name in files:
        path = d / name
        existed = path.is_file()
        written[name] = {
            "existed": existed,
            "mode": path.stat().st_mode & 0o777 if existed else None,
        }
        if existed:
            copy = d / PENDING_BEFORE / name
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(path.read_bytes())
    for name, text in state.items():
        target = d / PENDING_DIR / Path(name).relative_to(STATE_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        _write(target, text)
    conflicted = [n for n in files if n.endswith(".orig")]
    manifest = {
        "changes": changes,
        "conflicted": [n.removesuffix(".orig") for n in conflicted],
        "written": written,
        "created_dirs": created_dirs,
    }
    _write(d / PENDING_MANIFEST, json.dumps(manifest, indent=1) + "\n")


def read_pending(directory: str | Path) -> Pending | None:
    """The regen in progress in `directory`, or None.

    Raises:
        ScaffoldError: the manifest exists but is not one regen wrote (names the file).
    """
    d = Path(directory)
    path = d / PENDING_MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return Pending(
            d, data["changes"], tuple(data["conflicted"]), dict(data["written"]),
            tuple(data["created_dirs"]),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError) as e:
        raise ScaffoldError(
            f"{path}: not a pending regen's manifest ({type(e).__name__}: {e}); delete "
            f"{d / PENDING_DIR} to drop the pending regen (spec.json and the bases are the "
            "last finished render's)"
        ) from None


def refuse_if_pending(directory: str | Path) -> None:
    """Raise ConflictError, naming `--continue` and `--abort`, when a regen is in progress: its
    spec and bases are staged, not recorded, so nothing may merge against (or plan) the old ones.
    """
    pending = read_pending(directory)
    if pending is None:
        return
    left = pending.markers_left()
    where = (
        "; ".join(f"{path} still has conflict markers at line(s) {', '.join(map(str, lines))}"
                  for path, lines in left)
        if left
        else "its conflicts are resolved"
    )  # fmt: skip
    raise ConflictError(
        f"{pending.directory} has a regen in progress ({pending.changes}); its new spec and "
        f"merge bases wait in {pending.directory / PENDING_DIR}: {where}; run {pending.ways_out()}"
    )


def continue_regen(directory: str | Path) -> Pending:
    """Finish a conflicted regen: promote the staged spec and bases over `.scaffold/`.

    Raises:
        ScaffoldError: no regen in progress, train.py missing or back to its pre-regen bytes
            (that is --abort), or a conflict marker left (the file and line).
    """
    d = Path(directory)
    pending = read_pending(d)
    if pending is None:
        raise ScaffoldError(f"--continue: no regen in progress in {d} (nothing to continue)")
    if SCRIPT in pending.conflicted and not (d / SCRIPT).is_file():
        raise ScaffoldError(
            f"--continue: {d / SCRIPT} is missing; put the resolved script there, or run "
            f"`scaffold regen {d} --abort`"
        )
    before = d / PENDING_BEFORE / SCRIPT
    if SCRIPT in pending.conflicted and before.is_file():
        if (d / SCRIPT).read_bytes() == before.read_bytes():
            # e.g. train.py.orig copied back: promoting the spec would record options the script
            # does not have (and `diff` would then see nothing to change)
            raise ScaffoldError(
                f"--continue: {d / SCRIPT} is byte for byte what it was before the regen "
                f"({d / ORIG}), so it has none of the new render's changes; run `scaffold regen "
                f"{d} --abort` to undo the regen, or keep the new render's side where it applies"
            )
    left = pending.markers_left()
    if left:
        path, lines = left[0]
        more = sum(len(n) for _, n in left) - 1
        raise ConflictError(
            f"--continue: {path}:{lines[0]}: conflict marker left"
            + (f" (and {more} more marker line(s))" if more else "")
            + "; edit each marked region, delete the markers, then run --continue again "
            f"(or `scaffold regen {d} --abort`)"
        )
    staged = d / PENDING_DIR
    spec = staged / SPEC_FILE.relative_to(STATE_DIR)
    promoted = [
        path for path in sorted(staged.rglob("*"))
        if path.is_file() and path not in (spec, d / PENDING_MANIFEST)
        and path.relative_to(staged).parts[0] != PENDING_BEFORE.name
    ]  # fmt: skip
    # the spec last, so a spec is never newer than its bases; the staged files stay until every
    # one is promoted, so an interrupted --continue is finished by running it again
    for path in [*promoted, spec]:
        target = d / STATE_DIR / path.relative_to(staged)
        target.parent.mkdir(parents=True, exist_ok=True)
        _write(target, path.read_text())
    shutil.rmtree(staged)
    return pending


def abort_regen(directory: str | Path) -> Pending:
    """Undo a conflicted regen: every file it wrote back as it was (bytes and mode), the files
    it created removed, the staged state dropped. spec.json and the bases were not touched.

    Raises:
        ScaffoldError: no regen in progress.
    """
    d = Path(directory)
    pending = read_pending(d)
    if pending is None:
        raise ScaffoldError(f"--abort: no regen in progress in {d} (nothing to abort)")
    for name, was in pending.written.items():
        path = d / name
        if was["existed"]:
            with open(d / PENDING_BEFORE / name, "rb") as f:
                data = f.read()
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            tmp.chmod(was["mode"])
            os.replace(tmp, path)
        elif path.exists():
            path.unlink()
    for name in sorted(pending.created_dirs, key=len, reverse=True):  # deepest first
        with contextlib.suppress(OSError):  # not empty: the user put a file there since
            (d / name).rmdir()
    shutil.rmtree(d / PENDING_DIR)
    return pending


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
