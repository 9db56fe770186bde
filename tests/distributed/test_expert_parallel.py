"""Expert parallel (ep = 2 = dp_shard, gloo) equals one process on a tiny random Qwen3-MoE: the loss
of 3 AdamW steps and the gradients of every parameter at step 3 (experts gathered from their
ranks), the HF save (all experts on rank 0 under HF keys) and a DCP train-state round trip.

Each rank holds 2 of the 4 experts per MoE layer; tokens reach them by a differentiable
all-to-all; everything else is FSDP2-sharded over the same 2 ranks. Tolerance: fp32, only the
summation order differs (measured max |diff| ~1e-7); asserted at atol 1e-5 / rtol 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.helpers import SMALL_VOCAB, TINY_CONFIG, full_tensor, import_script, spawn

MOE = dict(
    TINY_CONFIG,
    model_type="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)


def _batch(step: int):
    """The global batch of a step: [4, 16] ids and labels (some positions ignored)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, MOE["vocab_size"], (4, 16), generator=g)
    labels = torch.randint(0, MOE["vocab_size"], (4, 16), generator=g)
    labels[:, :3] = -100
    return ids, labels


def _build(model_dir: Path, world_size: int, ep: int | None = None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from runtime import (
        ModelArgs,
        apply_expert_parallel,
        build_model,
        disable_fsdp_gradient_division,
        expert_meshes,
        load_hf_checkpoint,
        read_hf_config,
    )

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    model = build_model(ModelArgs.from_hf_config(read_hf_config(model_dir)), device="meta")
    if world_size > 1:
        # ep = dp_shard (None), or EP x FSDP: groups of ep ranks, experts replicated across them
        experts = apply_expert_parallel(model, *expert_meshes(mesh["dp_shard"], ep or world_size))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"], ignored_params=experts)
        fully_shard(model, mesh=mesh["dp_shard"], ignored_params=experts)
        disable_fsdp_gradient_division(model)
    model.to_empty(device="cpu")
    model.init_rope()
    load_hf_checkpoint(model, model_dir)
    return model


def _train(rank, world_size, model_dir, out_dir, ep=None):
    from runtime import (
        TrainState,
        all_reduce_expert_grads,
        clip_grad_norm,
        load_train_state,
        save_hf_checkpoint,
        save_train_state,
    )
    from runtime.checkpoint import read_hf_config
    from runtime.parallel import all_reduce_sum

    model = _build(model_dir, world_size, ep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    losses, norms = [], []
    for step in range(3):
        ids, labels = _batch(step)
        n_global = (labels != -100).sum()
        logits = model(ids[rank::world_size])  # this rank's rows
        ce = F.cross_entropy(
            logits.flatten(0, 1).float(), labels[rank::world_size].flatten(), reduction="sum"
        )
        loss = ce / n_global
        loss.backward()
        all_reduce_expert_grads(model)  # EP x FSDP: the replicas' parts; a no-op otherwise
        norms.append(clip_grad_norm(model, 0.0).item())  # 0: measure only
        losses.append(all_reduce_sum(loss.detach().clone()).item())
        if step < 2:
            opt.step()
            opt.zero_grad()
    grads = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    save_hf_checkpoint(model, Path(out_dir) / "hf", read_hf_config(model_dir))
    # DCP train state: save, load into a freshly built model + optimizer, compare this rank's part
    path = save_train_state(Path(out_dir) / "ckpt", TrainState(3), model, opt, sched, {})
    model2 = _build(model_dir, world_size, ep)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    load_train_state(path, model2, opt2, sched2)
    same = all(
        torch.equal(full_tensor(a.detach()), full_tensor(b.detach()))
        for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
    state1 = {n: s for n, s in zip(dict(model.named_parameters()), opt.state.values())}
    state2 = {n: s for n, s in zip(dict(model2.named_parameters()), opt2.state.values())}
    same_optim = state1.keys() == state2.keys() and all(
        torch.equal(full_tensor(state1[n][k]), full_tensor(state2[n][k]))
        for n in state1
        for k in ("exp_avg", "exp_avg_sq")
    )
    del model, model2, opt, opt2
    return losses, grads, same, same_optim, norms


def test_expert_parallel_two_ranks_equal_one_process(tmp_path):
    from runtime import ModelArgs, build_model, save_hf_checkpoint

    args = ModelArgs(**MOE)
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    model_dir = tmp_path / "tiny_moe"
    save_hf_checkpoint(model, model_dir, args.to_hf_config())

    ((ref_losses, ref_grads, *_),) = spawn(_train, 1, args=(model_dir, tmp_path / "one"))
    results = spawn(_train, 2, args=(model_dir, tmp_path / "ep2"))
    expert_keys = {k for k in ref_grads if ".mlp.experts." in k}
    assert len(expert_keys) == 2 * 4 * 3  # 2 MoE layers x 4 experts x gate/up/down
    held = [{k for k in grads if ".mlp.experts." in k} for _, grads, *_ in results]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == expert_keys  # 2 experts each
    assert all(".experts.0." in k or ".experts.1." in k for k in held[0])
    merged = {}
    for losses, grads, same, same_optim, _ in results:
        assert same and same_optim  # DCP train state round trip on 2 EP ranks
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5
        )
        merged.update(grads)
    assert merged.keys() == ref_grads.keys()
    worst = max((merged[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    print(f"max |grad difference| EP 2 vs 1 process at step 3: {worst:.2e}; losses {ref_losses}")
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, name  # every parameter, every expert got a gradient
        torch.testing.assert_close(merged[name], g, atol=1e-5, rtol=1e-4, msg=name)

    one, ep2 = (
        load_file(tmp_path / "one/hf/model.safetensors"),
        load_file(tmp_path / "ep2/hf/model.safetensors"),
    )
    assert one.keys() == ep2.keys() and expert_keys <= one.keys()
    for key in one:
        torch.testing.assert_close(ep2[key], one[key], atol=1e-5, rtol=1e-4, msg=key)


def test_ep_two_by_fsdp_two_on_four_ranks_equals_one_process(tmp_path):
    """EP x FSDP: 4 ranks in 2 ep groups of 2 (ranks 0-1 and 2-3), experts 0-1 on ranks 0 and 2,
    2-3 on ranks 1 and 3, their gradients summed over the replicas; every other parameter
    FSDP-sharded over the 4. The losses, gradient norms and gradients of every parameter at step
    3 (after 2 AdamW steps), the HF save and the DCP round trip equal 1 process (the tolerances
    of the ep = world test above)."""
    from runtime import ModelArgs, build_model, save_hf_checkpoint

    args = ModelArgs(**MOE)
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    model_dir = tmp_path / "tiny_moe"
    save_hf_checkpoint(model, model_dir, args.to_hf_config())

    ((ref_losses, ref_grads, _, _, ref_norms),) = spawn(
        _train, 1, args=(model_dir, tmp_path / "one")
    )
    results = spawn(_train, 4, args=(model_dir, tmp_path / "ep2x2", 2))
    held = [{k for k in grads if ".mlp.experts." in k} for _, grads, *_ in results]
    assert held[0] == held[2] and held[1] == held[3] and held[0].isdisjoint(held[1])
    assert all(".experts.0." in k or ".experts.1." in k for k in held[0])
    for rank, (losses, grads, same, same_optim, norms) in enumerate(results):
        assert same and same_optim, rank
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            torch.tensor(norms), torch.tensor(ref_norms), atol=1e-5, rtol=1e-5
        )
        for name, g in grads.items():  # each rank's experts and every full shared parameter
            torch.testing.assert_close(
                g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=f"{rank} {name}"
            )
    one = load_file(tmp_path / "one/hf/model.safetensors")
    ep4 = load_file(tmp_path / "ep2x2/hf/model.safetensors")
    assert one.keys() == ep4.keys()
    for key in one:
        torch.testing.assert_close(ep4[key], one[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize(
    "gpus,dtype", [(2, "fp32"), (4, "fp32"), (2, "bf16")], ids=["ep2", "ep2xfsdp2", "ep2-bf16"]
)
def test_emitted_script_with_ep_matches_one_process(
    gpus, dtype, small_tokenizer_dir, small_dataset, tmp_path
):
    """`scaffold new --model <tiny Qwen3-MoE dir> --gpus 2|4 --ep 2`: the script run by torchrun
    on 2 gloo ranks (experts split 2 + 2) or 4 (EP 2 x FSDP 2: two ep groups, the experts'
    replicas summing their gradients) logs the losses of the same script in 1 process (--ep 1,
    global batch 4 every way) and saves the same HF weights. bf16 (the default dtype; FSDP
    ignores the experts, so they cast their own fp32 weights, `MoeExpert`): the losses and
    gradient norms within bf16's summation-order noise (rel 1e-3; measured 1.2e-6 and 1.8e-4);
    not the weights, since AdamW's first steps move an element by about lr whatever its
    gradient's size, so bf16 noise on a near-zero gradient flips a 1e-3 step."""
    fp32 = dtype == "fp32"
    import json
    import os
    import subprocess
    import sys

    from generator.render import render
    from generator.spec import Spec
    from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint

    args = ModelArgs(**{**MOE, "vocab_size": SMALL_VOCAB}, max_position_embeddings=4096)
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    model_dir = tmp_path / "tiny_moe"
    save_hf_checkpoint(model, model_dir, args.to_hf_config())
    copy_tokenizer_files(small_tokenizer_dir, model_dir)
    script = tmp_path / "train.py"
    script.write_text(render(Spec(model=str(model_dir), gpus=gpus, ep=2, out=str(tmp_path))))

    def run(launcher: list[str], out: Path, extra: list[str]) -> dict[int, float]:
        argv = [
            "--dataset", str(small_dataset), "--out_dir", str(out), "--device", "cpu",
            "--dtype", dtype, "--max_steps", "2", "--warmup_steps", "0", "--lr", "1e-3",
            "--max_seq_len", "64", "--val_fraction", "0", "--eval_every_steps", "0",
            "--sample_max_new_tokens", "0", *extra,
        ]  # fmt: skip
        if launcher:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(
                [sys.executable, *launcher, str(script), *argv],
                env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        else:  # the 1-process reference: the script's main() here
            import_script(script, "ep_reference_train").main(argv)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}

    one = run([], tmp_path / "one", ["--ep", "1", "--micro_batch_size", "4"])
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    two = run(torchrun, tmp_path / "ep2", ["--micro_batch_size", str(4 // gpus)])
    assert sorted(two) == [1, 2]
    for step in (1, 2):
        (loss, norm), (ref_loss, ref_norm) = two[step], one[step]
        assert abs(loss - ref_loss) <= (1e-5 if fp32 else 1e-3) * ref_loss, (step, loss, ref_loss)
        if not fp32:
            assert abs(norm - ref_norm) <= 1e-3 * ref_norm, (step, norm, ref_norm)
    if not fp32:
        return
    a = load_file(tmp_path / "one/model/model.safetensors")
    b = load_file(tmp_path / "ep2/model/model.safetensors")
    assert a.keys() == b.keys() and any(".mlp.experts.3." in k for k in a)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("algo", ["dpo", "kd", "grpo", "ppo"])
def test_full_parameter_algorithms_with_ep_match_one_process(
    algo, small_tokenizer_dir, small_dataset, chain_sum_64, tmp_path
):
    """--ep 2 on 2 gloo ranks for the other full-parameter algorithms: DPO (its separate
    reference built by the same parallelize, experts sharded too), KD (an EP student, the MoE
    teacher whole on each rank), GRPO (the weight sync broadcasts each expert from its rank to
    the engine, which holds the whole model) and PPO (its value head FSDP-sharded beside the
    expert-parallel blocks, a separate KL reference with its experts sharded too): the per-step
    losses and gradient norms (and the RL rewards: the engine sampled from the same weights; PPO's
    value loss and explained variance) equal the same script on 1 process."""
    import json
    import os
    import subprocess
    import sys

    from generator.render import render
    from generator.spec import Spec
    from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint
    from tests.helpers import write_reward_driver

    args = ModelArgs(**{**MOE, "vocab_size": SMALL_VOCAB}, max_position_embeddings=4096)
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    model_dir = tmp_path / "tiny_moe"
    save_hf_checkpoint(model, model_dir, args.to_hf_config())
    copy_tokenizer_files(small_tokenizer_dir, model_dir)
    rl = algo in ("grpo", "ppo")
    layout = {"engine_gpus": 0} if rl else {}
    spec = Spec(algo=algo, model=str(model_dir), gpus=2, ep=2, out=str(tmp_path), **layout)
    script = tmp_path / "train.py"
    script.write_text(render(spec))
    common = [
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--warmup_steps",
        "0",
    ]
    if rl:
        driver = tmp_path / "driver.py"
        write_reward_driver(driver, script, f"{algo}_ep_driver")
        entry = driver
        argv = [
            *common, "--dataset", str(chain_sum_64), "--rollout", "sync", "--engine", "runtime",
            "--num_generations", "4", "--prompts_per_step", "2", "--max_new_tokens", "6",
            "--micro_batch_size", "2", "--lr", "1e-2", "--max_steps", "3", "--reward_weights",
            "1.0", "--save_final_model", "false", "--ray_num_cpus", "2", "--num_engines", "1",
            *(["--kl_coef", "0.05"] if algo == "ppo" else []),
        ]  # fmt: skip
        one_extra, two_extra = ["--ep", "1"], []
    else:
        pairs = tmp_path / "pairs.json"
        pairs.write_text(json.dumps([
            {"prompt": f"Count to {i}.", "chosen": " ".join(map(str, range(1, i + 2))), "rejected": "No."}
            for i in range(8)
        ]))  # fmt: skip
        data = pairs if algo == "dpo" else small_dataset
        extra = ["--ref_mode", "separate"] if algo == "dpo" else ["--teacher", str(model_dir)]
        entry = script
        argv = [
            *common, "--dataset", str(data), "--max_steps", "2", "--lr", "1e-3",
            "--max_seq_len", "64", "--val_fraction", "0", "--eval_every_steps", "0",
            "--sample_max_new_tokens", "0", *extra,
        ]  # fmt: skip
        one_extra, two_extra = ["--ep", "1", "--micro_batch_size", "4"], ["--micro_batch_size", "2"]

    def run(nproc: int, out: Path, extra: list[str]) -> list[dict]:
        launcher = [sys.executable]
        if nproc > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        proc = subprocess.run(
            [*launcher, str(entry), *argv, *extra, "--out_dir", str(out)],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
            timeout=600, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "loss" in r]

    one = run(1, tmp_path / "one", one_extra)
    runs = [run(2, tmp_path / "ep2", two_extra)]
    keys = ("loss", "grad_norm") + (("reward",) if rl else ())
    if algo == "ppo":
        # EP 2 x FSDP 2 too: 4 trainer ranks in 2 ep groups, each expert's 2 replicas summing
        # their gradients (all_reduce_expert_grads), the value head sharded over the 4
        runs.append(run(4, tmp_path / "ep2x2", []))
        keys += ("loss/value_avg", "val/explained_variance", "objective/kl")
    for got in runs:
        assert [r["step"] for r in got] == [r["step"] for r in one] and len(one) >= 2
        for a, b in zip(one, got, strict=True):
            for key in keys:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
