"""Checkpoint resharding: a train state saved by 2 FSDP2 ranks resumes on 1 rank (unwrapped fp32
model) and on 4 ranks (FSDP2 over 4) with exactly the saved parameters and AdamW state, at the
same global data position, and the next steps equal the uninterrupted 2-rank run's.

The global batch is kept at 4 examples (micro_batch_size 2 x 2 ranks = 4 x 1 = 1 x 4), so every
resumed step sees the same examples as the uninterrupted run (the sampler's position is global);
only the float summation order differs. Measured: losses agree to <1e-6 relative, final weights
to <1e-6 absolute; asserted with 10x margin (1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import full_tensor, spawn

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "examples" / "sft_smollm2" / "train.py"


def _args(model_dir, data, out, micro_batch_size: int) -> list[str]:
    return [
        "--model", str(model_dir), "--dataset", str(data), "--out_dir", str(out),
        "--device", "cpu", "--dtype", "fp32", "--max_steps", "4", "--lr", "1e-3",
        "--warmup_steps", "1", "--max_seq_len", "64", "--micro_batch_size", str(micro_batch_size),
        "--val_fraction", "0", "--eval_every_steps", "0", "--sample_max_new_tokens", "0",
        "--save_every_steps", "2",
    ]  # fmt: skip


def _train(rank, world_size, argv):
    from tests.helpers import import_script

    return import_script(SFT, "sft_reshard").main(argv)


def _load_then_resume(rank, world_size, checkpoint, argv):
    """Build the script's model/optimizer on this world size, load the checkpoint, return the full
    parameters and optimizer state; then run the script's main() resuming from it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from runtime import load_train_state
    from tests.helpers import import_script

    script = import_script(SFT, "sft_reshard")
    cfg = script.parse_config(script.Config, argv)
    dist_info, mesh = script.setup_distributed(cfg)
    model = script.setup_model(cfg, Path(cfg.model), mesh, dist_info.device)
    optimizer, scheduler = script.build_optimizer(cfg, model)
    state = load_train_state(checkpoint, model, optimizer, scheduler)
    params = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    options = StateDictOptions(full_state_dict=True)
    _, optim = get_state_dict(model, optimizer, options=options)
    optim_state = {
        name: {k: full_tensor(v).clone() for k, v in s.items()}
        for name, s in optim["state"].items()
    }
    lr = scheduler.get_last_lr()[0]
    del model, optimizer, scheduler
    metrics = script.main(argv)
    return (state.step, state.samples_consumed, lr), params, optim_state, metrics


def _logged(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, small_dataset, tmp_path_factory):
    """Uninterrupted 2-rank run of 4 steps (checkpoints at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("reshard") / "ref"
    spawn(_train, world_size=2, args=(_args(tiny_model_dir, small_dataset, out, 2),))
    return out


@pytest.mark.parametrize("world_size", [1, 4])
def test_two_rank_checkpoint_resumes_on_other_world_sizes(
    world_size, reference, tiny_model_dir, small_dataset, tmp_path
):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = reference / "checkpoints" / "step_000002"
    assert sorted(p.name for p in (checkpoint / "dcp").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # really sharded by 2 ranks
    dcp_to_torch_save(checkpoint / "dcp", tmp_path / "full.pt")  # the saved state, full tensors
    saved = torch.load(tmp_path / "full.pt", weights_only=False)

    out = tmp_path / "resumed"
    argv = _args(tiny_model_dir, small_dataset, out, 4 // world_size)
    argv += ["--resume", str(checkpoint)]
    results = spawn(_load_then_resume, world_size=world_size, args=(checkpoint, argv))
    for position, params, optim_state, _ in results:
        # step 2 of 2 micro-batches x 2 examples x 2 ranks = 8 examples; lr after 2 scheduler steps
        assert position[:2] == (2, 8)
        assert position[2] == _logged(reference)[3]["lr"]  # the scheduler is at step 3's lr
        assert params.keys() <= saved["model"].keys() and len(params) > 10
        for name, value in params.items():
            assert torch.equal(value, saved["model"][name]), name
        assert optim_state.keys() == saved["optim"]["state"].keys()
        for name, state in optim_state.items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], saved["optim"]["state"][name][key]), (name, key)

    ref, got = _logged(reference), _logged(out)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        print(
            f"world {world_size} step {step}: loss {got[step]['loss']!r} vs {ref[step]['loss']!r}"
        )
        assert got[step]["num_supervised"] == ref[step]["num_supervised"], step  # same examples
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
    a = load_file(reference / "model" / "model.safetensors")
    b = load_file(out / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((b[k] - a[k]).abs().max().item() for k in a)
    print(f"world {world_size}: max |weight difference| after step 4 = {worst:.2e}")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0, msg=key)
