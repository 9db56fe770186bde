"""The bad-input corpus (cases.py): every wrong input gives one error line, naming what to fix.

Each case must exit non-zero with no traceback; the last stderr line is the error (`Error: ...`
from scaffold, `error: ...` from train.py), it is the only error line, and it matches the case's
regexes (file, row, key or option, and what was expected).

All selected cases run in one subprocess (runner.py: one torch import instead of one per case);
`test_runner_matches_a_real_process` checks that runner against real `python train.py` /
`scaffold` processes, and BAD_INPUTS_ISOLATED=1 runs every case as its own real process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_inputs.cases import CASES, GOOD_ROWS, SCRIPT_ARGS, Case, jsonl

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
BY_ID = {c.id: c for c in CASES}
# compared with real processes in every run (so they are always in the batch)
REAL_PROCESS_CASES = ("new-unknown-model", "jsonl-malformed-line")
ISOLATED = os.environ.get("BAD_INPUTS_ISOLATED") == "1"


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


def _env(home: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "SCAFFOLD_HOME": str(home),  # empty: "where it looked" is predictable, nothing leaks in
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def _skip_reason(case: Case) -> str | None:
    if case.when == "no_cuda":
        import torch

        return "a CUDA device is present" if torch.cuda.is_available() else None
    if case.when == "no_vllm":
        import importlib.util

        return "vllm is installed here" if importlib.util.find_spec("vllm") else None
    if case.when in ("root", "not_root"):
        is_root = hasattr(os, "geteuid") and os.geteuid() == 0
        if is_root != (case.when == "root"):
            return f"runs only {'as' if case.when == 'root' else 'without'} root"
    return None


def _prepare(case: Case, root: Path, tiny_model_dir: Path, data: Path) -> dict:
    """Write the case's files and model variant; return its runner entry and placeholder values."""
    tmp = root / case.id
    tmp.mkdir()
    model = tiny_model_dir
    if case.model is not None:
        build = case.model.build if hasattr(case.model, "build") else case.model
        model = build(tiny_model_dir, root / f"{case.id}.model")
    values = {"tmp": str(tmp), "model": str(model), "data": str(data)}
    for name, content in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content = content()
        if isinstance(content, str):
            path.write_text(_fill(content, values), encoding="utf-8")
        else:
            path.write_bytes(content)
    for name in case.read_only:
        (tmp / name).mkdir(mode=0o555)
    script_args = SCRIPT_ARGS if case.script_args is None else case.script_args
    argv = list(case.argv) if case.tool == "scaffold" else [*case.pre, *script_args, *case.argv]
    entry = {
        "id": case.id,
        "tool": case.tool,
        "script": str(EXAMPLES / case.recipe / "train.py"),
        "argv": [_fill(a, values) for a in argv],
        "cwd": str(tmp),
        "patch": case.patch,
    }
    return {"entry": entry, "values": values, "dir": tmp}


def _run_isolated(entry: dict, env: dict, root: Path) -> dict:
    """The case as its own process: the real command line, or the runner for a simulated failure."""
    if entry["patch"]:
        plan, results = root / f"{entry['id']}.plan.json", root / f"{entry['id']}.results.json"
        plan.write_text(json.dumps([entry]))
        cmd = [sys.executable, "-m", "tests.bad_inputs.runner", str(plan), str(results)]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=300)
        return json.loads(results.read_text())[entry["id"]]
    if entry["tool"] == "scaffold":
        cmd = [sys.executable, "-m", "generator.cli", *entry["argv"]]
    else:
        cmd = [sys.executable, entry["script"], *entry["argv"]]
    proc = subprocess.run(
        cmd, cwd=entry["cwd"], env=env, capture_output=True, text=True, timeout=300
    )
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.fixture(scope="session")
def corpus(request, tmp_path_factory, tiny_model_dir):
    """Prepare and run every selected case once; {case id: (prepared, result)}."""
    selected = {
        item.callspec.params["case"].id
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_bad_input" and hasattr(item, "callspec")
    }
    selected |= set(REAL_PROCESS_CASES)
    root = tmp_path_factory.mktemp("bad_inputs")
    home = root / "scaffold_home"
    home.mkdir()
    data = root / "good.jsonl"
    data.write_text(jsonl(GOOD_ROWS))
    env = _env(home)
    prepared = {
        c.id: _prepare(c, root, tiny_model_dir, data)
        for c in CASES
        if c.id in selected and not _skip_reason(c)
    }
    entries = [p["entry"] for p in prepared.values()]
    if ISOLATED:
        results = {e["id"]: _run_isolated(e, env, root) for e in entries}
    else:
        plan, out = root / "plan.json", root / "results.json"
        plan.write_text(json.dumps(entries))
        cmd = [sys.executable, "-m", "tests.bad_inputs.runner", str(plan), str(out)]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=600)
        results = json.loads(out.read_text())
    yield {"env": env, "root": root, **{i: (prepared[i], results[i]) for i in prepared}}
    for p in prepared.values():  # let pytest clean up the read-only directories
        for name in BY_ID[p["entry"]["id"]].read_only:
            (p["dir"] / name).chmod(0o755)


def error_line(result: dict) -> str:
    """The single error line of a failed run (asserting there is exactly one, and no traceback)."""
    stderr = result["stderr"]
    context = f"\n--- stderr ---\n{stderr[-4000:]}\n--- stdout ---\n{result['stdout'][-2000:]}"
    assert result["rc"] != 0, f"exit status 0{context}"
    assert "Traceback" not in stderr, f"a traceback reached the user{context}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, f"nothing on stderr{context}"
    errors = [line for line in lines if re.match(r"(?i)error\b", line)]
    assert errors == [lines[-1]], f"expected one error line, last on stderr{context}"
    assert re.match(r"(Error|error): \S", lines[-1]), context
    return lines[-1]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, corpus):
    reason = _skip_reason(case)
    if reason:
        pytest.skip(reason)
    prepared, result = corpus[case.id]
    line = error_line(result)
    escaped = {k: re.escape(v) for k, v in prepared["values"].items()}
    for pattern in case.expect:
        assert re.search(_fill(pattern, escaped), line), (
            f"{_fill(pattern, escaped)!r} not in the error line:\n{line}"
        )
    for pattern in case.absent:
        left = sorted(str(p) for p in prepared["dir"].glob(pattern))
        assert not left, f"left behind after the failure: {left}\n{line}"


def test_corpus_is_large_and_covers_both_tools():
    assert len(CASES) >= 30 and len(BY_ID) == len(CASES)
    assert {c.tool for c in CASES} == {"scaffold", "script"}


@pytest.mark.parametrize("case_id", REAL_PROCESS_CASES)
def test_runner_matches_a_real_process(case_id, corpus):
    """The in-process runner reports what a real `scaffold` / `python train.py` process prints."""
    prepared, batched = corpus[case_id]
    real = _run_isolated({**prepared["entry"], "patch": None}, corpus["env"], corpus["root"])
    assert real["rc"] == batched["rc"]
    assert error_line(real) == error_line(batched)


def test_scaffold_debug_shows_the_traceback(corpus):
    """SCAFFOLD_DEBUG=1 re-raises the one-line error with its traceback (for bug reports)."""
    prepared, _ = corpus["jsonl-malformed-line"]
    env = {**corpus["env"], "SCAFFOLD_DEBUG": "1"}
    real = _run_isolated({**prepared["entry"], "patch": None}, env, corpus["root"])
    assert real["rc"] == 1
    assert "Traceback" in real["stderr"] and "ValueError" in real["stderr"]
