"""Every trick example runs on a tiny model with the small tokenizer and real data, and gives the
same losses as the plain script (the tricks change memory and speed, not the math)."""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from generator.cli import cli
from generator.features import TRICKS
from tests.helpers import SMALL_VOCAB, full_tensor, import_script, two_step_losses

REPO = Path(__file__).resolve().parents[2]
# Every allowed trick set that runs on CPU, without compile (each compile costs ~30 s of inductor
# on 2 cores: compile is covered by the two compile tests below) and offload (GPU only: refused on CPU).
# packing changes the batching (several documents per row) and the low-bit optimizers quantize the
# AdamW moments: those define the math; ac, lce and optim-in-bwd change memory and speed, not the math.
MATH = ("packing", "adamw8bit", "adamw4bit")
EXACT = ("ac", "lce", "optim-in-bwd")
# bf16-sr and cpu-offload (the precision recipes) run bf16 and have their own parity tests
# (tests/recipes/test_precision.py).
SWEPT = tuple(t for t in TRICKS if t not in ("compile", "offload", "bf16-sr", "cpu-offload"))


def _allowed(combo) -> bool:
    return not any(other in combo for t in combo for other in TRICKS[t].conflicts)


# Pairwise coverage: every trick alone, every allowed pair, and every maximal allowed stack (the
# slots interact pairwise; a maximal stack holds every slot at once). All 47 allowed subsets were
# swept before; the 3- and 4-trick subsets add no pair that these do not run.
_ALLOWED = [
    c for n in range(1, len(SWEPT) + 1) for c in itertools.combinations(SWEPT, n) if _allowed(c)
]
SWEEP = [c for c in _ALLOWED if len(c) <= 2] + [
    c for c in _ALLOWED if len(c) > 2 and not any(set(c) < set(d) for d in _ALLOWED)
]
# and the checked-in examples/sft_smollm2_memory set, against the plain script, as users get it
SWEEP += [("ac", "lce", "optim-in-bwd")]
# rows of 512 tokens hold several alpaca documents when packed (median 333 tokens of the small
# tokenizer; it was 256 with the real one, median 163)
PACKED_LEN = 512
REFUSED = {
    ("adamw8bit", "adamw4bit"): "--tricks adamw8bit and adamw4bit cannot be combined: both choose "
    "the optimizer",
    ("ac", "offload"): "--tricks ac and offload cannot be combined: with activation checkpointing",
}


def _render(tricks, out: Path) -> Path:
    result = CliRunner().invoke(cli, ["new", "--tricks", ",".join(tricks), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out / "train.py"


def _losses_in_process(tricks, tmp: Path, model_dir: Path, data: Path) -> list[float]:
    """Render `tricks`, import the script and run its main() here: 2 steps, gradient accumulation
    2, clipping on (a fresh interpreter per set would cost ~4 s of imports each)."""
    max_seq_len = PACKED_LEN if "packing" in tricks else 64
    script = _render(tricks, tmp / "run")
    return two_step_losses(script, tmp / "out", model_dir, data, max_seq_len)


@pytest.fixture(scope="module")
def references(tmp_path_factory, tiny_model_dir, small_dataset):
    """Losses of the trick sets that define the math (no trick, packing, low-bit, both), by set."""
    cache: dict[tuple, list[float]] = {}

    def get(tricks: tuple) -> list[float]:
        key = tuple(t for t in tricks if t in MATH)
        if key not in cache:
            tmp = tmp_path_factory.mktemp("ref_" + "_".join(key))
            if key:
                cache[key] = _losses_in_process(key, tmp, tiny_model_dir, small_dataset)
            else:  # the committed plain example, as users get it
                cache[key] = two_step_losses(
                    REPO / "examples" / "sft_smollm2" / "train.py", tmp / "out", tiny_model_dir,
                    small_dataset,
                )  # fmt: skip
        return cache[key]

    return get


@pytest.mark.parametrize("tricks", SWEEP, ids="+".join)
def test_every_allowed_trick_set_matches_its_reference(
    tricks, references, tmp_path, tiny_model_dir, small_dataset
):
    """Every allowed CPU trick set (compile and offload aside, see SWEEP) renders, runs 2 steps
    with gradient accumulation 2 and clipping, and gives the losses of the script with only its
    math-defining tricks (packing, low-bit optimizer): ac, lce and optim-in-bwd change memory and
    speed, not the math (1e-5). A low-bit optimizer itself is checked against the plain (or plain
    packed) script: step 1 is before any update (equal), step 2 differs only by the quantization of
    the AdamW moments (2e-3) and still lowers the loss."""
    reference = references(tricks)
    if any(t in EXACT for t in tricks):
        losses = _losses_in_process(tricks, tmp_path, tiny_model_dir, small_dataset)
        assert losses == pytest.approx(reference, abs=1e-5), (tricks, losses, reference)
    else:  # only math-defining tricks: this set is a reference; it trains
        assert len(reference) == 2 and reference[1] < reference[0], (tricks, reference)
    if any(t in ("adamw8bit", "adamw4bit") for t in tricks):
        full = references(("packing",) if "packing" in tricks else ())
        assert reference[0] == pytest.approx(full[0], abs=1e-5)
        assert reference[1] == pytest.approx(full[1], abs=2e-3), (tricks, reference, full)


@pytest.fixture(scope="module")
def packed_baseline(references):
    return references(("packing",))


def test_activation_checkpointing_saves_less(tiny_model_dir):
    """With "ac" the forward keeps only block inputs for backward: fewer saved activation bytes."""
    import torch

    script = import_script(
        REPO / "examples" / "sft_smollm2_memory" / "train.py", "sft_memory_train"
    )
    saved = {}
    for enabled in (False, True):
        cfg = script.Config(
            model=str(tiny_model_dir),
            dtype="fp32",
            device="cpu",
            enable_activation_checkpointing=enabled,
        )
        dist_info, mesh = script.setup_distributed(cfg)
        model = script.setup_model(cfg, tiny_model_dir, mesh, dist_info.device)
        total, inside = [0], [False]  # count only what the transformer blocks save

        def pack(t, total=total, inside=inside):
            if inside[0]:
                total[0] += t.numel() * t.element_size()
            return t

        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *a, inside=inside: inside.__setitem__(0, True))
            layer.register_forward_hook(lambda *a, inside=inside: inside.__setitem__(0, False))

        batch = {
            "input_ids": torch.randint(0, SMALL_VOCAB, (2, 64)),
            "labels": torch.randint(0, SMALL_VOCAB, (2, 64)),
        }
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = script.sft_loss(model, batch, cfg)
        loss.backward()  # recomputation works under FSDP2
        saved[enabled] = total[0]
    assert saved[True] < 0.2 * saved[False], saved


@pytest.mark.slow
def test_compile_with_the_full_stack_matches_packed_script(
    packed_baseline, tmp_path, tiny_model_dir, small_dataset
):
    """Compiled blocks under packing, ac, lce and optim-in-bwd (clipping's two passes reuse the
    graphs) give the packed script's losses (inductor's reordered sums: 1e-5)."""
    tricks = ("packing", "ac", "compile", "lce", "optim-in-bwd")
    script = _render(tricks, tmp_path / "run")
    losses = two_step_losses(
        script, tmp_path / "out", tiny_model_dir, small_dataset, PACKED_LEN, fresh_process=True
    )
    assert losses == pytest.approx(packed_baseline, abs=1e-5), (losses, packed_baseline)


@pytest.mark.parametrize("tricks", list(REFUSED), ids="+".join)
def test_refused_combinations_name_both_and_the_fix(tricks, tmp_path):
    result = CliRunner().invoke(
        cli, ["new", "--tricks", ",".join(tricks), "--out", str(tmp_path / "run")]
    )
    assert result.exit_code != 0
    assert REFUSED[tricks] in result.output
    a, b = tricks
    assert f"drop one of them: --tricks {a} or --tricks {b}" in result.output


def test_offload_refuses_a_cpu_run(tmp_path):
    """Offloading moves GPU activations to CPU memory: a CPU run says so before any work."""
    script = _render(("offload",), tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, str(script), "--device", "cpu"], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert (
        "offload moves activations from GPU to CPU memory; on a CPU run there is nothing to "
        "move: drop --tricks offload" in proc.stderr
    )


def _script_setup(script, model_dir, data, **overrides):
    cfg = script.Config(
        model=str(model_dir), dataset=str(data), dtype="fp32", device="cpu", val_fraction=0.0,
        micro_batch_size=2, gradient_accumulation_steps=2, **overrides,
    )  # fmt: skip
    dist_info, mesh = script.setup_distributed(cfg)
    tokenizer = script.Tokenizer.from_dir(model_dir)
    train_set, _ = script.build_datasets(cfg, tokenizer)
    model = script.setup_model(cfg, model_dir, mesh, dist_info.device)
    return cfg, dist_info.device, tokenizer, train_set, model


def test_packed_token_losses_and_grads_equal_unpacked(
    tmp_path, sft_script, tiny_model_dir, small_dataset
):
    """The same documents, packed (several per row) or one per row: the summed token loss and the
    gradients are equal, and packing needs fewer rows of the same length."""
    import torch

    packed = import_script(_render(("packing",), tmp_path / "run"), "sft_packed_train")
    cfg, device, tokenizer, packs, model = _script_setup(
        packed, tiny_model_dir, small_dataset, max_seq_len=PACKED_LEN
    )
    plain_cfg, _, _, docs, _ = _script_setup(
        sft_script, tiny_model_dir, small_dataset, max_seq_len=PACKED_LEN
    )
    assert [n for p in packs for n in p["seq_lens"]] == [len(d["input_ids"]) for d in docs]
    assert len(packs) < len(docs)  # several short documents share a row
    n_docs = sum(len(p["seq_lens"]) for p in packs[:4])  # 4 rows are enough (CPU time)
    packs, docs = packs[:4], docs[:n_docs]
    assert n_docs > 4
    batches = {
        "packed": [packed.collate(packs[i : i + 2], tokenizer.pad_token_id) for i in range(0, len(packs), 2)],
        "plain": [sft_script.collate(docs[i : i + 2], tokenizer.pad_token_id) for i in range(0, len(docs), 2)],
    }  # fmt: skip
    losses, grads = {}, {}
    for name, loss_fn, c in (
        ("packed", packed.sft_loss, cfg),
        ("plain", sft_script.sft_loss, plain_cfg),
    ):
        total = sum(loss_fn(model, b, c) for b in batches[name])
        total.backward()
        losses[name] = total.detach()
        grads[name] = [full_tensor(p.grad).clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(losses["packed"], losses["plain"], atol=1e-3, rtol=1e-6)
    for g, ref in zip(grads["packed"], grads["plain"]):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_compile_never_recompiles_and_matches_eager(
    tmp_path, sft_script, tiny_model_dir, small_dataset
):
    """Compiled blocks and loss: 3 steps of documents of varying length (padded to max_seq_len,
    the compile script's default) compile once in step 1, never again, and give the eager
    script's losses on the same batches."""
    from torch._dynamo.utils import counters

    compiled = import_script(_render(("compile",), tmp_path / "run"), "sft_compiled_train")
    cfg, device, tokenizer, train_set, model = _script_setup(
        compiled, tiny_model_dir, small_dataset, max_seq_len=128
    )
    assert cfg.pad_to_max_seq_len  # the compile script's default: one shape
    *_, eager = _script_setup(
        sft_script, tiny_model_dir, small_dataset, max_seq_len=128, pad_to_max_seq_len=True
    )
    collate_fn = functools.partial(
        compiled.collate, pad_token_id=tokenizer.pad_token_id, pad_to=cfg.max_seq_len
    )
    loader = compiled.build_dataloader(train_set, collate_fn, cfg.micro_batch_size, 0, 1, 0, True)
    batches = compiled.infinite_batches(loader)
    runs = {"compiled": (compiled, model), "eager": (sft_script, eager)}
    optims = {k: s.build_optimizer(cfg, m) for k, (s, m) in runs.items()}
    graphs, losses = [], {"compiled": [], "eager": []}
    for _ in range(3):
        micro = [next(batches)[1] for _ in range(cfg.gradient_accumulation_steps)]
        for name, (script, m) in runs.items():
            metrics = script.train_step(m, *optims[name], micro, cfg, device)
            losses[name].append(metrics["loss"])
        graphs.append((counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]))
    assert graphs[0][0] >= 2  # the block and the loss
    assert graphs[1:] == graphs[:1] * 2, graphs  # nothing compiled after step 1
    assert losses["compiled"] == pytest.approx(losses["eager"], abs=1e-5)
