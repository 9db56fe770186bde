"""Run bad-input cases in one process, reporting what the interpreter would have printed.

`python -m tests.bad_inputs.runner PLAN.json RESULTS.json` runs each entry of PLAN (a list of
{"id", "tool", "argv", "cwd", "patch"}) and writes {id: {"rc", "stdout", "stderr"}} to RESULTS.

One interpreter for all cases saves a torch import (seconds) per case. Each case is run the way
Python runs a program: the emitted script with `runpy.run_path(..., run_name="__main__")` (so its
own `if __name__ == "__main__":` error handling is what is tested), the CLI through
`generator.cli.main()`; then the exception that leaves it is turned into an exit status and
stderr text exactly as the interpreter does (SystemExit(str) -> the string and status 1,
SystemExit(int) -> that status, anything else -> a traceback and status 1). So a traceback that
would reach a user shows up here as "Traceback" in stderr. test_bad_inputs.py checks a few cases
against real separate processes too, and BAD_INPUTS_ISOLATED=1 runs every case that way.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import runpy
import sys
import traceback
from pathlib import Path


def _enospc_oserror(*args, **kwargs):
    path = args[1] if len(args) > 1 else kwargs.get("filename")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _enospc_safetensors(*args, **kwargs):
    from safetensors import SafetensorError

    # what safetensors 0.8 really raises on a full disk (measured on a 64 KiB tmpfs)
    raise SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )


def _patches(name: str) -> list[tuple[object, str, object]]:
    """(object, attribute, replacement) triples that simulate a failure; restored after the case."""
    import runtime.checkpoint

    if name == "save_file_enospc":
        return [(runtime.checkpoint, "save_file", _enospc_oserror)]
    if name == "save_file_safetensors_enospc":
        return [(runtime.checkpoint, "save_file", _enospc_safetensors)]
    if name == "replace_enospc":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if ".tmp-" in str(src):  # moving a finished checkpoint into place
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
            return real_replace(src, dst, *args, **kwargs)

        return [(runtime.checkpoint.os, "replace", replace)]
    if name == "dcp_save_enospc":  # the resumable train-state checkpoint (DCP shards)
        import runtime.train_state

        return [(runtime.train_state.dcp, "save", _enospc_oserror)]
    raise KeyError(f"unknown patch {name!r}")


def run_case(entry: dict) -> dict:
    """Run one case in this process; return its exit status and captured output."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    patches = _patches(entry["patch"]) if entry.get("patch") else []
    originals = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    rc = 0
    try:
        os.chdir(entry["cwd"])
        for obj, attr, new in patches:
            setattr(obj, attr, new)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if entry["tool"] == "scaffold":
                    from generator.cli import main

                    sys.argv = ["scaffold", *entry["argv"]]
                    main()
                else:
                    sys.argv = [entry["script"], *entry["argv"]]
                    runpy.run_path(entry["script"], run_name="__main__")
            except SystemExit as e:  # what the interpreter does with an uncaught SystemExit
                if e.code is None:
                    rc = 0
                elif isinstance(e.code, int):
                    rc = e.code
                else:
                    print(e.code, file=sys.stderr)
                    rc = 1
            except BaseException:  # what the interpreter prints for any other uncaught exception
                traceback.print_exc(file=sys.stderr)
                rc = 1
    finally:
        for obj, attr, old in originals:
            setattr(obj, attr, old)
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    plan_path, results_path = sys.argv[1:3]
    plan = json.loads(Path(plan_path).read_text())
    results = {entry["id"]: run_case(entry) for entry in plan}
    Path(results_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
