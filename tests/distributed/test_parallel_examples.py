"""The emitted distributed examples, launched for real on gloo ranks (CPU) on a tiny random
Llama (4 heads, 2 KV heads) with SmolLM2's tokenizer and real alpaca rows.

sft_qwen3_tp2 on 2 processes (tp=2: dp size 1), sft_smollm2_cp2 on 2 (cp=2: dp size 1, each rank
holds 2 of the 4 chunks of every row; its all-gather attention, and with --cp_mode ring the ring)
and sft_smollm2_hsdp on 4 (dp_replicate=2 x dp_shard=2) read the same global batch as one
process, so their losses equal the 1-process run of the plain script (fp32, 1e-5; constant lr, so
the 2-step run and its resumed step 3 follow the 3-step reference schedule); each saves a
resumable DCP checkpoint of its DTensor state and a HF checkpoint, and a resumed run continues
from it.
"""

from __future__ import annotations

import pytest

from tests.helpers import REPO, run_in_process, run_script, safetensors_keys

COMMON = [
    "--dtype", "fp32", "--warmup_steps", "0", "--min_lr_ratio", "1.0", "--lr", "1e-3", "--max_seq_len", "64",
    "--eval_every_steps", "0", "--sample_max_new_tokens", "0", "--val_fraction", "0.1",
]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, small_dataset, tmp_path_factory) -> list[dict]:
    """The plain example on 1 process (its main() here), micro-batch 4: the reference losses."""
    tmp = tmp_path_factory.mktemp("one")
    args = ["--model", str(tiny_model_dir), "--dataset", str(small_dataset), *COMMON]
    return run_in_process(tmp, [*args, "--max_steps", "3", "--micro_batch_size", "4"])


@pytest.mark.parametrize(
    ("example", "nproc", "dp_size"),
    [("sft_qwen3_tp2", 2, 1), ("sft_smollm2_cp2", 2, 1), ("sft_smollm2_hsdp", 4, 4)],
)
def test_distributed_example_runs_and_resumes(
    example, nproc, dp_size, one_process, tiny_model_dir, small_dataset, tmp_path
):
    script = REPO / "examples" / example / "train.py"
    args = [
        "--model", str(tiny_model_dir), "--dataset", str(small_dataset), *COMMON,
        "--micro_batch_size", str(4 // dp_size), "--save_every_steps", "1",
    ]  # fmt: skip
    first = run_script(tmp_path, [*args, "--max_steps", "2"], nproc=nproc, script=script)
    out = tmp_path / f"out_{nproc}"
    assert safetensors_keys(out / "model") == safetensors_keys(tiny_model_dir)
    # resume: step 3 starts from the step-2 DCP checkpoint (TP/HSDP DTensor model + optimizer)
    resumed = run_script(tmp_path, [*args, "--max_steps", "3"], nproc=nproc, script=script)
    rows = first + [r for r in resumed if r["step"] == 3]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for got, ref in zip(rows, one_process):
        assert got["num_supervised"] == ref["num_supervised"]
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
    # with 4 dp ranks the val set (not a multiple of 4) is padded with unsupervised copies, so
    # its mean over supervised tokens equals 1 process's
    assert rows[-1]["val_loss"] == pytest.approx(one_process[-1]["val_loss"], abs=1e-5)


def test_cp2_example_in_ring_mode_gives_the_one_process_run(
    one_process, tiny_model_dir, small_dataset, tmp_path
):
    """The same sft_smollm2_cp2 example with --cp_mode ring (K/V blocks passed around the 2 cp
    ranks, merged by log-sum-exp): 2 steps on 2 ranks give the 1-process losses and gradient
    norms (the tolerances above)."""
    script = REPO / "examples" / "sft_smollm2_cp2" / "train.py"
    args = [
        "--model", str(tiny_model_dir), "--dataset", str(small_dataset), *COMMON,
        "--micro_batch_size", "4", "--cp_mode", "ring", "--max_steps", "2",
    ]  # fmt: skip
    rows = run_script(tmp_path, args, nproc=2, script=script)
    assert [r["step"] for r in rows] == [1, 2]
    for got, ref in zip(rows, one_process):
        assert got["num_supervised"] == ref["num_supervised"]
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
