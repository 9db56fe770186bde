"""Model directory resolution: local path, scaffold cache, then the Hub (network may be off)."""

from __future__ import annotations

import pytest

huggingface_hub = pytest.importorskip("huggingface_hub")

from runtime.hub import HF_ALLOW_PATTERNS, base_model_id, resolve_model_dir  # noqa: E402

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


def test_local_directory_and_cache_come_before_the_hub(tmp_path, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("the Hub must not be asked when a local directory exists")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_model_dir(str(local), "Qwen/Qwen3-0.6B") == local
    monkeypatch.setenv("SCAFFOLD_HOME", str(tmp_path / "home"))
    cached = tmp_path / "home" / "models" / "qwen3-0.6b"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert resolve_model_dir("qwen3-0.6b", "Qwen/Qwen3-0.6B") == cached


def test_download_uses_allow_patterns(tmp_path, monkeypatch):
    calls = []

    def fake_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.setenv("SCAFFOLD_HOME", str(tmp_path / "home"))
    assert resolve_model_dir("qwen3-0.6b", "Qwen/Qwen3-0.6B") == tmp_path / "snapshot"
    assert calls == [("Qwen/Qwen3-0.6B", HF_ALLOW_PATTERNS)]
    assert "*.safetensors" in HF_ALLOW_PATTERNS and "config.json" in HF_ALLOW_PATTERNS
    assert not any(p.endswith((".bin", ".pt", ".pth")) for p in HF_ALLOW_PATTERNS)


def test_network_unavailable_error_names_local_directory_alternative(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("Failed to resolve 'huggingface.co' (network is unreachable)")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setenv("SCAFFOLD_HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_dir("qwen3-8b", "Qwen/Qwen3-8B")
    msg = str(err.value)
    assert "hub:Qwen/Qwen3-8B (OSError: Failed to resolve 'huggingface.co'" in msg
    assert str(tmp_path / "home" / "models" / "qwen3-8b") in msg  # where it looked
    assert "local Hugging Face directory" in msg  # the alternative


def test_explicit_path_is_never_replaced_by_the_default_model(tmp_path, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("an explicit --model path must not fall back to hf_repo_id")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    monkeypatch.setenv("SCAFFOLD_HOME", str(tmp_path / "home"))
    missing = tmp_path / "my-model"
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_dir(str(missing), "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert f"looked at {missing})" in str(err.value)


def test_error_names_the_scripts_options(tmp_path, monkeypatch):
    """KD's teacher is resolved like --model: the error names --teacher and --teacher_hf_repo_id."""
    monkeypatch.setenv("SCAFFOLD_HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_dir("my-teacher", "", ("--teacher", "--teacher_hf_repo_id"))
    msg = str(err.value)
    assert msg.startswith("--teacher 'my-teacher': no config.json found")
    assert "with --teacher, or its Hub id with --teacher_hf_repo_id" in msg and "--model" not in msg


def test_missing_dataset_file_names_each_place_once(tmp_path, monkeypatch):
    from runtime.hub import resolve_data_path

    monkeypatch.setenv("SCAFFOLD_HOME", str(tmp_path / "home"))
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=rf"\(looked at {missing}\); fix the path"):
        resolve_data_path(str(missing))  # an absolute path is not looked for in the cache
    with pytest.raises(FileNotFoundError) as err:
        resolve_data_path("nope.json")
    assert f"and {tmp_path / 'home' / 'data' / 'nope.json'})" in str(err.value)


def test_base_model_id_is_the_local_directory_given_else_the_hub_id(tmp_path, monkeypatch):
    """A relative local directory is named absolute (it must load from elsewhere on this machine);
    a name that is not a local directory is named by its Hub id, else by where it was found."""
    local = tmp_path / "base"
    local.mkdir()
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert base_model_id("base", local, "org/base") == str(local)
    assert base_model_id("./base", local, "") == str(local)
    cached = tmp_path / "home" / "models" / "qwen3-0.6b"
    assert base_model_id("qwen3-0.6b", cached, "Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert base_model_id("qwen3-0.6b", cached, "") == str(cached)
