"""CPU SFT benchmark: Scaffold vs TRL vs torchtune, full fine-tuning of SmolLM2-135M-Instruct.

Every (tool, dtype) pair trains the same model on the same Alpaca demo data with the same settings
(micro-batch 4, sequences padded to 256 tokens, AdamW lr 2e-5 without warmup, seed 0, no eval or
saving during the timed steps) in a fresh subprocess; the pairs run in alternation (repeat 1 of every pair, then repeat 2, ...)
so that drift in machine load spreads over all tools. Each run reports its per-step losses, the
real (non-pad) tokens and the wall time of steps 2..N (step 1 is a warm-up). The benchmark takes
the median tokens/s and peak RSS over repeats, measures this machine's torch.mm peak in fp32 and
bf16 with the same thread count, and writes a markdown section into RESULTS.md.

Run with the main venv's Python from the repo root:

    .venv/bin/python benchmarks/sft_cpu.py --steps 12 --micro_batch_size 4 --max_seq_len 256 \\
        --dtypes fp32,bf16 --repeats 2 --tools scaffold,trl,torchtune --out benchmarks/RESULTS.md

Peer venvs (benchmarks/.venvs/{trl,torchtune}) are built on first use by benchmarks/peers.py.
Logs of every run go to benchmarks/.work/sft_cpu/logs/. A tool that fails becomes a "failed" row
with the last line of its stderr; the other tools still run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
PEERS_DIR = HERE / "peers"
WORK_DIR = HERE / ".work" / "sft_cpu"
sys.path.insert(0, str(PEERS_DIR))
sys.path.insert(0, str(HERE))
# `peers` resolves to benchmarks/peers.py (a module wins over the namespace directory peers/).
import peers  # noqa: E402
from sft_data import data_path, model_dir  # noqa: E402

TOOLS = ("scaffold", "scaffold+lce", "trl", "torchtune")
# A tool is "<base>" or "<base>+trick+trick": scaffold renders its script with those --tricks;
# torchtune runs with its equivalent config flags (see peers/torchtune_run.py --tricks).
BASES = ("scaffold", "trl", "torchtune")
TRICKS_BY_BASE = {
    "scaffold": ("ac", "lce", "optim-in-bwd", "adamw8bit"),
    "trl": ("no-ac",),  # TRL 1.x's SFTConfig checkpoints activations by default; no-ac turns it off
    "torchtune": ("ac", "optim-in-bwd", "adamw8bit", "plain-ce"),
}


def split_tool(tool: str) -> tuple[str, list[str]]:
    """ "scaffold+ac+lce" -> ("scaffold", ["ac", "lce"])."""
    base, *tricks = tool.split("+")
    return base, tricks


def is_scaffold(tool: str) -> bool:
    return split_tool(tool)[0] == "scaffold"


def valid_tool(tool: str) -> bool:
    base, tricks = split_tool(tool)
    return base in BASES and all(t in TRICKS_BY_BASE[base] for t in tricks)


DTYPES = ("fp32", "bf16")


def markers(section: str) -> tuple[str, str]:
    """The begin/end comments around a section of RESULTS.md."""
    return f"<!-- benchmark:{section}:begin -->", f"<!-- benchmark:{section}:end -->"


LR = 2e-5
MM_SIZE = 2048
# glibc keeps freed heap memory (chunks below its dynamic mmap threshold, up to 32 MiB) and RSS
# shows it; with a fixed 128 KiB threshold big tensors are mmapped and returned on free, so RSS
# follows live memory (docs/DESIGN.md). Every tool gets the same setting in the second memory pass.
TUNED_MALLOC = "glibc.malloc.mmap_threshold=131072"


# --------------------------------------------------------------------------------------------
# Commands per tool
# --------------------------------------------------------------------------------------------


def scaffold_generate_command(run_dir: Path, tricks: str = "") -> list[str]:
    """`scaffold new` writing the SFT script for SmolLM2-135M (with `tricks`) into `run_dir`."""
    cli = Path(sys.executable).parent / "scaffold"
    prefix = [str(cli)] if cli.is_file() else [sys.executable, "-m", "generator.cli"]
    return [
        *prefix,
        "new",
        "--algo",
        "sft",
        "--model",
        "smollm2-135m",
        "--out",
        str(run_dir),
        "--force",
        *(["--tricks", tricks] if tricks else []),
    ]


def scaffold_command(
    dtype: str, steps: int, mbs: int, seq: int, run_dir: Path, tricks: list[str] = ()
) -> list[str]:
    """The command training with the generated `<run_dir>/train.py` (writes `<run_dir>/out`).

    With optim-in-bwd, clipping is off (--max_grad_norm 0), as in torchtune's optimizer_in_bwd
    (which refuses clipping); with clipping Scaffold's exact clip runs two passes.
    """
    clip = ["--max_grad_norm", "0"] if "optim-in-bwd" in tricks else []
    return [
        sys.executable,
        str(run_dir / "train.py"),
        "--max_steps", str(steps),
        "--micro_batch_size", str(mbs),
        "--max_seq_len", str(seq),
        "--dtype", dtype,
        "--lr", str(LR),
        "--warmup_steps", "0",  # the peers run a constant lr; the default 10 > short runs
        "--min_lr_ratio", "1.0",  # constant lr after warmup, like the peers (no cosine decay)
        "--val_fraction", "0",  # no held-out split and no final validation pass
        "--eval_every_steps", "0",
        "--save_every_steps", "0",
        "--sample_max_new_tokens", "0",
        "--seed", "0",
        "--pad_to_max_seq_len", "true",
        "--out_dir", str(run_dir / "out"),
        *clip,
    ]  # fmt: skip


def peer_command(tool: str, dtype: str, steps: int, mbs: int, seq: int) -> list[str]:
    """The command running a peer script in its own venv; it prints one JSON line."""
    base, tricks = split_tool(tool)
    script = {"trl": "trl_sft.py", "torchtune": "torchtune_run.py"}[base]
    return [
        str(peers.venv_python(base)),
        str(PEERS_DIR / script),
        "--max_steps", str(steps),
        "--micro_batch_size", str(mbs),
        "--max_seq_len", str(seq),
        "--lr", str(LR),
        "--dtype", dtype,
        "--seed", "0",
        *(["--tricks", ",".join(tricks)] if tricks else []),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Running one subprocess and reading its result
# --------------------------------------------------------------------------------------------


@dataclass
class Proc:
    """What a finished subprocess left behind."""

    returncode: int
    stdout: str
    stderr: str
    peak_rss_mib: float  # largest RSS of the process or any descendant it waited for
    wall_s: float


def run_process(cmd: list[str], cwd: Path, env: dict, log_stem: Path, timeout_s: float) -> Proc:
    """Run `cmd`, logging to `<log_stem>.out/.err`; measure its peak RSS with `os.wait4`.

    The child gets its own process group, so a timeout kills the whole tree.
    """
    log_stem.parent.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_stem.with_suffix(".out"), log_stem.with_suffix(".err")
    start = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        err.write("+ " + shlex.join(cmd) + "\n")
        err.flush()
        child = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True
        )
        status, rusage = _wait_with_timeout(child, timeout_s)
    wall = time.perf_counter() - start
    if status is None:
        returncode = 124
        with open(err_path, "a") as err:
            err.write(f"\ntimed out after {timeout_s:.0f} s\n")
    else:
        returncode = os.waitstatus_to_exitcode(status)
    return Proc(
        returncode=returncode,
        stdout=out_path.read_text(errors="replace"),
        stderr=err_path.read_text(errors="replace"),
        peak_rss_mib=rusage.ru_maxrss / 1024 if rusage else float("nan"),  # KiB on Linux
        wall_s=wall,
    )


def _wait_with_timeout(child: subprocess.Popen, timeout_s: float):
    """Reap `child` with wait4 (for its rusage); kill its process group after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, rusage = os.wait4(child.pid, os.WNOHANG)
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            return status, rusage
        if time.monotonic() > deadline:
            os.killpg(child.pid, signal.SIGKILL)
            _, _, rusage = os.wait4(child.pid, 0)
            child.returncode = -signal.SIGKILL
            return None, rusage
        time.sleep(0.5)


def last_line(text: str) -> str:
    """The last non-empty line (progress-bar carriage returns split too), for error reports."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def parse_json_line(stdout: str) -> dict:
    """The last stdout line that is a JSON object (the peers' result line)."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON result line on stdout")


def parse_scaffold_metrics(path: Path) -> dict:
    """Scaffold's `metrics.jsonl` -> the peers' result format; step 1 (warm-up) is skipped.

    Lines look like {"step", "loss", "lr", "grad_norm", "num_tokens" (non-pad input tokens of
    the step), "step_time_s", "tokens_per_s", "peak_mem_mib"}; lines without a training loss
    and step time (e.g. other records) are ignored.
    """
    if not path.is_file():
        raise ValueError(f"no metrics file at {path}")
    steps: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if {"step", "loss", "num_tokens", "step_time_s"} <= rec.keys():
            steps[int(rec["step"])] = rec
    if not steps:
        raise ValueError(f"no training steps in {path}")
    timed = [steps[s] for s in sorted(steps) if s >= 2]
    seconds = sum(r["step_time_s"] for r in timed)
    real_tokens = sum(int(r["num_tokens"]) for r in timed)
    return {
        "tool": "scaffold",
        "steps": len(steps),
        "losses": [float(steps[s]["loss"]) for s in sorted(steps)],
        "real_tokens": real_tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(real_tokens / seconds, 2) if seconds > 0 else 0.0,
        "peak_mem_mib": max(float(r.get("peak_mem_mib", 0.0)) for r in steps.values()),
    }


# --------------------------------------------------------------------------------------------
# One benchmark run per (tool, dtype, repeat)
# --------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One run of one tool; `ok` False means `error` says why."""

    tool: str
    dtype: str
    repeat: int
    ok: bool
    tokens_per_s: float = float("nan")
    peak_rss_mib: float = float("nan")  # measured by this script (wait4), same for every tool
    tuned_rss_mib: float = float("nan")  # the same, in a separate run under TUNED_MALLOC
    losses: list[float] = field(default_factory=list)
    real_tokens: int = 0
    seconds: float = 0.0
    wall_s: float = 0.0
    error: str = ""
    raw: dict = field(default_factory=dict)


def run_tool(
    tool: str, dtype: str, repeat: int, args, env: dict, steps: int | None = None, tag: str = ""
) -> RunResult:
    """Run one training job in a fresh subprocess and turn its output into a RunResult.

    `steps` overrides args.steps; `tag` is added to the log names (e.g. the malloc-tuned pass).
    """
    steps = steps or args.steps
    log_stem = WORK_DIR / "logs" / f"{tool}_{dtype}_r{repeat}{tag}"
    if is_scaffold(tool):
        run_dir = WORK_DIR / tool.replace("+", "_")
        shutil.rmtree(run_dir / "out", ignore_errors=True)
        cmd = scaffold_command(
            dtype, steps, args.micro_batch_size, args.max_seq_len, run_dir, split_tool(tool)[1]
        )
        cwd = run_dir
    else:
        cmd = peer_command(tool, dtype, steps, args.micro_batch_size, args.max_seq_len)
        cwd = REPO_ROOT
    proc = run_process(cmd, cwd, env, log_stem, args.timeout)
    result = RunResult(tool, dtype, repeat, ok=False, wall_s=proc.wall_s)
    result.peak_rss_mib = proc.peak_rss_mib
    if proc.returncode != 0:
        result.error = f"exit {proc.returncode}: {last_line(proc.stderr)}"
        return result
    try:
        if is_scaffold(tool):
            metrics = run_dir / "out" / "metrics.jsonl"
            raw = parse_scaffold_metrics(metrics)
            # Keep the metrics with the logs; drop the saved model (0.5 GB per run).
            shutil.copy(metrics, log_stem.with_suffix(".metrics.jsonl"))
            shutil.rmtree(run_dir / "out", ignore_errors=True)
        else:
            raw = parse_json_line(proc.stdout)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        result.error = f"unreadable result: {e}; stderr: {last_line(proc.stderr)}"
        return result
    result.ok = True
    result.raw = raw
    result.tokens_per_s = float(raw["tokens_per_s"])
    result.losses = [float(x) for x in raw["losses"]]
    result.real_tokens = int(raw["real_tokens"])
    result.seconds = float(raw["seconds"])
    return result


def prepare_tools(tools: list[str], env: dict) -> dict[str, str]:
    """Build peer venvs and generate the Scaffold script; returns {tool: error} for failures."""
    errors: dict[str, str] = {}
    for tool in tools:
        try:
            if is_scaffold(tool):
                run_dir = WORK_DIR / tool.replace("+", "_")
                proc = run_process(
                    scaffold_generate_command(run_dir, ",".join(split_tool(tool)[1])),
                    REPO_ROOT,
                    env,
                    WORK_DIR / "logs" / f"{tool.replace('+', '_')}_new",
                    timeout_s=600,
                )
                if proc.returncode != 0:
                    errors[tool] = (
                        f"`scaffold new` exit {proc.returncode}: {last_line(proc.stderr)}"
                    )
                elif not (run_dir / "train.py").is_file():
                    errors[tool] = f"`scaffold new` wrote no {run_dir / 'train.py'}"
            else:
                peers.ensure_venv(split_tool(tool)[0], log=lambda m: print(m, flush=True))
        except Exception as e:  # any setup failure becomes a failed row, not a crash
            errors[tool] = f"setup failed: {last_line(str(e))}"
    return errors


def ensure_inputs() -> None:
    """Make sure the SmolLM2 model and the Alpaca data are in the cache (fetch them if not)."""
    if (model_dir() / "config.json").is_file() and data_path().is_file():
        return
    code = "from generator.assets import ensure_smollm2, ensure_dataset; ensure_smollm2(); ensure_dataset()"
    print("fetching the benchmark model and data ...", flush=True)
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def child_env(threads: int) -> dict:
    """Environment for every child: fixed thread count, no tokenizer thread pools, offline hub."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("PYTHONPATH", None)
    return env


# --------------------------------------------------------------------------------------------
# Arithmetic: peak matmul rate, FLOPs per token
# --------------------------------------------------------------------------------------------

MM_PEAK_CODE = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
n = int(sys.argv[3])
a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
for _ in range(3):
    a @ b
best = 0.0
for _ in range(5):
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        a @ b
        reps += 1
    best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
print(json.dumps({"flops_per_s": best}))
"""


def measure_mm_peak(dtype: str, threads: int, env: dict) -> float:
    """Best FLOP/s of a 2048x2048 torch.mm in `dtype` over 5 windows of 0.5 s (a subprocess)."""
    proc = subprocess.run(
        [sys.executable, "-c", MM_PEAK_CODE, dtype, str(threads), str(MM_SIZE)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(parse_json_line(proc.stdout)["flops_per_s"])


def count_params(cfg: dict) -> int:
    """Parameters of a Llama-style decoder from its HF config.json (tied embeddings counted once)."""
    d, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q = d * cfg["num_attention_heads"] * head_dim
    kv = 2 * d * cfg["num_key_value_heads"] * head_dim
    o = cfg["num_attention_heads"] * head_dim * d
    mlp = 3 * d * cfg["intermediate_size"]
    per_layer = q + kv + o + mlp + 2 * d  # + two RMSNorm weights
    embed = vocab * d * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer + embed + d  # + final norm


def flops_per_token(cfg: dict, seq_len: int) -> tuple[float, int]:
    """Training FLOPs per token, 6 * N + 12 * layers * hidden * seq (PaLM, appendix B).

    6N: forward + backward of every weight matmul (the tied embedding counts once, for the LM
    head). 12 * L * H * S: attention scores and weighted values, forward + backward, without
    causal-mask savings, at the padded sequence length S. Returns (flops, N).
    """
    n = count_params(cfg)
    return 6 * n + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq_len, n


# --------------------------------------------------------------------------------------------
# Aggregation and the markdown report
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    """The table row of one (tool, dtype): medians over the successful repeats."""

    tool: str
    dtype: str
    runs: list[RunResult]

    @property
    def ok_runs(self) -> list[RunResult]:
        return [r for r in self.runs if r.ok]

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(r.tokens_per_s for r in self.ok_runs)

    @property
    def peak_rss_mib(self) -> float:
        return statistics.median(r.peak_rss_mib for r in self.ok_runs)

    @property
    def tuned_rss_mib(self) -> float:
        return statistics.median(r.tuned_rss_mib for r in self.ok_runs)

    @property
    def losses(self) -> list[float]:
        """Per-step loss, averaged over the successful repeats."""
        runs = self.ok_runs
        n = min(len(r.losses) for r in runs)
        return [statistics.fmean(r.losses[i] for r in runs) for i in range(n)]


def mean_abs_gap(a: list[float], b: list[float]) -> float:
    n = min(len(a), len(b))
    return statistics.fmean(abs(a[i] - b[i]) for i in range(n)) if n else float("nan")


def render_table(rows: list[Row], peaks: dict[str, float], fpt: float) -> list[str]:
    """The results table (failed rows say so; details go to the notes)."""
    lines = [
        "| tool | dtype | tokens/s | peak RSS MiB | peak RSS MiB, mmap_threshold 128 KiB | MFU "
        "| ratio to scaffold | x own baseline | final loss | loss gap to own fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r.tool, r.dtype): r for r in rows}
    for row in rows:
        if not row.ok_runs:
            lines.append(f"| {row.tool} | {row.dtype} | failed | - | - | - | - | - | - | - |")
            continue
        mfu = row.tokens_per_s * fpt / peaks[row.dtype]
        ref = by_key.get(("scaffold", row.dtype))
        ratio = f"{row.tokens_per_s / ref.tokens_per_s:.2f}" if ref and ref.ok_runs else "n/a"
        own = by_key.get((split_tool(row.tool)[0], row.dtype))  # the same tool without tricks
        own_ratio = (
            f"{row.tokens_per_s / own.tokens_per_s:.2f} speed, "
            f"{row.peak_rss_mib / own.peak_rss_mib:.2f} RSS"
            if own and own.ok_runs
            else "n/a"
        )
        fp32 = by_key.get((row.tool, "fp32"))
        gap = f"{mean_abs_gap(row.losses, fp32.losses):.3f}" if fp32 and fp32.ok_runs else "n/a"
        tuned = f"{row.tuned_rss_mib:.0f}" if math.isfinite(row.tuned_rss_mib) else "-"
        lines.append(
            f"| {row.tool} | {row.dtype} | {row.tokens_per_s:.1f} | {row.peak_rss_mib:.0f} "
            f"| {tuned} | {100 * mfu:.1f}% | {ratio} | {own_ratio} | {row.losses[-1]:.4f} | {gap} |"
        )
    return lines


def machine_info() -> dict:
    """CPU count, CPU model, memory, load average."""
    model, mem_gib = platform.processor() or "unknown", float("nan")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = int(line.split()[1]) / 2**20
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": model,
        "mem_gib": mem_gib,
        "loadavg": os.getloadavg(),
    }


def versions(tools: list[str]) -> dict[str, str]:
    """Versions of the main stack, Scaffold (with git commit) and the peers."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "transformers"):
        try:
            out[f"{dist} (main venv)"] = version(dist)
        except PackageNotFoundError:
            out[f"{dist} (main venv)"] = "missing"
    git = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    try:
        scaffold = version("scaffold")
    except PackageNotFoundError:
        scaffold = "not installed"
    out["scaffold"] = f"{scaffold} (git {git.stdout.strip() or 'unknown'})"
    for tool in tools:
        base = split_tool(tool)[0]
        if base != "scaffold" and peers.venv_python(base).is_file():
            for dist, v in peers.peer_versions(base).items():
                out[f"{dist} ({base} venv)"] = v
    return out


NOTES = """\
- tokens/s counts real (non-pad) input tokens of steps 2..N (step 1 is a warm-up and is left out),
  divided by the wall time of those steps; median over repeats. Every tool pads each sequence to
  max_seq_len, so each step computes on micro_batch_size x max_seq_len positions; padding is not
  counted as throughput.
- MFU = tokens/s x FLOPs per token / measured torch.mm peak of this dtype (bf16 rows use the bf16
  peak, also for TRL's autocast). FLOPs per token = 6 N + 12 L H S with N parameters (tied
  embedding counted once), L layers, H hidden size, S = max_seq_len (PaLM, appendix B; attention
  without causal savings).
- Peak RSS is measured by this script for every tool alike: the maximum resident set of the run's
  process tree (`os.wait4` rusage), including model loading. Two figures: with glibc's default
  malloc (what a user sees; freed memory below its dynamic mmap threshold, up to 32 MiB per
  chunk, stays in RSS) and, in a separate short run of every tool, with
  `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072`, where large freed tensors go back to the
  OS and RSS follows live memory.
- Same data, order and loss masks: the Alpaca rows become user = instruction (+ blank line + input),
  assistant = output, rendered with SmolLM2's chat template (its default system prompt included);
  the loss covers the answer and its `<|im_end|>\\n`, prompt masked. TRL (prompt-completion data,
  `completion_only_loss` default) and the torchtune tokenizer in benchmarks/peers give identical
  token ids and masks on all 999 rows; with seed 0 both draw the same sample order.
- Per tool: TRL 1.16 `SFTTrainer` (fp32, or `bf16=True` = autocast over fp32 weights and AdamW
  state); torchtune 0.6.1 stock `full_finetune_single_device` code (llama3_2 builder with SmolLM2
  dims, chunked CE; `dtype=bf16` = pure bf16 weights and AdamW state, no fp32 master copy), run
  without its end-of-epoch checkpoint save; Scaffold: the generated `train.py`.
- Step time: TRL from `on_step_begin` to `on_step_end` (batch fetch outside); torchtune its own
  per-step timer (includes the batch fetch); Scaffold its `step_time_s`.
- AdamW (betas 0.9/0.999, weight decay 0), lr 2e-5 without warmup, grad-norm clipping at 1.0.
  Every tool keeps the lr constant (Scaffold: `--min_lr_ratio 1.0`, `--warmup_steps 0`).
- Same sample order for all tools: seed 0, and Scaffold with `--val_fraction 0` keeps the file's
  order before its DistributedSampler shuffle, as torchtune's sampler does (equal real-token
  counts per step confirm it). Loss masks differ by one token per reply: the peers also train the
  `\\n` after `<|im_end|>`, Scaffold stops at `<|im_end|>` (the end-of-turn token is what
  generation needs); that near-zero-loss token lowers the peers' mean loss (step-1 loss on the
  same weights and rows: Scaffold 1.935, TRL and torchtune 1.876) at equal compute.
- TRL 1.x's `SFTConfig` turns activation checkpointing on by default (`gradient_checkpointing=True`):
  the "trl" rows recompute every block's activations in backward (less memory, more compute).
  "trl+no-ac" sets it to False, like Scaffold's and torchtune's defaults; "scaffold+ac" and
  "torchtune+ac" checkpoint activations like TRL's default.
- Scaffold computes lm_head and the softmax only at supervised positions (`logits_mask`): prompt
  and padding rows never reach the [D, V] projection; the peers project every position.
  After the timed steps Scaffold saves the final model in HF layout (included in its peak RSS).
  "scaffold+lce" is the same script rendered with `--tricks lce`
  (chunked linear cross-entropy; torchtune's config also uses its chunked CE).
"""


def render_section(args, rows, peaks, fpt, n_params, info, vers, started) -> str:
    """The markdown section for this benchmark, between the begin/end markers."""
    cmd = shlex.join([os.path.relpath(sys.executable, REPO_ROOT), *sys.argv])
    begin, end = markers(args.section)
    lines = [
        begin,
        "## SFT on CPU: SmolLM2-135M full fine-tuning (`benchmarks/sft_cpu.py`"
        + ("" if args.section == "sft_cpu" else f", section `{args.section}`")
        + ")",
        "",
        f"- date: {started}",
        f"- machine: {info['nproc']} CPUs ({info['affinity']} usable), {info['cpu']}, "
        f"{info['mem_gib']:.0f} GiB; load average at start {info['loadavg'][0]:.2f}, "
        f"at end {os.getloadavg()[0]:.2f}; {args.threads} threads per run",
        f"- command: `{cmd}`",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
        f"- setup: micro-batch {args.micro_batch_size}, max_seq_len {args.max_seq_len}, "
        f"{args.steps} steps, {args.repeats} repeat(s) per (tool, dtype), run in alternation",
        f"- torch.mm peak ({MM_SIZE}x{MM_SIZE}, {args.threads} threads): "
        + ", ".join(f"{d} {peaks[d] / 1e9:.0f} GFLOP/s" for d in sorted(peaks)),
        f"- FLOPs per token: 6 x {n_params / 1e6:.1f} M + 12 x L x H x {args.max_seq_len} "
        f"= {fpt / 1e6:.0f} MFLOP",
        "",
        *render_table(rows, peaks, fpt),
        "",
        "Notes:",
        "",
        NOTES.rstrip(),
    ]
    for row in rows:
        tps = ", ".join(f"{r.tokens_per_s:.1f}" if r.ok else "failed" for r in row.runs)
        lines.append(f"- {row.tool} {row.dtype}: tokens/s per repeat {tps}")
        failures = [r.error for r in row.runs if not r.ok]
        for error in dict.fromkeys(failures):  # unique, in order
            n = failures.count(error)
            lines.append(f"  - failed ({n}/{len(row.runs)} runs): `{error}`")
    lines += ["", end]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str, name: str) -> None:
    """Replace section `name` in `path` (between its markers), or append it."""
    begin, end = markers(name)
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + section.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32,bf16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--tools",
        default=",".join(TOOLS),
        help="comma-separated: scaffold[+trick...], trl, torchtune[+trick...]; tricks: "
        + "; ".join(f"{b}: {','.join(t) or '-'}" for b, t in TRICKS_BY_BASE.items()),
    )
    p.add_argument(
        "--section",
        default="sft_cpu",
        help="RESULTS.md section name (a second run with other tools keeps the first's table)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads per run")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per training run")
    p.add_argument(
        "--tuned_rss_steps",
        type=int,
        default=4,
        help=f"steps of the extra memory pass under GLIBC_TUNABLES={TUNED_MALLOC} (0 = skip)",
    )
    p.add_argument("--out", default=str(HERE / "RESULTS.md"), help="markdown file to update")
    args = p.parse_args(argv)
    args.tool_list = [t.strip() for t in args.tools.split(",") if t.strip()]
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [t for t in args.tool_list if not valid_tool(t)] + [
        d for d in args.dtype_list if d not in DTYPES
    ]
    if bad:
        p.error(f"unknown tool or dtype: {', '.join(bad)}")
    if args.steps < 2:
        p.error("--steps must be at least 2 (step 1 is a warm-up)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    info = machine_info()
    env = child_env(args.threads)
    ensure_inputs()
    errors = prepare_tools(args.tool_list, env)
    cfg = json.loads((model_dir() / "config.json").read_text())
    fpt, n_params = flops_per_token(cfg, args.max_seq_len)
    peaks = {d: measure_mm_peak(d, args.threads, env) for d in args.dtype_list}
    print("torch.mm peak GFLOP/s:", {d: round(v / 1e9, 1) for d, v in peaks.items()}, flush=True)

    runs: dict[tuple[str, str], list[RunResult]] = {
        (t, d): [] for d in args.dtype_list for t in args.tool_list
    }
    for repeat in range(1, args.repeats + 1):
        for dtype in args.dtype_list:
            for tool in args.tool_list:
                if tool in errors:
                    runs[tool, dtype].append(
                        RunResult(tool, dtype, repeat, ok=False, error=errors[tool])
                    )
                    continue
                print(f"[{repeat}/{args.repeats}] {tool} {dtype} ...", flush=True)
                result = run_tool(tool, dtype, repeat, args, env)
                status = f"{result.tokens_per_s:.1f} tok/s" if result.ok else result.error
                print(
                    f"    {status}, peak RSS {result.peak_rss_mib:.0f} MiB, "
                    f"wall {result.wall_s:.0f} s",
                    flush=True,
                )
                runs[tool, dtype].append(result)

    if args.tuned_rss_steps:
        tuned_env = {**env, "GLIBC_TUNABLES": TUNED_MALLOC}
        for dtype in args.dtype_list:
            for tool in args.tool_list:
                ok = [r for r in runs[tool, dtype] if r.ok]
                if not ok:
                    continue
                print(f"[memory pass, {TUNED_MALLOC}] {tool} {dtype} ...", flush=True)
                tuned = run_tool(
                    tool, dtype, 1, args, tuned_env, steps=args.tuned_rss_steps, tag="_tuned"
                )
                rss = tuned.peak_rss_mib if tuned.ok else float("nan")
                print(f"    peak RSS {rss:.0f} MiB" + ("" if tuned.ok else f" ({tuned.error})"))
                for r in ok:
                    r.tuned_rss_mib = rss
    rows = [Row(t, d, runs[t, d]) for d in args.dtype_list for t in args.tool_list]
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    (WORK_DIR / "runs.json").write_text(
        json.dumps([r.__dict__ for rs in runs.values() for r in rs], indent=1, default=str)
    )
    vers = versions(args.tool_list)
    section = render_section(args, rows, peaks, fpt, n_params, info, vers, started)
    write_section(Path(args.out), section, args.section)
    print(section)


if __name__ == "__main__":
    main()
