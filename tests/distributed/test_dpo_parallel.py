"""Parallel plans of the emitted DPO scripts (dpo, dpo-lora) over gloo equal one process: HSDP 2x2
(dp_replicate=2, dp_shard=2), TP 2 (sequence parallel, vocab-sharded log-probs), TP 2 x FSDP 2,
CP 2 (both cp modes; every row longer than one rank's chunk, so each sequence's log-prob is a sum
over both cp ranks) and CP 2 x FSDP 2; with the tricks packing (CP 2 ring, TP 2: packed rows, 2
pairs in one, replies spanning the cp ranks) and lce (CP 2, TP 2: the chunked per-token log-probs
on each rank's chunks and on vocab-sharded lm_head chunks).

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
ONE = {"dp_replicate": 1}  # the 1-process plan (the scripts' Config defaults are the spec's)
HSDP = {"dp_replicate": 2, "tp": 1, "cp": 1}
TP = {"dp_replicate": 1, "tp": 2, "cp": 1}
CP = {"dp_replicate": 1, "tp": 1, "cp": 2, "cp_mode": "allgather"}
RING = {"dp_replicate": 1, "tp": 1, "cp": 2, "cp_mode": "ring"}
# the step's logged means (TRL's names), compared step by step
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# the scripts rendered with tricks: `trick_scripts` key -> (algo, tricks); TRICK_CASES the
# (script, ref_mode) runs of their 1-process reference
TRICK_SPECS = {"dpo+packing": ("dpo", ("packing",)), "dpo+lce": ("dpo", ("lce",)),
               "dpo-lora+packing,lce": ("dpo-lora", ("packing", "lce"))}  # fmt: skip
TRICK_CASES = [("dpo+packing", "separate"), ("dpo+packing", "precomputed"),
               ("dpo+lce", "separate"), ("dpo+lce", "precomputed"),
               ("dpo-lora+packing,lce", "adapters-off")]  # fmt: skip


def run_case(script_path: str, model_dir: str, data: str, ref_mode: str, plan: dict) -> dict:
    """2 SGD steps of the DPO script under `plan`; losses, grad norms and trainable parameters."""
    import functools

    import torch.distributed as dist

    from runtime import (
        Tokenizer,
        data_parallel,
        precompute_reference_logprobs,
        shard_for_context_parallel,
    )
    from tests.helpers import import_script

    script = import_script(Path(script_path), f"dpo_plan_{Path(script_path).parent.name}")
    cfg = script.Config(
        model=model_dir, dataset=data, dtype="fp32", max_grad_norm=0.0, device="cpu",
        max_seq_len=64, val_fraction=0.0, ref_mode=ref_mode, sample_max_new_tokens=0, **plan,
    )  # fmt: skip
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    dp_rank, dp_size, dp_group = data_parallel(mesh)
    tokenizer = Tokenizer.from_dir(model_dir)
    examples = script.build_datasets(cfg, tokenizer)[0]
    packed = hasattr(script, "collate_preference_packs")  # rendered with the packing trick
    if packed:  # the 4 pairs packed in rows of up to 2 * max_seq_len tokens
        assert sum(len(row["sample_ids"]) for row in examples) == 4
        assert max(len(row["sample_ids"]) for row in examples) >= 2, "no row holds 2+ pairs"
        assert len(examples) >= dp_size, "each dp rank needs a row"
        collate = script.collate_preference_packs
    else:
        examples = examples[:4]  # the same global batch everywhere
        collate = script.collate
    collate = functools.partial(collate, pad_token_id=tokenizer.pad_token_id)
    # sequence parallel splits S over tp, context parallel into 2*cp chunks: rows padded to a
    # multiple, as the script's main pads them
    multiple = plan.get("tp", 1) * 2 * plan.get("cp", 1)
    micro_batches = [
        collate([ex], pad_to_multiple_of=multiple) for ex in examples[dp_rank::dp_size]
    ]
    if plan.get("cp", 1) > 1 and packed:  # a sequence of each row has tokens on both cp ranks
        for mb in micro_batches:
            on = [
                set(s["sequence_ids"][s["labels"] != -100].tolist())
                for s in (shard_for_context_parallel(mb, r, plan["cp"]) for r in range(plan["cp"]))
            ]
            assert on[0] & on[1], on
    elif plan.get("cp", 1) > 1:  # every row reaches past this rank's share: its sums span the ranks
        for mb in micro_batches:
            last = (mb["labels"] != -100).int().cumsum(-1).argmax(-1)  # last supervised position
            assert (last >= mb["labels"].shape[1] // 2).all(), last
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    if plan.get("tp", 1) > 1:  # vocab-sharded over tp (loss parallel), whatever FSDP adds on dp
        w = model.lm_head.weight
        assert w.placements[w.device_mesh.mesh_dim_names.index("tp")].is_shard(0), w.placements
        attn = model.model.layers[0].self_attn
        if hasattr(attn.q_proj, "lora_A"):  # adapters sharded with their base
            for param, shard_dim in [
                (attn.q_proj.weight, 0), (attn.q_proj.lora_A.weight, None),
                (attn.q_proj.lora_B.weight, 0), (attn.o_proj.weight, 1),
                (attn.o_proj.lora_A.weight, 1), (attn.o_proj.lora_B.weight, None),
            ]:  # fmt: skip
                tp_placement = param.placements[param.device_mesh.mesh_dim_names.index("tp")]
                assert (
                    tp_placement.is_replicate()
                    if shard_dim is None
                    else tp_placement.is_shard(shard_dim)
                ), tp_placement
    reference, table = None, None
    if ref_mode == "separate":
        reference = script.build_reference(cfg, Path(model_dir), mesh, dist_info.device)
    elif ref_mode == "precomputed":
        table = precompute_reference_logprobs(
            model, examples, lambda m, b: script.sequence_logprobs(m, b, cfg)[0],
            functools.partial(collate, pad_to_multiple_of=multiple),
            cfg.micro_batch_size, dp_rank, dp_size, "cpu", dp_group,
        )  # fmt: skip
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    losses, norms, metrics = [], [], []
    for _ in range(STEPS):
        m = script.train_step(
            model, reference, table, opt, sched, micro_batches, cfg, "cpu", dp_group
        )
        assert m["num_pairs"] == 4, "the pair count must be over the dp ranks only"
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        metrics.append([m[k] for k in METRICS])
    params = {
        n: full_tensor(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad
    }
    del model, reference, opt, sched
    gc.collect()
    dist.barrier()
    return {"losses": losses, "grad_norms": norms, "metrics": metrics, "params": params}


def _worker(rank, world_size, scripts, model_dir, data, cases):
    """cases: [(algo, ref_mode, plan)]; the results keyed by them. data: the pairs' file, or
    {algo: its file}."""
    return {
        (algo, ref_mode, tuple(plan.items())): run_case(
            scripts[algo], model_dir, data[algo] if isinstance(data, dict) else data, ref_mode, plan
        )
        for algo, ref_mode, plan in cases
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
def trick_pairs_path(tmp_path_factory) -> str:
    """The packed scripts' 4 pairs, which pack (max_seq_len 64: rows of 128) as [pairs 0, 1], [2],
    [3], each row with a reply whose tokens fall on both cp ranks (checked in `run_case`); the
    unpacked ones take `pairs_path` (each row's replies reach past its first half)."""
    rows = [
        {"prompt": f"Count to {6 * i + 3}.", "chosen": " ".join(map(str, range(1, 6 * i + 4))), "rejected": "No."}
        for i in range(4)
    ]  # fmt: skip
    path = tmp_path_factory.mktemp("dpo_trick_plans") / "pairs.json"
    path.write_text(json.dumps(rows))
    return str(path)


@pytest.fixture(scope="module")
def dpo_scripts(tmp_path_factory) -> dict[str, str]:
    """The emitted dpo and dpo-lora scripts of a TP 2 x CP 2 spec (their Config takes tp, cp,
    cp_mode and dp_replicate: every plan here runs them)."""
    from generator.render import render
    from generator.spec import Spec

    specs = {
        algo: Spec(algo=algo, model="qwen3-0.6b", gpus=4, tp=2, cp=2, dataset="dpo_en_demo.json")
        for algo in ("dpo", "dpo-lora")
    }
    out = {}
    for algo, spec in specs.items():
        d = tmp_path_factory.mktemp(algo)
        (d / "train.py").write_text(render(spec))
        out[algo] = str(d / "train.py")
    return out


@pytest.fixture(scope="module")
def trick_scripts(tmp_path_factory) -> dict[str, str]:
    """`TRICK_SPECS`' scripts, rendered for TP 2 x CP 2 (ring: packing's document mask)."""
    from generator.render import render
    from generator.spec import Spec

    out = {}
    for key, (algo, tricks) in TRICK_SPECS.items():
        spec = Spec(
            algo=algo, model="qwen3-0.6b", gpus=4, tp=2, cp=2, cp_mode="ring", tricks=tricks,
            dataset="dpo_en_demo.json",
        )  # fmt: skip
        d = tmp_path_factory.mktemp(key.replace(",", "_").replace("+", "_"))
        (d / "train.py").write_text(render(spec))
        out[key] = str(d / "train.py")
    return out


def _one_process(scripts: dict, model_dir, data: str | dict, cases: list) -> dict:
    """The 1-process runs of `cases` [(script key, ref_mode)], keyed by them."""
    plans = [(algo, ref_mode, {**ONE, "tp": 1, "cp": 1}) for algo, ref_mode in cases]
    (ref,) = spawn(_worker, 1, args=(scripts, str(model_dir), data, plans))
    return {(algo, ref_mode): r for (algo, ref_mode, _), r in ref.items()}


@pytest.fixture(scope="module")
def one_process(dpo_scripts, tiny_model_dir, pairs_path) -> dict:
    return _one_process(dpo_scripts, tiny_model_dir, pairs_path, CASES)


@pytest.fixture(scope="module")
def trick_data(pairs_path, trick_pairs_path) -> dict[str, str]:
    """Each `TRICK_SPECS` script's pairs file (`trick_pairs_path`'s docstring)."""
    return {key: trick_pairs_path if "packing" in key else pairs_path for key in TRICK_SPECS}


@pytest.fixture(scope="module")
def one_process_tricks(trick_scripts, tiny_model_dir, trick_data) -> dict:
    return _one_process(trick_scripts, tiny_model_dir, trick_data, TRICK_CASES)


def _check(results: dict, reference: dict) -> None:
    for (algo, ref_mode, plan), got in results.items():
        ref = reference[(algo, ref_mode)]
        where = f"{algo} ({ref_mode}), plan {dict(plan)}"
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0, msg=where)
        torch.testing.assert_close(
            got["grad_norms"], ref["grad_norms"], rtol=1e-4, atol=0, msg=where
        )
        # rewards are 0 at step 1 (the policy is the reference): an absolute floor of 1e-6
        torch.testing.assert_close(got["metrics"], ref["metrics"], rtol=1e-5, atol=1e-6, msg=where)
        assert got["params"].keys() == ref["params"].keys(), where
        for name, p in ref["params"].items():
            torch.testing.assert_close(
                got["params"][name], p, atol=2e-6, rtol=1e-5, msg=f"{where}: {name}"
            )


def test_one_process_reference_trains(one_process, one_process_tricks):
    """The reference runs move the weights far past the tolerance and lower the loss (the trick
    scripts' packed data: lr 1 overshoots, so their loss moves by > 1e-2 either way), so the
    parity checks below compare real updates."""
    for (algo, ref_mode), r in {**one_process, **one_process_tricks}.items():
        if (algo, ref_mode) in one_process:
            assert r["losses"][1] < r["losses"][0], (algo, ref_mode, r["losses"])
        else:
            assert abs(r["losses"][1] - r["losses"][0]) > 1e-2, (algo, ref_mode, r["losses"])
        assert min(r["grad_norms"]) * LR > 1e-3, (algo, ref_mode, r["grad_norms"])


def test_hsdp_and_tp_fsdp_four_ranks_equal_one(
    dpo_scripts, tiny_model_dir, pairs_path, one_process
):
    """HSDP 2x2: the reference sharded like the policy, the precomputed table all-reduced over
    dp = dp_replicate x dp_shard, the pair count over the 4 dp ranks. TP 2 x FSDP 2: the
    reference under the same TP plan, the log-probs from vocab-sharded logits, the table and the
    pair count over the 2 dp ranks only. CP 2 x FSDP 2 (ring; all-gather for dpo-lora) and CP 2 x
    TP 2 (dp 1)."""
    cases = [(algo, ref_mode, HSDP) for algo, ref_mode in CASES]
    cases += [(algo, ref_mode, TP) for algo, ref_mode in CASES]  # TP 2 x FSDP 2
    cases += [("dpo", "separate", RING), ("dpo-lora", "adapters-off", CP)]  # CP 2 x FSDP 2
    cases += [("dpo", "precomputed", {**TP, **CP, "tp": 2})]  # CP 2 x TP 2
    for r in spawn(_worker, 4, args=(dpo_scripts, str(tiny_model_dir), pairs_path, cases)):
        _check(r, one_process)


def test_tp_and_cp_two_ranks_equal_one(dpo_scripts, tiny_model_dir, pairs_path, one_process):
    """TP 2 alone (dp 1): both tp ranks read the same pairs; lm_head's logits vocab-sharded. CP 2
    (dp 1), K/V all-gathered and in a ring: each rank holds 2 of the 4 chunks of every row, its
    sequence log-probs are completed over the cp ranks (the reference's and the precomputed
    table's too), and the pair count is the dp ranks'."""
    cases = [(algo, ref_mode, plan) for algo, ref_mode in CASES for plan in (TP, CP)]
    cases += [("dpo", "precomputed", RING)]
    cases += [("dpo", "separate", {**CP, "ref_device": "cpu"})]  # a whole reference: whole rows
    for r in spawn(_worker, 2, args=(dpo_scripts, str(tiny_model_dir), pairs_path, cases)):
        _check(r, one_process)


def test_packing_and_lce_two_ranks_equal_one(
    trick_scripts, tiny_model_dir, trick_data, one_process_tricks
):
    """packing and lce under CP 2 and TP 2 (dp 1). Packing: the 4 pairs in 3 packed rows (2 pairs
    in the first; in each, a reply with tokens on both cp ranks); under CP (ring) each rank keeps
    its chunks of the row's sequence_ids and document_ids, attention is block-causal by document
    over the ring, and the per-sequence sums are completed over the cp ranks; under TP the row is
    padded to a multiple of tp. lce: the chunked per-token log-probs on each cp rank's chunks, and
    under TP on vocab-sharded chunks of lm_head (`token_logprobs`' loss-parallel path)."""
    cases = [
        ("dpo+packing", "separate", RING), ("dpo+packing", "precomputed", TP),
        ("dpo+lce", "precomputed", CP), ("dpo+lce", "separate", TP),
        ("dpo-lora+packing,lce", "adapters-off", RING),
        ("dpo-lora+packing,lce", "adapters-off", TP),
    ]  # fmt: skip
    for r in spawn(_worker, 2, args=(trick_scripts, str(tiny_model_dir), trick_data, cases)):
        _check(r, one_process_tricks)


def _main_rank(rank, world_size, script, args):
    from tests.helpers import import_script, read_metrics

    import_script(Path(script), "dpo_plan_main").main(args)
    return read_metrics(Path(args[args.index("--out_dir") + 1]))


def test_tp_example_main_equals_one_process(tiny_model_dir, tmp_path):
    """examples/dpo_qwen3_tp2's main() on 2 ranks (tp 2, dp 1: the same pairs as 1 process):
    loading, the precomputed reference pass (rows padded to a multiple of tp, the table reduced
    over dp), 2 steps, validation and the final HF save; the step and validation metrics equal
    examples/dpo_smollm2's on 1 process (fp32, 1e-5), and the saved keys are the checkpoint's."""
    from tests.helpers import EXAMPLES, safetensors_keys

    rows = [
        {"prompt": f"Count to {i}.", "chosen": " ".join(map(str, range(1, i + 2))), "rejected": "No."}
        for i in range(8)
    ]  # fmt: skip
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(rows))
    common = [
        "--model", str(tiny_model_dir), "--dataset", str(data), "--dtype", "fp32",
        "--ref_mode", "precomputed", "--max_seq_len", "64", "--micro_batch_size", "2",
        "--max_steps", "2", "--warmup_steps", "0", "--lr", "1e-2", "--val_fraction", "0.25",
        "--eval_every_steps", "2", "--sample_max_new_tokens", "0", "--resume", "none",
    ]  # fmt: skip
    one_args = [*common, "--out_dir", str(tmp_path / "one")]
    (one,) = spawn(_main_rank, 1, args=(str(EXAMPLES / "dpo_smollm2" / "train.py"), one_args))
    tp_args = [*common, "--out_dir", str(tmp_path / "tp")]
    script = str(EXAMPLES / "dpo_qwen3_tp2" / "train.py")
    for got in spawn(_main_rank, 2, args=(script, tp_args)):
        assert [r["step"] for r in got] == [r["step"] for r in one] and len(one) >= 2
        for r, ref in zip(got, one, strict=True):
            assert r["num_pairs"] == ref["num_pairs"]
            for key in ("loss", "rewards/margins", "logps/chosen", "val_loss"):
                if key in ref:
                    assert r[key] == pytest.approx(ref[key], abs=1e-5), (r["step"], key)
    assert "val_loss" in one[-1] and one[-1]["loss"] != one[0]["loss"]
    assert safetensors_keys(tmp_path / "tp" / "model") == safetensors_keys(tiny_model_dir)


def _target_logprobs_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from runtime import target_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 8, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.tensor([0, 3, 4, 7, 5])  # both vocab halves
    weights = torch.randn(5, generator=g, dtype=torch.float64)  # a non-uniform upstream gradient
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    sharded = distribute_tensor(logits.detach(), mesh, [Shard(-1)]).requires_grad_()
    got = target_logprobs(sharded, targets)
    (got * weights).sum().backward()
    return got.detach(), sharded.grad.full_tensor()


def test_target_logprobs_of_vocab_sharded_logits_equal_log_softmax():
    """`target_logprobs` on [T, V] logits sharded over 2 tp ranks: the values and the gradient of
    log_softmax(logits).gather(targets) on the whole logits (fp64 inputs, fp32 math: 1e-6)."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 8, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.tensor([0, 3, 4, 7, 5])
    weights = torch.randn(5, generator=g, dtype=torch.float64)
    expected = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    (expected * weights).sum().backward()
    for got, grad in spawn(_target_logprobs_rank, 2):
        torch.testing.assert_close(got, expected.detach().float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, logits.grad, atol=1e-6, rtol=0)
