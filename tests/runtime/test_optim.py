"""Warmup + cosine schedule values."""

import math

import pytest
import torch

from runtime.optim import cosine_schedule_with_warmup

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


def test_warmup_then_cosine():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = cosine_schedule_with_warmup(opt, warmup_steps=4, max_steps=12, min_lr_ratio=0.1)
    lrs = []
    for _ in range(13):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]  # never 0: the first update counts
    assert lrs[4] == 1.0
    mid = 4 + 4  # halfway through the decay
    assert math.isclose(lrs[mid], 0.1 + 0.9 * 0.5, rel_tol=1e-9)
    assert math.isclose(lrs[12], 0.1, rel_tol=1e-9)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_a_warmup_longer_than_the_run_is_clamped_to_it():
    """warmup_steps=10, max_steps=3 (a smoke run with the default warmup): the lr rises over the
    3 steps exactly as a 3-step warmup does, instead of staying below 3/11 of the peak."""
    lrs = {}
    for warmup in (3, 10):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = cosine_schedule_with_warmup(opt, warmup_steps=warmup, max_steps=3)
        lrs[warmup] = []
        for _ in range(3):
            lrs[warmup].append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
    assert lrs[10] == lrs[3] == [1 / 4, 2 / 4, 3 / 4]
