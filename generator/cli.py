"""`scaffold`: write, check and inspect training scripts.

Every user-facing error is one line (`Error: ...`) with the option, the bad value and the valid
choices; no tracebacks.
"""

from __future__ import annotations

import functools
import math
import os
import shlex
from pathlib import Path

import click

from generator import __version__
from generator.catalog import MODELS
from generator.features import ALGOS, PEFT_ALGOS, PEFT_METHODS, TRICKS, support_table
from generator.options import SPEC_OPTION_NAMES, spec_from_options, spec_options
from generator.plan import GPU_MEMORY_GIB, parse_gpu_memory
from generator.recipe import recipe_line
from generator.regen import SETTABLE
from generator.rundir import (
    BASE_FILE,
    LAUNCH_BASE_DIR,
    SCRIPT,
    SPEC_FILE,
    find_run_dirs,
    rendered_files,
    write_run_dir,
)
from generator.spec import (
    ScaffoldError,
    Spec,
    engine_weight_note,
    trainer_gpus,
)


def _friendly(fn):
    """Turn ScaffoldError and common OS errors into one-line click errors."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ScaffoldError, OSError, ValueError) as e:
            raise click.ClickException(str(e)) from e
        except click.ClickException:  # already a one-line user error
            raise
        except Exception as e:  # a bug of ours: still one line, the traceback on request
            if os.environ.get("SCAFFOLD_DEBUG"):
                raise
            raise click.ClickException(
                f"internal error {type(e).__name__}: {e} (set SCAFFOLD_DEBUG=1 for the traceback)"
            ) from e

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="scaffold")
def cli():
    """Scaffold writes one readable, editable train.py for a model, algorithm, tricks and GPUs."""


@cli.command()
@spec_options
@click.option(
    "--dataset",
    default=None,
    help="A .json/.jsonl/.parquet file, a file in $SCAFFOLD_HOME/data, or a HF dataset name "
    "[default: the algorithm's demo set: alpaca_en_demo.json, dpo_en_demo.json for DPO].",
)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory to write train.py (and .scaffold/) into.",
)
@click.option(
    "--teacher",
    default="",
    help="--algo kd: the frozen teacher, a catalog name or HF dir with the student's tokenizer "
    "[default: the student's own checkpoint, so the KL starts at 0].",
)
@click.option("--force", is_flag=True, help="Overwrite an existing train.py.")
@click.option(
    "--gpu-memory",
    default=None,
    help="Also print `scaffold plan`'s per-GPU memory of the written script and a fits / does "
    "not fit verdict for this GPU (GiB or a name, e.g. h100-80; simulated, takes seconds).",
)
@_friendly
def new(
    algo, peft, model, tricks, gpus, nodes, tp, cp, cp_mode, dp_replicate, ep, engine_gpus, engine_tp,
    layout, dtype, dataset, out, teacher, force, gpu_memory,
):  # fmt: skip
    """Write OUT/train.py for the chosen model, algorithm, tricks and GPUs.

    \b
    Example:
      scaffold new --algo sft --model smollm2-135m --out runs/demo
      scaffold new --algo qlora --peft dora --out runs/qdora
      scaffold new --algo kd --model smollm2-135m --teacher smollm2-1.7b --out runs/kd
      scaffold new --model llama3.3-70b --gpus 8 --tricks ac,lce --gpu-memory h200-141 --out r70
      python runs/demo/train.py --max_steps 50
    """
    from generator.render import render, render_launch

    gpu = parse_gpu_memory(gpu_memory) if gpu_memory is not None else None

    spec = spec_from_options(
        algo, peft, model, tricks, gpus, nodes, tp, cp, dp_replicate, ep, dtype, dataset, out,
        engine_gpus, engine_tp, teacher, layout, fit_gpu=gpu or ("h100-80", GPU_MEMORY_GIB["h100-80"]),
        cp_mode=cp_mode,
    )  # fmt: skip
    out_dir = Path(out)
    script = out_dir / SCRIPT
    if script.exists() and not force:
        raise ScaffoldError(
            f"{script} exists; use `scaffold regen {out}` to update it keeping your edits, "
            "or --force to overwrite"
        )
    text = render(spec)
    launch = render_launch(spec)
    write_run_dir(out_dir, spec, text, launch)
    # from inside the directory: out_dir ("out") is relative to where the script runs, and
    # `scaffold plot DIR` looks in DIR/out
    cd = f"cd {shlex.quote(str(out_dir))} && "
    if spec.nodes > 1:
        run = f"{cd}sbatch launch/slurm.sbatch   (or: launch/torchrun_multinode.sh)"
    elif trainer_gpus(spec) > 1:  # the mesh needs that many processes: `python train.py` refuses
        run = f"{cd}bash launch/torchrun.sh   (torchrun --nproc-per-node {trainer_gpus(spec)})"
    else:
        run = f"{cd}python train.py   (or: bash launch/torchrun.sh)"
    click.echo(
        f"wrote {script} ({len(text.splitlines())} lines) and {', '.join(launch)}\nrun: {run}"
    )
    note = engine_weight_note(spec)
    if note:
        click.echo(note)
    if spec.fit_for:
        click.echo(recipe_line(spec))
    _plan_summary(spec, gpu, text)


def _simulable_without_cpu_offload(spec: Spec, mbs, seq) -> bool:
    """The estimate covers what the planner covers (not MoE experts, ...): print it for
    cpu-offload only where the rest of the spec is plannable."""
    from dataclasses import replace

    from generator.plan import PlanError, check_simulable

    try:
        check_simulable(
            replace(spec, tricks=tuple(t for t in spec.tricks if t != "cpu-offload")), mbs, seq
        )
    except PlanError:
        return False
    return True


# The host memory a node's cpu-offload shards are judged against: 2 TB, the system memory of a
# DGX H100 or H200 node, less the GPUs' HEADROOM share for the OS, page cache and data loaders
NODE_HOST_MEMORY_GIB = 2e12 / 2**30
NODE_HOST_LABEL = "a 2 TB node"


def cpu_offload_estimate(
    spec: Spec, text: str, mbs: int | None, seq: int | None, label: str, gib: float
) -> str | None:
    """The verdict line of a cpu-offload spec, which the simulation cannot plan: the arithmetic
    estimate of what stays on the GPU, and the offloaded shards' host memory per node judged
    against NODE_HOST_MEMORY_GIB (both must fit). None where the spec has no cpu-offload or the
    rest of it is outside the estimate (`_simulable_without_cpu_offload`)."""
    from generator.plan import estimate, estimate_fits, format_estimate
    from generator.plan_report import HEADROOM

    if "cpu-offload" not in spec.tricks or not _simulable_without_cpu_offload(spec, mbs, seq):
        return None
    try:
        est = estimate(spec, text, mbs, seq, gib)
    except (KeyError, ValueError, ZeroDivisionError):  # a Config the estimate cannot read
        return None
    per_node = est.host * trainer_gpus(spec) / 2**30
    host_budget = (1 - HEADROOM) * NODE_HOST_MEMORY_GIB
    host_fits = per_node <= host_budget
    over = "" if host_fits else f", over the {host_budget:.0f} GiB usable of {NODE_HOST_LABEL}"
    note = (
        "estimate, not simulated: scaffold plan cannot simulate --tricks cpu-offload; "
        f"host memory ~{per_node:.0f} GiB per node for the offloaded shards{over}"
    )
    gpu_fits = estimate_fits(est, gib)
    if gpu_fits and not host_fits:  # the GPU share fits: name the host as what does not
        nodes = math.ceil(per_node * spec.nodes / host_budget)  # the shards scale with 1 / world
        return (
            f"does NOT fit: host memory ~{per_node:.0f} GiB per node for the offloaded shards, "
            f"over the {host_budget:.0f} GiB usable of {NODE_HOST_LABEL}; the GPU share fits "
            f"{label} (~{est.peak / 2**30:.0f} GiB of {(1 - HEADROOM) * gib:.1f} usable per GPU; "
            "estimate, not simulated: scaffold plan cannot simulate --tricks cpu-offload); over "
            f"--nodes {nodes} the shards would fit the hosts"
        )
    return format_estimate(est, label, gib, note=note, fits=gpu_fits and host_fits)


def _plan_summary(spec: Spec, gpu: tuple[str, float] | None, text: str) -> None:
    """After `scaffold new`: the simulated per-GPU memory and verdict (with --gpu-memory), or
    the arithmetic estimate's verdict for an h100-80 (`generator.plan_estimate`, well under a
    second) with the `scaffold plan` command that simulates it. A spec the planner cannot
    simulate says why with --gpu-memory; it never fails `new` (the script is already written)."""
    from generator.plan import (
        GPU_MEMORY_GIB,
        PlanError,
        check_simulable,
        estimate,
        format_estimate,
        format_result,
        is_grpo,
        plan_command,
        simulate,
    )
    from generator.spec import build_answers

    answers = build_answers(spec)
    mbs, seq = answers["micro_batch_size"], answers["max_seq_len"]
    batch = f"micro-batch {mbs} x {seq} tokens"
    if ALGOS[spec.algo].skeleton in ("dpo", "rm"):  # a pair is two sequences (chosen, rejected)
        batch = f"micro-batch {mbs} pair(s) x 2 x {seq} tokens"
    if is_grpo(spec):  # the script's Config: its rollout lengths, not the model's max_seq_len
        mbs, seq, batch = None, None, "the script's rollouts"
    try:
        check_simulable(spec, mbs, seq)
    except PlanError as e:
        label, gib = gpu or ("h100-80", GPU_MEMORY_GIB["h100-80"])
        line = cpu_offload_estimate(spec, text, mbs, seq, label, gib)
        if line is not None:  # the simulation cannot place host memory; the estimate can
            click.echo(f"memory per GPU: {line}")
            return
        if gpu is not None:
            click.echo(f"memory per GPU: not simulated: {e}")
        return
    try:
        if gpu is None:
            command = plan_command(spec, "h100-80")
            try:
                e = estimate(spec, text, mbs, seq, GPU_MEMORY_GIB["h100-80"])
            except (KeyError, ValueError, ZeroDivisionError):  # a Config the estimate cannot read
                click.echo(f"memory per GPU: {command}")
                return
            line = format_estimate(e, "h100-80", GPU_MEMORY_GIB["h100-80"], command)
            click.echo(f"memory per GPU: {line}")
            return
        click.echo(f"simulating memory per GPU ({batch}) ...", err=True)
        (result,) = simulate([spec], mbs, seq)
    except PlanError as e:
        if gpu is not None:
            click.echo(f"memory per GPU: not simulated: {e}")
        return
    click.echo(format_result(result, *gpu))


@cli.command()
@click.argument("directory", required=False, metavar="[DIR]")
@spec_options
@click.option(
    "--micro-batch-size",
    type=int,
    default=None,
    help="Sequences per rank per forward [default: the script's Config default].",
)
@click.option(
    "--max-seq-len",
    type=int,
    default=None,
    help="Tokens per sequence [default: the script's Config default]. --algo grpo: prompt + "
    "completion tokens per rollout; the prompt keeps max_prompt_len, the completion "
    "(max_new_tokens) gets the rest.",
)
@click.option(
    "--kl-coef",
    type=float,
    default=None,
    help="--algo grpo / grpo-lora: > 0 adds the KL reference the script then uses (grpo: a "
    "frozen model it builds; grpo-lora: the policy with its adapters off, no second model) "
    "[default: the script's Config, 0: none].",
)
@click.option(
    "--gpu-memory",
    default="h100-80",
    show_default=True,
    help="Memory per GPU: a number of GiB or a name: "
    + ", ".join(f"{n} ({g:g})" for n, g in GPU_MEMORY_GIB.items())
    + ".",
)
@click.option(
    "--suggest/--no-suggest",
    default=True,
    show_default=True,
    help="If it does not fit, simulate added tricks and more GPUs (cheapest first) and print "
    "the smallest change that fits.",
)
@_friendly
def plan(
    directory, algo, peft, model, tricks, gpus, nodes, tp, cp, cp_mode, dp_replicate, ep, dtype,
    engine_gpus, engine_tp, layout, micro_batch_size, max_seq_len, kl_coef, gpu_memory, suggest,
):  # fmt: skip
    """Per-GPU peak memory of the script `scaffold new` would write (or of DIR/train.py), simulated.

    \b
    Runs the rendered script's own model build and two training steps under fake tensors
    (no memory, no GPU) with a fake process group of gpus x nodes ranks, and PyTorch's memory
    tracker; prints parameters, gradients, optimizer state, activations, temporaries and the
    peak of one rank, a fits / does not fit verdict, and what would make it fit.
    --algo grpo / grpo-lora: the trainer's (gpus - engine_gpus) x nodes ranks, stepping on
    rollouts of the script's lengths; the rollout engines' memory is a computed estimate beside
    it, each phase of the layout printed (--layout colocated: the verdict is the largest of the
    trainer step, the generation and the weight sync). --tricks cpu-offload: host memory is not
    something the simulation can tell apart, so the verdict is the arithmetic estimate's, of
    the GPU's share and of the offloaded shards per node against a 2 TB node's host memory.
    --tricks compile and offload are not simulated (inductor's fusion, a side stream's host
    copies): plan says so, and the plan without them is an upper bound; nor is packing on the
    GRPO skeleton (its layout is read from the rollouts on the host). --algo qlora counts
    its NF4 base as torchao stores it, --algo kd its teacher (the script's Config teacher: the
    student itself unless DIR's spec or `scaffold new --teacher` names one) whole on every rank.
    Mixture-of-experts models (experts FSDP-sharded, or --ep) are simulated with every
    expert getting tokens x top_k / num_experts of a rank's tokens (balanced routing, said on
    the report line): a real router's imbalance adds to it under --ep.

    \b
    With DIR (a directory `scaffold new` wrote): DIR's spec and DIR/train.py as you edited it,
    its own functions and Config defaults (micro_batch_size, max_seq_len, dtype, lora_rank,
    kl_coef, ...); --micro-batch-size, --max-seq-len and --kl-coef still override, the spec
    options do not apply (change those with `scaffold regen DIR --set`). Suggestions are
    renders with your Config edits carried over, printed as the `scaffold regen` to run.

    \b
    Examples:
      scaffold plan --model llama3.3-70b --gpus 8 --gpu-memory h200-141
      scaffold plan runs/demo --gpu-memory 24
      scaffold plan --model smollm2-135m --tricks ac,lce --micro-batch-size 8 --gpu-memory 24
      scaffold plan --algo grpo --model llama3.3-70b --gpus 8 --gpu-memory h200-141
    """
    from generator.plan import check_simulable, format_result, format_suggestion, is_grpo, simulate
    from generator.plan import fits as plan_fits
    from generator.plan import suggest as plan_suggest
    from generator.render import render
    from generator.spec import build_answers

    gpu_label, gpu_gib = parse_gpu_memory(gpu_memory)
    mbs, seq = micro_batch_size, max_seq_len
    script = None
    if directory is not None:  # the script's Config gives what the options leave None
        spec, script = _planned_dir(directory, click.get_current_context())
        build_answers(spec)  # validates the spec
    else:
        spec = spec_from_options(
            algo, peft, model, tricks, gpus, nodes, tp, cp, dp_replicate, ep, dtype, None, None,
            engine_gpus, engine_tp, layout=layout, fit_gpu=(gpu_label, gpu_gib), cp_mode=cp_mode,
        )  # fmt: skip
        if spec.fit_for:
            click.echo(recipe_line(spec))
        answers = build_answers(spec)  # validates the spec
        if not is_grpo(spec):  # GRPO's defaults are its script's Config (rollout lengths)
            mbs = answers["micro_batch_size"] if mbs is None else mbs
            seq = answers["max_seq_len"] if seq is None else seq
    text = script.read_text() if script is not None else render(spec)
    line = cpu_offload_estimate(spec, text, mbs, seq, gpu_label, gpu_gib)
    if line is not None:  # the simulation cannot place host memory; the estimate can
        click.echo(f"memory per GPU: {line}")
        return
    check_simulable(spec, mbs, seq, kl_coef)
    progress = lambda line: click.echo(f"simulating {line} ...", err=True)  # noqa: E731
    (result,) = simulate([spec], mbs, seq, progress, kl_coef, scripts=[script])
    click.echo(format_result(result, gpu_label, gpu_gib))
    if suggest and not plan_fits(result, gpu_gib):
        s = plan_suggest(result, gpu_gib, mbs, seq, progress)
        click.echo(format_suggestion(s, result.spec, directory))


def _planned_dir(directory: str, ctx: click.Context) -> tuple[Spec, Path]:
    """`scaffold plan DIR`: DIR's spec and the path of its train.py, checked.

    Raises:
        ScaffoldError: a spec option given beside DIR, DIR without a spec or a train.py, a
            pending regen, or conflict markers in train.py.
    """
    from generator.regen import marker_lines, refuse_if_pending

    d = Path(directory)
    given = [
        f"--{p.name.replace('_', '-')}"
        for p in ctx.command.params
        if p.name in SPEC_OPTION_NAMES
        and ctx.get_parameter_source(p.name) is not click.core.ParameterSource.DEFAULT
    ]
    if given:
        raise ScaffoldError(
            f"{', '.join(given)} given with DIR: `scaffold plan {d}` plans the spec recorded in "
            f"{d / SPEC_FILE} and {d / SCRIPT}; change it with `scaffold regen {d} --set ...` "
            "first, or plan the options without DIR"
        )
    spec_path, script = d / SPEC_FILE, d / SCRIPT
    if not spec_path.is_file():
        raise ScaffoldError(
            f"scaffold plan {d}: {spec_path} is missing, so {d} is not a directory `scaffold new` "
            "wrote; give one that is, or plan options without DIR (scaffold plan --model ...)"
        )
    spec = Spec.from_json(spec_path.read_text(), source=str(spec_path))
    refuse_if_pending(d)  # its train.py is (half) a render of the staged spec, not of this one
    if not script.is_file():
        raise ScaffoldError(f"scaffold plan {d}: {script} is missing; the plan simulates it")
    with open(script, newline="") as f:
        markers = marker_lines(f.read().replace("\r\n", "\n"))
    if markers:
        raise ScaffoldError(
            f"scaffold plan {d}: {script} has conflict markers at line(s) "
            f"{', '.join(map(str, markers))}; resolve them first (it must run to be planned)"
        )
    return spec, script


@cli.command("list")
@click.argument("what", required=False, type=click.Choice(["models", "algos", "tricks", "support"]))
def list_(what):
    """List known models, algorithms, tricks, and the support table (which algorithm takes which
    trick and parallel plan; every "no" with its reason)."""
    from generator.spec.validate import model_args_class

    ModelArgs = model_args_class()

    if what in (None, "models"):
        click.echo(
            f"{'model':16} {'family':10} {'params':>9} {'context':>8} {'bf16 weights':>13}  source"
        )
        for e in MODELS.values():
            n = ModelArgs.from_hf_config(e.config, source=f"catalog:{e.name}").num_params()
            ctx = e.config["max_position_embeddings"]
            click.echo(
                f"{e.name:16} {e.family:10} {n / 1e9:8.2f}B {ctx:8d} {n * 2 / 2**30:9.1f} GiB  "
                f"{e.source}: {e.hf_repo_id}"
            )
    if what in (None, "algos"):
        click.echo("\nalgorithms:" if what is None else "algorithms:")
        for algo in ALGOS.values():
            click.echo(f"  {algo.name:10} {algo.summary}")
        click.echo(f"  --peft (with --algo {'/'.join(PEFT_ALGOS)}):")
        for name, summary in PEFT_METHODS.items():
            click.echo(f"    {name:8} {summary}")
    if what in (None, "tricks"):
        click.echo("\ntricks:" if what is None else "tricks:")
        width = max(len(name) for name in TRICKS)
        for t in TRICKS.values():
            click.echo(f"  {t.name:{width}} {t.summary}")
        refused = sorted({tuple(sorted((t.name, o))) for t in TRICKS.values() for o in t.conflicts})
        if refused:
            click.echo("  refused together: " + ", ".join(f"{a}+{b}" for a, b in refused))
    if what in (None, "support"):
        _echo_support_table(header=what is None)


def _echo_support_table(header: bool) -> None:
    """The support table: a row per trick and plan, a column per algorithm, then each "no"."""
    rows = support_table()
    algos = list(ALGOS)
    click.echo(
        "\nsupport (yes / no: reason below):" if header else "support (yes / no: reason below):"
    )
    width = max(len(name) for name, _ in rows)
    click.echo(f"  {'':{width}} " + " ".join(f"{a:>9}" for a in algos))
    for name, cells in rows:
        marks = ("yes" if cells[a] is None else "no" for a in algos)
        click.echo(f"  {name:{width}} " + " ".join(f"{m:>9}" for m in marks))
    for name, cells in rows:
        reasons: dict[str, list[str]] = {}
        for a in algos:
            if cells[a] is not None:
                reasons.setdefault(cells[a], []).append(a)
        for why, names in reasons.items():
            click.echo(f"  no: {name} with {', '.join(names)}: {why}")


_SET_HELP = (
    "Change one option of the recorded spec (repeatable): "
    f"{', '.join(k for k in SETTABLE if k != 'tricks')}, tricks (comma list; `tricks=` for none). "
    "Validated like `scaffold new`."
)


@cli.command()
@click.argument(
    "paths",
    nargs=-1,
    required=True,
    metavar="DIR...",
    type=click.Path(exists=True, file_okay=False),
)
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option(
    "--to-version",
    default="current",
    show_default=True,
    type=click.Choice(["current"]),
    help="Template release to move to (only the installed one can be rendered).",
)
@click.option(
    "--check",
    is_flag=True,
    help="Exit non-zero if any train.py under PATHS differs from a fresh render of its spec "
    "(or a regen there is unfinished).",
)
@click.option(
    "--continue",
    "continue_",
    is_flag=True,
    help="Finish a regen that left conflicts, once its markers are gone: the new spec and "
    "merge bases become DIR's.",
)
@click.option(
    "--abort",
    is_flag=True,
    help="Undo a regen that left conflicts: train.py, launch files, spec and bases as before it.",
)
@_friendly
def regen(paths, settings, to_version, check, continue_, abort):
    """Merge a new render of DIR's spec (changed by --set) into DIR/train.py, keeping your edits.

    \b
    3-way merge: base = DIR/.scaffold/train.py.base (the render you started from), yours =
    DIR/train.py, new = the render of the updated spec (launch/ files likewise). On a conflict
    train.py gets <<<<<<< / ||||||| / ======= / >>>>>>> markers, your previous file is kept as
    train.py.orig, the exit status is 1, and the new spec and bases wait in .scaffold/pending/:
    resolve the markers and run `scaffold regen DIR --continue`, or undo the regen with
    `scaffold regen DIR --abort`. Until then regen, diff and plan on DIR refuse.

    \b
    Examples:
      scaffold regen runs/demo --set tricks=ac --set gpus=8
      scaffold regen runs/demo --continue  # after resolving the conflicts
      scaffold regen runs/demo --abort     # or: back to before the regen
      scaffold regen --check examples      # CI: every example matches a fresh render
    """
    flags = [
        f for f, on in (("--check", check), ("--continue", continue_), ("--abort", abort)) if on
    ]
    if len(flags) > 1:
        raise ScaffoldError(f"{' and '.join(flags)} exclude each other; give one")
    if flags and settings:
        raise ScaffoldError(
            f"{flags[0]} takes no --set: "
            + (
                "it re-renders the recorded specs as they are"
                if check
                else "it finishes or undoes the regen already started"
            )
        )
    if check:
        _regen_check(paths)
        return
    from generator.regen import ConflictError, abort_regen, apply, continue_regen, plan

    if len(paths) != 1:
        raise ScaffoldError(
            f"regen merges into one DIR at a time; got {len(paths)} ({' '.join(paths)})"
        )
    if continue_:
        done = continue_regen(paths[0])
        click.echo(
            f"finished the regen of {done.directory} ({done.changes}): its spec and merge bases "
            "are the new render's; your resolved files are kept"
        )
        return
    if abort:
        done = abort_regen(paths[0])
        restored = sorted(n for n, was in done.written.items() if was["existed"])
        removed = sorted(n for n, was in done.written.items() if not was["existed"])
        click.echo(
            f"aborted the regen of {done.directory} ({done.changes}): restored "
            f"{', '.join(restored) or 'nothing'}"
            + (f", removed {', '.join(removed)}" if removed else "")
            + "; spec and merge bases as before"
        )
        return
    p = plan(paths[0], settings, to_version)
    script = p.directory / SCRIPT
    if p.up_to_date:
        click.echo(
            f"{script} is up to date with its spec and scaffold {__version__}; nothing to merge"
        )
        return
    apply(p)
    changes = "; ".join(p.spec_changes()) or "template update only"
    conflicts = p.conflicts()
    if not conflicts:
        click.echo(
            f"merged the new render into {script} and {p.directory / 'launch'} ({changes}); "
            "your edits are kept"
        )
        defaults = p.default_changes()
        if defaults:
            click.echo(
                f"Config defaults the new render changed (you had not edited them): "
                f"{', '.join(defaults)}; `scaffold plan {p.directory}` re-checks the memory"
            )
        return
    for path, c in conflicts:
        click.echo(c.describe(str(path)), err=True)
    files = sorted({str(path) for path, _ in conflicts})
    d = p.directory
    raise ConflictError(
        f"{len(conflicts)} conflicting region(s) in {', '.join(files)} ({changes}): edit each "
        f"marked region, delete the markers and run `scaffold regen {d} --continue`, or undo "
        f"the regen with `scaffold regen {d} --abort`; your previous file(s): "
        f"{', '.join(f + '.orig' for f in files)}"
    )


def _regen_check(paths) -> None:
    from generator.regen import read_pending
    from generator.render import render, render_launch

    dirs = find_run_dirs(paths)
    if not dirs:
        raise ScaffoldError(f"no {SPEC_FILE} under {', '.join(paths)}")
    drifted, edited, unfinished = [], [], []
    for d in dirs:
        pending = read_pending(d)
        if pending is not None:  # its files are half the new render's: comparing them says nothing
            click.echo(
                f"unfinished: {d} has a regen in progress ({pending.changes}); run "
                f"{pending.ways_out()}",
                err=True,
            )
            unfinished.append(d)
            continue
        spec = Spec.from_json((d / SPEC_FILE).read_text(), source=str(d / SPEC_FILE))
        files = rendered_files(render(spec), render_launch(spec))
        differ = {
            name
            for name, content in files.items()
            if not (d / name).is_file() or (d / name).read_text() != content
        }
        for name in sorted(differ):
            # a user file whose merge base is the fresh render differs by the user's edits only:
            # `scaffold regen` has nothing to merge there (it says "up to date"), so say so
            base = str(BASE_FILE) if name == SCRIPT else str(LAUNCH_BASE_DIR / name)
            if base in files and base not in differ and (d / name).is_file():
                edited.append(str(d / name))
            else:
                drifted.append(str(d / name))
    for path in drifted:
        click.echo(f"drift: {path} differs from a fresh render of its spec", err=True)
    for path in edited:
        click.echo(
            f"edited: {path} differs from a fresh render by your edits only (its merge base is "
            "that render: `scaffold regen` has nothing to merge)",
            err=True,
        )
    if unfinished and not (drifted or edited):
        raise click.ClickException(
            f"{len(unfinished)} directory(ies) with an unfinished regen (listed above); finish "
            "or undo each with `scaffold regen DIR --continue` / `--abort`"
        )
    if drifted or edited:
        also = f" and {len(unfinished)} directory(ies) with an unfinished regen" * bool(unfinished)
        ways = []
        if drifted:
            ways.append(
                f"{len(drifted)} file(s) out of date: update each directory with `scaffold regen "
                "DIR` (keeps your edits), or overwrite it with the `scaffold new ... --force` "
                "command in its train.py header"
            )
        if edited:
            ways.append(
                f"{len(edited)} file(s) edited by hand: --check wants every file as rendered "
                "(the checked-in examples); `scaffold diff DIR` shows nothing to merge for them"
            )
        raise click.ClickException("; ".join(ways) + also)
    click.echo(f"{len(dirs)} script(s) match their templates")


@cli.command("diff")
@click.argument(
    "directory", required=False, metavar="[DIR]", type=click.Path(exists=True, file_okay=False)
)
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option(
    "--spec",
    "specs",
    multiple=True,
    type=click.Path(exists=True),
    help="A spec.json (or a directory with .scaffold/spec.json); give it twice to compare two renders.",
)
@_friendly
def diff_(directory, settings, specs):
    """Print the unified diff `scaffold regen DIR` would apply to DIR/train.py; write nothing.

    \b
    Examples:
      scaffold diff runs/demo --set tricks=ac
      scaffold diff --spec a/.scaffold/spec.json --spec b/.scaffold/spec.json
    """
    from generator.regen import plan, unified_diff

    if specs:
        if directory or settings or len(specs) != 2:
            raise ScaffoldError(
                "--spec compares two renders: give exactly two --spec, and no DIR or --set"
            )
        from generator.render import render

        texts = []
        for s in specs:
            path = Path(s) / SPEC_FILE if Path(s).is_dir() else Path(s)
            texts.append(render(Spec.from_json(path.read_text(), source=str(path))))
        click.echo(unified_diff(texts[0], texts[1], specs[0], specs[1]), nl=False)
        return
    if not directory:
        raise ScaffoldError(
            "give DIR (what regen would change) or two --spec files (how two renders differ)"
        )
    p = plan(directory, settings)
    script = str(p.directory / SCRIPT)
    click.echo(unified_diff(p.ours, p.result.text, script, f"{script} (after regen)"), nl=False)
    if p.result.text == p.ours:
        click.echo(f"regen would not change {script}", err=True)
    for c in p.result.conflicts:
        click.echo(f"regen would conflict: {c.describe(script)}", err=True)


@cli.command()
@_friendly
def assets():
    """Build the embedded real model and data in $SCAFFOLD_HOME (default ~/.cache/scaffold)."""
    from generator.assets import ensure_chain_sum, ensure_dataset, ensure_smollm2

    ensure_dataset("alpaca_en_demo.json")
    ensure_dataset("dpo_en_demo.json")
    ensure_chain_sum()
    ensure_smollm2()


@cli.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out", default=None, help="PNG path (default RUN_DIR/metrics.png).")
@_friendly
def plot(run_dir, out):
    """Draw what RUN_DIR/metrics.jsonl (or RUN_DIR/out/metrics.jsonl) logs into a PNG: one panel
    per logged quantity, smoothed train curves over the raw ones, the run's command as title."""
    from generator.plot import plot_metrics

    path = plot_metrics(Path(run_dir), Path(out) if out else None)
    click.echo(f"wrote {path}")


def main():
    cli(prog_name="scaffold")


if __name__ == "__main__":
    main()
