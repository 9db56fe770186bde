"""Activation offloading's pack/unpack round trip on CPU (a CPU -> CPU copy: the stream path needs
CUDA): the same loss and gradients as without offloading, the block's large saved tensors really
go through the copy (each storage once), and nothing happens without grad."""

from __future__ import annotations

import pytest
import torch

import runtime.offload as offload
from runtime import ModelArgs, build_model
from runtime.loss import cross_entropy_sum
from tests.helpers import TINY_CONFIG

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


def _model():
    model = build_model(ModelArgs(**TINY_CONFIG), device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model


def _loss_and_grads(model):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 16), generator=g)
    y = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 16), generator=g)
    loss = cross_entropy_sum(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_offload_round_trip_gives_identical_gradients(monkeypatch):
    ref_loss, ref_grads = _loss_and_grads(_model())
    copied = []

    def counting_to_cpu(t):
        copied.append(t.numel() * t.element_size())
        return real_to_cpu(t)

    real_to_cpu = offload._to_cpu
    monkeypatch.setattr(offload, "_to_cpu", counting_to_cpu)
    model = _model()
    handles = [h for layer in model.model.layers for h in offload.offload_activations(layer)]
    loss, grads = _loss_and_grads(model)
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    # per block: the normed input (saved once for q/k/v_proj), q/k/v, attention out, MLP inputs...
    assert len(copied) >= 2 * 6 and min(copied) >= offload.MIN_OFFLOAD_BYTES
    with torch.no_grad():  # eval / generation: no hooks, nothing copied
        n = len(copied)
        model(torch.zeros(1, 4, dtype=torch.long))
        assert len(copied) == n
    for h in handles:
        h.remove()


@pytest.mark.slow
def test_offload_composes_with_compiled_blocks(monkeypatch):
    """Blocks compiled in place (trick "compile") with offload hooks: dynamo breaks the graph at
    the hooks (they run eagerly), the compiled graph's saved tensors still go through pack/unpack,
    and the gradients match eager (inductor's reordered sums: 1e-5)."""
    ref_loss, ref_grads = _loss_and_grads(_model())
    copied = []
    real_to_cpu = offload._to_cpu
    monkeypatch.setattr(offload, "_to_cpu", lambda t: copied.append(t) or real_to_cpu(t))
    model = _model()
    for layer in model.model.layers:
        offload.offload_activations(layer)
        layer.compile(dynamic=False)
    loss, grads = _loss_and_grads(model)
    assert copied
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-5, msg=name)
