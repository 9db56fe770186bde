"""Reward-model training under FSDP2 over 2 gloo processes equals 1 process: the pair-count
normalisation, the metrics all-reduce, the sharded score head and its seeded init, and the
validation sums over ranks; and under HSDP 2 x 2 on 4 (the example's main() over 3 steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import full_tensor, spawn

REPO = Path(__file__).resolve().parents[2]


def _step(rank, world_size, model_dir, data_path):
    from runtime import Tokenizer
    from tests.helpers import import_script

    script = import_script(REPO / "examples" / "rm_smollm2" / "train.py", "rm_train_dist")
    cfg = script.Config(
        model=model_dir, dataset=data_path, dtype="fp32", max_grad_norm=0.0, device="cpu",
        max_seq_len=64, val_fraction=0.0, center_rewards_coefficient=0.1,
    )  # fmt: skip
    dist_info, mesh = script.setup_distributed(cfg)
    tokenizer = Tokenizer.from_dir(model_dir)
    pad = script.reward_pad_token_id(tokenizer)
    pairs, _ = script.build_datasets(cfg, tokenizer)
    pairs = pairs[:4]  # the same global batch everywhere; each rank takes its half
    micro_batches = [script.collate([p], pad) for p in pairs[rank::world_size]]
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    before = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # update == gradient
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = script.train_step(model, opt, sched, micro_batches, cfg, "cpu")
    grads = {n: before[n] - full_tensor(p.detach()) for n, p in model.named_parameters()}
    loader = script.build_dataloader(
        pairs, lambda b: script.collate(b, pad), 1, rank, world_size, 0, train=False,
        unsupervised_fill=False,
    )  # fmt: skip
    val = script.evaluate(model, loader, cfg, "cpu")
    return metrics, grads, before["score.weight"], val


def test_fsdp2_two_ranks_equal_one_for_reward_model(tiny_model_dir, tmp_path):
    rows = [
        {"prompt": f"Count to {i}.", "chosen": " ".join(map(str, range(1, i + 2))), "rejected": "No.", "margin": 0.5 * i}
        for i in range(4)
    ]  # fmt: skip
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(rows))
    args = (str(tiny_model_dir), str(data))
    ((ref_metrics, ref_grads, ref_head, ref_val),) = spawn(_step, world_size=1, args=args)
    assert ref_grads["score.weight"].abs().sum() > 0
    for metrics, grads, head, val in spawn(_step, world_size=2, args=args):
        assert metrics["num_pairs"] == ref_metrics["num_pairs"] == 4
        for key in ("loss", "accuracy", "margin", "mean_reward"):
            assert abs(metrics[key] - ref_metrics[key]) < 1e-5, key
        assert torch.equal(head, ref_head)  # the seeded head init, whole on every rank count
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=name)
        for key in ("val_loss", "val_accuracy", "val_margin"):
            assert abs(val[key] - ref_val[key]) < 1e-5, key


def _main(rank, world_size, script, argv) -> dict[str, tuple]:
    """`script`'s main(argv); returns how `parallelize` left the embedding and the score head:
    {name: (mesh dim names, placements)}, () for a plain tensor (the plan is really applied),
    and "cp_attention": the name of the attention layers' context-parallel attention (None
    without cp)."""
    from runtime.models.llama import LlamaAttention
    from tests.helpers import import_script

    module = import_script(Path(script), "rm_plan_" + Path(script).parent.name)
    layouts = {}
    parallelize = module.parallelize

    def recording(model, *args, **kwargs):
        parallelize(model, *args, **kwargs)
        for name in ("model.embed_tokens.weight", "score.weight"):
            p = model.get_parameter(name)
            mesh = getattr(p, "device_mesh", None)
            layouts[name] = (mesh.mesh_dim_names, tuple(map(str, p.placements))) if mesh else ()
        attention = next(m for m in model.modules() if isinstance(m, LlamaAttention))
        layouts["cp_attention"] = getattr(attention.cp_attention, "__name__", None)

    module.parallelize = recording
    module.main(argv)
    return layouts


def _run(script: Path, world_size: int, out: Path, common: list[str], plan: list[str]):
    """`script`'s main() on `world_size` gloo ranks: its logged step rows, saved tensors and
    rank 0's parameter layouts (`_main`)."""
    argv = [*common, *plan, "--out_dir", str(out)]
    layouts = spawn(_main, world_size=world_size, args=(str(script), argv))[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], load_file(out / "model" / "model.safetensors"), layouts


def _three_step_args(model_dir: Path, pairs: Path, lr: float) -> list[str]:
    """The plan tests' flags: 3 steps, fp32, warmup 1, centring 0.1, no validation, fresh."""
    return [
        "--model", str(model_dir), "--dataset", str(pairs), "--dtype", "fp32",
        "--device", "cpu", "--max_seq_len", "192", "--max_steps", "3", "--lr", str(lr),
        "--warmup_steps", "1", "--val_fraction", "0", "--eval_every_steps", "0",
        "--center_rewards_coefficient", "0.1", "--resume", "none",
    ]  # fmt: skip


def _assert_runs_equal(one, one_model, got, got_model, what, abs_tol: float = 1e-7) -> None:
    """`_run`'s step rows and saved model of a parallel plan (`got`) equal the 1-process run's:
    steps 1-3, 4 pairs counted per step (over dp only), loss / accuracy / margin / mean_reward rel
    1e-5 (abs `abs_tol`), grad_norm rel 1e-4, every saved tensor (score.weight too) within 1e-5
    but for under 0.1% of its elements, and all within 1e-4."""
    assert [r["step"] for r in got] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(one, got, strict=True):
        assert b["num_pairs"] == a["num_pairs"] == 4, what
        for key in ("loss", "accuracy", "margin", "mean_reward"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=abs_tol), (what, key)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), what
    assert one_model.keys() == got_model.keys() and "score.weight" in one_model
    for key, want in one_model.items():
        # AdamW's first steps move every element by about lr whatever its gradient's size, so an
        # embedding row whose gradient is fp32 noise (a token no pair holds) can move apart by a
        # fraction of lr when the ranks sum in another order: measured 1 element of 32,768 at
        # 1.13e-5 (lr 1e-3, an AMD EPYC's kernels); a wrong gradient moves most elements by ~lr
        diff = (got_model[key] - want).abs()
        assert diff.max() < 1e-4 and (diff > 1e-5).float().mean() < 1e-3, (
            key, diff.max().item(), (diff > 1e-5).sum().item()
        )  # fmt: skip


def test_hsdp_two_by_two_equals_one_process_over_three_steps(tiny_model_dir, short_pairs, tmp_path):
    """HSDP 2 x 2 (dp_replicate 2 x dp_shard 2, 4 gloo ranks, 1 pair each) runs 3 steps of the
    example's main() as 1 process does with 4 pairs per micro-batch: gradients reduce-scattered in
    each replica group and all-reduced across them (not divided: the loss is over the global pair
    count), the clipped norm over the 2-D mesh, the score head sharded like any weight. Losses
    and accuracies rel 1e-5, grad norms rel 1e-4, the saved model (score.weight too) abs 1e-5."""
    common = _three_step_args(tiny_model_dir, short_pairs, lr=1e-3)
    script = REPO / "examples" / "rm_smollm2" / "train.py"
    one, one_model, _ = _run(script, 1, tmp_path / "one", common, ["--micro_batch_size", "4"])
    plan = ["--micro_batch_size", "1", "--dp_replicate", "2"]
    four, four_model, layouts = _run(script, 4, tmp_path / "four", common, plan)
    assert layouts["score.weight"][0] == ("dp_replicate", "dp_shard")  # HSDP's 2-D mesh
    _assert_runs_equal(one, one_model, four, four_model, "hsdp")
    # AdamW moves each weight by about lr (1e-3) a step, 100x the weight tolerance
    assert one[2]["loss"] != pytest.approx(one[0]["loss"], rel=1e-3)


def test_tp_two_and_tp_two_by_fsdp_two_equal_one_process(tiny_model_dir, short_pairs, tmp_path):
    """The script `scaffold new --algo rm --gpus 2 --tp 2` renders, 3 steps of its main(): TP 2 on
    2 gloo ranks (dp 1: both read the 4 pairs; rows padded to a multiple of 2, sequence parallel,
    the hidden states all-gathered before the replicated score head) and TP 2 x FSDP 2 on 4 (2
    pairs per dp rank) equal the same script with --tp 1 on 1 process: losses, accuracies and
    margins rel 1e-5, grad norms rel 1e-4 (measured 2.4e-7), the saved model (score.weight too)
    abs 1e-5 (measured 1.3e-6). lr 1e-4: AdamW's normalised step turns the reordered sums of an
    embedding row with a near-zero gradient into a weight difference of about 1e-2 x lr (1.3e-5
    at lr 1e-3), so the weight tolerance stays 10x what was measured."""
    from generator.render import render
    from generator.spec import Spec

    script = tmp_path / "rm_tp2" / "train.py"
    script.parent.mkdir()
    spec = Spec(algo="rm", model=str(tiny_model_dir), gpus=2, tp=2, out=str(script.parent))
    script.write_text(render(spec))
    common = [*_three_step_args(tiny_model_dir, short_pairs, lr=1e-4), "--save_every_steps", "0"]
    one, one_model, _ = _run(
        script, 1, tmp_path / "one", common, ["--tp", "1", "--micro_batch_size", "4"]
    )
    plans = [(2, ["--micro_batch_size", "4"]), (4, ["--micro_batch_size", "2"])]
    for world_size, plan in plans:
        out = tmp_path / f"tp{world_size}"
        got, got_model, layouts = _run(script, world_size, out, common, plan)
        # the plan is applied: the embedding vocab-sharded over tp, the score head replicated
        for name, want in (
            ("model.embed_tokens.weight", "S(0)"),
            ("score.weight", "R"),
        ):
            dims, placements = layouts[name]
            assert placements[dims.index("tp")] == want, (world_size, name, layouts[name])
        _assert_runs_equal(one, one_model, got, got_model, world_size)


def test_cp_two_in_both_modes_and_with_tp_two_equals_one_process(tiny_model_dir, tmp_path):
    """The script `scaffold new --algo rm --gpus 4 --tp 2 --cp 2` renders, 3 steps of its main():
    CP 2 on 2 gloo ranks (--tp 1; dp 1: both cp ranks read the 4 training pairs; every row
    padded to a multiple of 4 and cut into 4 chunks, 2 per rank), K/V all-gathered and in a ring,
    and CP 2 x TP 2 on 4 in the ring (the ring over tp-sharded heads), equal the same script with
    --tp 1 --cp 1 on 1 process. The rows end at different chunks, so both cp ranks hold scored
    tokens (measured: the training batch's scored tokens in chunks 1, 2 and 3). Losses,
    accuracies, margins and mean rewards rel 1e-5 / abs 1e-6, grad norms rel 1e-4, the held-out
    val_loss, val_accuracy and val_margin (4 pairs, evaluated after step 3) rel 1e-5 / abs 1e-6,
    the saved model (score.weight too) abs 1e-5."""
    from generator.render import render
    from generator.spec import Spec

    # 8 pairs, 4 held out: long chosen replies (up to ~70 tokens), short rejected ones
    rows = [
        {"prompt": f"Count to {3 * i + 1}.", "chosen": " ".join(map(str, range(1, 3 * i + 2))),
         "rejected": "No." if i % 2 else f"{i}?", "margin": 0.25 * i}
        for i in range(8)
    ]  # fmt: skip
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(rows))
    script = tmp_path / "rm_cp2" / "train.py"
    script.parent.mkdir()
    script.write_text(render(Spec(algo="rm", model=str(tiny_model_dir), gpus=4, tp=2, cp=2)))
    common = [
        *_three_step_args(tiny_model_dir, data, lr=1e-4), "--val_fraction", "0.5",
        "--micro_batch_size", "4", "--save_every_steps", "0",
    ]  # fmt: skip
    single = ["--tp", "1", "--cp", "1"]
    one, one_model, one_layouts = _run(script, 1, tmp_path / "one", common, single)
    assert one_layouts["cp_attention"] is None
    plans = [
        (2, ["--tp", "1", "--cp_mode", "allgather"], "context_parallel_attention"),
        (2, ["--tp", "1", "--cp_mode", "ring"], "ring_attention"),
        (4, ["--cp_mode", "ring"], "ring_attention"),
    ]
    for world_size, plan, attention in plans:
        what = f"{world_size} ranks {plan}"
        out = tmp_path / f"{world_size}_{plan[-1]}"
        got, got_model, layouts = _run(script, world_size, out, common, plan)
        assert layouts["cp_attention"] == attention, (what, layouts)  # the plan is applied
        dims, placements = layouts["score.weight"]
        assert dims[0] == "dp_shard_cp" and placements[-1] == ("R" if world_size == 4 else "S(0)")
        # abs 1e-6: a margin is a difference of rewards of size ~0.1 and rounds as they do
        # (measured up to 5.4e-8 on a margin of 0.007, where 1e-7 would leave 2x)
        _assert_runs_equal(one, one_model, got, got_model, what, abs_tol=1e-6)
        for key in ("val_loss", "val_accuracy", "val_margin"):
            assert got[-1][key] == pytest.approx(one[-1][key], rel=1e-5, abs=1e-6), (what, key)
