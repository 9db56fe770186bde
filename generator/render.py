"""Render a spec to the text of train.py: Jinja2 -> ruff (drop unused imports, sort, format) -> compile.

Deterministic: the same spec gives the same bytes (no timestamps, sorted inputs, pinned ruff).
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import jinja2

from generator.spec import ScaffoldError, Spec, SpecError, build_answers

SKELETONS = "recipes/{}.py.jinja"  # per algorithm (generator.features); features fill its slots
# Launch files written next to train.py (path relative to the output directory -> template).
LAUNCH_FILES = {
    "launch/torchrun.sh": "launch/torchrun.sh.jinja",
    "launch/torchrun_multinode.sh": "launch/torchrun_multinode.sh.jinja",
    "launch/slurm.sbatch": "launch/slurm.sbatch.jinja",
}
LINE_LENGTH = 100
_RESIDUE = ("{{", "{%", "{#")
FIRST_PARTY = ["--config", "lint.isort.known-first-party = ['runtime']"]


class RenderError(ScaffoldError, RuntimeError):
    """The templates produced something that is not valid, formatted Python (a template bug)."""


def templates_dir() -> Path:
    import templates

    return Path(templates.__file__).parent


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["pyrepr"] = pyrepr
    env.filters["rstrip"] = lambda text: str(
        text
    ).rstrip()  # a macro's text without its last newline
    return env


def pyrepr(value: str) -> str:
    """A Python string literal that evaluates to exactly `value`: `{{ x | pyrepr }}`.

    `repr` escapes quotes, backslashes, newlines and every non-printable character (U+2028, NUL,
    ...), and keeps astral characters whole (JSON, i.e. `tojson`, writes them as surrogate pairs,
    which Python reads as two characters). `{` becomes `\\x7b`, so no user value can look like
    Jinja residue: a `{` in `repr` output is always a literal character, never part of an escape.
    """
    if not isinstance(value, str):
        raise TypeError(f"pyrepr takes a str, got {type(value).__name__}: {value!r}")
    return repr(value).replace("{", "\\x7b")


def docstring_text(value: str) -> str:
    """`value` escaped for the inside of a non-raw triple-quoted docstring, so that it reads back
    as exactly `value` and can never end the docstring (a triple quote in a user path would
    otherwise end it and inject code; a backslash would start an escape or break the parse)."""
    out = []
    for ch in value:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch == "{":
            out.append("\\x7b")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])  # \n, \t, \x00, \u2028, ...
    return "".join(out)


# Answers printed inside the header docstring; they can hold user text (paths, dataset names).
# The named places in a skeleton that feature templates fill, each a macro of that name (e.g.
# helpers: module-level functions a feature adds, after the Model section).
# Additive slots collect every enabled feature's lines; override slots (loss, optimizer,
# backward_and_step, ...) replace the skeleton's default body, so at most one feature may fill
# each; `model_inputs` is single too: it defines the one `model_kwargs` dict, and a feature
# whose `model_inputs` renders to nothing for a spec does not fill it (context parallel's under
# packing, whose own passes the positions and the document ids).
SLOTS = (
    "title", "imports", "config_fields", "validate", "model_setup", "fsdp_kwargs", "after_shard",
    "load_weights", "helpers", "loss_setup", "model_inputs", "loss", "optimizer_cls", "optimizer",
    "datasets", "collate", "backward_and_step", "startup_print", "save", "docstring_notes",
)  # fmt: skip
OVERRIDE_SLOTS = (
    "title", "load_weights", "model_inputs", "loss", "optimizer_cls", "optimizer",
    "backward_and_step", "save",
)  # fmt: skip


def feature_slots(templates: list[str], answers: dict | None = None) -> dict[str, list[str]]:
    """For each slot, the feature templates (in order) that define a macro of that name; with the
    spec's `answers`, a `model_inputs` macro that renders to nothing for them does not count."""
    filled = {slot: [] for slot in SLOTS}
    for name in templates:
        module = environment().get_template(f"features/{name}.py.jinja").module
        for slot in SLOTS:
            if not hasattr(module, slot):
                continue
            if slot == "model_inputs" and answers is not None:
                if not str(module.model_inputs(answers)).strip():
                    continue
            filled[slot].append(name)
    for slot in OVERRIDE_SLOTS:
        if len(filled[slot]) > 1:
            raise SpecError(
                f"features {filled[slot]} both replace the {slot!r} section; choose one"
            )
    return filled


def template_answers(spec: Spec) -> dict:
    """`build_answers(spec)` plus what the feature templates themselves decide: `slots` (per slot,
    the features that fill it) and `forward_args` (the model call's arguments).

    Raises:
        SpecError: invalid spec, or two features that replace the same section.
    """
    answers = build_answers(spec)
    slots = feature_slots(answers["features"], answers)
    # A `model_inputs` slot defines `model_kwargs` (extra model arguments: positions, masks).
    forward_args = 'batch["input_ids"]' + (", **model_kwargs" if slots["model_inputs"] else "")
    return {**answers, "slots": slots, "forward_args": forward_args}


_DOCSTRING_ANSWERS = ("command", "model_name", "family")


def render_raw(spec: Spec) -> str:
    """Jinja output before any post-processing (for debugging templates)."""
    answers = template_answers(spec)
    answers.update({k: docstring_text(answers[k]) for k in _DOCSTRING_ANSWERS})
    return environment().get_template(SKELETONS.format(answers["skeleton"])).render(a=answers)


def render(spec: Spec) -> str:
    """The final text of train.py for `spec`.

    Raises:
        SpecError: invalid spec (from `build_answers`).
        RenderError: template residue, a syntax error, or a ruff failure in the output.
    """
    text = render_raw(spec)
    text = ruff_format(text)
    for marker in _RESIDUE:
        if marker in text:
            line = next(i + 1 for i, s in enumerate(text.splitlines()) if marker in s)
            raise RenderError(f"template residue {marker!r} at line {line} of the rendered script")
    compile(text, "train.py", "exec")
    return text


def render_launch(spec: Spec) -> dict[str, str]:
    """The launch files for `spec` (one-node torchrun, multi-node torchrun, Slurm sbatch), keyed
    by their path relative to the output directory. Deterministic, like `render`.

    They print only validated numbers and names (gpus, nodes, algo), never user text, so no
    value can break out of a shell comment or string.

    Raises:
        SpecError: invalid spec (from `build_answers`).
        RenderError: template residue in a rendered file.
    """
    answers = template_answers(spec)
    env = environment()
    files = {}
    for path, template in LAUNCH_FILES.items():
        text = env.get_template(template).render(a=answers)
        for marker in _RESIDUE:
            if marker in text:
                raise RenderError(f"template residue {marker!r} in the rendered {path}")
        files[path] = text
    return files


def ruff_format(source: str) -> str:
    """Drop unused imports, merge and sort the rest, and format, with the pinned ruff isolated from
    any user configuration.

    Features add their imports to a shared block; only the names the rendered code uses survive
    (F401), and the `from runtime import ...` lines of several features become one (isort). The
    ruff binary is called directly, two short processes per render: `python -m ruff` would start
    an interpreter for each (this was the slowest part of a render before, with libcst's scope
    analysis: 1.3 s vs 0.06 s per script, benchmarks/RESULTS.md).
    """
    common = [
        "--isolated",
        "--line-length",
        str(LINE_LENGTH),
        "--target-version",
        "py310",
        "--stdin-filename",
        "train.py",
    ]
    steps = [
        # known-first-party: the import groups must not depend on the directory we render from
        [
            "check",
            "--select",
            "F401,I",
            "--fix",
            "--quiet",
            "--exit-zero",
            *FIRST_PARTY,
            *common,
            "-",
        ],
        ["format", *common, "-"],
    ]
    for step in steps:
        proc = subprocess.run([ruff_bin(), *step], input=source, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RenderError(
                f"ruff {step[0]} failed on the rendered script: {proc.stderr.strip()}"
            )
        source = proc.stdout
    return source


@functools.cache
def ruff_bin() -> str:
    """Path of the pinned ruff executable (the one the `ruff` package installed)."""
    from ruff.__main__ import find_ruff_bin

    return str(find_ruff_bin())
