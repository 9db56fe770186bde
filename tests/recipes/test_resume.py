"""Never lose work: kill -9 at chosen points, resume, and end bit-identical to an uninterrupted run.

Every interrupted run is a real subprocess of an emitted script; the uninterrupted reference runs
in this process, on one thread like them. Tiny random Llama + the small tokenizer + 40 real
alpaca rows, fp32, deterministic CPU. Kills are `SIGKILL` sent by the process to itself
from a patched hook (no cleanup runs, exactly like `kill -9`), at a chosen step or inside a
checkpoint write, so the points are reproducible instead of timing-dependent.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from generator.render import render
from generator.spec import Spec
from tests.helpers import import_script

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "examples" / "sft_smollm2" / "train.py"
MEMORY = REPO / "examples" / "sft_smollm2_memory" / "train.py"

# Runs the script's main() in this process (under its entry_point, as `python train.py` does)
# after installing one kill point:
#   after_step K: SIGKILL right after step K was logged (before that step's checkpoint, if any)
#   in_save K:    SIGKILL inside the K-th checkpoint save of this process, after all its files
#                 and the COMPLETE marker are written and fsynced, just before the atomic rename
#   in_write K:   inside the first torch.save of the step-K checkpoint's save, from its stream's
#                 first write (torch.save's zip writer then fails as "unexpected pos")
# "SIGINT:after_step" (or SIGTERM, any mode) sends that signal instead of SIGKILL.
DRIVER = r"""
import importlib.util, os, signal, sys
script, mode, k, argv = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
spec = importlib.util.spec_from_file_location("train", script)
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)
import runtime.train_state as ts
how, _, mode = mode.rpartition(":")  # "SIGINT:after_step": that signal instead of SIGKILL
def die():
    os.kill(os.getpid(), getattr(signal, how or "SIGKILL"))
if mode == "after_step":
    log = train.MetricsLogger.log
    def log_then_die(self, metrics, step):
        log(self, metrics, step)
        if step == k:
            die()
    train.MetricsLogger.log = log_then_die
elif mode == "in_save":
    replace, calls = ts.os.replace, [0]
    def replace_or_die(src, dst):
        if "checkpoints" not in str(dst):  # metrics.jsonl's rewrite at startup is not a save
            return replace(src, dst)
        calls[0] += 1
        if calls[0] == k:
            die()
        replace(src, dst)
    ts.os.replace = replace_or_die
elif mode == "in_write":  # the signal inside torch.save's stream writer, as a Ctrl-C lands there
    save, done = ts.torch.save, [False]
    class Stream:
        def __init__(self, f):
            self.f = f
        def write(self, b):
            die()
            return self.f.write(b)
        def __getattr__(self, name):
            return getattr(self.f, name)
    def save_or_die(obj, f, *args, **kwargs):
        saving = ts.PROGRESS.saving
        path = isinstance(f, (str, os.PathLike))
        if path and not done[0] and saving is not None and saving.name == f"step_{k:06d}":
            done[0] = True
            with open(f, "wb") as out:
                return save(obj, Stream(out), *args, **kwargs)
        return save(obj, f, *args, **kwargs)
    ts.torch.save = save_or_die
sys.argv = [script, *argv]  # the command entry_point reports
train.entry_point(train.main, argv)
"""


def common_args(model_dir: Path, data: Path, out: Path, max_steps: int) -> list[str]:
    return [
        "--model", str(model_dir), "--dataset", str(data), "--out_dir", str(out),
        "--dtype", "fp32", "--max_steps", str(max_steps), "--lr", "1e-3", "--warmup_steps", "0",
        "--max_seq_len", "96", "--micro_batch_size", "4", "--val_fraction", "0",
        "--eval_every_steps", "0", "--sample_max_new_tokens", "0", "--save_every_steps", "2",
        "--keep_last_checkpoints", "2",
    ]  # fmt: skip


def run(
    script: Path, args: list[str], kill: tuple[str, int] | None = None
) -> subprocess.CompletedProcess:
    """Run the script (optionally with a kill point); returns the finished process."""
    cmd = [sys.executable, str(script), *args]
    if kill:
        cmd = [sys.executable, "-c", DRIVER, str(script), kill[0], str(kill[1]), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def run_reference(script: Path, args: list[str]) -> None:
    """The uninterrupted run, in this process (nothing is killed, so no process boundary is
    needed), on one intra-op thread like the subprocesses (OMP_NUM_THREADS=1), so the results can
    be compared bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        name = "resume_ref_" + "".join(c if c.isalnum() else "_" for c in str(script))
        import_script(script, name).main(args)
    finally:
        torch.set_num_threads(threads)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def assert_killed(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-3000:]


def steps_logged(out: Path) -> dict[int, dict]:
    """metrics.jsonl rows by step; a step re-run after a resume keeps its last row."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = (
        load_file(a / "model" / "model.safetensors"),
        load_file(b / "model" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_kills_at_steps_epoch_boundary_and_mid_save_resume_bit_exactly(
    tiny_model_dir, small_dataset, tmp_path
):
    """40 rows (all kept at max_seq_len 96) / micro-batch 4 = 10 micro-batches per epoch; 14 steps cross one epoch boundary.
    Checkpoints every 2 steps. The interrupted run is killed three times: after step 5 (resumes
    from step 4), after step 11, just past the epoch boundary (resumes from step 10, whose data
    position is the end of epoch 0), and inside the write of the step-12 checkpoint (that
    checkpoint must not count; resumes from step 10 again). Final weights, the per-step
    losses and the sample sequence equal an uninterrupted run's, bit for bit."""
    steps = 14
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    run_reference(SFT, common_args(tiny_model_dir, small_dataset, ref_out, steps))
    args = common_args(tiny_model_dir, small_dataset, out, steps)

    assert_killed(run(SFT, args, kill=("after_step", 5)))
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == [
        "step_000002",
        "step_000004",
    ]
    assert_killed(run(SFT, args, kill=("after_step", 11)))
    # resumes from step 10, saves step 12 (its 1st save), dies inside the step-14 save (2nd)
    proc = run(SFT, args, kill=("in_save", 2))
    assert_killed(proc)
    assert "resuming from" in proc.stdout and "step_000010" in proc.stdout
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_000010", "step_000012", "step_000014.tmp"], names  # .tmp not valid
    proc = run(SFT, args)
    assert_ok(proc)
    assert "step_000012" in proc.stdout  # the half-written step 14 was skipped
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000012", "step_000014"]

    ref, got = steps_logged(ref_out), steps_logged(out)
    # one row per step, in order: each resume dropped the rows its killed attempt logged after
    # the checkpoint it resumes from (step 5; 11; 13 and 14), and logged them again
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    run_json = json.loads((out / "run.json").read_text())
    assert [r["step"] for r in run_json["resumed"]] == [4, 10, 12]
    for step in range(1, steps + 1):
        assert got[step]["sample_ids"] == ref[step]["sample_ids"], step
        assert got[step]["loss"] == ref[step]["loss"], step
        assert got[step]["lr"] == ref[step]["lr"], step
    epoch0 = [i for step in range(1, 11) for i in ref[step]["sample_ids"]]
    assert sorted(epoch0) == list(range(40))  # each row exactly once per epoch
    assert_same_weights(ref_out, out)


def test_two_resumes_in_one_epoch_replay_the_same_samples(tiny_model_dir, small_dataset, tmp_path):
    """Two resumes inside one epoch (from steps 2 and 6) consume exactly the continuous run's
    sample sequence; a kill inside the very first checkpoint write leaves nothing valid, and
    the next run starts from scratch."""
    steps = 8
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    run_reference(SFT, common_args(tiny_model_dir, small_dataset, ref_out, steps))
    args = common_args(tiny_model_dir, small_dataset, out, steps)
    assert_killed(run(SFT, args, kill=("in_save", 1)))  # dies in the step-2 save
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000002.tmp"]
    # no valid checkpoint, but step 1's metrics: a plain rerun is refused (it would mix two runs)
    refused = run(SFT, args)
    assert refused.returncode == 1 and "holds an earlier run (metrics.jsonl" in refused.stderr
    assert_killed(run(SFT, [*args, "--overwrite"], kill=("after_step", 3)))  # starts fresh
    assert_killed(run(SFT, args, kill=("after_step", 7)))  # resumed from step 2
    proc = run(SFT, args)  # resumes from step 6
    assert_ok(proc)
    assert "step_000006" in proc.stdout
    ref, got = steps_logged(ref_out), steps_logged(out)
    assert [got[s]["sample_ids"] for s in range(1, steps + 1)] == [
        ref[s]["sample_ids"] for s in range(1, steps + 1)
    ]
    assert_same_weights(ref_out, out)


def _checkpoint_part(checkpoint: Path, part: str) -> dict:
    """One part ("optim", "model") of a DCP checkpoint as plain tensors."""
    import torchao.optim  # noqa: F401  (registers its low-bit state classes for torch.load)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint.parent / f"{checkpoint.name}.pt"
    if not target.exists():
        dcp_to_torch_save(checkpoint / "dcp", target)
    return torch.load(target, weights_only=False)[part]


def _optimizer_state(checkpoint: Path) -> dict:
    """The optimizer part of a DCP checkpoint as plain tensors."""
    return _checkpoint_part(checkpoint, "optim")


def render_script(tmp_path: Path, **spec) -> Path:
    out_dir = tmp_path / "script"
    out_dir.mkdir()
    script = out_dir / "train.py"
    script.write_text(render(Spec(model="smollm2-135m", out=str(out_dir), **spec)))
    return script


@pytest.mark.parametrize("algo", ["lora", "qlora"])
def test_lora_and_qlora_resume_exactly(algo, tiny_model_dir, small_dataset, tmp_path):
    """LoRA (and QLoRA over an NF4 base): checkpoints hold the adapters and their optimizer
    state (the frozen base is reloaded); a kill after step 3 and a resume from step 2 end with
    the uninterrupted run's losses and adapter weights."""
    script = render_script(tmp_path, algo=algo, peft="dora" if algo == "qlora" else "lora")
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    extra = ["--save_merged", "false"]
    run_reference(script, [*common_args(tiny_model_dir, small_dataset, ref_out, 4), *extra])
    args = [*common_args(tiny_model_dir, small_dataset, out, 4), *extra]
    assert_killed(run(script, args, kill=("after_step", 3)))
    keys = {k for k in _model_state(out / "checkpoints" / "step_000002")}
    # adapters only (torch's get_state_dict keeps the tied lm_head alias of the frozen embedding)
    assert any("lora_" in k for k in keys) and {k for k in keys if "lora_" not in k} <= {
        "lm_head.weight"
    }, sorted(keys)[:5]
    proc = run(script, args)
    assert_ok(proc)
    assert "step_000002" in proc.stdout
    ref, got = steps_logged(ref_out), steps_logged(out)
    assert [got[s]["loss"] for s in range(1, 5)] == [ref[s]["loss"] for s in range(1, 5)]
    wa = load_file(ref_out / "model" / "adapter_model.safetensors")
    wb = load_file(out / "model" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _model_state(checkpoint: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint.parent / f"{checkpoint.name}.model.pt"
    dcp_to_torch_save(checkpoint / "dcp", target)
    return torch.load(target, weights_only=False)["model"]


# the precision recipes (bf16 runs): bf16 weights rounded stochastically from torch's RNG (saved
# per rank), with 8-bit state under optimizer-in-backward, and CPU offload
@pytest.mark.parametrize(
    "tricks",
    [
        "ac,lce,optim-in-bwd",
        "optim-in-bwd,adamw8bit",
        "bf16-sr,optim-in-bwd,adamw8bit",
        "bf16-sr,cpu-offload",
    ],
)
def test_optimizer_in_backward_resumes_lr_and_states_exactly(
    tricks, tiny_model_dir, small_dataset, tmp_path
):
    """Optimizer-in-backward (per-parameter AdamW, or torchao AdamW8bit), and the precision
    recipes, warmup over the resume point and clipping on: after a kill at step 3 and a resume from
    step 2, the learning rates, losses, final weights and every optimizer state equal an
    uninterrupted run's."""
    if tricks == "ac,lce,optim-in-bwd":
        script = MEMORY
    else:
        script = render_script(tmp_path, tricks=tuple(tricks.split(",")))
    steps = 5
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    extra = ["--warmup_steps", "4", "--gradient_accumulation_steps", "2", "--micro_batch_size", "2"]
    if "bf16-sr" in tricks:
        extra += ["--dtype", "bf16"]
    run_reference(script, [*common_args(tiny_model_dir, small_dataset, ref_out, steps), *extra])
    args = [*common_args(tiny_model_dir, small_dataset, out, steps), *extra]
    assert_killed(run(script, args, kill=("after_step", 3)))
    proc = run(script, args)
    assert_ok(proc)
    assert "step_000002" in proc.stdout
    ref, got = steps_logged(ref_out), steps_logged(out)
    for step in range(1, steps + 1):
        assert (got[step]["lr"], got[step]["loss"]) == (ref[step]["lr"], ref[step]["loss"]), step
    assert ref[1]["lr"] < ref[2]["lr"] < ref[3]["lr"] < ref[4]["lr"]  # warmup spans the resume
    assert_same_weights(ref_out, out)
    assert_same_optimizer_state(
        ref_out / "checkpoints/step_000005", out / "checkpoints/step_000005"
    )


def assert_same_optimizer_state(a: Path, b: Path) -> None:
    """The optimizer states of two DCP checkpoints are equal, every tensor bit for bit."""
    flat_a, spec_a = torch.utils._pytree.tree_flatten(_optimizer_state(a))
    flat_b, spec_b = torch.utils._pytree.tree_flatten(_optimizer_state(b))
    assert spec_a == spec_b and len(flat_a) > 10
    for x, y in zip(flat_a, flat_b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("ref_mode", ["separate", "precomputed"])
def test_dpo_cpu_offload_resumes_exactly(ref_mode, tiny_model_dir, short_pairs, tmp_path):
    """DPO with cpu-offload (the policy's shards and AdamW state in host memory; the separate
    reference offloaded too, or the precomputed table read back from out_dir), warmup over the
    resume point, clipping on: after a kill at step 3 and a resume from step 2, the learning
    rates, losses, rewards, final weights and every optimizer state equal an uninterrupted
    run's. 4 pairs, 2 per step: 5 steps cross two epoch boundaries."""
    script = render_script(tmp_path, algo="dpo", tricks=("cpu-offload",))
    steps = 5
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    extra = ["--micro_batch_size", "1", "--gradient_accumulation_steps", "2", "--max_seq_len",
             "192", "--warmup_steps", "4", "--ref_mode", ref_mode]  # fmt: skip
    run_reference(script, [*common_args(tiny_model_dir, short_pairs, ref_out, steps), *extra])
    args = [*common_args(tiny_model_dir, short_pairs, out, steps), *extra]
    assert_killed(run(script, args, kill=("after_step", 3)))
    proc = run(script, args)
    assert_ok(proc)
    assert "step_000002" in proc.stdout
    ref, got = steps_logged(ref_out), steps_logged(out)
    keys = ("lr", "loss", "rewards/margins", "sample_ids")
    for step in range(1, steps + 1):
        assert [got[step][k] for k in keys] == [ref[step][k] for k in keys], step
    assert ref[1]["lr"] < ref[2]["lr"] < ref[3]["lr"] < ref[4]["lr"]  # warmup spans the resume
    assert ref[5]["loss"] != ref[1]["loss"]
    assert_same_weights(ref_out, out)
    assert_same_optimizer_state(
        ref_out / "checkpoints/step_000005", out / "checkpoints/step_000005"
    )


# GRPO's main() takes its reward functions from the caller: the tiny model learns even token ids
GRPO_DRIVER = DRIVER.replace(
    "train.entry_point(train.main, argv)",
    "from tests.helpers import even_token_reward\n"
    "train.entry_point(train.main, argv, reward_funcs=[even_token_reward])",
)


def rl_args(ray_session, model_dir: Path, data: Path, out_dir: Path, steps: int) -> list[str]:
    """GRPO-skeleton flags of the kill tests: sync rollouts of 2 prompts x 4 completions of <= 6
    tokens, fp32, lr 1e-2, a checkpoint every 2 steps, on this process's Ray (a killed driver's
    actors die with its job, where a Ray of its own would leave its agent processes behind)."""
    return [
        "--model", str(model_dir), "--dataset", str(data), "--out_dir", str(out_dir),
        "--dtype", "fp32", "--num_generations", "4", "--prompts_per_step", "2",
        "--max_new_tokens", "6", "--micro_batch_size", "4", "--lr", "1e-2",
        "--reward_weights", "1.0", "--rollout", "sync", "--num_engines", "1",
        "--ray_address", ray_session.get_runtime_context().gcs_address,
        "--max_steps", str(steps), "--save_every_steps", "2",
    ]  # fmt: skip


def run_rl(
    script: Path, args: list[str], kill: tuple[str, int] = ("none", 0)
) -> subprocess.CompletedProcess:
    """A GRPO-skeleton script on the tiny reward (GRPO_DRIVER), optionally with a kill point."""
    cmd = [sys.executable, "-c", GRPO_DRIVER, str(script), *map(str, kill), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def killed_after_3_and_resumed(run_to, ref_out: Path, out: Path) -> tuple[dict, dict]:
    """The RL kill tests' sequence: `run_to(out_dir, kill=...)` runs uninterrupted into ref_out,
    then into out killed after step 3 and resumed (from the step-2 checkpoint, which the resumed
    run must name); returns both runs' `steps_logged`."""
    assert_ok(run_to(ref_out))
    assert_killed(run_to(out, kill=("after_step", 3)))
    proc = run_to(out)
    assert_ok(proc)
    assert "step_000002" in proc.stdout
    return steps_logged(ref_out), steps_logged(out)


def test_grpo_cpu_offload_resumes_exactly(ray_session, even_model_dir, chain_sum_64, tmp_path):
    """GRPO with cpu-offload (the policy and its KL reference offloaded; sync rollouts, the
    weights gathered from the CPU shards and pushed to the engine after every step), warmup over
    the resume point: after a kill at step 3 and a resume from step 2, every step's rewards
    (sampled by an engine that got the resumed policy's weights), lr, loss, KL and gradient
    norm, the final weights and the optimizer state equal an uninterrupted run's. Every run
    joins this process's Ray: a killed driver's actors die with its job, where a Ray of its own
    would leave its agent processes behind."""
    script = render_script(tmp_path, algo="grpo", tricks=("cpu-offload",))
    steps = 4
    ref_out, out = tmp_path / "ref", tmp_path / "killed"

    def grpo(out_dir: Path, kill: tuple[str, int] = ("none", 0)) -> subprocess.CompletedProcess:
        args = rl_args(ray_session, even_model_dir, chain_sum_64, out_dir, steps)
        return run_rl(script, [*args, "--warmup_steps", "3", "--kl_coef", "0.1"], kill)

    ref, got = killed_after_3_and_resumed(grpo, ref_out, out)
    keys = ("reward", "lr", "loss", "kl", "grad_norm")
    for step in range(1, steps + 1):
        assert [got[step][k] for k in keys] == [ref[step][k] for k in keys], step
    assert ref[1]["lr"] < ref[2]["lr"] < ref[3]["lr"]  # warmup spans the resume
    assert ref[steps]["kl"] > 0 and ref[steps]["reward"] != ref[1]["reward"]  # the policy moved
    assert_same_weights(ref_out, out)
    final = f"checkpoints/step_{steps:06d}"
    assert_same_optimizer_state(ref_out / final, out / final)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(
    tiny_model_dir, small_dataset, tmp_path
):
    """lr 1e30 overflows the weights after the first update: the run stops with one line naming
    the step and the last good checkpoint, and nothing from the bad step is saved."""
    out = tmp_path / "nan"
    args = common_args(tiny_model_dir, small_dataset, out, 6)
    args += ["--lr", "1e30", "--save_every_steps", "1"]
    proc = run(SFT, args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step ") and "not finite" in last, last
    bad_step = int(last.split()[2].rstrip(":"))
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved[-1] == f"step_{bad_step - 1:06d}" and f"step_{bad_step - 1:06d}" in last
    assert not (out / "model").exists()


@pytest.mark.parametrize("max_grad_norm", ["0", "1.0"])
def test_inf_gradient_mid_backward_with_optimizer_in_backward(
    max_grad_norm, tiny_model_dir, small_dataset, tmp_path, monkeypatch
):
    """The optim-in-bwd example (ac, lce, optim-in-bwd), checkpoints every step: at step 2 one
    element of a middle parameter's gradient is set to inf as it arrives (a hook registered
    before the optimizer's). The run stops naming step 2 and the step-1 checkpoint, saves
    nothing of step 2, and no weight is NaN/inf. With clipping (max_grad_norm 1) the norm pass
    met the inf first and no weight moved from its step-1 value; without (0), exactly the
    parameters whose gradients arrived before the bad one moved: what the script's
    backward_and_step docstring and docs/GUIDE.md say."""
    s = import_script(MEMORY, f"inf_mid_backward_{max_grad_norm.replace('.', '_')}")
    out = tmp_path / "out"
    step, arrived, models = [0], [], []
    bad_name = "model.layers.1.self_attn.o_proj.weight"

    def local(t: torch.Tensor) -> torch.Tensor:  # this rank's values, FSDP-sharded or not
        return (t.to_local() if hasattr(t, "to_local") else t).detach()

    def poison(name: str, param) -> None:
        if step[0] == 2:
            arrived.append(name)
            if name == bad_name:
                local(param.grad).view(-1)[0] = float("inf")

    def setup_model(*args, **kwargs):
        model = SETUP_MODEL(*args, **kwargs)
        for name, param in model.named_parameters():  # before build_optimizer's hooks
            param.register_post_accumulate_grad_hook(lambda p, name=name: poison(name, p))
        models.append(model)
        return model

    def backward_and_step(model, *args, **kwargs):
        step[0] += 1
        if step[0] == 2:
            snapshot.update({n: local(p).clone() for n, p in model.named_parameters()})
        return BACKWARD_AND_STEP(model, *args, **kwargs)

    SETUP_MODEL, BACKWARD_AND_STEP, snapshot = s.setup_model, s.backward_and_step, {}
    monkeypatch.setattr(s, "setup_model", setup_model)
    monkeypatch.setattr(s, "backward_and_step", backward_and_step)
    args = common_args(tiny_model_dir, small_dataset, out, 4)
    args += ["--save_every_steps", "1", "--max_grad_norm", max_grad_norm]
    with pytest.raises(FloatingPointError, match=r"step 2: .*last good checkpoint: .*step_000001"):
        s.main(args)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001"]
    assert not (out / "model").exists()
    params = dict(models[0].named_parameters())
    assert all(torch.isfinite(local(p)).all() for p in params.values())
    moved = {n for n, p in params.items() if not torch.equal(local(p), snapshot[n])}
    bad = arrived.index(bad_name)
    assert 0 < bad < len(arrived) - 1  # gradients arrived both before and after the bad one
    assert moved == (set() if max_grad_norm != "0" else set(arrived[:bad])), (moved, arrived)


@pytest.mark.parametrize(
    "kill, what",
    [
        (("SIGINT", "after_step", 3), "after 3 steps"),
        (("SIGTERM", "after_step", 3), "after 3 steps"),
        (("SIGINT", "in_write", 4), "while saving {ckpt}/step_000004 (not completed"),
        (("SIGTERM", "in_save", 2), "while saving {ckpt}/step_000004 (not completed"),
    ],
    ids=["SIGINT-at-step", "SIGTERM-at-step", "SIGINT-in-torch-save", "SIGTERM-at-commit"],
)
def test_an_interrupt_ends_in_one_line_and_the_printed_command_resumes(
    kill, what, tiny_model_dir, small_dataset, tmp_path
):
    """Ctrl-C (SIGINT) or `kill` (SIGTERM) at a step or during a checkpoint save (inside
    torch.save's writer, where it used to read as a disk error, or at the commit): the run exits
    with 128 + the signal's number and one stderr line, no traceback, naming the signal, what it
    interrupted, the last complete checkpoint (step 2) and the command that resumes; an
    interrupted save leaves no .tmp and its step's checkpoint does not count. Running the printed
    command (its --overwrite dropped) resumes from step 2 and finishes."""
    sig, mode, k = kill
    out = tmp_path / "out"
    args = [*common_args(tiny_model_dir, small_dataset, out, 6), "--overwrite"]
    proc = run(SFT, args, kill=(f"{sig}:{mode}", k))
    assert proc.returncode == 128 + getattr(signal, sig), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    ckpt = out / "checkpoints"
    command = f"python {SFT} " + " ".join(a for a in args if a != "--overwrite")
    assert line.startswith(f"interrupted by {sig} {what.format(ckpt=ckpt)}"), line
    assert line.endswith(
        f"; last complete checkpoint: {ckpt}/step_000002; resume with: {command}"
    ), line
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002"]
    resumed = subprocess.run(
        [sys.executable, *shlex.split(line.split("resume with: python ", 1)[1])],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert_ok(resumed)
    assert "resuming from" in resumed.stdout and "step_000002" in resumed.stdout
    assert sorted(steps_logged(out)) == list(range(1, 7))


@pytest.mark.parametrize("example, sig", [("dpo_smollm2", "SIGTERM"), ("rm_smollm2", "SIGINT")])
def test_an_interrupt_of_the_preference_skeletons_is_one_line(
    example, sig, tiny_model_dir, short_pairs, tmp_path
):
    """The DPO and reward-model scripts (the other offline skeletons) end the same way."""
    out = tmp_path / "out"
    args = common_args(tiny_model_dir, short_pairs, out, 6)
    i = args.index("--sample_max_new_tokens")
    args = [*args[:i], *args[i + 2 :], "--max_seq_len", "192", "--micro_batch_size", "1"]
    proc = run(REPO / "examples" / example / "train.py", args, kill=(f"{sig}:after_step", 3))
    assert proc.returncode == 128 + getattr(signal, sig), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"interrupted by {sig} after 3 steps; last complete checkpoint: "), line
    assert f"{out}/checkpoints/step_000002; resume with: python " in line, line


def test_an_interrupt_of_the_grpo_skeleton_is_one_line(
    ray_session, even_model_dir, chain_sum_64, tmp_path
):
    """The GRPO skeleton (its own loop, a Ray rollout pipeline) ends the same way at Ctrl-C."""
    out = tmp_path / "out"
    args = rl_args(ray_session, even_model_dir, chain_sum_64, out, 4)
    proc = run_rl(REPO / "examples" / "grpo_smollm2" / "train.py", args, ("SIGINT:after_step", 3))
    assert proc.returncode == 130, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("interrupted by SIGINT after 3 steps; last complete checkpoint: "), line
    assert f"{out}/checkpoints/step_000002; resume with: python " in line, line


def test_two_ranks_resume_from_sharded_checkpoint(tiny_model_dir, small_dataset, tmp_path):
    """torchrun, 2 gloo ranks, FSDP2: 3 steps, then a second launch continues to 6 from the
    sharded (DCP) step-3 checkpoint; weights equal one uninterrupted 6-step launch bit for bit.
    (Constant lr, so changing max_steps does not change the schedule.)"""

    def torchrun(out: Path, steps: int) -> subprocess.CompletedProcess:
        args = common_args(tiny_model_dir, small_dataset, out, steps)
        args += ["--save_every_steps", "3", "--micro_batch_size", "2", "--min_lr_ratio", "1.0"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.run(
            [*cmd, str(SFT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )

    ref_out, out = tmp_path / "ref", tmp_path / "resumed"
    assert_ok(torchrun(ref_out, 6))
    assert_ok(torchrun(out, 3))
    assert sorted(p.name for p in (out / "checkpoints" / "step_000003" / "dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"
    ]  # fmt: skip
    proc = torchrun(out, 6)
    assert_ok(proc)
    assert "resuming from" in proc.stdout and "config changed: max_steps 3 -> 6" in proc.stdout
    ref, got = steps_logged(ref_out), steps_logged(out)
    assert [got[s]["loss"] for s in range(1, 7)] == [ref[s]["loss"] for s in range(1, 7)]
    assert_same_weights(ref_out, out)


@pytest.mark.parametrize("example", ["sft_smollm2", "lora_smollm2", "rm_smollm2"])
def test_a_rerun_at_max_steps_leaves_the_saved_model_as_it_is(
    example, tiny_model_dir, small_dataset, short_pairs, tmp_path
):
    """Records describe the weights beside them: a finished 2-step run (lr 1e-3) run again with
    --lr 5e-3 trains no step, so out/model stays byte for byte (training_config.json keeps lr
    1e-3) and run.json's entry of that resume records the change. With out/model gone (a stop
    between the last checkpoint and the save) the rerun writes it again from the checkpoint, with
    the checkpoint's config."""
    s = import_script(REPO / "examples" / example / "train.py", f"records_{example}")
    out = tmp_path / "out"
    args = common_args(
        tiny_model_dir, short_pairs if example == "rm_smollm2" else small_dataset, out, 2
    )
    if example == "rm_smollm2":  # a scorer has no end-of-run sample
        i = args.index("--sample_max_new_tokens")
        args = [*args[:i], *args[i + 2 :], "--max_seq_len", "192"]

    def saved() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in (out / "model").iterdir() if p.is_file()}

    s.main(args)
    before = saved()
    assert json.loads(before["training_config.json"])["lr"] == 1e-3
    s.main([*args, "--lr", "5e-3"])
    assert saved() == before
    resumes = json.loads((out / "run.json").read_text())["resumed"]
    assert [(r["step"], r["config_changes"]) for r in resumes] == [(2, {"lr": [0.001, 0.005]})]
    shutil.rmtree(out / "model")
    s.main([*args, "--lr", "5e-3"])
    assert saved() == before


def test_reward_model_resumes_exactly(tiny_model_dir, short_pairs, tmp_path):
    """Reward-model training (examples/rm_smollm2): killed after step 3, resumed from the step-2
    checkpoint, its losses, accuracies, margins and sample order per step, the final reward model
    (decoder and score head) and every optimizer state equal an uninterrupted run's. 4 pairs, 2
    per step: 5 steps cross two epoch boundaries."""
    script = REPO / "examples" / "rm_smollm2" / "train.py"
    steps = 5
    ref_out, out = tmp_path / "ref", tmp_path / "killed"

    def rm_args(out_dir: Path) -> list[str]:
        args = common_args(tiny_model_dir, short_pairs, out_dir, steps)
        i = args.index("--sample_max_new_tokens")  # a scorer has no end-of-run sample
        extra = ["--micro_batch_size", "1", "--gradient_accumulation_steps", "2",
                 "--max_seq_len", "192"]  # fmt: skip
        return [*args[:i], *args[i + 2 :], *extra]

    run_reference(script, rm_args(ref_out))
    args = rm_args(out)
    assert_killed(run(script, args, kill=("after_step", 3)))
    proc = run(script, args)
    assert_ok(proc)
    assert "step_000002" in proc.stdout
    ref, got = steps_logged(ref_out), steps_logged(out)
    keys = ("lr", "loss", "accuracy", "margin", "sample_ids")
    for step in range(1, steps + 1):
        assert [got[step][k] for k in keys] == [ref[step][k] for k in keys], step
    assert ref[5]["loss"] != ref[1]["loss"]
    assert_same_weights(ref_out, out)
    assert "score.weight" in load_file(out / "model" / "model.safetensors")
    assert_same_optimizer_state(
        ref_out / "checkpoints/step_000005", out / "checkpoints/step_000005"
    )


def test_ppo_resumes_exactly_after_kill(ray_session, even_model_dir, chain_sum_64, tmp_path):
    """PPO (examples/ppo_smollm2) with 2 PPO epochs per rollout batch (num_iterations) and the KL
    in the reward (a reference model): killed after step 3 (inside batch 2, before its second
    epoch), resumed from the step-2 checkpoint (a batch boundary): every step's rewards (sampled
    by an engine that got the resumed policy), loss, value loss, explained variance (of the value
    head read back from the checkpoint: a fresh zero head would change them), KL and gradient
    norm, the final weights, the value head and every optimizer state equal the uninterrupted
    run's."""
    script = REPO / "examples" / "ppo_smollm2" / "train.py"
    steps = 4
    ref_out, out = tmp_path / "ref", tmp_path / "killed"

    def ppo(out_dir: Path, kill: tuple[str, int] = ("none", 0)) -> subprocess.CompletedProcess:
        args = rl_args(ray_session, even_model_dir, chain_sum_64, out_dir, steps)
        return run_rl(script, [*args, "--num_iterations", "2", "--kl_coef", "0.05"], kill)

    ref, got = killed_after_3_and_resumed(ppo, ref_out, out)
    keys = ("reward", "loss", "loss/value_avg", "val/explained_variance", "objective/kl",
            "grad_norm", "lr")  # fmt: skip
    for step in range(1, steps + 1):
        assert [got[step][k] for k in keys] == [ref[step][k] for k in keys], step
    assert ref[3]["val/explained_variance"] != 0.0  # the head trained on batch 1 is in use
    assert ref[steps]["objective/kl"] > 0 and ref[steps]["reward"] != ref[1]["reward"]
    assert_same_weights(ref_out, out)
    final = f"checkpoints/step_{steps:06d}"
    heads = [
        {k: v for k, v in _checkpoint_part(o / final, "model").items() if "value_head" in k}
        for o in (ref_out, out)
    ]
    assert heads[0].keys() == heads[1].keys() and heads[0]
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])
    assert_same_optimizer_state(ref_out / final, out / final)
