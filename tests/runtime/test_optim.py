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
