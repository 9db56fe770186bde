"""The test helpers' own behaviour where a test's verdict depends on it: `spawn` reports a rank
killed by a signal as a crash and runs the ranks once more, also when the crash first shows as a
peer's gloo error; a rank's exception fails at once with its traceback."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import RankCrashed, _spawn_once, spawn


def _crash_once(rank: int, world_size: int, marker: str) -> float:
    """Rank 1 kills itself by SIGKILL on the first attempt (no marker yet); rank 0 is then in
    an all-reduce with it and fails with gloo's error. Later attempts sum the ranks."""
    if rank == 1 and not Path(marker).exists():
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1's own error")
    dist.barrier()
    return rank


def test_a_signalled_rank_is_a_crash_and_runs_again(tmp_path):
    marker = tmp_path / "crashed"
    with pytest.raises(RankCrashed, match="killed by a signal"):
        _spawn_once(_crash_once, 2, "gloo", (str(marker),), dict(os.environ), os.getcwd())
    marker.unlink()
    with pytest.warns(UserWarning, match="running the 2 ranks once more"):
        assert spawn(_crash_once, 2, args=(str(marker),)) == [3.0, 3.0]


def test_a_rank_exception_fails_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1's own error") as info:
        spawn(_raise_on_rank_1, 2)
    assert not isinstance(info.value, RankCrashed)
