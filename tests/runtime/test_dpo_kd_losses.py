"""token_logprobs and chunked_kd_loss against dense references: values and gradients."""

from __future__ import annotations

import pytest
import torch

from runtime.loss import IGNORE_INDEX, chunked_kd_loss, token_logprobs

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

B, S, D, V = 2, 7, 8, 11


def _inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :3] = IGNORE_INDEX  # a masked prompt
    labels[1, -1] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_token_logprobs_equal_dense_log_softmax(chunk_size):
    hidden, weight, labels = _inputs()
    got = token_logprobs(hidden, weight, labels, chunk_size=chunk_size)
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)  # [B, S, V]
    want = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels != IGNORE_INDEX)
    torch.testing.assert_close(got, want)
    coeff = torch.randn(B, S, dtype=got.dtype)  # a generic upstream gradient
    g_got = torch.autograd.grad((got * coeff).sum(), (hidden, weight))
    g_want = torch.autograd.grad((want * coeff).sum(), (hidden, weight))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b)


def test_token_logprobs_all_ignored_and_no_grad():
    hidden, weight, labels = _inputs()
    labels[:] = IGNORE_INDEX
    out = token_logprobs(hidden, weight, labels)
    assert out.shape == (B, S) and (out == 0).all()
    # still in hidden's graph (a cp rank whose chunks hold no reply token runs the backward too)
    g_hidden, g_weight = torch.autograd.grad(out.sum(), (hidden, weight))
    assert not g_hidden.any() and not g_weight.any()
    hidden, weight, labels = _inputs()
    with torch.no_grad():
        assert not token_logprobs(hidden, weight, labels, chunk_size=2).requires_grad


def _dense_kl(hs, ws, ht, wt, labels, temperature, kind):
    mask = labels != IGNORE_INDEX
    s = torch.log_softmax((hs @ ws.T) / temperature, -1)[mask]  # [T, V]
    t = torch.log_softmax((ht @ wt.T) / temperature, -1)[mask].detach()
    kl = (t.exp() * (t - s)).sum() if kind == "forward" else (s.exp() * (s - t)).sum()
    return kl * temperature**2


@pytest.mark.parametrize("kind", ["forward", "reverse"])
@pytest.mark.parametrize("temperature,chunk_size", [(1.0, 3), (2.0, 1), (0.7, 100)])
def test_chunked_kd_loss_equals_dense_kl(kind, temperature, chunk_size):
    hs, ws, labels = _inputs(0)
    g = torch.Generator().manual_seed(1)
    ht = torch.randn(B, S, 5, generator=g, dtype=torch.float64)  # a teacher of another width
    wt = torch.randn(V, 5, generator=g, dtype=torch.float64)
    got = chunked_kd_loss(hs, ws, ht, wt, labels, temperature, kind, chunk_size=chunk_size)
    want = _dense_kl(hs, ws, ht, wt, labels, temperature, kind)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got, (hs, ws))
    g_want = torch.autograd.grad(want, (hs, ws))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b)


def test_chunked_kd_loss_is_zero_for_identical_models_and_rejects_bad_args():
    hs, ws, labels = _inputs(0)
    assert chunked_kd_loss(hs, ws, hs.detach(), ws.detach(), labels).abs().item() < 1e-12
    with pytest.raises(ValueError, match="kind="):
        chunked_kd_loss(hs, ws, hs, ws, labels, kind="js")
    with pytest.raises(ValueError, match="same tokenizer"):
        chunked_kd_loss(hs, ws, hs, ws[:5], labels)
