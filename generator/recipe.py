"""The default memory recipe: the trick set `scaffold new` writes when `--tricks` is not given.

A spec whose plain script fits the target GPU (h100-80 unless `--gpu-memory`) keeps no tricks;
otherwise the recipe is the least lossy trick set whose arithmetic estimate
(`generator.plan_estimate`) fits within RECIPE_MARGIN of the GPU's usable memory. Least lossy
means, in this order:

1. the precision of what is stored (`precision_rank`): fp32 master weights with fp32 AdamW
   state, then 8-bit state, then 4-bit state, then bf16 weights with stochastic rounding
   (bf16-sr: bf16 state, then 8-bit, then 4-bit). Each step down stores fewer bytes per
   trained parameter and tracks fp32 less closely (benchmarks/RESULTS.md, precision recipes);
2. one forward and backward per step: optim-in-bwd with the scripts' gradient clipping runs
   every micro-batch twice (a norm pass, then the stepping pass: about half the throughput), so
   among sets of one precision, which learn alike, every set without it comes first;
3. fewer added tricks;
4. cheaper tricks (`generator.plan.FIT_TRICKS`: lce < ac < optim-in-bwd in compute cost).

The choice is arithmetic (well under a second per spec; no simulation), and the spec records
the GPU it was chosen for (`Spec.fit_for`) so the script's header can show the table of why
(`recipe_rows`). `tests/generator/test_recipe.py` checks by simulation that the 70B defaults
fit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from generator.features import CHOSEN_REF_MODE, TRICKS, refusal
from generator.plan import is_valid, with_tricks
from generator.spec import (
    Spec,
    engine_tp_choices,
    model_config,
    resolve_engine_layout,
)
from generator.spec.core import ROLLOUT_ALGOS

# Algorithms the estimate models (their frozen parts included): the ones a recipe is chosen for.
# kd and qlora keep the plain default: the estimate counts their teacher and NF4 base
# (tests/generator/test_plan_speed.py), but no recipe test has driven them yet.
RECIPE_ALGOS = ("sft", "lora", "dpo", "dpo-lora", "grpo", "grpo-lora")

# The chosen recipe's estimate must fit in this share of the usable memory (after the planner's
# HEADROOM): the estimate is within 15% of the simulation on its test matrix, and 10% under it
# on 70B GRPO colocated with bf16-sr,adamw8bit (67 GiB estimated, 74 simulated: at 0.95 that set
# was chosen and did not fit); tests/generator/test_recipe.py simulates the 70B defaults
RECIPE_MARGIN = 0.90
# The pool a recipe is drawn from (cost order as generator.plan.FIT_TRICKS), then bf16-sr
POOL = ("lce", "adamw8bit", "ac", "optim-in-bwd", "adamw4bit", "bf16-sr")
COST = {"lce": 1, "adamw8bit": 2, "ac": 3, "optim-in-bwd": 4, "adamw4bit": 5, "bf16-sr": 6}
PRECISION_NAMES = (
    "fp32 weights, fp32 AdamW state",
    "fp32 weights, 8-bit AdamW state",
    "fp32 weights, 4-bit AdamW state",
    "bf16 weights (stochastic rounding), bf16 AdamW state",
    "bf16 weights (stochastic rounding), 8-bit AdamW state",
    "bf16 weights (stochastic rounding), 4-bit AdamW state",
)
# The narrowest model the estimate is checked on (as generator.plan.ESTIMATE_MIN_HIDDEN): the
# tests' tiny models keep the plain default
MIN_HIDDEN = 1024


def precision_rank(tricks) -> int:
    """0 (fp32 master weights and AdamW state) .. 5 (bf16-sr with 4-bit state): PRECISION_NAMES."""
    low = 1 if "adamw8bit" in tricks else 2 if "adamw4bit" in tricks else 0
    return low + (3 if "bf16-sr" in tricks else 0)


@dataclass(frozen=True)
class Candidate:
    spec: Spec  # the spec with the candidate's tricks (and GRPO layout), fit_for unset
    peak: int  # estimated bytes per (trainer) GPU
    fits: bool  # within RECIPE_MARGIN of the usable memory, and the engines fit (GRPO)
    ref_mode: str = ""  # dpo: the reference mode estimated ("" = the script's default)

    @property
    def tricks(self) -> tuple[str, ...]:
        return self.spec.tricks


def _layouts(spec: Spec, vary_layout: bool) -> list[Spec]:
    """The spec, and where its GRPO layout was left to the CLI on one node of several GPUs, the
    colocated layout at each valid engine_tp (the engines on every trainer GPU, asleep while it
    steps: all GPUs train, so a large model's shards are half as large as on the split layout's
    half)."""
    out = [spec]
    if vary_layout and spec.algo in ROLLOUT_ALGOS and spec.nodes == 1 and spec.gpus > 1:
        for tp in engine_tp_choices(model_config(spec), spec.gpus):
            out.append(replace(spec, layout="colocated", engine_gpus=0, engine_tp=tp))
    return [s for s in out if is_valid(s)]


def second_backward(tricks) -> bool:
    """Whether a trick set runs each micro-batch's forward and backward twice per step: optim-in-bwd
    under the scripts' default clipping (max_grad_norm 1.0) needs the global norm before any
    parameter steps (`runtime.optim_in_backward`)."""
    return "optim-in-bwd" in tricks


def _sort_key(c: Candidate):
    s = c.spec
    return (
        precision_rank(s.tricks),
        s.layout != "split",
        second_backward(s.tricks),
        len(s.tricks),
        sum(COST.get(t, 0) for t in s.tricks),
        s.engine_tp,
    )


def candidates(spec: Spec, gpu_gib: float, vary_layout: bool = False) -> list[Candidate]:
    """Every valid trick set of POOL (added to spec.tricks), on each layout (`_layouts`), in the
    recipe order (the spec as given first), with its estimate. The Config defaults are read once
    per layout from its plain render (they do not depend on the tricks)."""
    from generator.plan_estimate import estimate
    from generator.plan_report import GIB, HEADROOM
    from generator.render import render_raw

    budget = RECIPE_MARGIN * (1 - HEADROOM) * gpu_gib * GIB
    pool = [
        t for t in POOL
        if t not in spec.tricks and refusal(t, spec.algo) is None
        and not any(o in spec.tricks for o in TRICKS[t].conflicts)
    ]  # fmt: skip
    sets = [()]
    for n in range(1, len(pool) + 1):
        for combo in itertools.combinations(pool, n):
            if not any(o in combo for t in combo for o in TRICKS[t].conflicts):
                sets.append(combo)
    out = []
    ref_mode = CHOSEN_REF_MODE.get(spec.algo, "")
    for layout in _layouts(replace(spec, fit_for="", fit_note=()), vary_layout):
        text = render_raw(layout)
        for added in sets:
            trial = with_tricks(layout, added)
            if added and not is_valid(trial):
                continue
            for mode in ("", ref_mode) if not out and ref_mode else (ref_mode,):
                config = {"ref_mode": mode} if mode else None
                e = estimate(trial, text, gpu_gib=gpu_gib, config=config)
                out.append(Candidate(trial, e.peak, e.peak <= budget and e.engine_ok, mode))
    first, rest = out[0], sorted(out[1:], key=_sort_key)
    return [first, *rest]


def applies(spec: Spec) -> bool:
    """Whether a recipe is chosen for `spec`: an algorithm the estimate models, on a model at
    least MIN_HIDDEN wide (the estimate's regime), in bf16 (bf16-sr and the precision order
    assume it; fp32 asks for fp32)."""
    return (
        spec.algo in RECIPE_ALGOS
        and spec.dtype == "bf16"
        and model_config(spec)["hidden_size"] >= MIN_HIDDEN
    )


def fit_gib(fit_for: str) -> float:
    """GiB of a `Spec.fit_for` label: a name of GPU_MEMORY_GIB, or `--gpu-memory`'s "80 GiB"."""
    from generator.plan_report import GPU_MEMORY_GIB

    return GPU_MEMORY_GIB.get(fit_for) or float(fit_for.split()[0])


def recipe_line(spec: Spec) -> str:
    """`scaffold new` / `scaffold plan`'s line for a chosen recipe ("" if none was chosen)."""
    if not spec.fit_for:
        return ""
    line = (
        f"recipe: --tricks {','.join(spec.tricks)} (the plain script does not fit {spec.fit_for}; "
        "the least lossy set whose estimate fits, chosen because --tricks was not given; the "
        "header lists what was tried; --tricks none keeps the plain script)"
    )
    if second_backward(spec.tricks):
        line += "\n" + SECOND_BACKWARD_COST.format(
            precision=PRECISION_NAMES[precision_rank(spec.tricks)]
        )
    return line


# What `scaffold new` says when the chosen recipe must run two passes per step
SECOND_BACKWARD_COST = (
    "cost: optim-in-bwd with gradient clipping runs each micro-batch's forward and backward twice "
    "per step (a norm pass, then the stepping pass), about half the throughput of one pass; no set "
    "without it fits at this precision ({precision}). --max_grad_norm 0 in the script keeps one "
    "pass, without clipping"
)


def choose_recipe(spec: Spec, gpu: tuple[str, float], vary_layout: bool = False) -> Spec:
    """`spec` with the default recipe for `gpu` (name, GiB): unchanged if it does not apply
    (`applies`), if the spec as given fits, or if no candidate fits (then `scaffold plan`'s
    search suggests more GPUs); else the first fitting candidate (its tricks; GRPO with
    `vary_layout`: also its layout and engine_tp), with `fit_for=name`."""
    if not is_valid(spec) or not applies(spec):  # validate_spec names a bad option first
        return spec
    found = candidates(spec, gpu[1], vary_layout)
    if found[0].fits:
        return spec
    first = next((c for c in found if c.fits), None)
    if first is None:
        return spec
    chosen = replace(first.spec, fit_for=gpu[0])
    return replace(chosen, fit_note=recipe_note(chosen))


def recipe_note(spec: Spec) -> tuple[str, ...]:
    """The header's lines on a recipe chosen for `spec.fit_for` (recorded in the spec, so a regen
    prints the same why): the rule, then each precision tried with its bytes per trained
    parameter and estimate (`recipe_rows`)."""
    from generator.plan_report import HEADROOM

    gib = fit_gib(spec.fit_for)
    lines = [
        f"- Recipe: `scaffold new` chose these tricks (no --tricks given) for {spec.fit_for}: "
        f"{(1 - HEADROOM) * gib:.1f} GiB usable per GPU, a recipe fits when its arithmetic "
        f"estimate is within {RECIPE_MARGIN:.0%} of that (`scaffold plan` simulates it). The "
        "least lossy precision that fits, with the fewest and cheapest tricks; per precision "
        "tried (bytes per trained parameter: weights + gradients + AdamW state):"
    ]
    for precision, tricks, nbytes, peak, fits in recipe_rows(spec):
        verdict = "fits" if fits else "does not fit"
        lines.append(f"  - {precision}, {tricks}: {nbytes} B, ~{peak:.0f} GiB per GPU, {verdict}")
    if second_backward(spec.tricks):
        precision = PRECISION_NAMES[precision_rank(spec.tricks)]
        lines.append(f"  - {SECOND_BACKWARD_COST.format(precision=precision)}")
    return tuple(lines)


def recipe_rows(spec: Spec) -> list[tuple[str, str, str, float, bool]]:
    """The header's table for a spec whose recipe was chosen (`spec.fit_for`): per precision
    rank up to the chosen one, its smallest-estimate trick set (the chosen set on its own rank),
    after the plain script's row: (precision, tricks, weights + gradients + AdamW state bytes
    per trained parameter, estimated GiB per GPU, fits within RECIPE_MARGIN)."""
    gpu_gib = fit_gib(spec.fit_for)
    plain = replace(
        spec, tricks=tuple(t for t in spec.tricks if t not in POOL), fit_for="", fit_note=()
    )
    if spec.layout == "colocated" and spec.algo in ROLLOUT_ALGOS:  # chosen over the split default
        engine_gpus, engine_tp = resolve_engine_layout(replace(plain, layout="split"), None, None)
        plain = replace(plain, layout="split", engine_gpus=engine_gpus, engine_tp=engine_tp)
    found = candidates(plain, gpu_gib, vary_layout=plain.layout != spec.layout)
    chosen = precision_rank(spec.tricks)
    rows = [_row(found[0])]  # the plain script (the spec's own tricks)
    for rank in range(chosen + 1):
        at_rank = [c for c in found if precision_rank(c.tricks) == rank]
        if not at_rank:
            continue
        mine = [
            c for c in at_rank
            if c.spec == replace(spec, fit_for="", fit_note=())
            and c.ref_mode == CHOSEN_REF_MODE.get(spec.algo, "")
        ]  # fmt: skip
        best = mine[0] if mine else min(at_rank, key=lambda c: c.peak)
        if best is not found[0] and _row(best) not in rows:
            rows.append(_row(best))
    return rows


def _row(c: Candidate) -> tuple[str, str, str, float, bool]:
    from generator.plan_harness import trained_bytes
    from generator.plan_report import GIB

    weights, state = trained_bytes(c.tricks)
    # GRPO's micro-batches accumulate every gradient before optimizer-in-backward steps
    grads = 0 if "optim-in-bwd" in c.tricks and c.spec.algo not in ROLLOUT_ALGOS else weights
    layout = ""
    if c.spec.algo in ROLLOUT_ALGOS and c.spec.gpus > 1:
        layout = f" ({c.spec.layout}, engine_tp {c.spec.engine_tp})"
    if c.spec.algo in CHOSEN_REF_MODE:
        layout = f" (reference {c.ref_mode or 'separate'})"
    return (
        PRECISION_NAMES[precision_rank(c.tricks)],
        (",".join(c.tricks) or "(none)") + layout,
        f"{weights} + {grads} + {state:g} = {weights + grads + state:g}",
        c.peak / GIB,
        c.fits,
    )
