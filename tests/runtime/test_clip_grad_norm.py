"""runtime.clip_grad_norm on one process: bit-identical to torch.nn.utils.clip_grad_norm_ on plain
parameters (norm and clipped gradients), max_norm 0 / inf only measure, and the same over FSDP2's
DTensor parameters (a 1-process gloo group). Two ranks and expert parallel:
tests/distributed/test_clip_grad_norm.py."""

from __future__ import annotations

import math

import pytest
import torch

from runtime import ModelArgs, build_model, clip_grad_norm
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


def _model_with_grads() -> torch.nn.Module:
    """The tiny Llama (seed 0) after one backward: the same gradients on every call."""
    model = build_model(ModelArgs(**TINY_CONFIG), device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    ids = torch.randint(
        0, TINY_CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
    )
    model(ids).float().logsumexp(-1).mean().backward()
    return model


def _grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clipping", "below-the-threshold"])
def test_equals_torch_clip_grad_norm_bit_for_bit(max_norm):
    model = _model_with_grads()
    ref = _model_with_grads()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    norm = clip_grad_norm(model, max_norm)
    assert norm.dtype == torch.float32 and norm.shape == () and type(norm) is torch.Tensor
    assert torch.equal(norm, expected)
    assert (norm > max_norm) == (max_norm < 1)  # the clipping case really clips
    for got, want in zip(_grads(model), _grads(ref), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("max_norm", [0.0, math.inf], ids=["zero", "inf"])
def test_zero_or_inf_only_measures(max_norm):
    model = _model_with_grads()
    before = [g.clone() for g in _grads(model)]
    ref = _model_with_grads()
    assert torch.equal(
        clip_grad_norm(model, max_norm), torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf)
    )
    assert all(torch.equal(g, b) for g, b in zip(_grads(model), before, strict=True))


def test_parameters_without_grad_are_skipped_and_bad_thresholds_refused():
    model, ref = _model_with_grads(), _model_with_grads()
    frozen = model.model.layers[0].mlp.down_proj.weight
    frozen.grad = ref.model.layers[0].mlp.down_proj.weight.grad = None
    assert torch.equal(
        clip_grad_norm(model, 0.05), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    )
    assert frozen.grad is None
    empty = torch.nn.Linear(2, 2)
    assert clip_grad_norm(empty, 1.0).item() == 0.0  # no gradient at all, as clip_grad_norm_
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="max_norm"):
            clip_grad_norm(model, bad)


def test_a_non_finite_gradient_gives_a_non_finite_norm():
    model = _model_with_grads()
    model.model.norm.weight.grad[0] = math.inf
    assert not torch.isfinite(clip_grad_norm(model, 1.0))
    model.model.norm.weight.grad[0] = math.nan
    assert torch.isnan(clip_grad_norm(model, 0.0))


def test_fsdp2_dtensor_parameters_one_process(process_group):
    """FSDP2 (1 rank, gloo): DTensor gradients, a plain scalar norm, the plain model's numbers."""
    from torch.distributed.fsdp import fully_shard

    from runtime.parallel import build_mesh

    plain, sharded = _model_with_grads(), _model_with_grads()
    grads = [p.grad for p in sharded.parameters()]
    mesh = build_mesh("cpu")
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(sharded, mesh=mesh["dp_shard"])
    for p, g in zip(sharded.parameters(), grads, strict=True):  # the plain model's gradients
        p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    norm = clip_grad_norm(sharded, 0.05)
    assert type(norm) is torch.Tensor and norm.dtype == torch.float32
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    for p, q in zip(sharded.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-9)
