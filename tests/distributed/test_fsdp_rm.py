"""Reward-model training under FSDP2 over 2 gloo processes equals 1 process: the pair-count
normalisation, the metrics all-reduce, the sharded score head and its seeded init, and the
validation sums over ranks."""

from __future__ import annotations

import json
from pathlib import Path

import torch

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
