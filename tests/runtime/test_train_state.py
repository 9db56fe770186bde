"""runtime.train_state: atomic saves, pruning, resume resolution, disk-full handling, sampler,
and `resume_training` (what the scripts run to resume, with its config-change report)."""

from __future__ import annotations

import errno

import pytest
import torch

from runtime import (
    ModelArgs,
    ResumableDistributedSampler,
    TrainState,
    build_model,
    claim_out_dir,
    cosine_schedule_with_warmup,
    load_train_state,
    resolve_resume,
    resume_training,
    save_train_state,
)
from runtime.train_state import COMPLETE_MARKER, checkpoint_dirs
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


def make(seed: int = 0, max_steps: int = 10, lr: float = 1e-3, optimizer_cls=torch.optim.AdamW):
    torch.manual_seed(seed)
    model = build_model(ModelArgs(**TINY_CONFIG), device="cpu")
    model.init_weights()
    optimizer = optimizer_cls(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = cosine_schedule_with_warmup(optimizer, 2, max_steps, 0.0)
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, n: int) -> None:
    for _ in range(n):
        ids = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 8))
        model(ids).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def test_round_trip_restores_model_optimizer_scheduler_and_rng(process_group, tmp_path):
    model, optimizer, scheduler = make()
    train_steps(model, optimizer, scheduler, 3)
    path = save_train_state(tmp_path, TrainState(3, 1, 5), model, optimizer, scheduler, {"a": 1})
    assert (path / COMPLETE_MARKER).is_file() and path.name == "step_000003"
    train_steps(model, optimizer, scheduler, 2)  # the continuation to reproduce
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model2, optimizer2, scheduler2 = make(seed=1)  # different init: everything must come back
    state = load_train_state(path, model2, optimizer2, scheduler2)
    assert (state.step, state.epoch, state.samples_consumed, state.path) == (3, 1, 5, path)
    assert scheduler2.last_epoch == 3
    train_steps(model2, optimizer2, scheduler2, 2)  # same RNG draws: the rng state came back
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("optimizer_cls", ["AdamW", "AdamW8bit"])
def test_resume_with_new_max_steps_and_lr_follows_the_new_schedule(
    process_group, tmp_path, optimizer_cls
):
    """A run to step 4 of 4 (its schedule ends at lr 0) resumed with --max_steps 8 --lr 2e-3:
    the next step uses the new schedule's lr, not the saved 0; the moments still come back."""
    if optimizer_cls == "AdamW8bit":
        from torchao.optim import AdamW8bit as cls
    else:
        cls = torch.optim.AdamW
    model, optimizer, scheduler = make(max_steps=4, optimizer_cls=cls)
    train_steps(model, optimizer, scheduler, 4)
    assert float(optimizer.param_groups[0]["lr"]) == 0.0  # the end of the old schedule
    path = save_train_state(tmp_path, TrainState(4, 0, 8), model, optimizer, scheduler, {})
    model2, optimizer2, scheduler2 = make(seed=1, max_steps=8, lr=2e-3, optimizer_cls=cls)
    load_train_state(path, model2, optimizer2, scheduler2)
    expected = 2e-3 * scheduler2.lr_lambdas[0](4)  # step 4 of the new 8-step schedule
    assert expected > 0
    for group in optimizer2.param_groups:
        assert float(group["lr"]) == pytest.approx(expected, rel=1e-6)
        assert float(group["initial_lr"]) == pytest.approx(2e-3) and group["weight_decay"] == 0.0
    assert scheduler2.last_epoch == 4 and scheduler2.base_lrs == [pytest.approx(2e-3)]
    plain = lambda t: t.dequantize() if hasattr(t, "dequantize") else t  # noqa: E731 (8-bit state)
    for (_, a), (_, b) in zip(optimizer.state.items(), optimizer2.state.items(), strict=True):
        for key in a:
            if torch.is_tensor(a[key]) and a[key].dtype.is_floating_point:
                torch.testing.assert_close(plain(b[key]), plain(a[key]), msg=key)
    scheduler2.step()
    assert float(optimizer2.param_groups[0]["lr"]) == pytest.approx(
        2e-3 * scheduler2.lr_lambdas[0](5), rel=1e-6
    )


def test_keeps_last_k_and_ignores_incomplete(process_group, tmp_path):
    model, optimizer, scheduler = make()
    for step in (1, 2, 3):
        save_train_state(tmp_path, TrainState(step), model, optimizer, scheduler, {}, keep_last=2)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_000002", "step_000003"]
    (tmp_path / "step_000009").mkdir()  # no COMPLETE marker: a crash mid-write
    (tmp_path / "step_000010.tmp").mkdir()
    assert resolve_resume("auto", tmp_path).name == "step_000003"
    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume("auto", tmp_path / "missing") is None
    with pytest.raises(ValueError, match="COMPLETE is missing"):
        resolve_resume(str(tmp_path / "step_000009"), tmp_path)
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    save_train_state(tmp_path, TrainState(4), model, optimizer, scheduler, {}, keep_last=2)
    assert not (tmp_path / "step_000010.tmp").exists()  # stale partial saves are cleaned up


SAVED_CONFIG = {"lr": 1e-05, "max_steps": 10, "betas": [0.9, 0.999], "dtype": "bf16", "old": 1}


def test_resume_training_loads_and_reports_each_changed_value(process_group, tmp_path, capsys):
    model, optimizer, scheduler = make()
    train_steps(model, optimizer, scheduler, 3)
    path = save_train_state(
        tmp_path, TrainState(3, 1, 40), model, optimizer, scheduler, SAVED_CONFIG
    )
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model2, optimizer2, scheduler2 = make(seed=1)
    # betas as a tuple: equal to the saved JSON list, so not a change; "old" left, "new" came
    config = {**SAVED_CONFIG, "lr": 2e-05, "max_steps": 20, "betas": (0.9, 0.999), "new": "x"}
    del config["old"]
    state = resume_training("auto", tmp_path, model2, optimizer2, scheduler2, config, True)
    assert (state.step, state.epoch, state.samples_consumed, state.path) == (3, 1, 40, path)
    assert scheduler2.last_epoch == 3
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert capsys.readouterr().out == (
        f"resuming from {path}: step 3, epoch 1, sample 40; config changed: lr 1e-05 -> 2e-05, "
        "max_steps 10 -> 20, new (missing) -> 'x', old 1 -> (missing)\n"
    )
    # the same checkpoint named by path, on a rank that does not print, with the same config
    state = resume_training(
        str(path), tmp_path, model2, optimizer2, scheduler2, SAVED_CONFIG, False
    )
    assert state.step == 3 and capsys.readouterr().out == ""
    resume_training(path, tmp_path, model2, optimizer2, scheduler2, SAVED_CONFIG, True)
    assert capsys.readouterr().out == f"resuming from {path}: step 3, epoch 1, sample 40\n"
    # a finished run rerun with its own max_steps: nothing to train, and the line says so
    resume_training(
        path, tmp_path, model2, optimizer2, scheduler2, {**SAVED_CONFIG, "max_steps": 3}, True
    )
    assert capsys.readouterr().out == (
        f"resuming from {path}: step 3, epoch 1, sample 40; config changed: max_steps 10 -> 3; "
        "max_steps=3 is reached: no step to train (raise --max_steps to train on, or pass "
        "--overwrite to start anew)\n"
    )


def test_resume_training_without_a_checkpoint_starts_fresh(process_group, tmp_path, capsys):
    model, optimizer, scheduler = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert resume_training(
        "auto", tmp_path / "none_yet", model, optimizer, scheduler, {}, True
    ) == (TrainState())
    save_train_state(tmp_path, TrainState(2), model, optimizer, scheduler, SAVED_CONFIG)
    train_steps(model, optimizer, scheduler, 1)  # now differs from the checkpoint
    after = {k: v.clone() for k, v in model.state_dict().items()}
    assert resume_training("none", tmp_path, model, optimizer, scheduler, {}, True) == TrainState()
    assert capsys.readouterr().out == ""
    assert all(torch.equal(model.state_dict()[k], after[k]) for k in after)  # nothing loaded
    assert not all(torch.equal(before[k], after[k]) for k in after)
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        resume_training(str(tmp_path / "nope"), tmp_path, model, optimizer, scheduler, {}, True)


def test_disk_full_during_save_keeps_previous_checkpoint(process_group, tmp_path, monkeypatch):
    model, optimizer, scheduler = make()
    good = save_train_state(tmp_path, TrainState(1), model, optimizer, scheduler, {})
    import runtime.train_state as ts

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ts.dcp, "save", full_disk)
    with pytest.raises(OSError, match=r"step_000002 failed \(No space left on device\)") as info:
        save_train_state(tmp_path, TrainState(2), model, optimizer, scheduler, {})
    assert info.value.errno == errno.ENOSPC
    assert checkpoint_dirs(tmp_path) == [good]
    assert not (tmp_path / "step_000002.tmp").exists() and not (tmp_path / "step_000002").exists()


def test_load_into_a_different_model_names_the_checkpoint(process_group, tmp_path):
    model, optimizer, scheduler = make()
    path = save_train_state(tmp_path, TrainState(1), model, optimizer, scheduler, {})
    other = build_model(ModelArgs(**{**TINY_CONFIG, "hidden_size": 32}), device="cpu")
    opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="does not match this model/optimizer"):
        load_train_state(path, other, opt, cosine_schedule_with_warmup(opt, 2, 10, 0.0))


def test_resumable_sampler_continues_the_epoch_order():
    from torch.utils.data import DistributedSampler

    data = list(range(23))
    for drop_last in (False, True):  # ends with True: the training setting, used below
        torch_order = DistributedSampler(data, 2, 1, shuffle=True, seed=3, drop_last=drop_last)
        torch_order.set_epoch(4)
        full = ResumableDistributedSampler(data, 2, 1, shuffle=True, seed=3, drop_last=drop_last)
        full.set_epoch(4)
        order = list(full)
        assert order == list(torch_order) and len(full) == len(order)  # from 0: torch's order
    part = ResumableDistributedSampler(data, 2, 1, shuffle=True, seed=3, drop_last=True)
    part.set_position(4, 10)  # 10 examples used by both ranks = 5 of this rank's
    assert list(part) == order[5:] and len(part) == len(order) - 5


@pytest.mark.parametrize("saved_ranks, resumed_ranks", [(2, 1), (2, 4), (4, 2), (2, 2)])
def test_resumable_sampler_resumes_on_another_number_of_ranks(saved_ranks, resumed_ranks):
    """After k micro-batches of b examples on R ranks, exactly the first k*b*R indices of the
    epoch's global order were used; a resume at that position on any number of ranks deals out
    exactly the rest, disjoint across ranks, and each resumed global batch (b' x R' = b x R) is
    the set of examples the uninterrupted run's next global batch would have had."""
    data, b, k = list(range(40)), 4 // saved_ranks, 3

    def samplers(ranks, start):
        out = [
            ResumableDistributedSampler(data, ranks, r, shuffle=True, seed=7) for r in range(ranks)
        ]
        for s in out:
            s.set_position(2, start)
        return out

    before = [list(s) for s in samplers(saved_ranks, 0)]
    used = {i for rank in before for i in rank[: k * b]}
    global_order = samplers(1, 0)[0].global_order()
    assert used == set(global_order[: k * b * saved_ranks])
    start = k * b * saved_ranks
    after = [list(s) for s in samplers(resumed_ranks, start)]
    flat = [i for rank in after for i in rank]
    assert sorted(flat) == sorted(global_order[start:]) and not used & set(flat)
    b2 = 4 // resumed_ranks  # the same global batch of 4 examples
    for step in range(2):
        uninterrupted = {i for rank in before for i in rank[(k + step) * b : (k + step + 1) * b]}
        resumed = {i for rank in after for i in rank[step * b2 : (step + 1) * b2]}
        assert resumed == uninterrupted, step


def _save_with_failing_rank1(rank, world_size, root):
    """Rank 1 cannot write its RNG file; both ranks must raise (not hang) and nothing is kept."""
    import runtime.train_state as ts

    model, optimizer, scheduler = make()
    save_train_state(root, TrainState(1), model, optimizer, scheduler, {})
    if rank == 1:
        real_save = ts.torch.save

        def failing_save(obj, path, *args, **kwargs):
            if "rng_rank1" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real_save(obj, path, *args, **kwargs)

        ts.torch.save = failing_save
    try:
        save_train_state(root, TrainState(2), model, optimizer, scheduler, {})
    except OSError as e:
        return str(e)
    return "saved"


def test_a_write_failure_on_one_rank_stops_every_rank(tmp_path):
    from tests.helpers import spawn

    messages = spawn(_save_with_failing_rank1, world_size=2, args=(tmp_path,))
    assert all("step_000002 failed (No space left on device)" in m for m in messages), messages
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_000001"]
    assert not (tmp_path / "step_000002.tmp").exists()


def test_claim_out_dir_refuses_an_earlier_run_it_cannot_resume(process_group, tmp_path):
    """Fresh into an unused dir: fine. An earlier run's files with no checkpoint (or
    resume='none'): refused, naming the files and both ways out. A checkpoint to resume: fine.
    overwrite: deletes exactly the run's outputs and keeps the user's own files."""
    out = tmp_path / "out"
    assert claim_out_dir(str(out), "auto", False, True) == out and out.is_dir()  # created
    (out / "notes.txt").write_text("mine")
    (out / "checkpoints").mkdir()  # empty: no earlier run yet
    claim_out_dir(out, "auto", False, True)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError, match=r"out_dir='.*a_file': cannot write there"):
        claim_out_dir(tmp_path / "a_file", "auto", False, True)  # before any model or data work
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (out / "model").mkdir()
    (out / "model" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileExistsError) as e:
        claim_out_dir(out, "auto", False, True)
    assert str(e.value) == (
        f"out_dir {out} holds an earlier run (metrics.jsonl, model) and no complete checkpoint to "
        "resume from: pass --out_dir with a new directory, or --overwrite to delete that run's "
        "outputs and start fresh"
    )
    model, optimizer, scheduler = make()
    save_train_state(out / "checkpoints", TrainState(2), model, optimizer, scheduler, SAVED_CONFIG)
    claim_out_dir(out, "auto", False, True)  # a resume continues that run
    with pytest.raises(FileExistsError, match=r"checkpoints, model\) and resume='none': pass"):
        claim_out_dir(out, "none", False, True)
    with pytest.raises(ValueError, match="overwrite=True starts a fresh run, but resume="):
        claim_out_dir(out, str(out / "checkpoints" / "step_000002"), True, True)
    claim_out_dir(out, "auto", True, False)  # not rank 0: deletes nothing
    assert (out / "metrics.jsonl").is_file()
    claim_out_dir(out, "auto", True, True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    claim_out_dir(out, "auto", False, True)  # now an unused dir
