"""The import layers of runtime/ and generator/, and the numbers docs/DESIGN.md quotes about them.

    .venv/bin/python scripts/layers.py      # prints the counts; exits 1 on a cycle or a violation

Every module of both packages sits in one layer of LAYERS; a module imports only modules of its
own layer or of layers listed before it (function-local imports count: a lazy import still ties
two modules together). tests/test_layers.py runs the same checks. Standard library only, and the
sources are parsed, not imported, so this runs without torch.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "generator")

# Bottom first. runtime: the model code knows no distributed or I/O code; each layer above adds
# one concern. generator sits above all of runtime (it reads configs and builds meta models).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("runtime.models", ("runtime.models", "runtime.models.args", "runtime.models.moe",
                        "runtime.models.llama")),
    ("runtime.parallel", ("runtime.parallel", "runtime.ring_attention",
                          "runtime.context_parallel", "runtime.expert_parallel")),
    ("runtime.io", ("runtime.dtensors", "runtime.checkpoint", "runtime.train_state",
                    "runtime.hub", "runtime.tokenizer", "runtime.config")),
    ("runtime.train", ("runtime.loss", "runtime.optim", "runtime.optim_in_backward",
                       "runtime.data", "runtime.packing", "runtime.metrics", "runtime.offload",
                       "runtime.config_checks", "runtime.preference",
                       "runtime.reward_model")),
    ("runtime.peft", ("runtime.lora",)),
    ("runtime.rl", ("runtime.generate", "runtime.grpo", "runtime.weight_transfer",
                    "runtime.rollout_vllm", "runtime.rollout", "runtime.rollout_setup",
                    "runtime.value_head")),
    # runtime/__init__.py (the names emitted scripts import) and quiet.py (filters it installs)
    ("runtime.api", ("runtime", "runtime.quiet")),
    ("generator.data", ("generator", "generator.catalog", "generator.features")),
    ("generator.spec", ("generator.spec.core", "generator.spec.validate",
                        "generator.spec.answers", "generator.spec")),
    ("generator.render", ("generator.render", "generator.rundir")),
    ("generator.plan", ("generator.plan_harness", "generator.plan_report",
                        "generator.plan_estimate", "generator.plan", "generator.recipe")),
    ("generator.regen", ("generator.regen",)),
    ("generator.commands", ("generator.assets", "generator.plot", "generator.options",
                            "generator.cli")),
)  # fmt: skip

# What a layer's modules may not import at all (prefixes of module names): the model code knows no
# collectives and no files, so it runs and tests in one process with no setup.
FORBIDDEN = {
    "runtime.models": ("torch.distributed", "safetensors", "os", "pathlib", "json", "shutil"),
}

# Modules outside the layer table (none: the tests' helpers moved to tests/helpers.py).
EXEMPT: frozenset[str] = frozenset()

# Design documents that live outside this repository; the code cites docs/DESIGN.md instead.
OUTSIDE_DOCS = re.compile(r"\b(?:STYLE|ARCHITECTURE|STACK|ASSETS)(?:\.md\b| ?§)|\bshared/")
CITING_DIRS = ("runtime", "generator", "templates", "scripts", "benchmarks", "tests")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module of PACKAGES
    name: str | None  # the imported name for `from target import name`, else None
    line: int


def modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: path} of every .py file under PACKAGES."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(mods: dict[str, Path]) -> list[Import]:
    """Every import (module level or inside a function) of one module of `mods` by another."""
    out = []
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [
                    Import(module, a.name, None, node.lineno)
                    for a in node.names
                    if a.name in mods and a.name != module
                ]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from .x import y
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:
                    submodule = f"{source}.{a.name}"
                    if submodule in mods:  # from package import submodule
                        out.append(Import(module, submodule, None, node.lineno))
                    elif source in mods and source != module:
                        out.append(Import(module, source, a.name, node.lineno))
    return out


def cycles(edges: list[Import]) -> list[list[str]]:
    """Every simple import cycle, each once (rotated to start at its smallest module)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.target)
    found = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.append(list(path))
            elif nxt > start and nxt not in path:  # start = the cycle's smallest module
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def layer_of() -> dict[str, int]:
    return {m: i for i, (_, members) in enumerate(LAYERS) for m in members}


def violations(mods: dict[str, Path], edges: list[Import], root: Path = ROOT) -> list[str]:
    """Imports against the layer order, and modules that no layer lists."""
    layers = layer_of()
    out = [
        f"{m}: in no layer of scripts/layers.py LAYERS"
        for m in mods
        if m not in layers and m not in EXEMPT
    ]
    out += [f"{m}: listed in LAYERS but not found" for m in layers if m not in mods]
    for e in edges:
        if e.importer in EXEMPT or e.importer not in layers:
            continue
        if e.target not in layers and e.target not in EXEMPT:
            continue  # reported above as in no layer
        message = None
        where = f"{mods[e.importer].relative_to(root)}:{e.line}: {e.importer}"
        if e.target in EXEMPT:
            message = f"{where} imports {e.target}, which is leaving the package"
        elif layers[e.target] > layers[e.importer]:
            message = (
                f"{where} ({LAYERS[layers[e.importer]][0]}) imports {e.target} "
                f"({LAYERS[layers[e.target]][0]}), a layer above"
            )
        if message and message not in out:  # `from m import a, b`: one line per statement
            out.append(message)
    return out


def forbidden_imports(mods: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Imports of FORBIDDEN modules (any module, not only runtime/generator ones) by a layer."""
    layers = layer_of()
    out = []
    for module, path in mods.items():
        layer = LAYERS[layers[module]][0] if module in layers else None
        banned = FORBIDDEN.get(layer, ())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if any(name == b or name.startswith(b + ".") for b in banned):
                    out.append(
                        f"{path.relative_to(root)}:{node.lineno}: {module} ({layer}) imports {name}"
                    )
    return out


def private_imports(edges: list[Import]) -> list[Import]:
    """`from a import _name` across modules, once per (importer, module, name); dunders such as
    __version__ are not private."""
    seen, out = set(), []
    for e in edges:
        key = (e.importer, e.target, e.name)
        if e.name and e.name.startswith("_") and not e.name.startswith("__") and key not in seen:
            seen.add(key)
            out.append(e)
    return out


def repository_files(root: Path, folder: str) -> list[Path]:
    """The repository's own files under `root/folder`: in a git checkout the ones git tracks and
    the untracked ones it does not ignore (what a commit could add), so whatever else lies in
    the tree (benchmarks/.venvs' installed packages, runs/) is not read; elsewhere every file."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", folder],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
        return sorted(p for p in (root / folder).rglob("*") if p.is_file())
    return sorted(root / name for name in listed.split("\0") if name)


def outside_citations(root: Path = ROOT) -> list[str]:
    """Lines in the repository's own code (`repository_files`) that cite a design document
    outside this repository."""
    out = []
    for d in CITING_DIRS:
        for path in repository_files(root, d):
            if path.suffix not in (".py", ".jinja", ".sh", ".md") or not path.is_file():
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if OUTSIDE_DOCS.search(line):
                    out.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return out


def largest(mods: dict[str, Path], package: str) -> tuple[int, str]:
    return max(
        (len(p.read_text().splitlines()), str(p.relative_to(ROOT)))
        for m, p in mods.items()
        if m.split(".")[0] == package
    )


def main() -> int:
    mods = modules()
    edges = imports(mods)
    found = {
        "import cycles": [" -> ".join([*c, c[0]]) for c in cycles(edges)],
        "imports against the layer order": violations(mods, edges),
        "imports a layer may not make": forbidden_imports(mods),
        "private names imported across modules": [
            f"{e.importer} imports {e.target}.{e.name}" for e in private_imports(edges)
        ],
        "citations of documents outside the repository": outside_citations(),
    }
    for what, items in found.items():
        print(f"{what}: {len(items)}")
        for item in items:
            print(f"    {item}")
    for package in PACKAGES:
        lines, path = largest(mods, package)
        print(f"largest module in {package}/: {path} ({lines} lines)")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
