"""runtime.rollout_vllm without vllm installed (the main venv): importable, and a clear error.

The engine itself is tested in tests/vllm (its own venv: `make test-vllm`).
"""

from __future__ import annotations

import importlib.util

import pytest

from runtime.rollout_vllm import VLLMEngine

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_engine_without_vllm_names_the_install_command(tmp_path):
    with pytest.raises(ImportError, match=r"scripts/vllm_venv\.sh"):
        VLLMEngine(str(tmp_path))
