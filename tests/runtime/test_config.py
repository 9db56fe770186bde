"""runtime.config.parse: overrides by field name, types, files, and errors that name the key;
runtime.config.entry_point: the scripts' one-line errors."""

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest

import runtime.config
from runtime.config import ConfigError, entry_point, help_text, parse

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


def _raise(error: BaseException):
    raise error


@pytest.fixture
def script_env(monkeypatch):
    """entry_point's environment: rank 0, no debug; time.sleep recorded instead of slept."""
    monkeypatch.delenv("SCAFFOLD_DEBUG", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    slept = []
    monkeypatch.setattr(runtime.config.time, "sleep", slept.append)
    return slept


def test_entry_point_returns_mains_result_and_passes_arguments(script_env):
    assert entry_point(lambda a, b=0: (a, b), 1, b=2) == (1, 2)
    assert script_env == []


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad\n  value\tthere "),
        ConfigError("invalid config: lr=0: must be > 0"),
        OSError(28, "No space left on device"),
        TimeoutError("rollout took\nlonger"),  # an OSError: GRPO's Ray timeouts
        FloatingPointError("step 3: loss nan"),
    ],
    ids=["value", "config", "oserror", "timeout", "non-finite"],
)
def test_entry_point_turns_user_errors_into_one_line(script_env, error):
    with pytest.raises(SystemExit) as exit_info:
        entry_point(_raise, error)
    assert exit_info.value.code == "error: " + " ".join(str(error).split())
    assert "\n" not in exit_info.value.code and "  " not in exit_info.value.code
    assert exit_info.value.__suppress_context__  # `from None`: no chained traceback either
    assert script_env == []


def test_entry_point_keeps_tracebacks_of_bugs_and_under_scaffold_debug(script_env, monkeypatch):
    with pytest.raises(KeyError):
        entry_point(_raise, KeyError("a bug"))
    monkeypatch.setenv("SCAFFOLD_DEBUG", "1")
    with pytest.raises(ValueError, match="bad value"):
        entry_point(_raise, ValueError("bad value"))
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError):  # debug wins on every rank
        entry_point(_raise, ConfigError("bad key"))
    assert script_env == []


def test_entry_point_config_error_on_a_later_rank_waits_then_exits_silently(
    script_env, monkeypatch
):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as exit_info:
        entry_point(_raise, ConfigError("invalid config: lr=0: must be > 0"))
    assert exit_info.value.code == 1 and script_env == [5.0]
    with pytest.raises(SystemExit) as exit_info:  # other errors are this rank's own: printed
        entry_point(_raise, OSError("disk full"))
    assert exit_info.value.code == "error: disk full" and script_env == [5.0]
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        entry_point(_raise, ConfigError("invalid config: x"))
    assert exit_info.value.code == "error: invalid config: x"


def test_entry_point_in_a_real_process_prints_one_line_and_exits_1():
    code = textwrap.dedent(
        """
        from runtime import entry_point

        def main():
            raise ValueError("dataset 'x.jsonl':\\n  row 3 has no 'messages'")

        if __name__ == "__main__":
            entry_point(main)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("SCAFFOLD_DEBUG", "RANK")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 1
    assert proc.stderr == "error: dataset 'x.jsonl': row 3 has no 'messages'\n"
    assert proc.stdout == ""
