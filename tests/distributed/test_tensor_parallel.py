"""Parallel plans of the emitted SFT script over gloo equal one process: FSDP2 (2), TP (2),
HSDP (2x2) and TP + FSDP (2x2), each with loss parallel on the plain `logits_mask` loss and on the
linear cross-entropy (`--tricks lce`), for a tied Llama and an untied Qwen3 (q/k norm, biases).

Each configuration runs the script's own `setup_distributed`, `setup_model` (TP plan, FSDP,
HF load) and `train_step` (token counts and loss over mesh["dp"]) for 3 SGD steps on the same
global batch; the reference is the same script at world size 1. SGD makes the parameter update
the gradient itself, so equal parameters after every step mean equal gradients.
Tolerance: loss 1e-5 relative, parameters atol 2e-6 (fp32; the sums run in a different order).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.helpers import full_tensor, odd_length_rows, spawn

LR = 0.5  # large enough that 3 steps move the weights well past the fp32 noise
STEPS = 3


def run_case(script_path: str, model_dir: str, dp_replicate: int, tp: int) -> dict:
    """3 SGD steps of the script under this plan; losses, grad norms and full parameters."""
    import torch.distributed as dist

    from tests.helpers import import_script

    script = import_script(Path(script_path), f"tp_script_{Path(script_path).parent.name}")
    cfg = script.Config(
        model=model_dir, dtype="fp32", max_grad_norm=0.0, device="cpu", max_seq_len=32,
        val_fraction=0.0, tp=tp, dp_replicate=dp_replicate, sample_max_new_tokens=0,
    )  # fmt: skip
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    dp = mesh["dp"]
    rows = odd_length_rows(256)[dp.get_local_rank() :: dp.size()]  # this dp rank's share of 8 rows
    micro_batches = [
        script.collate(rows[i : i + 2], pad_token_id=0, pad_to_multiple_of=tp)
        for i in range(0, len(rows), 2)
    ]
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    tied = model.args.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    if tp > 1:  # vocab-sharded over tp (loss parallel), whatever FSDP adds on the dp dims
        w = model.lm_head.weight
        assert w.placements[w.device_mesh.mesh_dim_names.index("tp")].is_shard(0), w.placements
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    losses, norms = [], []
    for _ in range(STEPS):
        m = script.train_step(
            model, opt, sched, micro_batches, cfg, dist_info.device, dp.get_group()
        )
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        assert m["num_supervised"] == sum(
            sum(t != -100 for t in r["labels"]) for r in odd_length_rows(256)
        ), "the supervised-token count must be over the dp ranks only"
    params = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    del model, opt, sched
    gc.collect()
    dist.barrier()
    return {"losses": losses, "grad_norms": norms, "params": params}


def _worker(rank, world_size, scripts, model_dirs, plans):
    return {
        (s, m, plan): run_case(scripts[s], model_dirs[m], *plan)
        for s in scripts
        for m in model_dirs
        for plan in plans
    }


@pytest.fixture(scope="module")
def tp_scripts(tmp_path_factory) -> dict[str, str]:
    """The emitted TP script, with the plain loss and with --tricks lce."""
    from generator.render import render
    from generator.spec import Spec

    out = {}
    for name, tricks in (("plain", ()), ("lce", ("lce",))):
        d = tmp_path_factory.mktemp(f"tp_{name}")
        spec = Spec(algo="sft", model="qwen3-0.6b", gpus=4, tp=2, tricks=tricks, out=str(d))
        (d / "train.py").write_text(render(spec))
        out[name] = str(d / "train.py")
    return out


def _check(results: dict, reference: dict) -> None:
    for (script, model, plan), got in results.items():
        ref = reference[("plain", model)]
        where = f"{script} loss, {model}, (dp_replicate, tp)={plan}"
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0, msg=where)
        torch.testing.assert_close(
            got["grad_norms"], ref["grad_norms"], rtol=1e-4, atol=0, msg=where
        )
        for name, p in ref["params"].items():
            torch.testing.assert_close(
                got["params"][name], p, atol=2e-6, rtol=1e-5, msg=f"{where}: {name}"
            )


@pytest.fixture(scope="module")
def reference(tp_scripts, tiny_dirs) -> dict:
    ((ref,),) = [spawn(_worker, 1, args=({"plain": tp_scripts["plain"]}, tiny_dirs, [(1, 1)]))]
    return {(s, m): r for (s, m, _), r in ref.items()}


def test_fsdp2_and_tp_two_ranks_equal_one(tp_scripts, tiny_dirs, reference):
    """FSDP2 over 2 ranks (dp_shard=2) and TP over 2 ranks (tp=2): loss parallel, plain and lce."""
    results = spawn(_worker, 2, args=(tp_scripts, tiny_dirs, [(1, 1), (1, 2)]))
    for r in results:
        _check(r, reference)
    first = reference[("plain", "llama_tied")]["losses"]
    assert first[-1] < first[0], "the 3 steps must train (loss goes down)"


def test_hsdp_and_tp_fsdp_four_ranks_equal_one(tp_scripts, tiny_dirs, reference):
    """HSDP 2x2 (dp_replicate=2, dp_shard=2) and TP + FSDP 2x2 (dp_shard=2, tp=2)."""
    results = spawn(_worker, 4, args=(tp_scripts, tiny_dirs, [(2, 1), (1, 2)]))
    for r in results:
        _check(r, reference)
