"""Parallel plans of the emitted DPO scripts (dpo, dpo-lora) over gloo equal one process: HSDP 2x2
(dp_replicate=2, dp_shard=2).

Each case runs the script's own `setup_distributed`, `setup_model`, reference (a sharded separate
copy, the precomputed table, or the adapters-off base) and `train_step` for 2 SGD steps on the
same global batch of 4 pairs; each dp rank takes its share. The 1-process run of the same script
is the reference. SGD makes the update the gradient itself, so equal parameters after every step
mean equal gradients. Tolerances as the SFT plan tests (tests/distributed/test_tensor_parallel.py):
loss 1e-5 relative, grad norm 1e-4 relative, parameters atol 2e-6 (fp32, sums in another order).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import full_tensor, spawn

LR = 1.0  # update == gradient (norm ~1.7 at step 1): far past fp32 noise
STEPS = 2
# (script, ref_mode): the reference each skeleton has; precomputed covers the table's all-reduce
CASES = [("dpo", "separate"), ("dpo", "precomputed"), ("dpo-lora", "adapters-off")]


def run_case(script_path: str, model_dir: str, data: str, ref_mode: str, plan: dict) -> dict:
    """2 SGD steps of the DPO script under `plan`; losses, grad norms and trainable parameters."""
    import functools

    import torch.distributed as dist

    from runtime import Tokenizer, data_parallel, precompute_reference_logprobs
    from tests.helpers import import_script

    script = import_script(Path(script_path), f"dpo_plan_{Path(script_path).parent.name}")
    cfg = script.Config(
        model=model_dir, dataset=data, dtype="fp32", max_grad_norm=0.0, device="cpu",
        max_seq_len=64, val_fraction=0.0, ref_mode=ref_mode, sample_max_new_tokens=0, **plan,
    )  # fmt: skip
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    dp_rank, dp_size, _ = data_parallel(mesh)
    tokenizer = Tokenizer.from_dir(model_dir)
    pairs = script.build_datasets(cfg, tokenizer)[0][:4]  # the same global batch everywhere
    collate = functools.partial(script.collate, pad_token_id=tokenizer.pad_token_id)
    micro_batches = [collate([p]) for p in pairs[dp_rank::dp_size]]
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    reference, table = None, None
    if ref_mode == "separate":
        reference = script.build_reference(cfg, Path(model_dir), mesh, dist_info.device)
    elif ref_mode == "precomputed":
        table = precompute_reference_logprobs(
            model, pairs, lambda m, b: script.sequence_logprobs(m, b, cfg)[0], collate,
            cfg.micro_batch_size, dp_rank, dp_size, "cpu",
        )  # fmt: skip
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    losses, norms = [], []
    for _ in range(STEPS):
        m = script.train_step(model, reference, table, opt, sched, micro_batches, cfg, "cpu")
        assert m["num_pairs"] == 4, "the pair count must be over the dp ranks only"
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    params = {
        n: full_tensor(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad
    }
    del model, reference, opt, sched
    gc.collect()
    dist.barrier()
    return {"losses": losses, "grad_norms": norms, "params": params}


def _worker(rank, world_size, scripts, model_dir, data, plans):
    return {
        (algo, ref_mode, tuple(plan.items())): run_case(
            scripts[algo], model_dir, data, ref_mode, plan
        )
        for algo, ref_mode in CASES
        for plan in plans
    }


@pytest.fixture(scope="module")
def pairs_path(tmp_path_factory) -> str:
    rows = [
        {"prompt": f"Count to {i}.", "chosen": " ".join(map(str, range(1, i + 2))), "rejected": "No."}
        for i in range(4)
    ]  # fmt: skip
    path = tmp_path_factory.mktemp("dpo_plans") / "pairs.json"
    path.write_text(json.dumps(rows))
    return str(path)


@pytest.fixture(scope="module")
def dpo_scripts(tmp_path_factory) -> dict[str, str]:
    """The emitted dpo and dpo-lora scripts of a 4-GPU HSDP spec."""
    from generator.render import render
    from generator.spec import Spec

    out = {}
    for algo in ("dpo", "dpo-lora"):
        d = tmp_path_factory.mktemp(algo)
        spec = Spec(algo=algo, gpus=4, dp_replicate=2, dataset="dpo_en_demo.json", out=str(d))
        (d / "train.py").write_text(render(spec))
        out[algo] = str(d / "train.py")
    return out


@pytest.fixture(scope="module")
def one_process(dpo_scripts, tiny_model_dir, pairs_path) -> dict:
    (ref,) = spawn(
        _worker, 1, args=(dpo_scripts, str(tiny_model_dir), pairs_path, [{"dp_replicate": 1}])
    )
    return {(algo, ref_mode): r for (algo, ref_mode, _), r in ref.items()}


def _check(results: dict, reference: dict) -> None:
    for (algo, ref_mode, plan), got in results.items():
        ref = reference[(algo, ref_mode)]
        where = f"{algo} ({ref_mode}), plan {dict(plan)}"
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0, msg=where)
        torch.testing.assert_close(
            got["grad_norms"], ref["grad_norms"], rtol=1e-4, atol=0, msg=where
        )
        assert got["params"].keys() == ref["params"].keys(), where
        for name, p in ref["params"].items():
            torch.testing.assert_close(
                got["params"][name], p, atol=2e-6, rtol=1e-5, msg=f"{where}: {name}"
            )


def test_one_process_reference_trains(one_process):
    """The reference runs move the weights far past the tolerance and lower the loss, so the
    parity checks below compare real updates."""
    for (algo, ref_mode), r in one_process.items():
        assert r["losses"][1] < r["losses"][0], (algo, ref_mode, r["losses"])
        assert min(r["grad_norms"]) * LR > 1e-3, (algo, ref_mode, r["grad_norms"])


def test_hsdp_four_ranks_equal_one(dpo_scripts, tiny_model_dir, pairs_path, one_process):
    """HSDP 2x2: the reference sharded like the policy, the precomputed table all-reduced over
    dp = dp_replicate x dp_shard, the pair count over the 4 dp ranks."""
    plans = [{"dp_replicate": 2}]
    for r in spawn(_worker, 4, args=(dpo_scripts, str(tiny_model_dir), pairs_path, plans)):
        _check(r, one_process)
