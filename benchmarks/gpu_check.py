"""The prepared GPU check (issue 24): a few short runs of rendered scripts on one CUDA GPU, each
run's CUDA peak against `scaffold plan`'s simulation of the same script and sizes.

Two steps, because the lent GPU machine reaches no network:

  python benchmarks/gpu_check.py --prepare            # here: .gpu-check/ (wheels, tokenizer, data, scripts)
  bash scripts/gpu_check.sh                           # there: the runs, the table, RESULTS.md, $OUT

`--smoke` runs the same cases' logic on CPU with a tiny model (tests/benchmarks/test_gpu_check.py).
The models are random weights at real sizes (SmolLM2-135M's config; `--smoke`: 2 layers of 64) with
the real SmolLM2 tokenizer: the real weights (540 MB) cannot travel to the device, and memory and
speed do not depend on the weights' values. What runs where: docs/GPU.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREPARED = ROOT / ".gpu-check"
# What the device's python lacks of what the generator (render, plan) and the low-bit tricks import
# (pyproject.toml); all three wheels are for x86-64 Linux, and torchao's kernels are CUDA builds.
WHEELS = ("torchao==0.18.0", "ruff==0.17.0", "merge3==1.0.0")
# pip takes every --platform tag a wheel may carry (ruff's is manylinux_2_17, torchao's 2_28; the
# device's glibc is newer than both)
PLATFORMS = [a for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
             for a in ("--platform", tag)]  # fmt: skip
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)
DATA_FILES = ("alpaca_en_demo.json", "dpo_en_demo.json", "chain_sum.jsonl")
# `scaffold plan` simulates its worst case: rows of max_seq_len tokens, every position supervised
# (the largest logits a batch can make). The demo rows are a few hundred tokens with the prompt
# unsupervised, so their peak sits far under the plan (first GPU run: 0.48x for plain SFT, most of
# the gap the [T, V] logits of positions the plan supervises and the data does not). These files
# hold the demo's own replies joined into one long reply per row (over max_seq_len tokens at 1024,
# a one-word prompt), so a run is the plan's case and its peak can be held to PLAN_TOLERANCE.
FULL_ROWS = {"alpaca_full_rows.json": 120, "dpo_full_rows.json": 40}  # rows (pairs) written
FULL_ROW_CHARS = 8000  # about 1,800 SmolLM2 tokens of English: every row is cut at 1024
# measured / planned within this of 1 passes: the planner's own bar against real CPU steps
# (tests/generator/test_plan.py); on CUDA max_memory_allocated leaves out what the plan leaves out
# (the CUDA context, NCCL buffers, allocator fragmentation)
PLAN_TOLERANCE = 0.10
# a case the planner cannot simulate (cpu-offload) is held to the arithmetic estimate, whose own
# bar against the simulation is generator.plan_estimate.ESTIMATE_TOLERANCE (kept equal here so the
# check imports nothing of the generator before it runs)
ESTIMATE_TOLERANCE = 0.15
SMOKE_STEPS = 3
TOTAL_BUDGET_S = 450.0
PLAN_RESERVE_S = 100.0  # of it, for the planner's simulations (20-40 s each for 135M on 2 CPUs)  # the whole check, under the 8 minutes with start-up to spare


@dataclass(frozen=True)
class Case:
    name: str
    new_args: tuple[str, ...]  # `scaffold new` options
    dataset: str
    steps: int
    timeout_s: float
    config: tuple = ()  # (Config field, value) pairs the run and its plan both take
    cuda_only: str = ""  # why the case cannot run on CPU ("" = it can)
    needs: tuple[str, ...] = ()  # modules the run imports beyond the base environment

    @property
    def rl(self) -> bool:
        """A GRPO case: no eval or sample, its sizes are its rollouts' (config), not Sizes."""
        return "grpo" in self.new_args


CASES = (
    Case("sft-bf16", ("--algo", "sft"), "alpaca_full_rows.json", 10, 120),
    Case(
        "sft-bf16-compile-packing",
        ("--algo", "sft", "--tricks", "compile,packing"),
        "alpaca_full_rows.json",
        10,
        200,
    ),
    Case(
        "sft-bf16-offload",
        ("--algo", "sft", "--tricks", "offload"),
        "alpaca_full_rows.json",
        10,
        120,
        cuda_only="offload is CUDA only (the script refuses it on CPU)",
    ),
    # the low-memory recipe: every trick `scaffold plan` adds to make a run fit (plan.FIT_TRICKS),
    # with the 8-bit AdamW (the 4-bit one excludes it), so torchao's optimizer runs on the GPU too
    Case(
        "sft-lowmem",
        ("--algo", "sft", "--tricks", "ac,lce,optim-in-bwd,adamw8bit"),
        "alpaca_full_rows.json",
        10,
        120,
    ),
    # FSDP2's CPUOffloadPolicy: shards, gradients and AdamW state in host memory, the step on the
    # CPU, gloo beside NCCL for the CPU tensors' collectives; held to the arithmetic estimate
    Case(
        "sft-cpu-offload",
        ("--algo", "sft", "--tricks", "cpu-offload"),
        "alpaca_full_rows.json",
        10,
        120,
    ),
    Case("dpo", ("--algo", "dpo"), "dpo_full_rows.json", 3, 120),
    # issue 24's GRPO case: vLLM on the trainer's GPU, asleep (weights to host memory, KV cache
    # freed) while the trainer steps, woken and re-synced (object store) for each batch; it comes
    # before the runtime-engine case so the check's time budget reaches it first
    Case(
        "grpo-colocated-vllm",
        ("--algo", "grpo", "--layout", "colocated"),
        "chain_sum.jsonl",
        3,
        240,
        config=(
            ("num_generations", 4),
            ("prompts_per_step", 4),
            ("max_new_tokens", 32),
            ("max_prompt_len", 128),
            ("engine", "vllm"),
        ),
        cuda_only="vLLM's sleep mode (the colocated layout) runs on CUDA only",
        needs=("ray", "vllm"),
    ),
    Case(
        "grpo",
        ("--algo", "grpo"),
        "chain_sum.jsonl",
        3,
        200,
        config=(
            ("num_generations", 4),
            ("prompts_per_step", 4),
            ("max_new_tokens", 32),
            ("max_prompt_len", 128),
        ),
        needs=("ray",),
    ),
)


@dataclass(frozen=True)
class Sizes:
    micro_batch_size: int
    max_seq_len: int
    model: dict  # config.json fields over SmolLM2-135M's


GPU_SIZES = Sizes(8, 1024, {})
SMOKE_SIZES = Sizes(
    2,
    64,
    {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
)  # fmt: skip


@dataclass
class Row:
    case: str
    status: str = "fail"  # pass / fail / skip
    steps: int = 0
    tokens_per_s: float | None = None
    peak_mib: float | None = None
    planned_mib: float | None = None
    note: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.peak_mib is None or not self.planned_mib:
            return None
        return self.peak_mib / self.planned_mib


def _fail(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr)
    raise SystemExit(1)


# ---------------------------------------------------------------- prepare (here, with a network)


def prepare(dest: Path, cases: list[Case], wheels_too: bool = True) -> None:
    """Fill `dest` with what the device cannot fetch: the wheels, the tokenizer, the data and the
    rendered scripts (rendering needs ruff, which the device also gets from `dest/wheels`)."""
    from generator.assets import ensure_chain_sum, ensure_dataset, ensure_smollm2

    dest.mkdir(parents=True, exist_ok=True)
    wheels = dest / "wheels"
    wheels.mkdir(exist_ok=True)
    for req in WHEELS if wheels_too else ():
        # --platform/--python-version: the device's x86-64 Linux and Python 3.12, whatever runs this
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               *PLATFORMS, "--python-version", "3.12", "-d", str(wheels), req]  # fmt: skip
        subprocess.run(cmd, check=True)
    smollm2 = ensure_smollm2()
    tok = dest / "tokenizer"
    tok.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(smollm2 / name, tok / name)
    data = dest / "data"
    data.mkdir(exist_ok=True)
    for name in DATA_FILES:
        src = ensure_chain_sum() if name == "chain_sum.jsonl" else ensure_dataset(name)
        shutil.copy2(src, data / name)
    write_full_rows(data)
    for case in cases:
        render_case(case, dest / "scripts" / case.name)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"prepared {dest} ({size / 2**20:.1f} MiB)")


def _long_replies(replies: list[str], count: int) -> list[str]:
    """`count` texts of at least FULL_ROW_CHARS characters, each the replies from a different start
    joined in order (wrapping around)."""
    out = []
    for start in range(count):
        parts, i = [], start
        while sum(map(len, parts)) < FULL_ROW_CHARS:
            parts.append(replies[i % len(replies)])
            i += 1
        out.append("\n\n".join(parts))
    return out


def write_full_rows(data: Path) -> None:
    """data/alpaca_full_rows.json and data/dpo_full_rows.json (FULL_ROWS) from the demo files in
    `data`: the same formats, one-word prompts, replies longer than max_seq_len tokens."""
    alpaca = json.loads((data / "alpaca_en_demo.json").read_text())
    n = FULL_ROWS["alpaca_full_rows.json"]
    rows = [{"instruction": "Continue.", "input": "", "output": text}
            for text in _long_replies([r["output"] for r in alpaca if r["output"]], n)]  # fmt: skip
    (data / "alpaca_full_rows.json").write_text(json.dumps(rows, indent=1))
    dpo = json.loads((data / "dpo_en_demo.json").read_text())
    n = FULL_ROWS["dpo_full_rows.json"]
    chosen = _long_replies([p["chosen"]["value"] for p in dpo], n)
    rejected = _long_replies([p["rejected"]["value"] for p in dpo][::-1], n)
    pairs = [{"conversations": [{"from": "human", "value": "Continue."}],
              "chosen": {"from": "gpt", "value": c}, "rejected": {"from": "gpt", "value": r}}
             for c, r in zip(chosen, rejected)]  # fmt: skip
    (data / "dpo_full_rows.json").write_text(json.dumps(pairs, indent=1))


def render_case(case: Case, out: Path) -> None:
    cmd = [sys.executable, "-m", "generator.cli", "new", *case.new_args,
           "--model", "smollm2-135m", "--out", str(out), "--force"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """Unpack the prepared wheels of the modules this python lacks into `site` (put on PYTHONPATH): the device has no network, and a
    wheel is a zip of its site-packages layout. ruff's binary goes to `site/bin`, where ruff looks
    for it next to a `pip install --target` of itself."""
    done = []
    for whl in sorted(wheels.glob("*.whl")):
        if importlib.util.find_spec(whl.name.split("-")[0]) is not None:
            continue  # this python has it: an unpacked copy on PYTHONPATH would shadow it
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data") and parts[1:2] == ["scripts"]:
                    target = site / "bin" / "/".join(parts[2:])
                elif parts[0].endswith(".data"):
                    target = site / "/".join(parts[2:])
                else:
                    target = site / info.filename
                if info.is_dir():
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(info))
                if info.external_attr >> 16 & 0o111 or target.parent.name == "bin":
                    target.chmod(0o755)
        done.append(whl.name)
    return done


# ---------------------------------------------------------------- the check (device, or --smoke)


def environment(device: str) -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "torchao": _version("torchao"),
        "ray": _version("ray"),
        "ruff": _version("ruff"),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
        )
    else:
        env["gpu"] = "none (CPU smoke run)"
    return env


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "absent"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "present (no metadata)"


def runtime_probe(device: str) -> None:
    """One bf16 forward + backward of a tiny runtime model on `device`: whether this torch runs the
    runtime at all (the project pins torch 2.13; the lent GPU has another build). Exits in one line
    if not."""
    import torch

    try:
        from runtime import ModelArgs, build_model

        args = ModelArgs(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
        model = build_model(args, device=device)
        model.init_weights(generator=torch.Generator(device=device).manual_seed(0))
        ids = torch.randint(0, 128, (2, 16), device=device)
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(ids)
        logits = out if torch.is_tensor(out) else out[0]
        logits.float().sum().backward()
    except Exception as e:
        _fail(
            f"the runtime does not run on torch {torch.__version__} ({device}): {type(e).__name__}: {e}"
        )


def build_model_dir(out: Path, sizes: Sizes, tokenizer: Path) -> Path:
    """Random weights (seed 0) at SmolLM2-135M's config with `sizes.model` over it, and the real
    tokenizer: a directory every script's --model takes."""
    import torch

    from generator.catalog import MODELS
    from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint

    cfg = {**MODELS["smollm2-135m"].config, **sizes.model}
    model = build_model(ModelArgs.from_hf_config(cfg), device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, out, model.args.to_hf_config())
    copy_tokenizer_files(tokenizer, out)
    return out


def plan_cases(cases: list[Case], rows: dict, scripts: Path, model_dir: Path, sizes: Sizes,
               deadline: float) -> None:  # fmt: skip
    """`scaffold plan`'s simulation of each case's spec on `model_dir` at the run's sizes, in one
    planner child; a case the planner refuses gets the refusal as its note."""
    try:
        from generator.plan_harness import PlanError, check_simulable, simulate
        from generator.spec import Spec
    except ImportError as e:  # the generator's deps (ruff, merge3) were not installed
        for c in cases:
            rows[c.name].extra["plan"] = f"planner unavailable: {e}"
        return
    specs, names = [], []
    for c in cases:
        data = json.loads((scripts / c.name / ".scaffold" / "spec.json").read_text())["spec"]
        spec = Spec(**dict(data, tricks=tuple(data["tricks"]), model=str(model_dir)))
        mbs = None if c.rl else sizes.micro_batch_size
        seq = None if c.rl else sizes.max_seq_len
        if "compile" in spec.tricks:
            # the planner refuses compile (inductor's fusions are not in fake tensors); fusing
            # only frees temporaries, so the plan without it is the bound the run must stay under
            spec = replace(spec, tricks=tuple(t for t in spec.tricks if t != "compile"))
            rows[c.name].extra["bound"] = True
        try:
            check_simulable(spec, mbs, seq, None)
        except PlanError as e:
            if "cpu-offload" in spec.tricks:  # not simulable: the estimate `scaffold new` prints
                _estimate_case(rows[c.name], spec, scripts / c.name / "train.py", mbs, seq)
                continue
            rows[c.name].extra["plan"] = f"not planned: {e}"
            continue
        specs.append((spec, mbs, seq))
        names.append(c.name)
    for (spec, mbs, seq), name in zip(specs, names):
        left = deadline - time.monotonic()
        if left < 30:
            rows[name].extra["plan"] = "not planned: the check's time budget ran out"
            continue
        try:
            (result,) = simulate(
                [spec],
                mbs,
                seq,
                config=dict(next(c for c in cases if c.name == name).config) or None,
            )
        except Exception as e:  # the planner's failure is this case's note, not the check's end
            rows[name].extra["plan"] = f"plan failed: {e}"
            continue
        rows[name].planned_mib = result.peak / 2**20
        rows[name].extra["plan"] = f"planned in {result.seconds:.0f} s" + (
            " (without compile: an upper bound)" if rows[name].extra.get("bound") else ""
        )


def _estimate_case(row: Row, spec, script: Path, mbs: int | None, seq: int | None) -> None:
    """cpu-offload: the planner cannot simulate it (host and device memory are one pool on the
    CPU), so the run is held to the arithmetic estimate `scaffold new` prints, within
    ESTIMATE_TOLERANCE (the estimate's own bar against the simulation)."""
    from generator.plan_estimate import estimate

    try:
        e = estimate(spec, script.read_text(), mbs, seq)
    except Exception as err:  # the estimate's failure is this case's note, not the check's end
        row.extra["plan"] = f"estimate failed: {err}"
        return
    row.planned_mib = e.peak / 2**20
    row.extra["estimate"] = True
    row.extra["plan"] = (
        f"estimated (cpu-offload is not simulated); host {e.host / 2**20:,.0f} MiB per rank"
    )


def run_case(case: Case, script: Path, out_dir: Path, model_dir: Path, data: Path, sizes: Sizes,
             device: str, timeout_s: float, env: dict) -> Row:  # fmt: skip
    row = Row(case.name)
    cmd = [sys.executable, str(script), "--model", str(model_dir),
           "--dataset", str(data / case.dataset), "--max_steps", str(case.steps),
           "--warmup_steps", "0", "--device", device, "--out_dir", str(out_dir), "--overwrite"]  # fmt: skip
    if not case.rl:  # GRPO has no eval or sample; its sizes are its rollouts' (config)
        cmd += ["--micro_batch_size", str(sizes.micro_batch_size), "--max_seq_len", str(sizes.max_seq_len),
                "--eval_every_steps", "0", "--sample_max_new_tokens", "0",
                # every row padded to max_seq_len: the plan simulates that worst case, so the
                # run's peak compares with it (demo rows are a few hundred tokens)
                "--pad_to_max_seq_len", "true"]  # fmt: skip
    cmd += [a for key, value in case.config for a in (f"--{key}", str(value))]
    row.extra["command"] = shlex.join(cmd)
    start = time.monotonic()
    log = out_dir.parent / f"{case.name}.log"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  cwd=script.parent, env=env)  # fmt: skip
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    row.seconds = time.monotonic() - start
    steps = _step_rows(out_dir / "metrics.jsonl")
    row.steps = len(steps)
    if steps:
        row.peak_mib = max(r["peak_mem_mib"] for r in steps)
        # tokens/s past the first two steps (compilation, allocator warm-up); GRPO logs samples/s
        key = "tokens_per_s" if "tokens_per_s" in steps[0] else "samples_per_s"
        rates = [r[key] for r in steps[2:] or steps]
        row.tokens_per_s = statistics.median(rates)
        row.extra["rate_unit"] = key
    if rc is None:
        row.note = f"timed out after {timeout_s:.0f} s (log: {log.name})"
    elif rc != 0:
        last = (log.read_text().strip().splitlines() or ["no output"])[-1]
        row.note = f"exit {rc}: {last[-200:]}"
    elif row.steps != case.steps:
        row.note = f"{row.steps} of {case.steps} steps logged"
    else:
        row.status = "pass"
    return row


def _step_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "peak_mem_mib" in r]


def judge(row: Row, device: str) -> None:
    """Fold the plan comparison into the row's verdict (the run itself already passed or not)."""
    plan = row.extra.get("plan", "")
    if row.ratio is None:
        row.note = "; ".join(filter(None, [row.note, plan]))
        return
    if device != "cuda":
        # on CPU the logged peak is the process's RSS (Python, libraries, allocator caches)
        row.note = "; ".join(
            filter(None, [row.note, plan, "CPU peak is RSS: not compared with the plan"])
        )
        return
    tolerance = ESTIMATE_TOLERANCE if row.extra.get("estimate") else PLAN_TOLERANCE
    low = 0.0 if row.extra.get("bound") else 1 - tolerance
    if not low <= row.ratio <= 1 + tolerance and row.status == "pass":
        row.status = "fail"
        bar = "at most 1.10x" if low == 0 else f"within {tolerance:.0%}"
        row.note = f"peak {row.ratio:.2f}x the plan (bar: {bar})"
    row.note = "; ".join(filter(None, [row.note, plan]))


def table(rows: list[Row]) -> str:
    lines = [
        "| case | status | steps | tokens/s | peak MiB | planned MiB | peak / plan | s | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        rate = "" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
        if r.extra.get("rate_unit") == "samples_per_s":
            rate += " samples/s"
        cells = [r.case, r.status, str(r.steps), rate,
                 "" if r.peak_mib is None else f"{r.peak_mib:,.0f}",
                 "" if r.planned_mib is None else f"{r.planned_mib:,.0f}",
                 "" if r.ratio is None else f"{r.ratio:.3f}", f"{r.seconds:.0f}",
                 r.note.replace("|", "/")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def section(rows: list[Row], env: dict, command: str, sizes: Sizes, device: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = "CUDA `max_memory_allocated`" if device == "cuda" else "CPU RSS (smoke run)"
    envline = ", ".join(f"{k} {v}" for k, v in env.items())
    return (
        f"## GPU check{', CPU smoke run' if device != 'cuda' else ''} ({now}, `benchmarks/gpu_check.py`)\n\n"
        f"Command: `{command}`. Environment: {envline}.\n"
        f"Random weights (seed 0) at SmolLM2-135M's config{' with ' + json.dumps(sizes.model) if sizes.model else ''}, "
        f"real tokenizer and data; micro batch {sizes.micro_batch_size}, max_seq_len {sizes.max_seq_len}. "
        f"peak = the largest logged `peak_mem_mib` ({what}); planned = `scaffold plan`'s simulated peak "
        f"of the same spec, model and sizes (for cpu-offload, which the planner cannot simulate, its "
        f"arithmetic estimate, as the row's note says); tokens/s = the median past the first two steps.\n\n"
        f"{table(rows)}\n"
    )


def check(args, cases: list[Case]) -> int:
    deadline = time.monotonic() + args.budget_s
    device = "cpu" if args.smoke else "cuda"
    prepared = Path(args.prepared)
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        _fail(f"no CUDA GPU visible to torch {torch.__version__} (use --smoke on CPU)")
    for sub in ("tokenizer", "data", "scripts"):
        if not (prepared / sub).is_dir():
            _fail(
                f"{prepared / sub} is missing: run `python benchmarks/gpu_check.py --prepare` where there is a network, and carry .gpu-check"
            )
    env = environment(device)
    for k, v in env.items():
        print(f"{k}: {v}", flush=True)
    runtime_probe(device)
    print(f"runtime probe: bf16 forward + backward on {device} ok", flush=True)
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    if args.smoke:  # the same cases, fewer steps: what is checked there is the logic, not speed
        cases = [replace(c, steps=min(c.steps, SMOKE_STEPS)) for c in cases]
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    model_dir = build_model_dir(work / "model", sizes, prepared / "tokenizer")
    rows = {c.name: Row(c.name) for c in cases}
    runnable = []
    for c in cases:
        missing = [m for m in c.needs if importlib.util.find_spec(m) is None]
        if c.cuda_only and device != "cuda":
            rows[c.name].status, rows[c.name].note = "skip", c.cuda_only
        elif missing:
            rows[c.name].status = "skip"
            rows[
                c.name
            ].note = f"{', '.join(missing)} not installed here (make gpu-env installs them; the lent device cannot carry their wheels)"
        else:
            runnable.append(c)
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    # the plans run after every case: keep their time out of the runs' share
    runs_deadline = deadline - (0 if args.no_plan else PLAN_RESERVE_S)
    for c in runnable:
        left = runs_deadline - time.monotonic()
        if left < 20:
            rows[c.name].status, rows[c.name].note = "skip", "the check's time budget ran out"
            continue
        script = prepared / "scripts" / c.name / "train.py"
        print(f"run {c.name} ({c.steps} steps, at most {min(c.timeout_s, left):.0f} s)", flush=True)
        rows[c.name] = run_case(c, script, work / "runs" / c.name, model_dir, prepared / "data",
                                sizes, device, min(c.timeout_s, left), child_env)  # fmt: skip
        print(
            f"  {rows[c.name].status}: {rows[c.name].steps} steps in {rows[c.name].seconds:.0f} s {rows[c.name].note}",
            flush=True,
        )
    if not args.no_plan:
        print("plan: simulating the plannable cases", flush=True)
        plan_cases([c for c in runnable], rows, prepared / "scripts", model_dir, sizes, deadline)
    for r in rows.values():
        judge(r, device)
    command = "python benchmarks/gpu_check.py " + shlex.join(sys.argv[1:])
    text = section(list(rows.values()), env, command, sizes, device)
    print("\n" + text)
    outs = [Path(args.results)] if args.results else []
    if os.environ.get("OUT"):
        outs.append(Path(os.environ["OUT"]) / "gpu_check.md")
        (Path(os.environ["OUT"]) / "gpu_check.json").write_text(
            json.dumps({"environment": env, "rows": [r.__dict__ | {"ratio": r.ratio} for r in rows.values()]}, indent=1)
        )  # fmt: skip
    if os.environ.get("OUT"):  # each run's log comes back with the table (the device keeps nothing)
        logs = Path(os.environ["OUT"]) / "logs"
        logs.mkdir(exist_ok=True)
        for log in (work / "runs").glob("*.log"):
            shutil.copy2(log, logs / log.name)
    for path in outs:
        with path.open("a") as f:
            f.write("\n" + text)
        print(f"appended to {path}")
    return 0 if all(r.status != "fail" for r in rows.values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--prepare", action="store_true", help="fill --prepared (needs a network) and stop"
    )
    p.add_argument(
        "--no-wheels",
        action="store_true",
        help="--prepare without the wheels (a --smoke run needs none)",
    )
    p.add_argument(
        "--install-wheels", metavar="SITE", help="unpack --prepared/wheels into SITE and stop"
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, the same logic")
    p.add_argument("--prepared", default=str(PREPARED))
    p.add_argument("--work", default=str(ROOT / "runs" / "gpu-check"))
    p.add_argument(
        "--results",
        default=None,
        help="a file the section is appended to (the check's script: benchmarks/RESULTS.md)",
    )
    p.add_argument("--cases", nargs="*", help="only these cases")
    p.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S)
    p.add_argument("--no-plan", action="store_true", help="skip the planner's simulations")
    args = p.parse_args(argv)
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    unknown = set(args.cases or ()) - {c.name for c in CASES}
    if unknown:
        _fail(
            f"unknown case(s) {', '.join(sorted(unknown))}; valid: {', '.join(c.name for c in CASES)}"
        )
    if args.prepare:
        prepare(Path(args.prepared), cases, wheels_too=not args.no_wheels)
        return 0
    if args.install_wheels:
        print(
            "unpacked: "
            + ", ".join(install_wheels(Path(args.prepared) / "wheels", Path(args.install_wheels)))
        )
        return 0
    return check(args, cases)


if __name__ == "__main__":
    sys.exit(main())
