"""LoRA SFT (`--algo lora`) and KD (`--algo kd`) under the plans they take beyond FSDP/HSDP, over
gloo, equal one process.

LoRA under tensor and context parallel: TP 2
and TP 2 x FSDP 2, with the adapters sharded consistently with their base (colwise base: lora_A
replicated, lora_B colwise; rowwise base: lora_A rowwise, lora_B replicated), and CP 2 (the
adapters act per token).

The emitted script's own `setup_distributed`, `setup_model` (adapters, the TP plan, FSDP, HF
load, adapter init) and `train_step` run 2 AdamW steps (the script's optimizer: the adapters'
gradients reach it through its state, lora_B is 0 at step 1) on the same global batch of 4 rows;
then its `save` writes the PEFT adapter and the merged HF model, gathered from the DTensor shards.
Tolerances as the SFT plan tests: loss 1e-5 relative, grad norm 1e-4 relative; saved tensors
atol 2e-6.

KD under CP 2: the teacher takes the student's chunks (its attention context-parallel too).
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import odd_length_rows, spawn


def _train(rank, world_size, script_path, model_dir, out_dir, plan):
    import torch.distributed as dist

    from runtime import data_parallel
    from tests.helpers import import_script

    script = import_script(Path(script_path), "lora_tp_script")
    cfg = script.Config(
        model=model_dir, dtype="fp32", device="cpu", max_seq_len=32, val_fraction=0.0,
        warmup_steps=0, lr=1e-2, sample_max_new_tokens=0, save_merged=True, **plan,
    )  # fmt: skip
    tp = getattr(cfg, "tp", 1)  # a script rendered without --tp has no tp field
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    dp_rank, dp_size, dp_group = data_parallel(mesh)
    cp_args = ()
    if cfg.cp > 1:  # counts and the loss over dp x cp; this rank's place in mesh["cp"]
        cp_args = (mesh["cp"].get_local_rank(), cfg.cp)
        dp_group = mesh["dp_cp"].get_group()
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    # the frozen base projections: (mesh dims, local tensor type) of each, () when not sharded
    base = {
        n: (p.device_mesh.mesh_dim_names, type(p.to_local()).__name__)
        if hasattr(p, "to_local")
        else ()
        for n, p in model.named_parameters()
        if n.endswith("proj.weight")
    }
    optimizer, scheduler = script.build_optimizer(cfg, model)
    rows = odd_length_rows(512)[:4][dp_rank::dp_size]
    micro_batches = [
        script.collate([r], pad_token_id=0, pad_to_multiple_of=tp * 2 * cfg.cp) for r in rows
    ]
    losses, norms = [], []
    for _ in range(2):
        m = script.train_step(
            model, optimizer, scheduler, micro_batches, cfg, dist_info.device, dp_group, *cp_args
        )
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    script.save(
        model, None, Path(model_dir), cfg, dataclasses.asdict(cfg), Path(out_dir), dist_info.is_main
    )
    del model, optimizer, scheduler
    gc.collect()
    dist.barrier()
    return losses, norms, base


@pytest.fixture(scope="module")
def lora_tp_script(tmp_path_factory) -> str:
    """The emitted lora script of a TP 2 x CP 2 spec (its Config takes tp, cp and dp_replicate)."""
    from generator.render import render
    from generator.spec import Spec

    d = tmp_path_factory.mktemp("lora_tp")
    (d / "train.py").write_text(render(Spec(algo="lora", model="qwen3-0.6b", gpus=4, tp=2, cp=2)))
    return str(d / "train.py")


def test_lora_tp_tp_fsdp_and_cp_equal_one_process(lora_tp_script, tiny_model_dir, tmp_path):
    """TP 2 (2 ranks), TP 2 x FSDP 2 (4 ranks) and CP 2 (2 ranks, K/V all-gathered): losses, grad
    norms, the saved adapter and the merged model equal 1 process's."""
    runs = {
        "one": (1, {"tp": 1, "cp": 1}),
        "tp2": (2, {"tp": 2, "cp": 1}),
        "tp2_fsdp2": (4, {"tp": 2, "cp": 1}),
        "cp2": (2, {"tp": 1, "cp": 2}),
    }
    results = {}
    for name, (world, plan) in runs.items():
        args = (lora_tp_script, str(tiny_model_dir), str(tmp_path / name), plan)
        results[name] = spawn(_train, world_size=world, args=args)
    _assert_plans_equal_one(results, tmp_path, ("tp2", "tp2_fsdp2", "cp2"))


def _assert_plans_equal_one(
    results: dict, out: Path, plans, adapter_tol: float = 2e-6, merged_tol: float = 2e-6
) -> None:
    """Each of `plans` (keys of `results`, `_train`'s per-rank returns; its run wrote out/<plan>)
    gives the losses and grad norms of results["one"] (rtol 1e-5, 1e-4) on every rank, and its
    saved adapter and merged model equal out/one's (atol `adapter_tol` and `merged_tol`, rtol
    1e-5 or the same when larger)."""
    ((ref_losses, ref_norms, _),) = results["one"]
    assert ref_losses[1] < ref_losses[0], ref_losses
    adapter = load_file(out / "one" / "adapter_model.safetensors")
    merged = load_file(out / "one" / "merged" / "model.safetensors")
    assert any(v.abs().max() > 1e-4 for k, v in adapter.items() if "lora_B" in k), "B trained"
    for name in plans:
        for losses, norms, _ in results[name]:
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(norms, ref_norms, rtol=1e-4, atol=0, msg=name)
        for ref, path, tol in [
            (adapter, "adapter_model.safetensors", adapter_tol),
            (merged, "merged/model.safetensors", merged_tol),
        ]:
            got = load_file(out / name / path)
            assert got.keys() == ref.keys(), (name, path)
            for key, value in ref.items():
                torch.testing.assert_close(
                    got[key], value, atol=tol, rtol=max(tol, 1e-5), msg=f"{name} {key}"
                )


def test_qlora_cp_both_modes_equal_one_process(shardable_model_dir, tmp_path):
    """QLoRA under CP 2 on 2 ranks (dp 1), K/V all-gathered and in a ring: the NF4 base is
    sharded over dp_shard x cp ("dp_shard_cp": hidden 256, so every projection's NF4 blocks split
    over 2), each row of up to 16 tokens is cut into 4 chunks of 4, and the losses, grad norms,
    the saved adapter and the merged model (gathered from the NF4 shards) equal 1 process's."""
    from generator.render import render
    from generator.spec import Spec

    script = tmp_path / "train.py"
    script.write_text(render(Spec(algo="qlora", gpus=2, cp=2)))
    runs = {
        "one": (1, {"cp": 1}),
        "allgather": (2, {"cp": 2, "cp_mode": "allgather"}),
        "ring": (2, {"cp": 2, "cp_mode": "ring"}),
    }
    results = {
        name: spawn(
            _train, world, args=(str(script), str(shardable_model_dir), str(tmp_path / name), plan)
        )
        for name, (world, plan) in runs.items()
    }
    for name in ("allgather", "ring"):
        for _, _, base in results[name]:  # every NF4 weight sharded over the cp ranks, none whole
            assert set(base.values()) == {(("dp_shard_cp",), "NF4Tensor")}, (name, base)
    # the tolerances of the qlora FSDP test (test_fsdp_adapters_kd): Adam's first steps turn the
    # reduction-order noise of near-zero adapter gradients into weight differences (measured
    # 1.4e-5 on lora_A entries of size 0.07; the merged model 1.4e-6)
    _assert_plans_equal_one(
        results, tmp_path, ("allgather", "ring"), adapter_tol=1e-4, merged_tol=1e-5
    )


def _kd_steps(rank, world_size, script_path, model_dir, teacher_dir, plan):
    import torch.distributed as dist

    from runtime import data_parallel
    from tests.helpers import full_tensor, import_script

    script = import_script(Path(script_path), "kd_cp_script")
    cfg = script.Config(
        model=model_dir, teacher=teacher_dir, dtype="fp32", device="cpu", max_seq_len=32,
        val_fraction=0.0, max_grad_norm=0.0, sample_max_new_tokens=0, **plan,
    )  # fmt: skip
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    dp_rank, dp_size, dp_group = data_parallel(mesh)
    cp_args = ()
    if cfg.cp > 1:
        cp_args = (mesh["cp"].get_local_rank(), cfg.cp)
        dp_group = mesh["dp_cp"].get_group()
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    if cfg.tp > 1:  # the student's lm_head vocab-sharded over tp (loss parallel)
        w = model.lm_head.weight
        assert w.placements[w.device_mesh.mesh_dim_names.index("tp")].is_shard(0), w.placements
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # update == gradient
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    rows = odd_length_rows(512)[:4][dp_rank::dp_size]
    micro_batches = [
        script.collate([r], pad_token_id=0, pad_to_multiple_of=cfg.tp * 2 * cfg.cp) for r in rows
    ]
    losses, norms = [], []
    for _ in range(2):
        m = script.train_step(model, opt, sched, micro_batches, cfg, "cpu", dp_group, *cp_args)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    params = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    del model, opt, sched
    gc.collect()
    dist.barrier()
    return losses, norms, params


def test_kd_tp_and_cp_equal_one_process(tiny_model_dir, tmp_path):
    """KD under TP 2 (the CE vocab-parallel, the KL on the gathered student logits) and CP 2 (K/V
    all-gathered: the teacher, whole on each rank, takes the student's chunks with the same
    context-parallel attention): 2 SGD steps give the 1-process losses, grad norms and student
    parameters. The teacher is the student perturbed, so the KL is not 0."""
    import shutil

    from safetensors.torch import save_file

    from generator.render import render
    from generator.spec import Spec

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir, teacher)
    g = torch.Generator().manual_seed(0)
    weights = load_file(teacher / "model.safetensors")
    weights = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(weights, teacher / "model.safetensors", metadata={"format": "pt"})
    script = tmp_path / "train.py"
    script.write_text(render(Spec(algo="kd", model="qwen3-0.6b", gpus=4, tp=2, cp=2)))
    args = (str(script), str(tiny_model_dir), str(teacher))
    one = {"tp": 1, "cp": 1}
    ((ref_losses, ref_norms, ref_params),) = spawn(_kd_steps, 1, args=(*args, one))
    assert ref_losses[1] < ref_losses[0], ref_losses
    runs = [spawn(_kd_steps, 2, args=(*args, {**one, plan: 2})) for plan in ("tp", "cp")]
    for losses, norms, params in runs[0] + runs[1]:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-4, atol=0)
        for name, p in ref_params.items():
            torch.testing.assert_close(params[name], p, atol=2e-6, rtol=1e-5, msg=name)
