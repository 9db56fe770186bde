"""`scaffold regen` / `scaffold diff`: 3-way merges keep user edits, conflicts are marked and
reported, nothing is lost silently, option changes stay local, and no option value can inject code.

Renders cost ~0.3 s (ruff), so every render in this module goes through one cache (`_cached_render`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import generator.render
from generator.cli import cli
from generator.regen import HEADER, lines_changed, marker_lines, merge, section_of_lines
from generator.spec import Spec

_ORIGINAL_RENDER = generator.render.render


@functools.cache
def _cached_render(spec: Spec) -> str:
    return _ORIGINAL_RENDER(spec)


@pytest.fixture(autouse=True)
def cached_render(monkeypatch, tmp_path):
    monkeypatch.setattr(generator.render, "render", _cached_render)
    monkeypatch.chdir(tmp_path)


AC_LINES = (
    "from torch.distributed._composable import checkpoint",
    "    enable_activation_checkpointing: bool = True",
    "            checkpoint(layer)",
)


def _line(text: str, needle: str) -> str:
    """The one full line (with its newline) of `text` that contains `needle`."""
    found = [line for line in text.splitlines(keepends=True) if needle in line]
    assert len(found) == 1, (needle, found)
    return found[0]


_PLAIN = Spec(out="run")  # what `_new` writes
DEVICE_LINE = _line(_cached_render(_PLAIN), 'device: str = "auto"')  # Config, where ac adds a field
TOKENIZE_LINE = _line(_cached_render(_PLAIN), "= tokenizer.render_with_assistant_spans(")
STEP_LINE = _line(_cached_render(_PLAIN), "loss.backward()")  # in train_step


def _new(tmp_path: Path, *args: str) -> Path:
    """`scaffold new --out run` in tmp_path (the cwd): the same spec in every test, so one render."""
    result = CliRunner().invoke(cli, ["new", "--out", "run", *args])
    assert result.exit_code == 0, result.output
    return Path("run")


def _edit(path: Path, old: str, new: str) -> str:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    return path.read_text()


def _snapshot(directory: Path) -> dict:
    return {
        p: (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _spec_of(directory: Path) -> Spec:
    return Spec.from_json((directory / ".scaffold" / "spec.json").read_text())


# ---------------------------------------------------------------------------------------------
# Scenarios


def test_regen_keeps_edits_and_gains_the_option(tmp_path):
    out = _new(tmp_path)
    script = out / "train.py"
    tokenize_edit = TOKENIZE_LINE + "    text = text.strip()  # user: no trailing whitespace\n"
    step_edit = STEP_LINE.replace("loss.backward()", "loss.backward()  # user: checked")
    _edit(script, TOKENIZE_LINE, tokenize_edit)
    _edit(script, STEP_LINE, step_edit)

    result = CliRunner().invoke(cli, ["regen", str(out), "--set", "tricks=ac"])
    assert result.exit_code == 0, result.output
    assert "your edits are kept" in result.output and "tricks: (none) -> ac" in result.output

    new_spec = dataclasses.replace(_spec_of(out), tricks=("ac",))
    expected = (
        _cached_render(new_spec).replace(TOKENIZE_LINE, tokenize_edit).replace(STEP_LINE, step_edit)
    )
    assert script.read_text() == expected  # both edits, every ac line, nothing else
    assert all(line in expected for line in AC_LINES)
    assert _spec_of(out).tricks == ("ac",)
    assert (out / ".scaffold" / "train.py.base").read_text() == _cached_render(new_spec)
    assert not (out / "train.py.orig").exists()
    compile(script.read_text(), "train.py", "exec")

    # Nothing changed since: regen is a no-op that writes nothing.
    before = _snapshot(out)
    again = CliRunner().invoke(cli, ["regen", str(out)])
    assert again.exit_code == 0 and "nothing to merge" in again.output
    assert _snapshot(out) == before

    # And back off again: the option's lines go, the edits stay.
    off = CliRunner().invoke(cli, ["regen", str(out), "--set", "tricks="])
    assert off.exit_code == 0, off.output
    plain = _cached_render(dataclasses.replace(new_spec, tricks=()))
    assert script.read_text() == plain.replace(TOKENIZE_LINE, tokenize_edit).replace(
        STEP_LINE, step_edit
    )


def _files(directory: Path) -> dict:
    """{path: (bytes, mode)} of every file under `directory`: what an undo must give back."""
    return {
        p: (p.read_bytes(), p.stat().st_mode & 0o777)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _resolve(text: str, theirs_too: bool = True) -> str:
    """Each conflict region resolved as a user would: yours, plus (theirs_too) the lines the new
    render added."""
    lines = text.splitlines(keepends=True)
    out, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("<<<<<<< "):
            out.append(lines[i])
            i += 1
            continue
        base_at = next(k for k in range(i, len(lines)) if lines[k].startswith("||||||| "))
        mid_at = next(k for k in range(base_at, len(lines)) if lines[k] == "=======\n")
        end_at = next(k for k in range(mid_at, len(lines)) if lines[k].startswith(">>>>>>> "))
        old = lines[base_at + 1 : mid_at]
        added = [n for n in lines[mid_at + 1 : end_at] if n not in old] if theirs_too else []
        out += lines[i + 1 : base_at] + added
        i = end_at + 1
    return "".join(out)


def _conflicted(tmp_path: Path) -> tuple[Path, dict, str]:
    """A run whose regen (tricks=ac, gpus=2) conflicts in train.py's Config and in the Slurm
    file: (directory, its files before the regen, the edited train.py)."""
    out = _new(tmp_path)
    before_text = _edit(
        out / "train.py", DEVICE_LINE, '    device: str = "cuda"  # user: GPUs only\n'
    )
    _edit(out / "launch" / "slurm.sbatch", "--nproc-per-node 1", "--nproc-per-node 3")
    (out / "launch" / "torchrun.sh").chmod(0o700)  # a mode of the user's, which regen changes
    before = _files(out)
    result = CliRunner().invoke(cli, ["regen", str(out), "--set", "tricks=ac", "--set", "gpus=2"])
    assert result.exit_code == 1, result.output
    return out, before, before_text


@pytest.mark.fast
def test_overlapping_edit_conflicts_stages_the_new_spec_and_blocks_other_commands(tmp_path):
    out = _new(tmp_path)
    script = out / "train.py"
    before = _edit(script, DEVICE_LINE, '    device: str = "cuda"  # user: GPUs only\n')
    old_state = {n: (out / ".scaffold" / n).read_bytes() for n in ("spec.json", "train.py.base")}

    result = CliRunner().invoke(cli, ["regen", str(out), "--set", "tricks=ac"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    text = script.read_text()
    markers = marker_lines(text)
    assert len(markers) == 4
    start, end = markers[0], markers[-1]
    assert f"train.py:{start}-{end}: conflict in # === 2. Config ===" in result.output
    assert "1 conflicting region(s)" in result.output and "train.py.orig" in result.output
    assert f"scaffold regen {out} --continue" in result.output
    assert f"scaffold regen {out} --abort" in result.output
    lines = text.splitlines()
    assert lines[start - 1] == "<<<<<<< yours" and lines[end - 1] == ">>>>>>> new render"
    region = "\n".join(lines[start - 1 : end])
    assert '"cuda"  # user: GPUs only' in region and "enable_activation_checkpointing" in region
    assert (out / "train.py.orig").read_text() == before
    # The recorded spec and base stay the old render's; the new ones are staged.
    assert {n: (out / ".scaffold" / n).read_bytes() for n in old_state} == old_state
    new_spec = dataclasses.replace(_spec_of(out), tricks=("ac",))
    pending = out / ".scaffold" / "pending"
    assert Spec.from_json((pending / "spec.json").read_text()) == new_spec
    assert (pending / "train.py.base").read_text() == _cached_render(new_spec)
    # Clean regions merged anyway: the other ac lines are in.
    assert "            checkpoint(layer)" in text

    # While the regen is pending, regen and diff refuse, naming the markers and both ways out,
    # and write nothing; so does `plan DIR` (it would plan the old spec).
    snapshot = _snapshot(out)
    for command in (["regen", str(out), "--set", "gpus=2"], ["diff", str(out)], ["plan", str(out)]):
        refused = CliRunner().invoke(cli, command)
        assert refused.exit_code == 1, refused.output
        assert f"conflict markers at line(s) {', '.join(map(str, markers))}" in refused.output
        assert "--continue" in refused.output and "--abort" in refused.output
        assert refused.output.count("\n") == 1
    assert _snapshot(out) == snapshot

    # Resolved but not continued: still refused (the base is still the old render), saying so.
    script.write_text(_resolve(text))
    refused = CliRunner().invoke(cli, ["regen", str(out)])
    assert refused.exit_code == 1 and "its conflicts are resolved" in refused.output
    assert f"scaffold regen {out} --continue" in refused.output


@pytest.mark.fast
def test_abort_restores_script_launch_files_spec_and_bases_byte_for_byte(tmp_path):
    out, before, _ = _conflicted(tmp_path)
    assert marker_lines((out / "train.py").read_text())
    assert marker_lines((out / "launch" / "slurm.sbatch").read_text())
    assert (out / "launch" / "torchrun.sh").stat().st_mode & 0o777 == 0o755  # merged cleanly
    # a half-resolved file is discarded too: --abort means "as before the regen"
    (out / "train.py").write_text(_resolve((out / "train.py").read_text()))

    result = CliRunner().invoke(cli, ["regen", str(out), "--abort"])
    assert result.exit_code == 0, result.output
    assert "restored launch/slurm.sbatch, launch/torchrun.sh" in result.output
    assert "removed launch/slurm.sbatch.orig, train.py.orig" in result.output
    assert _files(out) == before  # every file, its bytes and its mode; nothing left over

    again = CliRunner().invoke(cli, ["regen", str(out), "--abort"])
    assert again.exit_code == 1 and again.output.count("\n") == 1
    assert f"--abort: no regen in progress in {out} (nothing to abort)" in again.output
    # and the directory is a normal one again: the same regen conflicts the same way
    redo = CliRunner().invoke(cli, ["regen", str(out), "--set", "tricks=ac", "--set", "gpus=2"])
    assert redo.exit_code == 1 and "2 conflicting region(s)" in redo.output


@pytest.mark.fast
def test_continue_refuses_markers_then_promotes_spec_and_bases(tmp_path):
    out, _, _ = _conflicted(tmp_path)
    script, slurm = out / "train.py", out / "launch" / "slurm.sbatch"
    first = marker_lines(script.read_text())[0]
    refused = CliRunner().invoke(cli, ["regen", str(out), "--continue"])
    assert refused.exit_code == 1 and refused.output.count("\n") == 1
    assert f"--continue: {script}:{first}: conflict marker left" in refused.output

    script.write_text(_resolve(script.read_text()))  # train.py done, the Slurm file not yet
    slurm_first = marker_lines(slurm.read_text())[0]
    refused = CliRunner().invoke(cli, ["regen", str(out), "--continue"])
    assert refused.exit_code == 1
    assert f"--continue: {slurm}:{slurm_first}: conflict marker left" in refused.output
    assert _spec_of(out) == Spec(out="run")  # nothing promoted by a refused --continue

    slurm.write_text(_resolve(slurm.read_text(), theirs_too=False))  # keeps --nproc-per-node 3
    done = CliRunner().invoke(cli, ["regen", str(out), "--continue"])
    assert done.exit_code == 0, done.output
    new_spec = Spec(out="run", tricks=("ac",), gpus=2)
    assert _spec_of(out) == new_spec
    assert (out / ".scaffold" / "train.py.base").read_text() == _cached_render(new_spec)
    launch = generator.render.render_launch(new_spec)
    for name, text in launch.items():
        assert (out / ".scaffold" / name).read_text() == text
    assert not (out / ".scaffold" / "pending").exists()

    # the next diff is empty, and the next regen merges against the new render: no conflict
    empty = CliRunner().invoke(cli, ["diff", str(out)])
    assert empty.exit_code == 0 and empty.output == f"regen would not change {script}\n"
    more = CliRunner().invoke(cli, ["regen", str(out), "--set", "dataset=mine.jsonl"])
    assert more.exit_code == 0, more.output
    text = script.read_text()
    assert '"cuda"  # user: GPUs only' in text and "enable_activation_checkpointing" in text
    assert 'dataset: str = "mine.jsonl"' in text and "torchrun --nproc-per-node 2" in text
    assert "--nproc-per-node 3" in slurm.read_text()  # the user's resolution, kept


@pytest.mark.fast
def test_orig_copied_back_cannot_be_continued_and_new_force_drops_the_pending_regen(tmp_path):
    """The issue's trap: after a conflict, the user copies train.py.orig back. --continue would
    record options the script lacks, so it refuses and points to --abort; `diff` refuses too
    (it used to report nothing to change). `scaffold new --force` starts over: no pending regen."""
    out = _new(tmp_path)
    _edit(out / "train.py", DEVICE_LINE, '    device: str = "cuda"  # user\n')
    assert CliRunner().invoke(cli, ["regen", str(out), "--set", "tricks=ac"]).exit_code == 1
    shutil.copy(out / "train.py.orig", out / "train.py")
    refusals = [
        (["regen", str(out), "--continue"], "train.py is byte for byte what it was before"),
        (["diff", str(out)], "has a regen in progress (tricks: (none) -> ac)"),
    ]
    for command, message in refusals:
        refused = CliRunner().invoke(cli, command)
        assert refused.exit_code == 1 and refused.output.count("\n") == 1, refused.output
        assert message in refused.output and f"scaffold regen {out} --abort" in refused.output
    assert _spec_of(out).tricks == ()
    forced = CliRunner().invoke(cli, ["new", "--out", "run", "--tricks", "ac", "--force"])
    assert forced.exit_code == 0, forced.output
    assert not (out / ".scaffold" / "pending").exists()
    assert CliRunner().invoke(cli, ["regen", str(out)]).exit_code == 0


@pytest.mark.fast
def test_regen_check_reports_an_unfinished_regen(tmp_path):
    out, _, _ = _conflicted(tmp_path)
    result = CliRunner().invoke(cli, ["regen", "--check", str(out)])
    assert result.exit_code == 1
    assert f"unfinished: {out} has a regen in progress" in result.output
    assert "1 directory(ies) with an unfinished regen" in result.output
    for flags in (
        ["--continue", "--abort"],
        ["--abort", "--set", "gpus=2"],
        ["--check", "--abort"],
    ):
        refused = CliRunner().invoke(cli, ["regen", str(out), *flags])
        assert refused.exit_code == 1 and refused.output.count("\n") == 1, refused.output


def test_edit_of_the_header_command_line_conflicts(tmp_path):
    out = _new(tmp_path)
    script = out / "train.py"
    _edit(script, "Edit freely;", "Edited by me; edit freely;")  # the line under the command line
    result = CliRunner().invoke(cli, ["regen", str(out), "--set", "dtype=fp32"])
    assert result.exit_code == 1
    assert f"conflict in {HEADER}" in result.output
    text = script.read_text()
    assert "Edited by me" in text and "--dtype fp32" in text
    assert 'dtype: str = "fp32"' in text  # the Config change merged cleanly


def test_template_change_merges_cleanly(tmp_path, monkeypatch):
    out = _new(tmp_path)
    script = out / "train.py"
    tokenize_edit = TOKENIZE_LINE + "    text = text.strip()  # user edit\n"
    _edit(script, TOKENIZE_LINE, tokenize_edit)

    # "Template v2": a copy of templates/ with a changed default and a new comment in another section.
    v2 = tmp_path / "templates_v2"
    shutil.copytree(generator.render.templates_dir(), v2)
    for banner, note in [
        ("# === 6. Optimizer + LR schedule ===\n", "# v2: a new optimizer note\n"),
        ("# === 9. main ===\n", "# v2: a new note on main\n"),
        ("Launch:\n", "Launch (v2):\n"),
    ]:  # each banner is in one template file (a skeleton's own, or a shared partial)
        holders = [
            f for f in (v2 / "recipes").rglob("*.jinja")
            if banner in f.read_text() and (f.parent.name == "partials" or f.stem == "sft.py")
        ]  # fmt: skip
        assert len(holders) == 1 and holders[0].read_text().count(banner) == 1, (banner, holders)
        text = holders[0].read_text()
        holders[0].write_text(text.replace(banner, banner + note if note.startswith("#") else note))
    monkeypatch.setattr(generator.render, "templates_dir", lambda: v2)
    monkeypatch.setattr(generator.render, "render", _ORIGINAL_RENDER)  # not the v1 cache

    result = CliRunner().invoke(cli, ["regen", str(out), "--to-version", "current"])
    assert result.exit_code == 0, result.output
    assert "template update only" in result.output
    merged = script.read_text()
    assert merged == _ORIGINAL_RENDER(_spec_of(out)).replace(TOKENIZE_LINE, tokenize_edit)
    assert "# v2: a new optimizer note" in merged and "Launch (v2):" in merged


def test_crlf_file_is_merged_and_kept_crlf(tmp_path):
    out = _new(tmp_path)
    script = out / "train.py"
    text = script.read_text().replace(TOKENIZE_LINE, TOKENIZE_LINE + "    pass  # user\n")
    script.write_bytes(text.replace("\n", "\r\n").encode())
    result = CliRunner().invoke(cli, ["regen", str(out), "--set", "tricks=ac"])
    assert result.exit_code == 0, result.output
    merged = script.read_bytes().decode()
    assert "    pass  # user\r\n" in merged and "enable_activation_checkpointing" in merged
    assert merged.count("\r\n") == merged.count("\n")


def test_markers_and_line_numbers():
    assert marker_lines("Title\n=======\n") == []  # an RST underline alone is not a marker
    assert marker_lines("a\n<<<<<<< yours\nb\n=======\nc\n>>>>>>> new render\n") == [2, 4, 6]
    # A form feed inside a line is not a line break: conflict lines are the editor's line numbers.
    result = merge("a\nb\nc\nd\n", "a\nb\x0cX\nc\nd\n", "a\nb\nc2\nd\n")
    (conflict,) = result.conflicts
    lines = result.text.split("\n")
    assert (conflict.start, conflict.end) == (2, 11)  # 3 sides of 2 lines + 4 markers
    assert (
        lines[1] == "<<<<<<< yours" and lines[2] == "b\x0cX" and lines[10] == ">>>>>>> new render"
    )
    assert conflict.sections == (HEADER,) and (conflict.ours, conflict.theirs) == (2, 2)


# ---------------------------------------------------------------------------------------------
# diff


def test_diff_prints_what_regen_would_apply_and_writes_nothing(tmp_path):
    out = _new(tmp_path)
    _edit(out / "train.py", STEP_LINE, STEP_LINE.replace("()", "()  # user"))
    before = _snapshot(out)
    result = CliRunner().invoke(cli, ["diff", str(out), "--set", "tricks=ac"])
    assert result.exit_code == 0, result.output
    assert _snapshot(out) == before
    assert result.output.startswith(
        f"--- {out / 'train.py'}\n+++ {out / 'train.py'} (after regen)\n"
    )
    added = [
        line[1:]
        for line in result.output.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    assert any(line.startswith(AC_LINES[1]) for line in added)
    assert not any("# user" in line for line in added)  # the user's edit is already there

    # A diff that would conflict says so, still writing nothing.
    _edit(out / "train.py", DEVICE_LINE, DEVICE_LINE.replace('"auto"', '"cpu"', 1))
    before = _snapshot(out)
    conflicting = CliRunner().invoke(cli, ["diff", str(out), "--set", "tricks=ac"])
    assert conflicting.exit_code == 0
    assert "regen would conflict: " in conflicting.output and "<<<<<<< yours" in conflicting.output
    assert _snapshot(out) == before


def test_diff_of_two_specs(tmp_path):
    runner = CliRunner()
    a, b = tmp_path / "a", tmp_path / "b"
    assert runner.invoke(cli, ["new", "--out", str(a)]).exit_code == 0
    assert (
        runner.invoke(cli, ["new", "--out", str(b), "--tricks", "ac", "--dtype", "fp32"]).exit_code
        == 0
    )
    spec_a = str(a / ".scaffold" / "spec.json")
    result = runner.invoke(
        cli, ["diff", "--spec", spec_a, "--spec", str(b)]
    )  # a file, or a directory
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"--- {spec_a}\n+++ {b}\n")
    assert f"+{AC_LINES[0]}" in result.output
    assert (
        '-    dtype: str = "bf16"' in result.output and '+    dtype: str = "fp32"' in result.output
    )
    for bad in (
        ["diff", "--spec", spec_a],
        ["diff", str(a), "--spec", spec_a, "--spec", spec_a],
        ["diff"],
    ):
        refused = runner.invoke(cli, bad)
        assert refused.exit_code == 1 and refused.output.count("\n") == 1, refused.output


def test_regen_to_lora_then_dora_keeps_edits(tmp_path):
    """sft -> lora -> dora by `--set`: the user's edit survives both merges."""
    out = _new(tmp_path)
    script = out / "train.py"
    tokenize_edit = TOKENIZE_LINE + "    text = text.strip()  # user: no trailing whitespace\n"
    _edit(script, TOKENIZE_LINE, tokenize_edit)
    for setting, spec in [
        ("algo=lora", Spec(out="run", algo="lora")),
        ("peft=dora", Spec(out="run", algo="lora", peft="dora")),
    ]:
        result = CliRunner().invoke(cli, ["regen", str(out), "--set", setting])
        assert result.exit_code == 0, result.output
        assert script.read_text() == _cached_render(spec).replace(TOKENIZE_LINE, tokenize_edit)
        assert _spec_of(out) == spec


# ---------------------------------------------------------------------------------------------
# --set validation


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "colour=red",
            "unknown key 'colour'; valid keys: algo, dataset, dtype, gpus, model, nodes, tp, cp, cp_mode, dp_replicate, ep, engine_gpus, engine_tp, layout, peft, teacher, tricks",
        ),
        ("out=elsewhere", "unknown key 'out'"),
        ("gpus", "expected key=value"),
        ("gpus=two", "--set gpus='two': not an integer"),
        ("gpus=0", "--gpus 0 and --nodes 1 must both be >= 1"),
        ("dtype=fp16", "--dtype 'fp16'; valid: bf16, fp32"),
        ("tricks=ac,warp", "unknown trick(s) ['warp']; valid: packing, ac"),
        ("model=gpt5", "unknown model 'gpt5'"),
        ("algo=reinforce", "unknown algorithm 'reinforce'"),
        ("dataset= ", "--dataset is empty"),
        (
            "peft=dora",
            "--peft dora needs an adapter algorithm (--algo lora or qlora or dpo-lora or grpo-lora)",
        ),
        ("peft=ia3", "--peft 'ia3'; valid: lora, dora"),
    ],
)
def test_set_errors_are_one_line_and_write_nothing(setting, message, tmp_path):
    out = _new(tmp_path)
    before = _snapshot(out)
    for command in ("regen", "diff"):
        result = CliRunner().invoke(cli, [command, str(out), "--set", setting])
        assert result.exit_code == 1, result.output
        assert message in result.output
        assert "Traceback" not in result.output and result.output.count("\n") == 1
    assert _snapshot(out) == before


def test_regen_usage_errors(tmp_path):
    out = _new(tmp_path)
    runner = CliRunner()
    for args, message in [
        (["regen", str(out), "--check", "--set", "gpus=2"], "takes no --set"),
        (["regen", str(out), str(tmp_path)], "one DIR at a time"),
        (["regen", str(tmp_path)], "spec.json is missing"),
    ]:
        result = runner.invoke(cli, args)
        assert result.exit_code == 1 and message in result.output and result.output.count("\n") == 1
    (out / ".scaffold" / "train.py.base").unlink()
    result = runner.invoke(cli, ["regen", str(out)])
    assert result.exit_code == 1 and "train.py.base is missing" in result.output


# ---------------------------------------------------------------------------------------------
# Injection: user strings render as literals that read back exactly


HOSTILE = [
    'x"""\nimport os\nos.system("echo pwned")\n"""',
    'it\'s "quoted"',
    "'''",
    "C:\\Users\\me\\new\\data.json",
    "C:\\Nope\\x\\u\\N",
    "trailing\\",
    "line1\nline2\r\n",
    "nul\x00and\x01ctrl\ttab",
    "</script><!--",
    "{{ a.model }}{% raw %}{#",
    "déjà vu 😀 \u2028\u2029\x85\ufeff",
    "\ud800lone surrogate",
    "   spaces   ",
]


@pytest.mark.parametrize("dataset", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_dataset_renders_as_a_literal(dataset, tmp_path):
    from tests.helpers import import_script

    spec = Spec(dataset=dataset, out="o")
    text = _cached_render(spec)
    tree = ast.parse(text)
    assert (
        ast.get_docstring(tree, clean=False).count(spec.command()) == 1
    )  # header reads back exactly
    assert [type(n).__name__ for n in tree.body[:2]] == [
        "Expr",
        "Import",
    ]  # docstring, then imports
    path = tmp_path / "train.py"
    path.write_text(text)
    module = import_script(path, f"hostile_{HOSTILE.index(dataset)}")
    assert module.Config().dataset == dataset
    assert module.__doc__.count(spec.command()) == 1


def test_hostile_set_value_through_regen(tmp_path):
    out = _new(tmp_path)
    dataset = 'evil"""\nraise SystemExit("pwned")\n#'
    result = CliRunner().invoke(cli, ["regen", str(out), "--set", f"dataset={dataset}"])
    assert result.exit_code == 0, result.output
    tree = ast.parse((out / "train.py").read_text())
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    values = {s.target.id: s.value for s in config.body if isinstance(s, ast.AnnAssign)}
    assert ast.literal_eval(values["dataset"]) == dataset
    assert json.loads((out / ".scaffold" / "spec.json").read_text())["spec"]["dataset"] == dataset


# ---------------------------------------------------------------------------------------------
# Local diffs: one option changes only the sections it concerns


CONFIG = "# === 2. Config ==="


IMPORTS, MODEL, LOSS = "# === 1. Imports ===", "# === 4. Model ===", "# === 5. Loss ==="
OPTIM, STEP = "# === 6. Optimizer + LR schedule ===", "# === 8. train_step ==="
DATA, MAIN = "# === 7. Data ===", "# === 9. main ==="


@pytest.mark.parametrize(
    "change, allowed, max_lines",
    [
        ({"tricks": ("ac",)}, {HEADER, IMPORTS, CONFIG, MODEL}, 14),
        ({"tricks": ("lce",)}, {HEADER, IMPORTS, CONFIG, MODEL, LOSS}, 24),
        # 4 of its lines are the header's bytes-per-parameter line (gradients 4 -> 0), reflowed;
        # 4 backward_and_step's docstring on what a non-finite gradient leaves (issue 47)
        ({"tricks": ("optim-in-bwd",)}, {HEADER, IMPORTS, OPTIM, STEP}, 48),
        ({"tricks": ("adamw8bit",)}, {HEADER, IMPORTS, OPTIM}, 20),
        ({"tricks": ("adamw4bit",)}, {HEADER, IMPORTS, OPTIM}, 20),
        ({"tricks": ("packing",)}, {HEADER, IMPORTS, CONFIG, LOSS, DATA, MAIN}, 50),
        ({"tricks": ("compile",)}, {HEADER, CONFIG, MODEL, LOSS}, 30),
        ({"tricks": ("offload",)}, {HEADER, IMPORTS, CONFIG, MODEL}, 30),
        ({"dtype": "fp32"}, {HEADER, CONFIG}, 12),
        # a multi-GPU script checkpoints every 50 steps by default (Config's save_every_steps)
        ({"gpus": 8}, {HEADER, CONFIG}, 14),
        ({"nodes": 2}, {HEADER, CONFIG}, 14),
        ({"dataset": "mine.jsonl"}, {HEADER, CONFIG}, 12),
        # an algorithm is one template: its save() sits after train_step, before main's banner, and
        # main calls it in place of the runtime's save_hf_model; the optimizer's no-decay comment
        # names DoRA's magnitudes
        # lora and qlora: + the save's `record` (what training_config.json holds, issue 47)
        ({"algo": "lora"}, {HEADER, IMPORTS, CONFIG, MODEL, OPTIM, STEP, MAIN}, 121),
        ({"algo": "qlora"}, {HEADER, IMPORTS, CONFIG, MODEL, OPTIM, STEP, MAIN}, 129),
        ({"algo": "lora", "peft": "dora", "_from": "lora"}, {HEADER, CONFIG}, 12),
        ({"algo": "qlora", "_from": "lora"}, {HEADER, IMPORTS, MODEL}, 20),
    ],
)
def test_option_changes_are_local(change, allowed, max_lines):
    change = dict(change)
    base = Spec(out="runs/x", algo=change.pop("_from", "sft"))
    added, removed, sections = lines_changed(
        _cached_render(base), _cached_render(dataclasses.replace(base, **change))
    )
    assert set(sections) <= allowed
    assert 0 < added + removed <= max_lines


# ---------------------------------------------------------------------------------------------
# Property: no user edit is ever lost silently
#
# A user edit is one of: insert 1-2 new lines before base line i; delete base line i; modify base
# line i (append a comment); i is drawn from a random section, or next to a region the option
# change rewrites (so that about half the cases conflict). Inserted and modified lines carry a unique token, so "present" is
# exact: such a line occurs exactly once in the result, either outside every conflict region or
# on the "yours" side of a reported one; the ones outside conflicts keep the user's order.
# A deleted line has no token, and identical lines (blank lines, `)`) cannot be told apart without
# an alignment, so a deletion is checked when the line is unique in base: outside conflict regions
# it must not come back, i.e. it may occur at most (copies in the new render - 1) times there
# (a new render can legitimately add another copy of the same text elsewhere). Inside a conflict
# region it is reported, so it is not silent.
# Also: conflict regions are exactly the marker blocks in the text, each names the banner it falls
# under; with no edits the result is the new render; new lines of the new render are never lost.

SPECS = [
    Spec(out="runs/p"),
    Spec(out="runs/p", tricks=("ac",)),
    Spec(out="runs/p", dtype="fp32"),
    Spec(out="runs/p", gpus=8, nodes=2),
    Spec(out="runs/p", tricks=("ac",), dtype="fp32", dataset="other.jsonl"),
]


@functools.cache
def _renders() -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(_cached_render(s).splitlines(keepends=True)) for s in SPECS)


@functools.cache
def _near_changes(i: int, j: int) -> tuple[int, ...]:
    """Base lines within 2 lines of a region the option change rewrites (where conflicts live)."""
    base, theirs = _renders()[i], _renders()[j]
    near = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(
        None, base, theirs, autojunk=False
    ).get_opcodes():
        if tag != "equal":
            near.update(range(max(0, i1 - 2), min(len(base), i2 + 2)))
    return tuple(sorted(near))


@st.composite
def scenarios(draw):
    i, j = draw(st.lists(st.integers(0, len(SPECS) - 1), min_size=2, max_size=2, unique=True))
    base = list(_renders()[i])
    banners = [k for k, line in enumerate(base) if line.startswith("# === ")]
    bounds = list(zip([0, *banners], [*banners, len(base)]))  # header + one range per section
    edits = {}
    for token in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):  # anywhere, section by section
            lo, hi = draw(st.sampled_from(bounds))
            pos = draw(st.integers(lo, hi - 1))
        else:  # next to what the option change rewrites
            pos = draw(st.sampled_from(_near_changes(i, j)))
        kind = draw(st.sampled_from(["insert", "delete", "modify"]))
        width = draw(st.integers(1, 2))
        edits.setdefault(pos, (kind, token, width))
    return i, j, edits


def _apply(base: list[str], edits: dict) -> tuple[list[str], list[str], list[str]]:
    """The user's file, the tokened lines it gained (in file order), the base lines it deleted."""
    ours, tokened, deleted = [], [], []
    for k, line in enumerate(base):
        kind, token, width = edits.get(k, (None, None, 0))
        if kind == "insert":
            new = [f"    # user-edit-{token}.{w}: inserted\n" for w in range(width)]
            ours += new + [line]
            tokened += new
        elif kind == "delete":
            deleted.append(line)
        elif kind == "modify":
            new = line.rstrip("\n") + f"  # user-edit-{token}: modified\n"
            ours.append(new)
            tokened.append(new)
            deleted.append(line)
        else:
            ours.append(line)
    return ours, tokened, deleted


@settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(scenarios())
def test_no_edit_is_lost_silently(scenario):
    i, j, edits = scenario
    base, theirs = list(_renders()[i]), list(_renders()[j])
    ours, tokened, deleted = _apply(base, edits)
    result = merge("".join(base), "".join(ours), "".join(theirs))
    out = result.text.splitlines(keepends=True)

    # Conflict regions are exactly the marker blocks, and each names its section.
    in_conflict, yours_side, expected_markers = [False] * len(out), set(), set()
    sections = section_of_lines(out)
    for c in result.conflicts:
        assert out[c.start - 1] == "<<<<<<< yours\n" and out[c.end - 1] == ">>>>>>> new render\n"
        base_marker = next(k for k in range(c.start, c.end) if out[k - 1].startswith("||||||| "))
        mid = next(k for k in range(base_marker, c.end) if out[k - 1] == "=======\n")
        expected_markers |= {c.start, base_marker, mid, c.end}
        yours_side |= set(range(c.start, base_marker - 1))  # 0-based indexes of the yours lines
        for k in range(c.start - 1, c.end):
            in_conflict[k] = True
        assert c.sections[0] == sections[c.start - 1]
        assert c.ours == base_marker - c.start - 1 and c.theirs == c.end - mid - 1
    assert set(marker_lines(result.text)) == expected_markers
    clean = [line for k, line in enumerate(out) if not in_conflict[k]]

    if not edits:
        assert result.text == "".join(theirs) and not result.conflicts

    # Every inserted or modified line: exactly once, outside conflicts or on the yours side.
    positions = []
    for line in tokened:
        where = [k for k, o in enumerate(out) if o == line]
        assert len(where) == 1, (line, where)
        assert not in_conflict[where[0]] or where[0] in yours_side, line
        if not in_conflict[where[0]]:
            positions.append(where[0])
    assert positions == sorted(positions)  # user order kept

    # Every deleted line that is unique in base stays deleted outside conflicts.
    base_counts, theirs_counts, clean_counts = Counter(base), Counter(theirs), Counter(clean)
    for line in deleted:
        if base_counts[line] == 1:
            assert clean_counts[line] <= max(0, theirs_counts[line] - 1), line

    # The new render's own new lines are not lost either.
    out_counts = Counter(out)
    for line in theirs_counts:
        if base_counts[line] == 0:
            assert out_counts[line] >= 1, line


# The last commit whose examples/ were rendered by the templates before the shared partials
# (the skeletons were pasted copies then): a user's edited script of that time must regenerate
# onto today's templates with the edit kept.
BEFORE_SHARED_PARTIALS = "cc53fd5"
# The last commit before the runtime took over the scripts' loaders, final save, start-up summary,
# DPO reference cache and GRPO rollout plumbing (the scripts lost 100-220 lines each).
BEFORE_RUNTIME_HELPERS = "f503683"
# A Config default a user changes. (Not `seed`: its line is next to `sample_prompt`, whose default
# changed since; nor `keep_last_checkpoints`, next to `save_every_steps`, whose default became 50
# in multi-GPU scripts: a 3-way merge rightly calls two changes with no unchanged line between
# them a conflict; `scaffold regen --abort` / `--continue` handle that one.)
EDIT = (
    "    log_every_steps: int = 1\n",
    "    log_every_steps: int = 10  # user edit: log less often\n",
)


def _git_show(rev: str, path: str) -> str:
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        ["git", "-C", str(repo), "show", f"{rev}:{path}"], capture_output=True, text=True
    )
    assert proc.returncode == 0, f"this test needs the repository's history: {proc.stderr}"
    return proc.stdout


def _examples_at(rev: str) -> list[str]:
    """The example directories that existed at `rev` (later ones have no old render to move)."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "--name-only", f"{rev}:examples"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, f"this test needs the repository's history: {proc.stderr}"
    return sorted(proc.stdout.split())


@pytest.mark.parametrize(
    ("example", "rev"),
    [
        (e, rev)
        for rev in (BEFORE_SHARED_PARTIALS, BEFORE_RUNTIME_HELPERS)
        for e in _examples_at(rev)
    ],
)
def test_an_edited_script_of_the_old_templates_regenerates_with_its_edit(example, rev, tmp_path):
    """The checked-in example as rendered by older templates (before the shared partials; before
    the runtime helpers), with a user edit, moves onto the current templates: no conflict, the
    edit kept, and otherwise today's render."""
    out = tmp_path / example
    (out / ".scaffold").mkdir(parents=True)
    launch = ("launch/torchrun.sh", "launch/torchrun_multinode.sh", "launch/slurm.sbatch")
    for name in ("spec.json", "train.py.base", *launch):
        path = out / ".scaffold" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_git_show(rev, f"examples/{example}/.scaffold/{name}"))
    for name in launch:
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(_git_show(rev, f"examples/{example}/{name}"))
    old = _git_show(rev, f"examples/{example}/train.py")
    assert old.count(EDIT[0]) == 1
    (out / "train.py").write_text(old.replace(*EDIT))
    result = CliRunner().invoke(cli, ["regen", str(out), "--to-version", "current"])
    assert result.exit_code == 0, result.output
    merged = (out / "train.py").read_text()
    assert "<<<<<<<" not in merged and EDIT[1] in merged
    assert merged == _ORIGINAL_RENDER(_spec_of(out)).replace(*EDIT)


@pytest.mark.fast
def test_regen_names_the_config_defaults_it_changed(tmp_path):
    """`--set gpus=2` turns on the multi-GPU defaults (periodic checkpoints): a clean merge names
    each Config default it changed that the user had not edited, and not the user's own edits."""
    out = _new(tmp_path)
    script = out / "train.py"
    _edit(script, "log_every_steps: int = 1", "log_every_steps: int = 5")
    result = CliRunner().invoke(cli, ["regen", str(out), "--set", "gpus=2"])
    assert result.exit_code == 0, result.output
    line = next(s for s in result.output.splitlines() if s.startswith("Config defaults"))
    assert "save_every_steps: 0 -> 50" in line and f"scaffold plan {out}" in line
    assert "log_every_steps" not in line
    assert "save_every_steps: int = 50" in script.read_text()
    # back to one GPU: the default goes back, and is named again
    back = CliRunner().invoke(cli, ["regen", str(out), "--set", "gpus=1"])
    assert "save_every_steps: 50 -> 0" in back.output, back.output
    # a template-only regen with no default changed prints no such line
    again = CliRunner().invoke(cli, ["regen", str(out), "--set", "dataset=mine.jsonl"])
    assert again.exit_code == 0 and "Config defaults" not in again.output, again.output
