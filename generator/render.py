"""Render a spec to the text of train.py: Jinja2 -> libcst (drop unused imports) -> ruff format -> compile.

Deterministic: the same spec gives the same bytes (no timestamps, sorted inputs, pinned ruff).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jinja2
import libcst as cst
from libcst.metadata import MetadataWrapper, ScopeProvider

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
# each; `model_inputs` is single too: it defines the one `model_kwargs` dict.
SLOTS = (
    "title", "imports", "config_fields", "validate", "model_setup", "fsdp_kwargs", "after_shard",
    "load_weights", "helpers", "loss_setup", "model_inputs", "loss", "optimizer_cls", "optimizer",
    "datasets", "collate", "backward_and_step", "startup_print", "save", "docstring_notes",
)  # fmt: skip
OVERRIDE_SLOTS = (
    "title", "load_weights", "model_inputs", "loss", "optimizer_cls", "optimizer",
    "backward_and_step", "save",
)  # fmt: skip


def feature_slots(templates: list[str]) -> dict[str, list[str]]:
    """For each slot, the feature templates (in order) that define a macro of that name."""
    filled = {slot: [] for slot in SLOTS}
    for name in templates:
        module = environment().get_template(f"features/{name}.py.jinja").module
        for slot in SLOTS:
            if hasattr(module, slot):
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
    slots = feature_slots(answers["features"])
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
    text = remove_unused_imports(text)
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


class _UnusedImportRemover(cst.CSTTransformer):
    def __init__(self, unused: set[cst.CSTNode]):
        self.unused = unused

    def _keep(self, names):
        return [a for a in names if a not in self.unused]

    def leave_Import(self, original, updated):
        kept = self._keep(original.names)
        if not kept:
            return cst.RemoveFromParent()
        return updated.with_changes(
            names=[a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in kept]
        )

    def leave_ImportFrom(self, original, updated):
        if isinstance(original.names, cst.ImportStar) or (
            isinstance(original.module, cst.Name) and original.module.value == "__future__"
        ):
            return updated
        kept = self._keep(original.names)
        if not kept:
            return cst.RemoveFromParent()
        names = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in kept]
        return updated.with_changes(names=names)


def remove_unused_imports(source: str) -> str:
    """Drop imported names that the module never references (libcst scope analysis).

    Features add imports to a shared block; only the ones the rendered code uses survive.
    """
    wrapper = MetadataWrapper(cst.parse_module(source))
    scopes = wrapper.resolve(ScopeProvider)
    unused: set[cst.CSTNode] = set()
    for scope in set(scopes.values()):
        if scope is None:
            continue
        for assignment in scope.assignments:
            node = getattr(assignment, "node", None)
            if isinstance(node, cst.Import | cst.ImportFrom) and not assignment.references:
                for alias in node.names if not isinstance(node.names, cst.ImportStar) else []:
                    bound = alias.asname.name.value if alias.asname else _top_name(alias.name)
                    if bound == assignment.name:
                        unused.add(alias)
    return wrapper.module.visit(_UnusedImportRemover(unused)).visit(_DuplicateImportMerger()).code


class _DuplicateImportMerger(cst.CSTTransformer):
    """Merge `from X import a` statements of the same module into the first one.

    Features add their own `from runtime import ...` lines; the script should show one.
    """

    def leave_Module(self, original, updated):
        names: dict[str, list[cst.ImportAlias]] = {}
        for stmt in updated.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for node in stmt.body:
                if isinstance(node, cst.ImportFrom) and self._mergeable(node):
                    names.setdefault(self._key(node), []).extend(node.names)
        seen: set[str] = set()
        body = []
        for stmt in updated.body:
            node = (
                stmt.body[0]
                if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
                else None
            )
            if isinstance(node, cst.ImportFrom) and self._mergeable(node):
                key = self._key(node)
                if key in seen:
                    continue
                seen.add(key)
                unique = {cst.Module([]).code_for_node(a): a for a in names[key]}
                merged = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in unique.values()]
                stmt = stmt.with_changes(
                    body=[node.with_changes(names=merged, lpar=None, rpar=None)]
                )
            body.append(stmt)
        return updated.with_changes(body=body)

    @staticmethod
    def _mergeable(node: cst.ImportFrom) -> bool:
        return (
            not node.relative
            and not isinstance(node.names, cst.ImportStar)
            and node.module is not None
        )

    @staticmethod
    def _key(node: cst.ImportFrom) -> str:
        return cst.Module([]).code_for_node(node.module)


def _top_name(node: cst.BaseExpression) -> str:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node.value


def ruff_format(source: str) -> str:
    """Sort imports and format with the pinned ruff, isolated from any user configuration."""
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
        ["check", "--select", "I", "--fix", "--quiet", "--exit-zero", *FIRST_PARTY, *common, "-"],
        ["format", *common, "-"],
    ]
    for step in steps:
        proc = subprocess.run(
            [sys.executable, "-m", "ruff", *step], input=source, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RenderError(
                f"ruff {step[0]} failed on the rendered script: {proc.stderr.strip()}"
            )
        source = proc.stdout
    return source
