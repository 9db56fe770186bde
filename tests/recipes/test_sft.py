"""The emitted SFT script (examples/sft_smollm2/train.py), run for real.

Unit tests import the script and call its functions; end-to-end tests launch it with `python` and
on 2 gloo ranks on a tiny random Llama that carries SmolLM2's real tokenizer and on
the real SmolLM2-135M-Instruct, with real alpaca rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime import IGNORE_INDEX, Tokenizer, load_rows, to_messages
from tests.helpers import full_tensor, run_in_process, run_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "sft_smollm2" / "train.py"


def test_tokenize_example_masks_prompt_keeps_end_of_turn(sft_script, smollm2_dir, alpaca_path):
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    rows = load_rows(str(alpaca_path))
    for i in (0, 5, 17):
        messages = to_messages(rows[i], i, str(alpaca_path))
        ex = sft_script.tokenize_example(messages, tokenizer, max_seq_len=4096)
        ids, labels = ex["input_ids"], ex["labels"]
        assert len(ids) == len(labels) and labels[-1] == IGNORE_INDEX
        targets = [t for t in labels if t != IGNORE_INDEX]
        # exactly the reply and its end-of-turn token are learned, though pad == eos == <|im_end|>
        assert (
            tokenizer.decode(targets, skip_special_tokens=False) == rows[i]["output"] + "<|im_end|>"
        )
        assert targets[-1] == tokenizer.eos_token_id == tokenizer.pad_token_id
        first = next(t for t, y in enumerate(labels) if y != IGNORE_INDEX)
        prompt = tokenizer.decode(ids[: first + 1], skip_special_tokens=False)
        assert prompt.endswith("<|im_start|>assistant\n") and rows[i]["instruction"] in prompt
        for t, y in enumerate(labels[:-1]):  # labels are pre-shifted
            assert y in (IGNORE_INDEX, ids[t + 1])
    truncated = sft_script.tokenize_example(messages, tokenizer, max_seq_len=40)
    assert len(truncated["input_ids"]) == 40


def test_collate_pads_with_ignore_index(sft_script):
    batch = sft_script.collate(
        [
            {"id": 3, "input_ids": [5, 6, 7], "labels": [6, 7, IGNORE_INDEX]},
            {"id": 0, "input_ids": [9], "labels": [IGNORE_INDEX]},
        ],
        pad_token_id=2,
    )
    assert batch["sample_ids"].tolist() == [3, 0]
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 2, 2]]
    assert batch["labels"].tolist() == [[6, 7, -100], [-100, -100, -100]]
    assert batch["num_tokens"].item() == 4
    assert sft_script.collate([{"id": 0, "input_ids": [1], "labels": [-100]}], 0, pad_to=4)[
        "input_ids"
    ].shape == (1, 4)


def test_no_supervised_token_is_a_setup_error(sft_script, tiny_model_dir, tmp_path):
    path = tmp_path / "empty_replies.jsonl"
    path.write_text(
        "\n".join(json.dumps({"instruction": "hi " * 50, "output": "ok"}) for _ in range(3))
    )
    cfg = sft_script.Config(model=str(tiny_model_dir), dataset=str(path), max_seq_len=16)
    with pytest.raises(ValueError, match="no example has a supervised token"):
        sft_script.build_datasets(cfg, Tokenizer.from_dir(tiny_model_dir))


def test_rows_without_a_reply_token_are_dropped_and_counted(
    sft_script, tiny_model_dir, tmp_path, capsys
):
    """Rows whose prompt fills max_seq_len keep no reply token: they are dropped, and rank 0 says
    how many of how many (as the DPO and reward-model scripts do for their pairs)."""
    path = tmp_path / "rows.jsonl"
    rows = [{"instruction": "hi " * 50, "output": "ok"}] * 2 + [
        {"instruction": "hi", "output": "ok"}
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = sft_script.Config(
        model=str(tiny_model_dir), dataset=str(path), max_seq_len=32, val_fraction=0.0
    )
    train, _ = sft_script.build_datasets(cfg, Tokenizer.from_dir(tiny_model_dir))
    assert [ex["id"] for ex in train] == [2]
    assert f"{path}: 2 of 3 rows dropped: no reply token is left within max_seq_len=32" in (
        capsys.readouterr().out
    )


def test_gradient_accumulation_equals_one_big_batch(sft_script, tiny_model_dir, small_dataset):
    """2 micro-batches of very different lengths give the loss and gradient of one batch of both."""
    cfg = sft_script.Config(
        model=str(tiny_model_dir),
        dataset=str(small_dataset),
        dtype="fp32",
        max_grad_norm=0.0,
        device="cpu",
    )
    dist_info, mesh = sft_script.setup_distributed(cfg)
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    train_set, _ = sft_script.build_datasets(cfg, tokenizer)
    by_len = sorted(train_set, key=lambda ex: len(ex["input_ids"]))
    short, long = [by_len[0]], by_len[-3:]
    assert len(long[0]["input_ids"]) > 3 * len(short[0]["input_ids"])
    results = []
    for micro_batches in ([short, long], [short + long]):
        model = sft_script.setup_model(cfg, tiny_model_dir, mesh, dist_info.device)
        before = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # SGD lr=1: the update is the gradient
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        batches = [sft_script.collate(mb, tokenizer.pad_token_id) for mb in micro_batches]
        metrics = sft_script.train_step(model, opt, sched, batches, cfg, dist_info.device)
        grads = {n: before[n] - full_tensor(p.detach()) for n, p in model.named_parameters()}
        results.append((metrics, grads))
    (m1, g1), (m2, g2) = results
    assert m1["num_supervised"] == m2["num_supervised"]
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-6, rtol=1e-5)
    assert g1["model.layers.0.mlp.down_proj.weight"].abs().sum() > 0


@pytest.mark.fast
def test_tiny_run_learns_and_saves_hf_model(tiny_model_dir, small_dataset, tmp_path):
    args = [
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(small_dataset),
        "--dtype",
        "fp32",
        "--max_steps",
        "8",
        "--warmup_steps",
        "0",
        "--lr",
        "3e-3",
        "--micro_batch_size",
        "4",
        "--max_seq_len",
        "128",
        "--eval_every_steps",
        "4",
        "--sample_max_new_tokens",
        "4",
        "--val_fraction",
        "0.1",
    ]
    rows = run_script(tmp_path, args)
    losses = [r["loss"] for r in rows]
    assert len(rows) == 8 and all(r["step"] == i + 1 for i, r in enumerate(rows))
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0]
    for key in ("lr", "grad_norm", "tokens_per_s", "peak_mem_mib", "num_tokens"):
        assert all(r[key] > 0 for r in rows), key
    saved = tmp_path / "out_1" / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_config.json"} <= {
        p.name for p in saved.iterdir()
    }
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(saved)
    from runtime import LlamaForCausalLM, ModelArgs, load_hf_checkpoint, read_hf_config

    ours = LlamaForCausalLM(ModelArgs.from_hf_config(read_hf_config(saved)))
    load_hf_checkpoint(ours, saved)
    ids = torch.tensor([[1, 200, 300, 400, 2]])
    torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)


def test_a_newcomers_first_runs(sft_script, tiny_model_dir, small_dataset, tmp_path):
    """`python train.py --max_steps 3` runs with the default warmup (clamped, with one note) and
    answers the first validation prompt at the end; its redirected log has no progress-bar
    carriage return. A second fresh run into that out_dir is refused, naming the way out, and
    leaves the first run's files as they were; --overwrite starts anew, and the plot's curves
    are that run's only."""
    import subprocess
    import sys

    from generator.plot import read_metrics  # what `scaffold plot` draws from

    out = tmp_path / "out"
    args = [
        "--model", str(tiny_model_dir), "--dataset", str(small_dataset), "--dtype", "fp32",
        "--max_steps", "3", "--micro_batch_size", "2", "--max_seq_len", "128",
        "--val_fraction", "0.1", "--sample_max_new_tokens", "2", "--out_dir", str(out),
    ]  # fmt: skip

    def train(*extra):
        return subprocess.run(
            [sys.executable, str(SCRIPT), *args, *extra],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    first = train()
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert sft_script.Config.warmup_steps > 3  # the default is longer than this run
    assert (
        "note | warmup_steps=10 is longer than max_steps=3: the lr warms up over the whole run (3 steps"
        in first.stdout
    )
    cfg = sft_script.Config(
        model=str(tiny_model_dir), dataset=str(small_dataset), max_seq_len=128, val_fraction=0.1
    )
    _, val_set = sft_script.build_datasets(cfg, Tokenizer.from_dir(tiny_model_dir))
    question = val_set[0]["prompt"][-1]["content"]
    assert f"sample | user: {question}\n" in first.stdout and question != cfg.sample_prompt
    assert "\r" not in first.stdout + first.stderr
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    peak = sft_script.Config.lr
    assert [round(r["lr"] / peak, 6) for r in rows] == [0.25, 0.5, 0.75]  # a 3-step warmup
    saved = {
        p: p.read_bytes() for p in [out / "metrics.jsonl", out / "model" / "model.safetensors"]
    }

    again = train("--max_steps", "2", "--lr", "1e-3")
    assert again.returncode == 1
    assert again.stderr.strip().splitlines()[-1:] == [
        f"error: out_dir {out} holds an earlier run (metrics.jsonl, run.json, model) and no "
        "complete checkpoint to resume from: pass --out_dir with a new directory, or --overwrite "
        "to delete that run's outputs and start fresh"
    ], again.stderr[-2000:]
    assert all(p.read_bytes() == b for p, b in saved.items())

    fresh = train("--max_steps", "2", "--lr", "1e-3", "--overwrite")
    assert fresh.returncode == 0, fresh.stdout[-2000:] + fresh.stderr[-2000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["lr"] < 1e-3  # the new run's only
    run = json.loads((out / "run.json").read_text())
    assert run["command"].endswith("--lr 1e-3 --overwrite") and "resumed" not in run
    # the start prints what differs from the defaults in one line; run.json keeps all of it
    assert run["config"]["lr"] == 1e-3 and run["config"]["max_steps"] == 2
    (line,) = [x for x in fresh.stdout.splitlines() if x.startswith("config | ")]
    assert "max_steps 2" in line and "lr 0.001" in line and '"warmup_steps"' not in fresh.stdout


@pytest.mark.parametrize("example", ["sft_smollm2", "sft_smollm2_memory"])
def test_two_processes_match_one(example, tiny_model_dir, small_dataset, tmp_path):
    """2 gloo ranks (micro-batch 2 each) gives the losses of 1 rank with micro-batch 4,
    for the plain script and with ac + lce + optim-in-bwd (sharded lm_head, norm all-reduce)."""
    script = REPO / "examples" / example / "train.py"
    common = [
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(small_dataset),
        "--dtype",
        "fp32",
        "--max_steps",
        "3",
        "--warmup_steps",
        "0",
        "--lr",
        "1e-3",
        "--max_seq_len",
        "96",
        "--eval_every_steps",
        "0",
        "--sample_max_new_tokens",
        "0",
        "--val_fraction",
        "0.1",
        "--gradient_accumulation_steps",
        "2",
    ]
    one = run_in_process(tmp_path, [*common, "--micro_batch_size", "4"], script=script)
    two = run_script(tmp_path, [*common, "--micro_batch_size", "2"], nproc=2, script=script)
    for a, b in zip(one, two):
        assert a["num_tokens"] == b["num_tokens"] and a["num_supervised"] == b["num_supervised"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)  # fp32 norm rounding
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-5) if "val_loss" in a else True


def _real_eight_rows_losses(smollm2_dir, alpaca_path, tmp_path, dtype: str) -> list[float]:
    """SmolLM2-135M on 8 real alpaca rows (100-107), 6 steps of 4 rows of <= 160 tokens (3 epochs)
    at lr 1e-4 without warmup, in `dtype`: the loss of every step."""
    rows = json.loads(alpaca_path.read_text())[100:108]
    data = tmp_path / "eight.json"
    data.write_text(json.dumps(rows))
    args = [
        "--model", str(smollm2_dir), "--dataset", str(data), "--dtype", dtype, "--max_steps", "6",
        "--warmup_steps", "0", "--lr", "1e-4", "--micro_batch_size", "4", "--max_seq_len", "160",
        "--val_fraction", "0", "--eval_every_steps", "0", "--sample_max_new_tokens", "0",
    ]  # fmt: skip
    (tmp_path / dtype).mkdir()
    return [r["loss"] for r in run_in_process(tmp_path / dtype, args)]


def test_real_smollm2_learns(smollm2_dir, alpaca_path, tmp_path):
    """CI's real-model SFT run (the bf16-against-fp32 curves are the learning tier's, below): the
    fp32 run of `_real_eight_rows_losses`, whose last epoch is lower than its first by 0.2."""
    losses = _real_eight_rows_losses(smollm2_dir, alpaca_path, tmp_path, "fp32")
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.2, losses


@pytest.mark.learning
def test_real_smollm2_learns_and_bf16_tracks_fp32(smollm2_dir, alpaca_path, tmp_path, learning):
    """The real model on 8 real rows for 3 epochs (`_real_eight_rows_losses`): the loss falls in
    fp32 and in bf16 (fp32 master weights), and the bf16 curve stays close to fp32's."""
    curves = {
        dtype: _real_eight_rows_losses(smollm2_dir, alpaca_path, tmp_path, dtype)
        for dtype in ("fp32", "bf16")
    }
    gap = sum(abs(a - b) for a, b in zip(curves["fp32"], curves["bf16"])) / len(curves["fp32"])
    for dtype, losses in curves.items():
        first_epoch, last_epoch = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
        learning(f"{dtype} loss, first 2 -> last 2 steps", 6, first_epoch, last_epoch, "fall > 0.2")
    learning("mean gap bf16 to fp32", 6, None, gap, "< 0.1")
    for dtype, losses in curves.items():
        first_epoch, last_epoch = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
        assert last_epoch < first_epoch - 0.2, (dtype, losses)
    assert gap < 0.1, curves
