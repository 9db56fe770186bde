"""runtime.config.parse: overrides by field name, types, files, and errors that name the key."""

import json
from dataclasses import dataclass, field

import pytest

from runtime.config import ConfigError, help_text, parse

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


@dataclass
class Cfg:
    lr: float = 1e-5
    max_steps: int = 10
    compile: bool = False
    name: str = "x"
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj"])
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    limit: int | None = None


def test_defaults_and_overrides():
    cfg = parse(Cfg, ["--lr", "2e-5", "--max-steps=50", "--compile", "--name", "run 1"])
    assert (cfg.lr, cfg.max_steps, cfg.compile, cfg.name) == (2e-5, 50, True, "run 1")
    assert parse(Cfg, []) == Cfg()


def test_types():
    cfg = parse(
        Cfg,
        [
            "--lr=1",
            "--compile=false",
            "--lora_target_modules=q_proj,v_proj",
            "--betas",
            "0.9,0.95",
            "--limit",
            "none",
        ],
    )
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.compile is False
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    assert cfg.betas == [0.9, 0.95]
    assert cfg.limit is None
    assert parse(Cfg, ["--limit", "3", "--max_steps", "1e3"]).limit == 3
    assert parse(Cfg, ["--max_steps", "1e3"]).max_steps == 1000


def test_unknown_key_suggests_closest():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'max_step'; did you mean --max_steps\?"
    ):
        parse(Cfg, ["--max_step", "3"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "ten"], r"--max_steps: expected int, got 'ten'"),
        (["--compile=maybe"], r"--compile: expected bool"),
        (["--lr"], r"--lr needs a value"),
        (
            ["--lr", "--max_steps", "3"],
            r"--lr needs a value \(field type float\), got the next flag --max_steps",
        ),
        (["--max_steps", "1.5"], r"expected int"),
    ],
)
def test_bad_values_name_the_key(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(Cfg, argv)


def test_overrides_file_then_flags(tmp_path):
    path = tmp_path / "o.json"
    path.write_text(json.dumps({"lr": 3e-4, "max_steps": 7}))
    cfg = parse(Cfg, [str(path), "--max_steps", "9"])
    assert (cfg.lr, cfg.max_steps) == (3e-4, 9)
    path.write_text(json.dumps({"nope": 1}))
    with pytest.raises(ConfigError, match="unknown config key 'nope'"):
        parse(Cfg, [str(path)])
    with pytest.raises(ConfigError, match="not found"):
        parse(Cfg, [str(tmp_path / "missing.json")])


def test_help_lists_every_key_with_type_default_and_comment(tmp_path, capsys, monkeypatch):
    """`python train.py --help` prints the script's own Config: section comments, each key with
    its type and default and the comment written after it; it exits 0 and trains nothing."""
    import importlib.util
    import sys

    script = tmp_path / "script_with_config.py"
    script.write_text(
        "from dataclasses import dataclass, field\n\n\n@dataclass\nclass Config:\n"
        "    # optimization\n"
        "    lr: float = 2e-5  # peak learning rate\n"
        "    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])\n"
        "    limit: int | None = None  # stop after this many rows\n"
    )
    spec = importlib.util.spec_from_file_location("script_with_config", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "script_with_config", module)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        parse(module.Config, ["--lr", "1", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python train.py" in out and "# optimization" in out
    assert "--lr float (default: 2e-05)  peak learning rate" in out
    assert "--betas list[float] (default: [0.9, 0.95])" in out
    assert "--limit int | None (default: None)  stop after this many rows" in out
    monkeypatch.setenv("RANK", "1")  # under torchrun only rank 0 prints
    with pytest.raises(SystemExit):
        parse(module.Config, ["-h"])
    assert capsys.readouterr().out == ""


@dataclass
class _WrappedConfig:
    # timeouts
    weight_sync_timeout_s: float = (
        300.0  # an engine that has not loaded new weights by then is an error
    )
    reward_weights: list[float] = field(default_factory=lambda: [1.0, 0.2])  # per reward function
    plain: int = 3  # a plain one


def test_help_keeps_comments_of_fields_the_formatter_wrapped():
    text = help_text(_WrappedConfig)
    assert "--weight_sync_timeout_s float (default: 300.0)  an engine that has not loaded" in text
    assert "--reward_weights list[float] (default: [1.0, 0.2])  per reward function" in text
    assert "--plain int (default: 3)  a plain one" in text
    assert "# timeouts" in text
