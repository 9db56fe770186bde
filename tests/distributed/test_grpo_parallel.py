"""The GRPO-skeleton scripts (grpo, grpo-lora, ppo) under tensor parallel (TP 2: sequence parallel,
vocab-sharded log-probs) and context parallel (CP 2, cp_mode allgather and ring) on 2 trainer
processes (gloo ranks forked by `tests.helpers.launch`) against the same script on 1 process.

Sync rollouts from one engine: every run samples the same rollouts as long as the engine gets the
same weights. Rank 0 shares them with both ranks (one dp rank: both ranks train the same rows), the
TP ranks reduce the log-softmax over their vocab shards, the CP ranks run their chunks of every
row and gather the log-probs (and PPO's values, for GAE) back into whole rows. So the per-step
loss, gradient norm and rewards equal the 1-process run's; equal rewards after the first step
mean the weight sync gathered the same weights from the TP / CP trainer (the rewards change
between batches: checked). The final save (`full_tensor` over the mesh, as the object-store
sync) is compared tensor by tensor: AdamW, 3-4 steps at lr 1e-2, fp32 sums in another order.

Each algorithm exercises what its plan touches: grpo the per-sequence means of loss_type grpo
(|o_i| over whole rows); grpo-lora gspo's sequence ratio (num_iterations 2), the k3 KL to the
adapters-off base and top_p sampling (under TP its support needs the gathered [T, V] logits);
ppo the k1 KL reward from a separate reference, GAE and the whitening over whole rows, and the
value head (replicated over tp).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import joined_ray, run_script, spawn, write_reward_driver

# the flags of each algorithm's runs (beside the plan's): the smallest configs of
# test_grpo_ranks.py / test_ppo_ranks.py
COMMON = [
    "--dtype", "fp32", "--engine", "runtime", "--rollout", "sync", "--num_engines", "1",
    "--max_new_tokens", "6", "--micro_batch_size", "2", "--lr", "1e-2", "--warmup_steps", "0",
    "--reward_weights", "1.0", "--resume", "none", "--ray_num_cpus", "2",
]  # fmt: skip
ALGO_ARGS = {
    "grpo": ["--num_generations", "4", "--prompts_per_step", "2", "--max_steps", "3",
             "--loss_type", "grpo"],
    "grpo-lora": ["--num_generations", "4", "--prompts_per_step", "2", "--max_steps", "4",
                  "--num_iterations", "2", "--loss_type", "gspo", "--kl_coef", "0.05",
                  "--top_p", "0.95", "--save_merged", "false"],
    "ppo": ["--num_generations", "1", "--prompts_per_step", "4", "--max_steps", "4",
            "--num_iterations", "2", "--kl_coef", "0.05"],
}  # fmt: skip
ONE = ["--tp", "1", "--cp", "1"]
# the memory tricks under TP and ring CP, each script against its own 1-process run (the same
# tricks): lce's chunked completion log-probs (vocab-parallel per chunk under TP, grpo-lora's
# top_p gathering each chunk's whole rows; on this rank's chunks under CP) and packing (rows
# padded to a multiple of tp / 2*cp; under CP the document ids sharded with their tokens)
TRICKS = {
    "grpo+lce": ("grpo", ("lce",)),
    "grpo+packing": ("grpo", ("packing",)),
    "grpo-lora+lce,packing": ("grpo-lora", ("lce", "packing")),
}
PLANS = {
    "tp2": ["--tp", "2", "--cp", "1"],
    "cp2": ["--tp", "1", "--cp", "2", "--cp_mode", "allgather"],
    "ring2": ["--tp", "1", "--cp", "2", "--cp_mode", "ring"],
}
KEYS = {  # compared with the 1-process run's, beside reward and grad_norm
    "grpo": ("loss", "clip_ratio/region_mean"),
    "grpo-lora": ("loss", "kl", "clip_ratio/region_mean"),
    "ppo": ("loss", "loss/policy_avg", "loss/value_avg", "val/explained_variance", "objective/kl"),
}


@pytest.fixture(scope="module")
def drivers(tmp_path_factory) -> dict:
    """Each algorithm's script rendered with both plans (qwen3-0.6b: heads divisible by 2; the
    flags pick tp / cp), wrapped in the even-token reward driver."""
    from generator.render import render
    from generator.spec import Spec

    out = {}
    for name, (algo, tricks) in {**{a: (a, ()) for a in ALGO_ARGS}, **TRICKS}.items():
        module = f"{name.replace('-', '_').replace('+', '_').replace(',', '_')}_parallel"
        d = tmp_path_factory.mktemp(module)
        # packing under cp needs the ring (its K/V blocks carry the document ids)
        cp_mode = "ring" if "packing" in tricks else "allgather"
        spec = Spec(algo=algo, model="qwen3-0.6b", gpus=8, tp=2, cp=2, cp_mode=cp_mode, tricks=tricks, dataset="chain_sum.jsonl", out="o")  # fmt: skip
        (d / "train.py").write_text(render(spec))
        out[name] = write_reward_driver(d / "driver.py", d / "train.py", module)
    return out


def _run(tmp, driver, algo, model_dir, data, plan, nproc, ray) -> tuple[list[dict], dict]:
    """The run's metrics and the tensors of its final save; the run joins `ray`, the module's."""
    from safetensors.torch import load_file

    args = ["--model", str(model_dir), "--dataset", str(data), *COMMON, *ALGO_ARGS[algo], *plan]
    args += joined_ray(ray)
    history = run_script(tmp, args, nproc=nproc, script=driver, launcher="fork")
    # the trained parameters: grpo-lora's adapters (PEFT layout), the others' whole model
    saved = "adapter_model.safetensors" if algo == "grpo-lora" else "model.safetensors"
    return history, load_file(tmp / f"out_{nproc}" / "model" / saved)


@pytest.fixture(scope="module")
def one_process(drivers, even_model_dir, chain_sum_64, tmp_path_factory, ray_session, run_once):
    """`one_process(name)`: that script's 1-process run (the reference of its plans; name: an
    algorithm, or a key of TRICKS), run once per test run when its first case asks, whichever
    pytest-xdist worker that is (`run_once`: the others read its metrics and its saved file; every
    worker renders the same script)."""
    runs = {}

    def get(name: str) -> tuple[list[dict], dict]:
        from safetensors.torch import load_file

        if name not in runs:
            algo = TRICKS[name][0] if name in TRICKS else name

            def compute() -> dict:
                tmp = tmp_path_factory.mktemp(f"{algo}_one")
                history, _ = _run(
                    tmp, drivers[name], algo, even_model_dir, chain_sum_64, ONE, 1, ray_session
                )
                saved = "adapter_model.safetensors" if algo == "grpo-lora" else "model.safetensors"
                return {"history": history, "saved": str(tmp / "out_1" / "model" / saved)}

            value = run_once(f"grpo_parallel_one_{name}", compute)
            runs[name] = value["history"], load_file(value["saved"])
        return runs[name]

    return get


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("algo", ALGO_ARGS)
def test_two_ranks_equal_one(
    drivers, one_process, even_model_dir, chain_sum_64, tmp_path, algo, plan, ray_session
):
    one, one_weights = one_process(algo)
    two, two_weights = _run(tmp_path, drivers[algo], algo, even_model_dir, chain_sum_64, PLANS[plan], 2, ray_session)  # fmt: skip
    _check_equal(algo, one, two, one_weights, two_weights)


@pytest.mark.parametrize("plan", ["tp2", "ring2"])
@pytest.mark.parametrize("name", TRICKS)
def test_tricks_two_ranks_equal_one(
    drivers, one_process, even_model_dir, chain_sum_64, tmp_path, name, plan, ray_session
):
    """lce and packing under TP 2 and ring CP 2 give the 1-process run of the same script."""
    algo = TRICKS[name][0]
    one, one_weights = one_process(name)
    two, two_weights = _run(tmp_path, drivers[name], algo, even_model_dir, chain_sum_64, PLANS[plan], 2, ray_session)  # fmt: skip
    _check_equal(algo, one, two, one_weights, two_weights)


def _check_equal(algo: str, one: list, two: list, one_weights: dict, two_weights: dict) -> None:
    """The 2-rank run's metrics and final tensors equal the 1-process run's (module docstring)."""
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(one, two, strict=True):
        assert b["reward"] == pytest.approx(
            a["reward"], abs=1e-6
        )  # the same rollouts: same weights synced
        # abs 1e-5, not test_ppo_ranks.py's 1e-6: TP / CP also reorder the forward's sums, and
        # AdamW turns that noise into parameter differences (below), so a late step's loss (terms
        # of ~0.1 cancelling to ~1e-3) differs by ~1e-6 (measured 1.2e-6: ppo cp2, step 4)
        for key in KEYS[algo]:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # the policy moved (so the syncs mattered) and the gradients are far from fp32 noise
    assert len({r["reward"] for r in one}) > 1 and all(r["grad_norm"] > 1e-3 for r in one)
    assert one_weights.keys() == two_weights.keys()
    assert not any("value_head" in k for k in two_weights)  # the critic stays in the trainer
    # AdamW moves every element by ~lr whatever its gradient's size, so an element whose gradient
    # is fp32 noise (near 0: lora_A while B is still ~0) can move differently by up to lr = 1e-2;
    # measured at most 2 elements per tensor over 1e-5, the largest 2.3e-4 (grpo-lora lora_A).
    # A wrong gradient moves most of a tensor's elements by ~lr.
    for name, w in one_weights.items():
        diff = (two_weights[name] - w).abs()
        assert diff.max() < 1e-3 and (diff > 1e-5).float().mean() < 0.01, (name, diff.max())


def _synced_weights(rank, world_size, script: str, model_dir: str, tp: int) -> tuple[dict, dict]:
    """The script's policy on `world_size` ranks at tp (adapters, if any, set to fixed nonzero
    values: the same full values on every rank, each keeping its shard), gathered as the
    object-store sync does (every rank takes part, rank 0 keeps the tensors) and as the collective
    transfer's source yields them on rank 0 (every rank iterates it)."""
    from pathlib import Path

    from runtime import HFWeightSource, gather_hf_state_dict, gather_merged_hf_state_dict
    from runtime.dtensors import copy_into
    from runtime.lora import _full, is_adapter_param
    from tests.helpers import import_script

    s = import_script(Path(script), f"grpo_parallel_sync_{Path(script).parent.name}")
    cfg = s.Config(model=model_dir, dtype="fp32", device="cpu", tp=tp, cp=1)
    _, mesh = s.setup_distributed(cfg)
    model = s.setup_model(cfg, Path(model_dir), mesh, torch.device("cpu"))
    merged = hasattr(cfg, "lora_rank")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_param(name):
                copy_into(param, _full(param) + 0.05 * torch.randn(param.shape, generator=g))
    gather = gather_merged_hf_state_dict if merged else gather_hf_state_dict
    gathered = gather(model, torch.float32, keep=rank == 0)
    source = HFWeightSource(model, torch.float32, torch.device("cpu"), merged=merged)
    sourced = {name: t.clone() for name, t in source}
    return (gathered, sourced) if rank == 0 else ({}, {})


@pytest.mark.parametrize("algo", ALGO_ARGS)
def test_weight_sync_from_tp_ranks_equals_one(drivers, even_model_dir, algo):
    """Both weight-sync paths from a TP 2 trainer (vocab-sharded embedding and head, colwise /
    rowwise blocks, adapters sharded with their base, the value head replicated) give rank 0 the
    1-process tensors: grpo-lora its merged weights, ppo no value head; the other rank keeps
    nothing."""
    script = str(drivers[algo].parent / "train.py")
    one, one_sourced = _synced_weights(0, 1, script, str(even_model_dir), 1)  # in this process
    (two, two_sourced), other = spawn(_synced_weights, 2, args=(script, str(even_model_dir), 2))
    assert other == ({}, {}) and two.keys() == one.keys()
    assert "model.layers.0.self_attn.q_proj.weight" in one
    assert not any("lora" in k or "value_head" in k for k in one)
    assert two_sourced.keys() == one_sourced.keys()
    for key, tensor in one.items():  # fp32 reduction order only (the merged B A)
        torch.testing.assert_close(two[key], tensor, atol=1e-6, rtol=1e-6, msg=key)
    for key, tensor in one_sourced.items():
        torch.testing.assert_close(two_sourced[key], tensor, atol=1e-6, rtol=1e-6, msg=key)


def test_colocated_tp_with_offloaded_optimizer_equals_one_split(
    one_process, even_model_dir, chain_sum_64, tmp_path
):
    """The colocated script under TP 2 with --offload_optimizer (the optimizer state is TP
    DTensors: every sync empties their storages, the next step refills them; the engine sleeps and
    wakes at every sync) equals the split script's 1-process run: the same rollouts, losses and
    gradient norms."""
    from generator.render import render
    from generator.spec import Spec

    spec = Spec(algo="grpo", layout="colocated", model="qwen3-0.6b", gpus=2, tp=2, dataset="chain_sum.jsonl", out="o")  # fmt: skip
    (tmp_path / "train.py").write_text(render(spec))
    driver = write_reward_driver(tmp_path / "driver.py", tmp_path / "train.py", "grpo_colocated_tp")
    one, _ = one_process("grpo")
    more = ["--tp", "2", "--offload_optimizer", "true", "--save_final_model", "false"]
    args = ["--model", str(even_model_dir), "--dataset", str(chain_sum_64), *COMMON, *ALGO_ARGS["grpo"], *more]  # fmt: skip
    two = run_script(tmp_path, args, nproc=2, script=driver)
    for a, b in zip(one, two, strict=True):
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert all(r["engine_slept_mib"] > 0.4 and r["engine_woke_mib"] > 0.4 for r in two[:2])


def _chunked_logprobs(rank, world_size, top_p: float) -> tuple[torch.Tensor, ...]:
    """`token_logprobs` (3 chunks, some positions ignored) of a [32, 16] weight, vocab-sharded
    over a "tp" mesh of world_size ranks when world_size > 1, under top_p (1.0 = off) as GRPO's
    completion log-probs take it: the [2, 8] log-probs, the hidden and the weight's (full)
    gradients of a weighted sum."""
    import functools

    from runtime.grpo import _truncate_keeping_labels
    from runtime.loss import IGNORE_INDEX, token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 8, 16, generator=g).requires_grad_()
    full = torch.randn(32, 16, generator=g)
    labels = torch.randint(0, 32, (2, 8), generator=g)
    labels[0, :3] = labels[1, 6:] = IGNORE_INDEX
    coeffs = torch.randn(2, 8, generator=g)
    weight = torch.nn.Parameter(full.clone())
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    truncate = (
        functools.partial(_truncate_keeping_labels, top_k=0, top_p=top_p) if top_p < 1 else None
    )
    out = token_logprobs(hidden, weight, labels, num_chunks=3, logits_transform=truncate)
    (out * coeffs).sum().backward()
    grad = weight.grad.full_tensor() if world_size > 1 else weight.grad
    return out.detach(), hidden.grad, grad


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_chunked_logprobs_vocab_parallel_equal_one(top_p):
    """lce's chunked log-probs with lm_head's weight vocab-sharded over 2 tp ranks (loss
    parallel; under top_p each chunk's whole rows gathered) equal one process's: values, the
    hidden gradient (summed over the vocab shards) and the weight gradient, on both ranks."""
    one = _chunked_logprobs(0, 1, top_p)
    assert one[0].ne(0).sum() == 11 and one[1].abs().sum() > 0  # the ignored positions are 0
    for two in spawn(_chunked_logprobs, 2, args=(top_p,)):
        for a, b in zip(one, two, strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
