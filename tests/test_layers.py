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
