"""Context parallel (runtime.context_parallel) of the emitted SFT script over gloo equals one
process: CP 2 (2 ranks); CP 2 x FSDP 2, HSDP x CP, CP 2 x TP 2 and CP 4 (4 ranks); with the plain
`logits_mask` loss and with `--tricks ac,lce` (recomputed all-gather, per-token linear CE), for a
tied Llama and an untied Qwen3 (q/k norm, biases); in both cp modes (cp_mode "allgather" and
"ring": K/V blocks passed around the cp ranks, runtime.ring_attention). Packed rows under the ring
mode (`--tricks packing --cp-mode ring`: block-causal by document over the ring) give the unpacked
one-process run. Plus the batch layout of `shard_for_context_parallel`, its inverse
`context_parallel_gather` (forward and gradient) and the script's own validation messages.
Measured (2 ranks, 3 steps): loss within 1.0e-7 relative, parameters within 1.2e-7.

Each configuration runs the script's own `setup_distributed`, `setup_model` (CP plan, FSDP over
dp_shard x cp, HF load) and `train_step` (head-tail sharding of every row; token counts and loss
over dp x cp) for 3 SGD steps on the same global batch; the reference is the same script at world
size 1 with cp=1. SGD makes the parameter update the gradient itself, so equal parameters after
every step mean equal gradients.
Tolerance: loss rtol 1e-5, grad norm rtol 1e-4, parameters atol 2e-6 / rtol 1e-5 (fp32; the
attention and gradient sums run in a different order).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from runtime import shard_for_context_parallel
from tests.helpers import full_tensor, odd_length_rows, spawn

LR = 0.5  # large enough that 3 steps move the weights well past the fp32 noise
STEPS = 3


def test_shard_layout_head_tail_chunks_and_global_positions():
    """cp=2: S=8 in 4 chunks of 2; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2."""
    S = 8
    ids = torch.arange(100, 100 + 2 * S).view(2, S)  # [B=2, S]
    batch = {"input_ids": ids, "labels": ids + 1000, "num_tokens": torch.tensor(13), "x": 7}
    rank0 = shard_for_context_parallel(batch, 0, 2)
    rank1 = shard_for_context_parallel(batch, 1, 2)
    assert rank0["position_ids"].tolist() == [[0, 1, 6, 7]] * 2
    assert rank1["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    for shard in (rank0, rank1):  # every entry stays with its token
        pos = shard["position_ids"]
        assert torch.equal(shard["input_ids"], ids.gather(1, pos))
        assert torch.equal(shard["labels"], ids.gather(1, pos) + 1000)
        assert shard["x"] == 7
    # the row's non-padding count is kept once (rank 0), so a sum over dp x cp counts it once
    assert (rank0["num_tokens"].item(), rank1["num_tokens"].item()) == (13, 0)
    # cp=4 on given (packed-style) positions: chunks (r, 7 - r) of 8
    pos = torch.arange(16).view(1, 16) % 5
    got = [
        shard_for_context_parallel({"input_ids": pos, "position_ids": pos}, r, 4) for r in range(4)
    ]
    assert got[1]["position_ids"].tolist() == [pos[0, [2, 3, 12, 13]].tolist()]
    assert sorted(torch.cat([g["input_ids"] for g in got], 1)[0].tolist()) == sorted(
        pos[0].tolist()
    )
    assert shard_for_context_parallel(batch, 0, 1)["input_ids"].equal(ids)  # cp=1: whole rows
    with pytest.raises(ValueError, match="not divisible by 2\\*cp=6"):
        shard_for_context_parallel(batch, 0, 3)


def _gather_worker(rank, world_size):
    """Rows [2, 12] (S = 12: 2*cp chunks of 3 at cp 2) sharded to this rank, gathered back, and
    the gradient of a weighted sum of the gathered rows."""
    import torch.distributed as dist

    from runtime import context_parallel_gather

    rows = torch.arange(2 * 12, dtype=torch.float32).view(2, 12)
    local = shard_for_context_parallel({"input_ids": rows}, rank, world_size)["input_ids"]
    local = local.clone().requires_grad_(True)
    whole = context_parallel_gather(local, dist.group.WORLD)
    weights = torch.linspace(0.5, 2.0, whole.numel()).view(whole.shape)
    (whole * weights).sum().backward()
    expected = shard_for_context_parallel({"input_ids": weights}, rank, world_size)["input_ids"]
    return torch.equal(whole, rows), torch.equal(local.grad, expected)


def test_gather_is_the_inverse_of_the_shard_and_keeps_the_local_gradient():
    """`context_parallel_gather` of each rank's `shard_for_context_parallel` chunks gives the
    whole rows on every rank, and its backward hands each rank the gradient of its own chunks
    only, nothing summed (exact)."""
    assert spawn(_gather_worker, world_size=2) == [(True, True), (True, True)]


def run_case(
    script_path: str, model_dir: str, dp_replicate: int, cp: int, tp: int = 1,
    cp_mode: str = "allgather", packed: bool = False,
) -> dict:  # fmt: skip
    """3 SGD steps of the script under this plan; losses, grad norms and full parameters.

    packed: the 8 rows packed into rows of max_seq_len (the packing script's data); one step over
    all of them is the same loss and gradient as the unpacked rows."""
    import torch.distributed as dist

    from tests.helpers import import_script

    script = import_script(Path(script_path), f"cp_script_{Path(script_path).parent.name}")
    cfg = script.Config(
        model=model_dir, dtype="fp32", max_grad_norm=0.0, device="cpu", max_seq_len=32,
        val_fraction=0.0, cp=cp, dp_replicate=dp_replicate, sample_max_new_tokens=0,
        **({"tp": tp} if tp > 1 else {}), **({"cp_mode": cp_mode} if cp > 1 else {}),
    )  # fmt: skip
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    dp = mesh["dp"]
    cp_rank = mesh["cp"].get_local_rank() if cp > 1 else 0
    rows = odd_length_rows(256)
    if packed:  # 4 packs of 2 documents each, whose boundaries fall inside the cp chunks
        rows = script.pack_examples(rows, cfg.max_seq_len)
    rows = rows[dp.get_local_rank() :: dp.size()]  # this dp rank's share of the rows
    micro_batches = [
        script.collate(rows[i : i + 2], pad_token_id=0, pad_to_multiple_of=2 * cp * tp)
        for i in range(0, len(rows), 2)
    ]
    model = script.setup_model(cfg, Path(model_dir), mesh, dist_info.device)
    attn = model.model.layers[0].self_attn
    assert (attn.cp_group is not None) == (cp > 1)
    if cp > 1:
        assert attn.cp_attention.__name__ == {"ring": "ring_attention"}.get(
            cp_mode, "context_parallel_attention"
        )
    if tp > 1:  # the TP plan is on too: vocab-sharded lm_head (loss parallel)
        w = model.lm_head.weight
        assert w.placements[w.device_mesh.mesh_dim_names.index("tp")].is_shard(0), w.placements
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    losses, norms = [], []
    for _ in range(STEPS):
        m = script.train_step(
            model, opt, sched, micro_batches, cfg, dist_info.device,
            mesh["dp_cp"].get_group(), cp_rank, cp,
        )  # fmt: skip
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        assert m["num_supervised"] == sum(
            sum(t != -100 for t in r["labels"]) for r in odd_length_rows(256)
        ), "the supervised-token count must cover every token once (dp x cp)"
        assert m["num_tokens"] == sum(len(r["input_ids"]) for r in odd_length_rows(256))
    params = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    del model, opt, sched
    gc.collect()
    dist.barrier()
    return {"losses": losses, "grad_norms": norms, "params": params}


def _worker(rank, world_size, scripts, model_dirs, cases):
    """cases: (script name, model name, (dp_replicate, cp[, tp[, cp_mode]])) triples."""
    return {
        (s, m, plan): run_case(scripts[s], model_dirs[m], *plan, packed=s == "packing")
        for s, m, plan in cases
    }


@pytest.fixture(scope="module")
def cp_scripts(tmp_path_factory) -> dict[str, str]:
    """The emitted CP script: plain loss, --tricks ac,lce, with --tp 2 (loss parallel), and with
    --tricks packing --cp-mode ring."""
    from generator.render import render
    from generator.spec import Spec

    out = {}
    for name, tricks, tp in (
        ("plain", (), 1), ("ac_lce", ("ac", "lce"), 1), ("tp", (), 2), ("packing", ("packing",), 1),
    ):  # fmt: skip
        d = tmp_path_factory.mktemp(f"cp_{name}")
        model = "qwen3-0.6b" if tp > 1 else "smollm2-135m"  # heads divisible by tp
        mode = "ring" if "packing" in tricks else "allgather"
        spec = Spec(model=model, gpus=4, cp=2, cp_mode=mode, tp=tp, tricks=tricks, out=str(d))
        (d / "train.py").write_text(render(spec))
        out[name] = str(d / "train.py")
    return out


@pytest.fixture(scope="module")
def reference(cp_scripts, tiny_dirs) -> dict:
    cases = [("plain", m, (1, 1)) for m in tiny_dirs]
    ((ref,),) = [spawn(_worker, 1, args=(cp_scripts, tiny_dirs, cases))]
    return {(s, m): r for (s, m, _), r in ref.items()}


def _check(results: dict, reference: dict) -> None:
    for (script, model, plan), got in results.items():
        ref = reference[("plain", model)]
        where = f"{script} loss, {model}, (dp_replicate, cp)={plan}"
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0, msg=where)
        torch.testing.assert_close(
            got["grad_norms"], ref["grad_norms"], rtol=1e-4, atol=0, msg=where
        )
        for name, p in ref["params"].items():
            torch.testing.assert_close(
                got["params"][name], p, atol=2e-6, rtol=1e-5, msg=f"{where}: {name}"
            )


def test_cp2_equals_one_process(cp_scripts, tiny_dirs, reference):
    """CP over 2 ranks (dp_shard=1): each rank holds 2 of the 4 chunks of every row; all-gather
    and ring, and packed rows in the ring mode (compared with the unpacked one-process run)."""
    cases = [(s, m, (1, 2, 1, mode)) for s in ("plain", "ac_lce") for m in tiny_dirs for mode in ("allgather", "ring")]  # fmt: skip
    cases += [("packing", m, (1, 2, 1, "ring")) for m in tiny_dirs]
    results = spawn(_worker, 2, args=(cp_scripts, tiny_dirs, cases))
    for r in results:
        _check(r, reference)
    first = reference[("plain", "llama_tied")]["losses"]
    assert first[-1] < first[0], "the 3 steps must train (loss goes down)"


def test_cp_with_fsdp_hsdp_tp_and_cp4_four_ranks_equal_one(cp_scripts, tiny_dirs, reference):
    """CP 2 x FSDP 2 (dp_shard=2, cp=2), HSDP x CP (dp_replicate=2, cp=2), CP 2 x TP 2 and CP 4,
    on 4 ranks (a subset of the script x model pairs: 4 processes share 2 cores); the ring mode
    under CP 4, CP 2 x FSDP 2 with packed rows and CP 2 x TP 2."""
    cases = [
        ("plain", "llama_tied", (1, 2)),
        ("ac_lce", "qwen3_untied", (1, 2)),
        ("plain", "qwen3_untied", (2, 2)),
        ("tp", "qwen3_untied", (1, 2, 2)),  # CP 2 x TP 2 (dp_shard=1), q/k norm under SP
        ("plain", "llama_tied", (1, 4)),  # CP 4: 8 chunks, rank r holds r and 7 - r
        ("ac_lce", "llama_tied", (1, 4, 1, "ring")),  # a ring of 4
        ("packing", "qwen3_untied", (1, 2, 1, "ring")),  # 2 dp ranks of 2 packs, rings of 2
        ("tp", "qwen3_untied", (1, 2, 2, "ring")),  # the ring over heads sharded by tp
    ]
    results = spawn(_worker, 4, args=(cp_scripts, tiny_dirs, cases))
    for r in results:
        _check(r, reference)


def test_script_validate_names_the_cp_numbers(monkeypatch):
    """The emitted example's own validate(): world size and max_seq_len against 2*cp."""
    from tests.helpers import EXAMPLES, import_script

    script = import_script(EXAMPLES / "sft_smollm2_cp2" / "train.py", "sft_smollm2_cp2_train")
    monkeypatch.setenv("WORLD_SIZE", "2")
    script.validate(script.Config())  # the defaults: cp=2 on 2 processes, max_seq_len 512
    with pytest.raises(ValueError) as e:
        script.validate(script.Config(max_seq_len=30))
    assert "max_seq_len=30 is not divisible by 2*cp=4" in str(e.value)
    assert "multiple of 4 (e.g. 32) or choose cp in [1]" in str(e.value)
    with pytest.raises(ValueError, match=r"cp=3, dp_replicate=1: .* world size 2 .* \[1, 2\]"):
        script.validate(script.Config(cp=3))
    with pytest.raises(ValueError, match="sample_max_new_tokens=8 with cp=2"):
        script.validate(script.Config(sample_max_new_tokens=8))
    script.validate(script.Config(cp_mode="ring"))
    with pytest.raises(ValueError) as e:
        script.validate(script.Config(cp_mode="rings"))
    assert "cp_mode='rings': choose 'allgather' or 'ring'" in str(e.value)


def test_packed_script_validate_asks_for_the_ring(cp_scripts, monkeypatch):
    """--tricks packing --cp-mode ring: its Config defaults to the ring; switching it to all-gather
    is refused with the reason."""
    from tests.helpers import import_script

    script = import_script(Path(cp_scripts["packing"]), "cp_packing_validate")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert script.Config.cp_mode == "ring"
    script.validate(script.Config(max_seq_len=32))
    with pytest.raises(ValueError) as e:
        script.validate(script.Config(max_seq_len=32, cp_mode="allgather"))
    assert "cp_mode='allgather' with packing" in str(e.value) and "--cp_mode ring" in str(e.value)
