"""The compatibility matrix: every algorithm takes every trick its support table allows, and the
math-preserving tricks give that algorithm's plain-script losses and gradient norms.

The SFT skeleton's full sweep is tests/recipes/test_tricks.py; this file runs the other
algorithms (LoRA, QLoRA, KD on the SFT skeleton; DPO and GRPO on theirs) with the tricks that
used to be refused there. Pairwise coverage on CPU: each of ac, lce, optim-in-bwd alone, the
three together, and the three with each low-bit optimizer (every pair of the five tricks runs in
at least one set); compile once per skeleton in a fresh process; packing against unpacked on the
same documents (GRPO's steps, DPO's pair losses and gradients). offload is CUDA-only and refused on CPU runs
(tests/recipes/test_tricks.py checks the refusal).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generator.features import ALGOS, TRICKS
from generator.render import render
from generator.spec import Spec, SpecError
from tests.helpers import grpo_two_steps, import_script, read_metrics, two_step_args

REPO = Path(__file__).resolve().parents[2]
EXACT_SETS = [("ac",), ("lce",), ("optim-in-bwd",), ("ac", "lce", "optim-in-bwd")]
LOW_BIT = ("adamw8bit", "adamw4bit")
STACKS = [("ac", "lce", "optim-in-bwd", low) for low in LOW_BIT]
ALGOS_HERE = ("lora", "qlora", "kd", "dpo", "dpo-lora", "grpo", "grpo-lora")


def _script(tmp: Path, algo: str, tricks: tuple) -> object:
    """Render `algo` with `tricks` into tmp and import it (a fresh module per set)."""
    path = tmp / f"{algo}_{'_'.join(tricks) or 'plain'}.py"
    path.write_text(render(Spec(algo=algo, tricks=tricks, out="run")))
    return import_script(path, "compose_" + path.stem.replace("-", "_"))


def _offline_two_steps(script, algo, tmp, model_dir, data) -> list[tuple[float, float]]:
    """(loss, grad_norm) of 2 steps of main(): 2 micro-batches per step, clipping on, fp32."""
    out = tmp / "out"
    pairs = ALGOS[algo].skeleton in ("dpo", "rm")
    args = two_step_args(out, model_dir, data, max_seq_len=192 if pairs else 64)
    if pairs:  # 4 pairs: 2 steps of 2 micro-batches of 1 pair
        args[args.index("--micro_batch_size") + 1] = "1"
    if algo == "rm":  # a scorer has no end-of-run sample
        i = args.index("--sample_max_new_tokens")
        args = [*args[:i], *args[i + 2 :]]
    if algo == "kd":
        args += ["--teacher", str(model_dir), "--teacher_hf_repo_id", ""]
    if algo in ("lora", "qlora", "dpo-lora"):
        args += ["--lora_rank", "4"]
    script.main(args)
    return [(row["loss"], row["grad_norm"]) for row in read_metrics(out)]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, small_dataset, short_pairs):
    """run(algo, tricks) -> [(loss, grad_norm)] x 2, cached per (algo, tricks)."""
    cache: dict = {}

    def get(algo: str, tricks: tuple) -> list[tuple[float, float]]:
        key = (algo, tricks)
        if key not in cache:
            tmp = tmp_path_factory.mktemp(f"{algo}_{'_'.join(tricks) or 'plain'}")
            script = _script(tmp, algo, tricks)
            torch.manual_seed(0)
            if ALGOS[algo].skeleton == "grpo":
                cache[key] = grpo_two_steps(script, tiny_model_dir)
            else:
                pairs = ALGOS[algo].skeleton in ("dpo", "rm")
                data = short_pairs if pairs else small_dataset
                cache[key] = _offline_two_steps(script, algo, tmp, tiny_model_dir, data)
        return cache[key]

    return get


def _close(got: list, want: list, atol: float = 1e-5) -> bool:
    """Every (loss, grad_norm) of `got` within atol of `want` (relative above 1)."""
    pairs = [gw for step in zip(got, want, strict=True) for gw in zip(*step, strict=True)]
    return all(abs(g - w) <= atol * max(1.0, abs(w)) for g, w in pairs)


@pytest.mark.parametrize("algo", ALGOS_HERE)
@pytest.mark.parametrize("tricks", EXACT_SETS, ids="+".join)
def test_exact_tricks_give_the_plain_losses_and_gradients(algo, tricks, run):
    """ac, lce and optim-in-bwd change memory, not the math: the 2 steps' losses and gradient
    norms (step 2's loss also checks step 1's update; GRPO: its KL and importance weights too)
    equal the plain script's within 1e-5."""
    plain, got = run(algo, ()), run(algo, tricks)
    assert plain[1][0] != plain[0][0]  # the plain script trains: step 2 sees the update
    assert _close(got, plain), (algo, tricks, got, plain)


@pytest.mark.parametrize("algo", ALGOS_HERE)
@pytest.mark.parametrize("tricks", STACKS, ids="+".join)
def test_low_bit_stacks_match_their_optimizer_alone(algo, tricks, run):
    """With a low-bit AdamW the exact tricks still change nothing (1e-5 against the low-bit
    optimizer alone); the low-bit optimizer itself equals fp32 AdamW before its first update and
    differs by the quantization of the moments after it (2e-3 on the loss)."""
    low = tricks[-1]
    alone, plain, got = run(algo, (low,)), run(algo, ()), run(algo, tricks)
    assert _close(got, alone), (algo, tricks, got, alone)
    assert alone[0] == pytest.approx(plain[0], abs=1e-5)
    assert alone[1][0] == pytest.approx(plain[1][0], abs=2e-3)


# the reward model refuses lce (no lm_head): the exact tricks and stacks without it
RM_SETS = [("ac",), ("optim-in-bwd",), ("ac", "optim-in-bwd")]
RM_STACKS = [("ac", "optim-in-bwd", low) for low in LOW_BIT]


@pytest.mark.parametrize("tricks", RM_SETS, ids="+".join)
def test_rm_exact_tricks_give_the_plain_losses_and_gradients(tricks, run):
    """The reward model's 2 steps with ac and optim-in-bwd equal its plain script's (1e-5)."""
    plain, got = run("rm", ()), run("rm", tricks)
    assert plain[1][0] != plain[0][0]
    assert _close(got, plain), (tricks, got, plain)


@pytest.mark.parametrize("tricks", RM_STACKS, ids="+".join)
def test_rm_low_bit_stacks_match_their_optimizer_alone(tricks, run):
    """As `test_low_bit_stacks_match_their_optimizer_alone`, for the reward model."""
    low = tricks[-1]
    alone, plain, got = run("rm", (low,)), run("rm", ()), run("rm", tricks)
    assert _close(got, alone), (tricks, got, alone)
    assert alone[0] == pytest.approx(plain[0], abs=1e-5)
    assert alone[1][0] == pytest.approx(plain[1][0], abs=2e-3)


def test_every_pair_of_the_swept_tricks_runs_with_every_algorithm():
    """The sets above cover every pair of ac, lce, optim-in-bwd and a low-bit optimizer (the two
    low-bit ones refuse each other) for every algorithm here."""
    swept = ("ac", "lce", "optim-in-bwd", *LOW_BIT)
    sets = [*EXACT_SETS, *STACKS]
    for a in swept:
        for b in swept:
            if a < b and {a, b} != set(LOW_BIT):
                assert any(a in s and b in s for s in sets), (a, b)


@pytest.mark.parametrize("algo", ["kd", "dpo", "grpo", "rm"])
def test_compile_gives_the_plain_losses(algo, tmp_path, tiny_model_dir, small_dataset, short_pairs):
    """Per-block torch.compile, once per skeleton family, in a fresh process (inductor's caches and
    config stay out of this one): the plain script's losses and gradient norms within 1e-5."""
    results = {}
    for tricks in ((), ("compile",)):
        path = tmp_path / f"{algo}_{'_'.join(tricks) or 'plain'}.py"
        path.write_text(render(Spec(algo=algo, tricks=tricks, out="run")))
        driver = (
            "import json, sys; from pathlib import Path; sys.path.insert(0, {repo!r})\n"
            "from tests.helpers import grpo_two_steps, import_script\n"
            "from tests.recipes import test_compose as t\n"
            "s = import_script(Path({path!r}), 'driver_script')\n"
            "if {grpo}: r = grpo_two_steps(s, Path({model!r}))\n"
            "else: r = t._offline_two_steps(s, {algo!r}, Path({tmp!r}), Path({model!r}), Path({data!r}))\n"
            "print('RESULT', json.dumps(r))\n"
        ).format(
            repo=str(REPO), path=str(path), grpo=ALGOS[algo].skeleton == "grpo", algo=algo,
            tmp=str(tmp_path / ("t_" + "_".join(tricks))), model=str(tiny_model_dir),
            data=str(short_pairs if algo in ("dpo", "rm") else small_dataset),
        )  # fmt: skip
        (tmp_path / ("t_" + "_".join(tricks))).mkdir()
        proc = subprocess.run(
            [sys.executable, "-c", driver], capture_output=True, text=True, timeout=900, cwd=REPO
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        results[tricks] = [tuple(x) for x in json.loads(line[len("RESULT ") :])]
    assert _close(results[("compile",)], results[()]), results


# the smallest spec that turns each plan on (the support table's plan rows)
PLAN_SPECS = {
    "--gpus N": dict(gpus=2),
    "--dp-replicate": dict(gpus=4, dp_replicate=2),
    # 4 GPUs: a GRPO-skeleton spec's engines take half, its trainer the other 2
    "--tp": dict(model="qwen3-0.6b", gpus=4, tp=2),
    "--cp": dict(gpus=4, cp=2),
    "--ep": dict(model="qwen3-30b-a3b", gpus=2, ep=2),
}


@pytest.mark.fast
def test_every_refused_pair_names_its_reason():
    """Every (algorithm, trick or plan) cell of the support table: a "yes" renders, a "no" is
    refused by `scaffold new`'s validation with the table's reason (offload renders: the script
    refuses a CPU run itself)."""
    from generator.features import support_table

    refused = 0
    for row, cells in support_table():
        options = {"tricks": (row,)} if row in TRICKS else PLAN_SPECS[row]
        for algo, why in cells.items():
            spec = Spec(algo=algo, out="run", **options)
            if why is None:
                assert render(spec), (row, algo)
                continue
            refused += 1
            with pytest.raises(SpecError) as e:
                render(spec)
            assert why in str(e.value), (row, algo, str(e.value))
    assert refused > 0  # the plans' rows hold the refusals today


@pytest.mark.parametrize("algo", ["grpo", "grpo-lora"])
@pytest.mark.parametrize("tricks", [("packing",), ("packing", "lce")], ids="+".join)
def test_grpo_packed_rollouts_give_the_unpacked_step(algo, tricks, run):
    """Packing changes only the layout of a GRPO micro-batch (its rollouts become documents of
    packed rows with per-token advantages and sampler log-probs): policy loss, gradient norm, KL,
    importance weights and clip fraction of both steps equal the unpacked script's (1e-5)."""
    assert _close(run(algo, tricks), run(algo, ())), (algo, tricks)


@pytest.mark.parametrize("algo", ["dpo", "dpo-lora"])
@pytest.mark.parametrize("lce", [False, True], ids=["logits", "lce"])
def test_dpo_packed_pairs_give_the_unpacked_losses(
    algo, lce, tmp_path, tiny_model_dir, short_pairs
):
    """The same 4 real pairs (<= 192 tokens: rows of 2 * 384 hold several), unpacked ([2P] padded
    rows) and packed (each pair's chosen and rejected sequences two documents of one row):
    per-pair losses, the rewards/* and logps/* sums and the gradients of the summed loss agree
    (1e-5), with and without lce."""
    extra = ("lce",) if lce else ()
    plain = _script(tmp_path, algo, extra)
    packed = _script(tmp_path, algo, ("packing", *extra))
    overrides = {"model": str(tiny_model_dir), "dataset": str(short_pairs), "dtype": "fp32", "device": "cpu", "max_seq_len": 384, "val_fraction": 0.0}  # fmt: skip
    if algo == "dpo-lora":
        overrides["lora_rank"] = 4
    results = {}
    for name, script in (("plain", plain), ("packed", packed)):
        cfg = script.Config(**overrides)
        _, mesh = script.setup_distributed(cfg)
        torch.manual_seed(0)
        model = script.setup_model(cfg, tiny_model_dir, mesh, torch.device("cpu"))
        if algo == "dpo-lora":  # B = 0 at init would make the policy the reference: move it
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
        reference = (
            script.build_reference(cfg, tiny_model_dir, mesh, torch.device("cpu"))
            if algo == "dpo"
            else None
        )
        train_set, _ = script.build_datasets(cfg, script.Tokenizer.from_dir(tiny_model_dir))
        collate = script.collate_preference_packs if name == "packed" else script.collate
        batch = collate(train_set, pad_token_id=0)
        losses, sums = script.pair_losses(model, reference, None, batch, cfg)
        losses.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (
            batch["sample_ids"].tolist(),
            losses.detach(),
            {k: v.item() for k, v in sums.items()},
            grads,
        )
        script.destroy_distributed()
    (ids_u, loss_u, sums_u, grads_u), (ids_p, loss_p, sums_p, grads_p) = (
        results["plain"],
        results["packed"],
    )
    assert ids_u == ids_p == [0, 1, 2, 3]
    assert len(train_set) < 4  # the packed rows do hold several pairs
    torch.testing.assert_close(loss_p, loss_u, atol=1e-5, rtol=1e-5)
    assert sums_p == pytest.approx(sums_u, abs=1e-4, rel=1e-5)
    assert grads_u.keys() == grads_p.keys() and grads_u
    for n, g in grads_u.items():
        torch.testing.assert_close(grads_p[n], g, atol=1e-5, rtol=1e-4, msg=n)
