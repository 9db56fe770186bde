"""The default recipe (`generator.recipe`): what `scaffold new` writes when --tricks is not given.

The 70B defaults on 8 x h100-80 are simulated (`scaffold plan`'s figure) and must fit; the choice
order, the plain default of small models, `--tricks none`, explicit tricks and the header's
table are checked on the arithmetic alone."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from generator.cli import cli
from generator.options import spec_from_options
from generator.plan import ESTIMATE_TOLERANCE, estimate, fits, simulate
from generator.plan_report import grpo_phases
from generator.recipe import RECIPE_MARGIN, candidates, choose_recipe, precision_rank
from generator.render import render
from generator.spec import Spec, SpecError
from tests.helpers import REPO

H100 = ("h100-80", 79.6)


def _default(algo: str, model: str = "llama3.3-70b", gpus: int = 8, tricks=None, **kw) -> Spec:
    """The spec `scaffold new --algo ALGO --model MODEL --gpus GPUS` writes (h100-80)."""
    return spec_from_options(
        algo, "lora", model, tricks, gpus, 1, 1, 1, 1, 1, "bf16", None, "o", fit_gpu=H100, **kw
    )


def test_70b_defaults_are_the_least_lossy_fitting_recipes():
    """SFT keeps fp32 master weights with 8-bit state (fp32 state does not fit with every memory
    trick); LoRA needs only ac; DPO takes the precomputed reference; GRPO goes colocated on all 8 GPUs with bf16-sr and 8-bit state
    (the split layout's 4 trainer ranks would need 4-bit state, a lower precision rank);
    grpo-lora's split script needs only ac (at the multi-GPU rows of 512 + 1024 tokens)."""
    sft = _default("sft")
    assert (sft.tricks, sft.fit_for) == (("ac", "optim-in-bwd", "adamw8bit"), "h100-80")
    assert _default("lora").tricks == ("ac",)
    grpo = _default("grpo")
    assert grpo.tricks == ("ac", "adamw8bit", "bf16-sr")
    assert (grpo.layout, grpo.engine_gpus, grpo.engine_tp) == ("colocated", 0, 8)
    lora = _default("grpo-lora")
    assert (lora.tricks, lora.fit_for, lora.layout) == (("ac",), "h100-80", "split")
    # DPO: the precomputed reference (no second model resident) with 4-bit state (8-bit's
    # estimate, 68 GiB, is over the 90% margin); dpo-lora's adapters-off reference needs only ac
    dpo = _default("dpo")
    assert dpo.tricks == ("ac", "optim-in-bwd", "adamw4bit")
    assert 'ref_mode: str = "precomputed"' in render(dpo)
    assert 'ref_mode: str = "separate"' in render(_default("dpo", tricks="none"))
    assert _default("dpo-lora").tricks == ("ac",)


def test_the_choice_is_the_first_fitting_candidate_in_precision_order():
    """Every candidate before the chosen one does not fit; none of a better precision rank does."""
    plain = spec_from_options("sft", "lora", "llama3.3-70b", None, 8, 1, 1, 1, 1, 1, "bf16")
    found = candidates(plain, H100[1])
    assert found[0].tricks == () and not found[0].fits
    chosen = next(i for i, c in enumerate(found) if c.fits)
    assert found[chosen].tricks == _default("sft").tricks
    assert all(precision_rank(c.tricks) <= 1 for c in found[:chosen])
    ranks = [precision_rank(c.tricks) for c in found[1:]]
    assert ranks == sorted(ranks)
    budget = RECIPE_MARGIN * 0.9 * H100[1] * 2**30
    assert found[chosen].peak <= budget < min(c.peak for c in found[:chosen])


def test_one_backward_pass_comes_first_at_each_precision():
    """Among the candidates of one precision (which learn alike) on one layout, every set without
    optim-in-bwd (whose clipping runs each micro-batch twice per step) is tried before any set with
    it, however many tricks it adds: on 70B SFT, (ac, lce) before (optim-in-bwd) alone."""
    plain = spec_from_options("sft", "lora", "llama3.3-70b", None, 8, 1, 1, 1, 1, 1, "bf16")
    found = candidates(plain, H100[1])[1:]  # the plain script first, then the recipe order
    for rank in range(6):
        at_rank = [c.tricks for c in found if precision_rank(c.tricks) == rank]
        passes = ["optim-in-bwd" in t for t in at_rank]
        assert passes == sorted(passes), (rank, at_rank)  # False (one pass) first
    order = [c.tricks for c in found]
    assert order.index(("ac", "lce")) < order.index(("optim-in-bwd",))


@pytest.mark.parametrize(
    "algo, cost", [("sft", True), ("dpo", True), ("lora", False), ("dpo-lora", False)]
)
def test_scaffold_new_says_what_a_second_backward_pass_costs(algo, cost, tmp_path):
    """The 70B SFT and DPO defaults on 8 x h100-80 must take optim-in-bwd (no set of their
    precision fits without it): `scaffold new` and the script's header say it runs forward and
    backward twice per step, and how to keep one pass; the LoRA defaults (ac) say nothing."""
    out = tmp_path / "o"
    args = ["new", "--algo", algo, "--model", "llama3.3-70b", "--gpus", "8", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    said = "runs each micro-batch's forward and backward twice per step"
    assert (said in result.output) == cost, result.output
    assert (said in " ".join((out / "train.py").read_text().split())) == cost
    if cost:
        assert "--max_grad_norm 0 in the script keeps one pass" in result.output


@pytest.mark.slow
def test_70b_defaults_fit_h100_80_in_the_simulation():
    """`scaffold plan`'s simulated figure (the trainer peak; GRPO: the largest colocated phase)
    of each 70B default fits an h100-80 with the 10% headroom, and the estimate that chose it is
    within ESTIMATE_TOLERANCE of it (printed: benchmarks/RESULTS.md)."""
    specs = [_default(algo) for algo in ("sft", "lora", "dpo", "dpo-lora", "grpo")]
    for result in simulate(specs, None, None):  # dpo: the render's precomputed reference
        simulated = result.peak
        if result.rollout is not None:  # GRPO: the largest phase of its layout
            simulated = grpo_phases(result.rollout, result.peak, H100[1])["verdict"]
        estimated = estimate(result.spec, render(result.spec), gpu_gib=H100[1]).peak
        print(f"{result.spec.algo} {','.join(result.spec.tricks)}: simulated "
              f"{simulated / 2**30:.2f} GiB, estimated {estimated / 2**30:.2f} GiB")  # fmt: skip
        assert fits(result, H100[1]), (result.spec, simulated / 2**30)
        assert abs(estimated - simulated) <= ESTIMATE_TOLERANCE * simulated


def test_small_models_and_fitting_specs_keep_the_plain_script():
    """The plain script fits (SmolLM2 on CPU, 8B on 8 GPUs), the estimate's regime is not met
    (hidden < 1024), fp32 asks for fp32, or the algorithm is outside the estimate (kd, qlora):
    no tricks are added and nothing is recorded."""
    for spec in (
        _default("sft", "smollm2-135m", 1),
        _default("grpo", "smollm2-135m", 1),
        _default("sft", "llama3.1-8b", 8),
        _default("kd"),
        _default("qlora"),
        _default("dpo", "smollm2-135m", 1),
        spec_from_options(
            "sft", "lora", "llama3.3-70b", None, 8, 1, 1, 1, 1, 1, "fp32", fit_gpu=H100
        ),  # fmt: skip
    ):
        assert (spec.tricks, spec.fit_for) == ((), ""), spec


def test_explicit_tricks_and_none_are_kept():
    assert _default("sft", tricks="none").tricks == ()
    assert _default("sft", tricks="ac").tricks == ("ac",)
    assert _default("sft", tricks="").tricks == ()
    with pytest.raises(SpecError, match="`none` means no tricks"):
        _default("sft", tricks="none,ac")
    # an explicit GRPO layout is kept; on the split layout's 4 trainer ranks no recipe fits (16
    # micro-batches accumulate every gradient, bf16-sr's 2 bytes included), so the spec stays as
    # asked and `scaffold plan`'s search suggests more GPUs; 405B on 8 GPUs likewise
    split = _default("grpo", layout="split")
    assert (split.layout, split.tricks, split.fit_for) == ("split", (), "")
    assert choose_recipe(_default("sft", "llama3.1-405b", 8, tricks="none"), H100).tricks == ()


def test_new_prints_the_recipe_and_the_header_says_why(tmp_path):
    out = tmp_path / "r70"
    result = CliRunner().invoke(
        cli, ["new", "--model", "llama3.3-70b", "--gpus", "8", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "recipe: --tricks ac,optim-in-bwd,adamw8bit (the plain script does not fit h100-80" in (
        result.output
    )
    assert "memory per GPU: fits on h100-80" in result.output
    text = (out / "train.py").read_text()
    assert "- Recipe: `scaffold new` chose these tricks (no --tricks given) for h100-80" in text
    header = text[: text.index('"""', 3)]
    assert "fp32 weights, fp32 AdamW state, (none): 4 + 4 + 8 = 16 B, ~166 GiB per GPU" in header
    assert "ac,optim-in-bwd,adamw8bit: 4 + 0 + 2 = 6 B, ~62 GiB per GPU,\n    fits" in header
    assert "--tricks ac,optim-in-bwd,adamw8bit" in header  # the command reproduces the tricks
    spec = json.loads((out / ".scaffold" / "spec.json").read_text())["spec"]
    assert (spec["tricks"], spec["fit_for"]) == (["ac", "optim-in-bwd", "adamw8bit"], "h100-80")
    # regen keeps the recorded recipe (and its header) as written
    again = CliRunner().invoke(cli, ["regen", str(out), "--check"])
    assert again.exit_code == 0, again.output
    # the recorded why stays through other changes and goes when the tricks are set by hand
    kept = CliRunner().invoke(cli, ["regen", str(out), "--set", "dataset=other.json"])
    assert kept.exit_code == 0, kept.output
    assert "- Recipe: `scaffold new` chose" in (out / "train.py").read_text()
    mine = CliRunner().invoke(cli, ["regen", str(out), "--set", "tricks=ac,lce"])
    assert mine.exit_code == 0, mine.output
    spec = json.loads((out / ".scaffold" / "spec.json").read_text())["spec"]
    assert (spec["tricks"], spec["fit_for"], spec["fit_note"]) == (["ac", "lce"], "", [])
    assert "- Recipe:" not in (out / "train.py").read_text()


@pytest.mark.parametrize(
    "args",
    [
        ["--algo", "grpo"],
        ["--algo", "grpo", "--model", "llama3.3-70b", "--gpus", "8"],
        ["--algo", "dpo", "--model", "llama3.3-70b", "--gpus", "8"],
    ],
    ids=["grpo-smollm2", "grpo-70b-chooser", "dpo-70b-chooser"],
)
def test_scaffold_new_never_imports_torch(args, tmp_path):
    """`scaffold new` renders, chooses a recipe and gives its fit verdict by arithmetic: it never
    imports torch (the runtime package's import alone took 8 s of a 9 s `scaffold new --algo
    grpo` on 2 cores), so it answers in about a second, as the README says."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from generator.cli import cli\n"
        f"result = CliRunner().invoke(cli, ['new', *{args!r}, '--out', {str(tmp_path / 'o')!r}])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('runtime')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
