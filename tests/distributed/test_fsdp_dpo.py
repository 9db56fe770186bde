"""DPO under FSDP2 over 2 gloo processes equals 1 process: the pair-count normalisation, the
metrics all-reduce, the sharded separate reference and the precomputed table's all-reduce."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import torch

from tests.helpers import full_tensor, spawn

REPO = Path(__file__).resolve().parents[2]


def _step(rank, world_size, model_dir, data_path):
    from runtime import Tokenizer, precompute_reference_logprobs
    from tests.helpers import import_script

    script = import_script(REPO / "examples" / "dpo_smollm2" / "train.py", "dpo_train_dist")
    cfg = script.Config(
        model=model_dir, dataset=data_path, dtype="fp32", max_grad_norm=0.0, device="cpu",
        max_seq_len=64, val_fraction=0.0, ref_mode="separate",
    )  # fmt: skip
    dist_info, mesh = script.setup_distributed(cfg)
    tokenizer = Tokenizer.from_dir(model_dir)
    train_set, _ = script.build_datasets(cfg, tokenizer)
    pairs = train_set[:4]  # the same global batch everywhere; each rank takes its half
    mine = pairs[rank::world_size]
    micro_batches = [script.collate([p], tokenizer.pad_token_id) for p in mine]
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    reference = script.build_reference(cfg, Path(model_dir), mesh, dist_info.device)
    dp = mesh["dp_shard"]
    pre_cfg = dataclasses.replace(cfg, ref_mode="precomputed")
    table = precompute_reference_logprobs(
        model, pairs, lambda m, b: script.sequence_logprobs(m, b, pre_cfg)[0],
        functools.partial(script.collate, pad_token_id=tokenizer.pad_token_id),
        pre_cfg.micro_batch_size, dp.get_local_rank(), dp.size(), "cpu",
    )  # fmt: skip
    before = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    # at policy == reference the loss is log 2 but its gradient is -beta/2 * d(h)/d(theta) != 0
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # update == gradient
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = script.train_step(model, reference, None, opt, sched, micro_batches, cfg, "cpu")
    grads = {n: before[n] - full_tensor(p.detach()) for n, p in model.named_parameters()}
    return metrics, grads, table


def test_fsdp2_two_ranks_equal_one_for_dpo(tiny_model_dir, tmp_path):
    rows = [
        {"prompt": f"Count to {i}.", "chosen": " ".join(map(str, range(1, i + 2))), "rejected": "No."}
        for i in range(4)
    ]  # fmt: skip
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(rows))
    args = (str(tiny_model_dir), str(data))
    ((ref_metrics, ref_grads, ref_table),) = spawn(_step, world_size=1, args=args)
    for metrics, grads, table in spawn(_step, world_size=2, args=args):
        assert metrics["num_pairs"] == ref_metrics["num_pairs"] == 4
        for key in ("loss", "rewards/chosen", "logps/chosen", "logps/rejected"):
            assert abs(metrics[key] - ref_metrics[key]) < 1e-5, key
        torch.testing.assert_close(table, ref_table, atol=1e-5, rtol=1e-6)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=name)


def _new_loss_steps(rank, world_size, model_dir, reference_dir, data_path):
    """SimPO, ORPO and KTO (separate reference) steps of the same global batch on this rank's
    half of it: the reference a perturbed copy of the policy, so KTO's z_ref is not 0."""
    from runtime import Tokenizer
    from tests.helpers import import_script

    script = import_script(REPO / "examples" / "dpo_smollm2" / "train.py", "dpo_train_dist_new")
    out = {}
    for loss_type in ("simpo", "orpo", "kto"):
        cfg = script.Config(
            model=model_dir, dataset=data_path, dtype="fp32", max_grad_norm=0.0, device="cpu",
            max_seq_len=64, val_fraction=0.0, loss_type=loss_type,
        )  # fmt: skip
        dist_info, mesh = script.setup_distributed(cfg)
        tokenizer = Tokenizer.from_dir(model_dir)
        if loss_type == "kto":  # 8 examples: 2 desirable and 2 undesirable ones, each rank 1 + 1
            examples, _ = script.build_kto_datasets(cfg, tokenizer)
            batch, collate = [examples[i] for i in (0, 4, 1, 5)], script.collate_kto
        else:
            batch, collate = script.build_datasets(cfg, tokenizer)[0][:4], script.collate
        mine = batch[rank::world_size]
        micro_batches = [collate([ex], tokenizer.pad_token_id) for ex in mine]
        model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
        reference = None
        if loss_type == "kto":
            reference = script.build_reference(cfg, Path(reference_dir), mesh, dist_info.device)
        before = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # update == gradient
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        metrics = script.train_step(model, reference, None, opt, sched, micro_batches, cfg, "cpu")
        grads = {n: before[n] - full_tensor(p.detach()) for n, p in model.named_parameters()}
        out[loss_type] = (metrics, grads)
        del model, reference, opt
    return out


def test_fsdp2_two_ranks_equal_one_for_simpo_orpo_kto(tiny_model_dir, tmp_path):
    """The same for the other losses: the per-token means, the ORPO odds and, for KTO, z_ref,
    which is taken over every rank's KL sequences (one value, the 1-process one) with the
    reference sharded like the policy."""
    from safetensors.torch import load_file, save_file

    rows = [
        {"prompt": f"Count to {i}.", "chosen": " ".join(map(str, range(1, i + 2))), "rejected": "No."}
        for i in range(4)
    ]  # fmt: skip
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(rows))
    reference = tmp_path / "reference"
    shutil.copytree(tiny_model_dir, reference)
    g = torch.Generator().manual_seed(0)
    weights = load_file(reference / "model.safetensors")
    weights = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(weights, reference / "model.safetensors", metadata={"format": "pt"})
    args = (str(tiny_model_dir), str(reference), str(data))
    (one,) = spawn(_new_loss_steps, world_size=1, args=args)
    assert one["kto"][0]["kl"] > 0.01 and one["kto"][0]["count/chosen"] == 2
    for two in spawn(_new_loss_steps, world_size=2, args=args):
        for loss_type, (ref_metrics, ref_grads) in one.items():
            metrics, grads = two[loss_type]
            keys = ["loss", "rewards/chosen", "rewards/rejected", "logps/chosen"]
            keys += {"orpo": ["nll_loss", "log_odds_ratio"], "kto": ["kl"]}.get(loss_type, [])
            for key in keys:
                assert abs(metrics[key] - ref_metrics[key]) < 1e-5, (loss_type, key)
            for name, g in ref_grads.items():
                torch.testing.assert_close(
                    grads[name], g, atol=1e-6, rtol=1e-5, msg=f"{loss_type} {name}"
                )
