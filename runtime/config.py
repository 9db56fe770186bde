"""Command-line overrides for a recipe's `Config` dataclass.

`python train.py --lr 2e-5 --max_steps 50 --lora_target_modules q_proj,v_proj --compile=false`
or `python train.py overrides.yaml --lr 1e-4` (a JSON/YAML file of field: value, then flags);
`python train.py --help` lists every key with its type, default and comment.

`entry_point(main)` is what a script runs under `if __name__ == "__main__":`: a bad input ends in
one `error: ...` line instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import re
import shlex
import signal
import sys
import time
import types
import typing
from pathlib import Path

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


class ConfigError(ValueError):
    """A bad override: unknown key, wrong type, unreadable overrides file."""


# What a user can fix: a bad config, data, path, checkpoint or disk, a non-finite loss, a Ray
# timeout (TimeoutError is an OSError). Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, FloatingPointError)
# A rank > 0 that fails on the same ConfigError as rank 0 exits this much later than rank 0: on
# the first rank's failure torchrun stops the others, which could cut rank 0 off before its
# message is out.
_SILENT_RANK_DELAY_S = 5.0


def launch_command(argv: list[str] | None = None) -> str:
    """The command line that started this process, as a user would retype it: `python train.py
    --max_steps 3`, or `torchrun --nproc-per-node 8 train.py ...` under torchrun (its
    LOCAL_WORLD_SIZE and, for several nodes, NNODES from its environment).

    Args:
        argv: the script's arguments when `main(argv)` was called with them; None = sys.argv[1:].
    """
    args = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    if "LOCAL_WORLD_SIZE" in os.environ:  # set by torchrun (and torch.distributed.run)
        launcher = ["torchrun", "--nproc-per-node", os.environ["LOCAL_WORLD_SIZE"]]
        nodes = int(os.environ.get("WORLD_SIZE", 1)) // max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
        if nodes > 1:
            launcher += ["--nnodes", str(nodes)]
    else:
        launcher = ["python"]
    return shlex.join(launcher + args)


def resume_command(argv: list[str] | None = None) -> str:
    """`launch_command` without --overwrite and --resume: what continues this run from its newest
    complete checkpoint (`--resume auto`, the default); rerunning with --overwrite would start it
    anew and delete its checkpoints."""
    args = sys.argv[1:] if argv is None else list(argv)
    kept, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        key = arg.split("=", 1)[0]
        if key in ("--overwrite", "--resume"):
            # `--flag value` takes the next argument unless it is another flag (a bare boolean)
            nxt = args[i + 1] if i + 1 < len(args) else "--"
            skip = "=" not in arg and not nxt.startswith("--")
            continue
        kept.append(arg)
    return launch_command(kept)


def _raise_interrupt(signum, frame) -> None:
    """The SIGINT / SIGTERM handler `entry_point` installs: record it, raise RunInterrupted."""
    from runtime.train_state import PROGRESS, RunInterrupted

    PROGRESS.interrupted = signum
    raise RunInterrupted(signum)


def entry_point(main, *args, **kwargs):
    """Run `main(*args, **kwargs)` as a script's entry point and return what it returns.

    A `USER_ERRORS` exception ends the process with exit status 1 and one stderr line,
    `error: <message>` (whitespace, newlines included, collapsed to single spaces), so the user
    reads what to fix rather than a traceback. SIGINT (Ctrl-C) and SIGTERM end it with one stderr
    line from rank 0, `interrupt_report`'s (what was interrupted, the last complete checkpoint,
    the command that resumes), and exit status 128 + the signal's number (130, 143). Under torchrun a `ConfigError` is raised the same
    on every rank: rank 0 prints it, a rank > 0 (env RANK) waits 5 s and exits 1 silently.

    Args:
        main: the script's `main`; args and kwargs are passed to it.

    Returns:
        main's result.

    Raises:
        SystemExit: status 1 on a USER_ERRORS exception (the `error:` string as its code, or 1 on
            a silent rank > 0); 130 / 143 on SIGINT / SIGTERM.
        BaseException: main's own exception, with its traceback, when it is not a USER_ERRORS
            one, or when env SCAFFOLD_DEBUG is set (any non-empty value, as for the CLI).
    """
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_interrupt)
    try:
        return main(*args, **kwargs)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (RunInterrupted): one line, not a traceback
        if os.environ.get("SCAFFOLD_DEBUG"):
            raise
        from runtime.train_state import interrupt_report

        signum = getattr(e, "signum", signal.SIGINT)
        if int(os.environ.get("RANK", "0")) == 0:
            print(interrupt_report(signal.Signals(signum).name, resume_command()), file=sys.stderr)
        raise SystemExit(128 + signum) from None
    except USER_ERRORS as e:
        if os.environ.get("SCAFFOLD_DEBUG"):
            raise
        if isinstance(e, ConfigError) and int(os.environ.get("RANK", "0")) > 0:
            time.sleep(_SILENT_RANK_DELAY_S)
            raise SystemExit(1) from None
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None


def parse(config_cls: type, argv: list[str] | None = None):
    """Build `config_cls` from its defaults, an optional JSON/YAML file, then `--key value` flags.

    Args:
        config_cls: a dataclass whose fields all have defaults.
        argv: arguments without the program name (default `sys.argv[1:]`).

    Returns:
        An instance of `config_cls`.

    Raises:
        ConfigError: an unknown key (with the closest valid name), a value that does not convert
            to the field's type, a flag without a value, or an unreadable overrides file.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    if "--help" in argv or "-h" in argv:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: once, not once per rank
            print(help_text(config_cls))
        raise SystemExit(0)
    values: dict[str, object] = {}
    if argv and not argv[0].startswith("--"):
        path = argv.pop(0)
        for key, raw in _read_overrides_file(path).items():
            try:
                key = _check_key(str(key), fields)
                values[key] = _coerce(key, raw, hints[key])
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}") from None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --key value or --key=value"
            )
        key, eq, raw = arg[2:].partition("=")
        key = _check_key(key.replace("-", "_"), fields)
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if hints[key] is bool and (nxt is None or nxt.startswith("--")):
                raw = "true"  # a bare --flag means true
            elif nxt is None or re.match(r"--[A-Za-z]", nxt):
                after = f", got the next flag {nxt}" if nxt else ""
                raise ConfigError(
                    f"--{key} needs a value (field type {_type_name(hints[key])}){after}"
                )
            else:
                raw, i = nxt, i + 1
        values[key] = _coerce(key, raw, hints[key])
        i += 1
    return config_cls(**values)


def help_text(config_cls: type) -> str:
    """`--help`: usage, then one line per field: `--name TYPE (default: X)  comment`.

    The comments are those written after each field in the script's `Config` (read from its
    source, so an edited comment shows up); the section comments between fields are kept.
    """
    hints = typing.get_type_hints(config_cls)
    try:
        source = inspect.getsource(config_cls)
    except (OSError, TypeError):
        source = ""
    comments, lines, current, indent = {}, [], None, None
    for line in source.splitlines():
        field_line = re.match(r"(\s+)(\w+)\s*:[^#]*?(?:#\s*(.*))?$", line)
        if field_line and field_line.group(2) in hints:
            indent, current = field_line.group(1), field_line.group(2)
            comments[current] = field_line.group(3) or ""
            lines.append(current)
        elif re.match(r"\s+#", line) and indent in (None, re.match(r"\s*", line).group()):
            lines.append(line.strip())  # a section comment ("# data")
        elif current and not comments[current] and "#" in line:
            # a field the formatter wrapped: its comment sits on a continuation line
            comments[current] = line.split("#", 1)[1].strip()
    out = [
        "usage: python train.py [OVERRIDES.json|yaml] [--key value ...]   (or torchrun ... "
        "train.py ...)",
        "Every key of the script's Config; a bare --flag sets a bool to true.",
    ]
    default = lambda f: (  # noqa: E731
        f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    )
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for item in [x for x in lines if x in fields or x.startswith("#")] or list(fields):
        if item.startswith("#"):
            out.append(f"\n{item}")
            continue
        f = fields[item]
        text = f"  --{f.name} {_type_name(hints[f.name])} (default: {default(f)!r})"
        out.append(f"{text}  {comments.get(f.name, '')}".rstrip())
    return "\n".join(out)


# Names other trainers (HF Trainer/TRL, torchtune, nanoGPT) use for our fields; suggested when the
# field exists in the config, since difflib cannot see that learning_rate means lr.
_SYNONYMS = {
    "learning_rate": "lr",
    "batch_size": "micro_batch_size",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation": "gradient_accumulation_steps",
    "grad_accum_steps": "gradient_accumulation_steps",
    "max_length": "max_seq_len",
    "max_seq_length": "max_seq_len",
    "seq_len": "max_seq_len",
    "block_size": "max_seq_len",
    "grad_clip": "max_grad_norm",
    "clip_grad_norm": "max_grad_norm",
    "warmup": "warmup_steps",
    "num_warmup_steps": "warmup_steps",
    "num_steps": "max_steps",
    "total_steps": "max_steps",
    "max_iters": "max_steps",
    "output_dir": "out_dir",
    "model_name_or_path": "model",
    "model_path": "model",
    "dataset_path": "dataset",
    "data_path": "dataset",
    "precision": "dtype",
}


def _check_key(key: str, fields: dict) -> str:
    if key in fields:
        return key
    synonym = _SYNONYMS.get(key)
    close = [synonym] if synonym in fields else difflib.get_close_matches(key, list(fields), n=1)
    hint = f"; did you mean --{close[0]}?" if close else f"; valid keys: {', '.join(fields)}"
    raise ConfigError(f"unknown config key {key!r}{hint}")


def _read_overrides_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"overrides file {path!r} not found (expected a .json/.yaml file or --key value flags)"
        )
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:
        reason = " ".join(str(e).split())  # YAML errors span several lines
        raise ConfigError(f"{path}: cannot parse overrides ({type(e).__name__}: {reason})") from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of config keys to values, got {type(data).__name__}"
        )
    return data


def _type_name(tp) -> str:
    if typing.get_origin(tp) is not None:  # list[float], int | None
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, raw, tp):
    """Convert `raw` (a string from the command line, or a JSON/YAML value) to type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        return _coerce(key, raw, args[0])
    if origin in (list, tuple):
        (elem,) = typing.get_args(tp)[:1] or (str,)
        items = (
            raw if isinstance(raw, list | tuple) else [s for s in str(raw).split(",") if s.strip()]
        )
        out = [
            _coerce(key, item.strip() if isinstance(item, str) else item, elem) for item in items
        ]
        return tuple(out) if origin is tuple else out
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            low = str(raw).strip().lower()
            if low in _TRUE | _FALSE:
                return low in _TRUE
            raise ValueError(raw)
        if tp is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(raw)
            return int(float(raw)) if isinstance(raw, str) and "e" in raw.lower() else int(raw)
        if tp is float:
            return float(raw)  # int -> float is fine: --lr=1 means 1.0
        if tp is str:
            return str(raw)
    except (TypeError, ValueError):
        pass
    else:
        raise ConfigError(f"--{key}: unsupported field type {_type_name(tp)}")
    raise ConfigError(f"--{key}: expected {_type_name(tp)}, got {raw!r}")
