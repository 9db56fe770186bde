"""`scaffold plan`: per-rank peak memory of the emitted training step, simulated with fake tensors,
and the cheapest change that makes a run fit.

Three modules, bottom up: `generator.plan_harness` runs the script's step under fake tensors (the
only code that touches private torch APIs), `generator.plan_report` gives the verdict and the
text, and this module searches for added tricks or more GPUs that fit (`suggest`). This module is
also the planner's public face: the CLI, the tests and benchmarks/plan.py import from here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from generator.features import TRICKS, refusal
from generator.plan_estimate import (
    ESTIMATE_TOLERANCE,
    Estimate,
    estimate,
    estimate_fits,
    format_estimate,
)
from generator.plan_harness import (
    GIB,
    PlanError,
    PlanResult,
    check_simulable,
    config_with,
    describe_spec,
    engine_layout,
    import_script,
    is_dpo,
    is_grpo,
    measure_dpo_step,
    measure_grpo_step,
    measure_step,
    model_dir_for,
    simulate,
)
from generator.plan_report import (
    GPU_MEMORY_GIB,
    HEADROOM,
    engine_estimate,
    fits,
    format_result,
    parse_gpu_memory,
    plan_command,
)
from generator.spec import ScaffoldError, Spec, model_config, trainer_gpus, validate_spec

__all__ = [
    "is_valid",
    "with_tricks",
    "ESTIMATE_TOLERANCE",
    "Estimate",
    "FIT_TRICKS",
    "GIB",
    "GPU_MEMORY_GIB",
    "HEADROOM",
    "MAX_SUGGESTED_WORLD",
    "PlanError",
    "PlanResult",
    "Suggestion",
    "check_simulable",
    "config_with",
    "describe_spec",
    "engine_estimate",
    "engine_layout",
    "estimate",
    "estimate_fits",
    "fits",
    "format_estimate",
    "format_result",
    "format_suggestion",
    "import_script",
    "is_dpo",
    "is_grpo",
    "measure_dpo_step",
    "measure_grpo_step",
    "measure_step",
    "model_dir_for",
    "parse_gpu_memory",
    "plan_command",
    "simulate",
    "suggest",
]

# Tricks the planner may add to make a run fit, with a rough cost rank (lower = cheaper to turn
# on): lce is free (one more matmul), 8-bit AdamW changes the update slightly, ac costs about 1/3
# more compute, optim-in-bwd rules out gradient accumulation, 4-bit AdamW moves the update most.
FIT_TRICKS = {"lce": 1, "adamw8bit": 2, "ac": 3, "optim-in-bwd": 4, "adamw4bit": 5}
MAX_SUGGESTED_WORLD = 1024  # "more GPUs" doubles the GPU count up to this many in all
# The narrowest model the estimate is checked on (SmolLM2 1.7B, Llama 3.2 1B: hidden 2048); the
# tests' tiny models (hidden 64, where lm_head and the loss are most of the step) are not its
# regime, so their searches simulate every candidate
ESTIMATE_MIN_HIDDEN = 1024


def _candidate_trick_sets(spec: Spec) -> list[tuple[str, ...]]:
    """Trick sets to try, cheapest first: every combination of FIT_TRICKS that the algorithm
    accepts and the registry allows together, added to spec.tricks; ordered by number of added
    tricks, then by summed cost."""
    pool = [
        t for t in FIT_TRICKS
        if t not in spec.tricks and refusal(t, spec.algo) is None
        and not any(o in spec.tricks for o in TRICKS[t].conflicts)
    ]  # fmt: skip
    sets = []
    for n in range(1, len(pool) + 1):
        for combo in itertools.combinations(pool, n):
            if any(o in combo for t in combo for o in TRICKS[t].conflicts):
                continue
            sets.append(combo)
    return sorted(sets, key=lambda c: (len(c), sum(FIT_TRICKS[t] for t in c)))


def with_tricks(spec: Spec, added: tuple[str, ...]) -> Spec:
    """`spec` with `added` tricks, all in registry order (the search's and the recipe's)."""
    order = list(TRICKS)
    return replace(spec, tricks=tuple(sorted((*spec.tricks, *added), key=order.index)))


def is_valid(spec: Spec) -> bool:
    """Whether `validate_spec` accepts `spec`."""
    try:
        validate_spec(spec)
    except ScaffoldError:
        return False
    return True


@dataclass(frozen=True)
class Suggestion:
    """What makes a run fit: added tricks, and a GPU count per node (GRPO: a node count) if
    tricks alone do not."""

    added_tricks: tuple[str, ...]
    gpus: int
    result: PlanResult
    nodes: int | None = None  # None: the base's


def suggest(
    base: PlanResult, gpu_gib: float, micro_batch_size: int | None, max_seq_len: int | None,
    progress=None,
) -> Suggestion | None:  # fmt: skip
    """The cheapest change that fits, found by simulating candidates.

    Tricks: first all candidate tricks together (if even they do not fit, no subset does: each
    trick only removes memory), then the candidate sets in `_candidate_trick_sets` order,
    stopping at the first that fits. Then GPUs: with all candidate tricks, the GPU count per
    node doubles until the run fits (up to MAX_SUGGESTED_WORLD ranks in all). GRPO: more GPUs
    must be more trainer GPUs, so the node count doubles instead (each node keeps its engine
    GPUs; --gpus per node stays what the machines have). Every candidate is a spec
    `validate_spec` accepts; others are skipped. A base planned from a user's script
    (`scaffold plan DIR`) passes its Config edits to every candidate's render, so the candidates
    differ from it only in what is suggested.

    Speed: a candidate whose arithmetic estimate (`generator.plan_estimate`), less
    ESTIMATE_TOLERANCE, is still over the GPU is not simulated (`_ruled_out`); the others of a
    stage are simulated in one child process, which stops at the first that fits.

    Returns:
        The Suggestion, or None if nothing tried fits.
    """
    spec = base.spec
    kl_coef = base.rollout["kl_coef"] if base.rollout else None
    candidates = [c for c in _candidate_trick_sets(spec) if is_valid(with_tricks(spec, c))]
    everything = candidates[-1] if candidates else ()

    def first_fit(specs: list[Spec]) -> PlanResult | None:
        """The first of `specs` whose simulation fits, simulating only those not ruled out."""
        kept = [c for c in specs if not _ruled_out(c, base, gpu_gib, micro_batch_size, max_seq_len)]
        if not kept:
            return None
        results = simulate(
            kept, micro_batch_size, max_seq_len, progress, kl_coef, config=base.config_edits,
            until=lambda r: fits(r, gpu_gib),
        )  # fmt: skip
        return next((r for r in results if fits(r, gpu_gib)), None)

    if candidates:
        full = first_fit([with_tricks(spec, everything)])
        if full is not None:
            cheaper = first_fit([with_tricks(spec, c) for c in candidates[:-1]])
            if cheaper is not None:
                added = tuple(t for t in cheaper.spec.tricks if t not in spec.tricks)
                return Suggestion(added, spec.gpus, cheaper)
            return Suggestion(everything, spec.gpus, full)
    if is_grpo(spec):
        bigger = (replace(spec, nodes=spec.nodes * 2**k) for k in itertools.count(1))
    else:
        bigger = (replace(spec, gpus=spec.gpus * 2**k) for k in itertools.count(1))
    larger = []
    for candidate in bigger:
        if trainer_gpus(candidate) * candidate.nodes > MAX_SUGGESTED_WORLD:
            break
        candidate = with_tricks(candidate, everything)
        if is_valid(candidate):
            larger.append(candidate)
    result = first_fit(larger)
    if result is None:
        return None
    return Suggestion(everything, result.spec.gpus, result, result.spec.nodes)


def _ruled_out(
    candidate: Spec, base: PlanResult, gpu_gib: float, micro_batch_size: int | None,
    max_seq_len: int | None,
) -> bool:  # fmt: skip
    """The arithmetic estimate, less ESTIMATE_TOLERANCE (its error bound on the tests' matrix),
    is still over the GPU: the candidate cannot fit, so it is not simulated. A plan of a user's
    script (`scaffold plan DIR`, Config edits the estimate does not read) and a model narrower
    than the ones the estimate is checked on (ESTIMATE_MIN_HIDDEN; their simulations take a
    second each) rule nothing out."""
    if base.config_edits or model_config(candidate)["hidden_size"] < ESTIMATE_MIN_HIDDEN:
        return False
    from generator.render import render

    e = estimate(candidate, render(candidate), micro_batch_size, max_seq_len, gpu_gib)
    return e.peak * (1 - ESTIMATE_TOLERANCE) > (1 - HEADROOM) * gpu_gib * GIB


def format_suggestion(s: Suggestion | None, base: Spec, directory: str | None = None) -> str:
    """The suggestion's line; with `directory` (`scaffold plan DIR`) as the `scaffold regen`
    command that makes the change in DIR (its edits kept)."""
    if s is None:
        if is_grpo(base) and base.layout == "colocated":
            tricks = [t for t in FIT_TRICKS if refusal(t, base.algo) is None]
            return (
                f"nothing tried fits: --tricks {','.join(tricks)} (colocated runs on one node: "
                "no more GPUs to try); lower --micro-batch-size or --max-seq-len, set "
                "offload_optimizer or a lower engine_gpu_memory_utilization in the script's "
                "Config (`scaffold plan DIR` plans them), or use --layout split on more nodes"
            )
        if is_grpo(base):
            tricks = [t for t in FIT_TRICKS if refusal(t, base.algo) is None]
            return (
                f"nothing tried fits: --tricks {','.join(tricks)} and up to "
                f"{MAX_SUGGESTED_WORLD} trainer GPUs (doubling --nodes); lower "
                "--micro-batch-size or --max-seq-len, or give the trainer more of each node's "
                "GPUs (fewer --engine-gpus)"
            )
        return (
            "nothing tried fits: all of the tricks " + ", ".join(FIT_TRICKS)
            + f" and up to {MAX_SUGGESTED_WORLD} GPUs; lower --micro-batch-size or --max-seq-len"
        )  # fmt: skip
    r = s.result
    parts = []
    if s.added_tricks:
        parts.append("--tricks " + ",".join(r.spec.tricks))
    if s.gpus != base.gpus:
        parts.append(f"--gpus {s.gpus}" + (f" --nodes {base.nodes}" if base.nodes > 1 else ""))
    if s.nodes is not None and s.nodes != base.nodes:
        parts.append(f"--nodes {s.nodes}")
    per = "trainer rank" if is_grpo(base) else "rank"
    change = " ".join(parts)
    if directory is not None:
        sets = [f"tricks={','.join(r.spec.tricks)}"] if s.added_tricks else []
        sets += [f"gpus={s.gpus}"] if s.gpus != base.gpus else []
        sets += [f"nodes={s.nodes}"] if s.nodes is not None and s.nodes != base.nodes else []
        change = (
            f"{change} (`scaffold regen {directory} "
            + " ".join(f"--set {s}" for s in sets)
            + "`, your Config edits kept)"
        )
    return (
        f"fits with {change}: peak {r.peak / GIB:.2f} GiB per {per} "
        f"(smallest change tried, cheapest first)"
    )
