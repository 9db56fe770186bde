"""runtime/ and generator/ import in layers (scripts/layers.py LAYERS): no import cycle, no
import of a layer above, no private name taken from another module, no citation of a document
outside the repository. The sources are parsed, not imported, so this runs in well under a second.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "layers.py"
_spec = importlib.util.spec_from_file_location("scaffold_layers", _PATH)
layers = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = layers  # dataclasses look their module up there
_spec.loader.exec_module(layers)


@pytest.fixture(scope="module")
def graph():
    mods = layers.modules()
    return mods, layers.imports(mods)


def test_no_import_cycle(graph):
    _, edges = graph
    assert layers.cycles(edges) == []


def test_every_import_follows_the_layer_order(graph):
    mods, edges = graph
    assert layers.violations(mods, edges) == []


def test_the_model_layer_imports_no_distributed_or_file_code(graph):
    mods, _ = graph
    assert layers.forbidden_imports(mods) == []


def test_no_private_name_crosses_modules(graph):
    _, edges = graph
    assert [
        f"{e.importer} imports {e.target}.{e.name}" for e in layers.private_imports(edges)
    ] == []


def test_no_citation_outside_the_repository():
    assert layers.outside_citations() == []


def test_citations_are_read_from_the_repository_files_only(tmp_path):
    """A checkout's citation check reads what git tracks and the untracked files it does not
    ignore: a citation in a peer venv that `benchmarks/sft_cpu.py` installs under the ignored
    benchmarks/.venvs is not the repository's; the same line in a new benchmark file is."""
    import subprocess

    cite = "# see " + "STYLE" + ".md\n"  # split, so this file does not cite it itself
    (tmp_path / ".gitignore").write_text("benchmarks/.venvs/\n")
    stray = tmp_path / "benchmarks/.venvs/torchtune/lib/site-packages/pkg/_sandbox.py"
    stray.parent.mkdir(parents=True)
    stray.write_text(cite)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert layers.outside_citations(tmp_path) == []
    (tmp_path / "benchmarks/new_bench.py").write_text(cite)
    assert layers.outside_citations(tmp_path) == [f"benchmarks/new_bench.py:1: {cite.strip()}"]
    # outside a checkout every file under the folders is read
    (tmp_path / ".git").rename(tmp_path / "not_git")
    assert len(layers.outside_citations(tmp_path)) == 2


def test_the_checks_catch_what_they_guard_against(tmp_path):
    """A cycle, an upward import and a private import in a throwaway tree are all reported."""
    for name, body in {
        "runtime/__init__.py": "",
        "runtime/models/__init__.py": "",
        "runtime/models/llama.py": "from runtime.checkpoint import _copy_into\n",
        "runtime/checkpoint.py": "def f():\n    import runtime.models.llama\n",
        "generator/__init__.py": "",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    mods = layers.modules(tmp_path)
    edges = layers.imports(mods)
    assert layers.cycles(edges) == [["runtime.checkpoint", "runtime.models.llama"]]
    assert [e.name for e in layers.private_imports(edges)] == ["_copy_into"]
    upward = [v for v in layers.violations(mods, edges, tmp_path) if "a layer above" in v]
    assert len(upward) == 1 and "runtime.models.llama (runtime.models) imports" in upward[0]
    (tmp_path / "runtime/models/moe.py").write_text("import torch.distributed as dist\n")
    found = layers.forbidden_imports(layers.modules(tmp_path), tmp_path)
    assert found == [
        "runtime/models/moe.py:1: runtime.models.moe (runtime.models) imports torch.distributed"
    ]
