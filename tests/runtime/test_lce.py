"""linear_cross_entropy vs plain `F.cross_entropy(h @ W.T, y, ignore_index=-100, reduction="sum")`:
loss and gradients, uneven and all-ignored chunks, tied weights, bf16, gradcheck, memory, FSDP2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.loss import IGNORE_INDEX, linear_cross_entropy

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

B, S, D, V = 3, 11, 16, 50  # B*S = 33 positions: never a multiple of the chunk sizes below


def _inputs(dtype=torch.float32, seed=0, ignore_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < ignore_frac] = IGNORE_INDEX
    return hidden, weight, labels


def _reference(hidden, weight, labels):
    """Plain CE on the full logits in fp32 (the definition LCE must match)."""
    logits = hidden.float() @ weight.float().T  # [B, S, V]
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _loss_and_grads(fn, hidden, weight, labels, scale=1.0):
    """loss, d(scale * loss)/d hidden, d(scale * loss)/d weight (scale = the 1/global_tokens)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_chunks": 1},
        {"num_chunks": 3},
        {"num_chunks": 8},
        {"chunk_size": 5},
        {"num_chunks": 999},
    ],
    ids=["one_chunk", "3_uneven", "8_uneven", "chunk_size_5", "more_chunks_than_tokens"],
)
def test_matches_cross_entropy_fp32(kwargs):
    hidden, weight, labels = _inputs()
    scale = 1.0 / (labels != IGNORE_INDEX).sum().item()  # as train_step: loss / global tokens
    ref = _loss_and_grads(_reference, hidden, weight, labels, scale)
    out = _loss_and_grads(
        lambda h, w, y: linear_cross_entropy(h, w, y, **kwargs), hidden, weight, labels, scale
    )
    assert out[0].dtype == torch.float32
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), out, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_flat_tokens_equal_batched():
    hidden, weight, labels = _inputs()
    batched = linear_cross_entropy(hidden, weight, labels, num_chunks=4)
    flat = linear_cross_entropy(hidden.reshape(-1, D), weight, labels.reshape(-1), num_chunks=4)
    torch.testing.assert_close(batched, flat, atol=0, rtol=0)


def test_all_ignored_chunk_and_sequence():
    # sequence 0 entirely masked and most of sequence 1 (a prompt): whole chunks of positions
    # vanish before chunking; the rest must still match exactly
    hidden, weight, labels = _inputs(ignore_frac=0.0)
    labels[0] = IGNORE_INDEX
    labels[1, :9] = IGNORE_INDEX
    ref = _loss_and_grads(_reference, hidden, weight, labels)
    out = _loss_and_grads(
        lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=4), hidden, weight, labels
    )
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), out, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert torch.all(out[1][0] == 0), "masked positions get exactly zero gradient"


def test_all_ignored_batch_is_zero_not_nan():
    hidden, weight, labels = _inputs()
    labels.fill_(IGNORE_INDEX)
    loss, grad_hidden, grad_weight = _loss_and_grads(
        lambda h, w, y: linear_cross_entropy(h, w, y, num_chunks=4), hidden, weight, labels
    )
    assert loss.item() == 0.0
    # zero (not None) gradients: an FSDP rank without supervised tokens still joins the backward
    assert grad_hidden is not None and grad_weight is not None
    assert torch.all(grad_hidden == 0) and torch.all(grad_weight == 0)


def test_tied_weight_gradients_add_up():
    """W is both the embedding (lookup) and the output projection: both gradients accumulate."""
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_()
    mix = torch.randn(D, D, generator=g).requires_grad_()
    input_ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, :3] = IGNORE_INDEX

    def grads(loss_fn):
        weight.grad = mix.grad = None
        hidden = torch.tanh(F.embedding(input_ids, weight) @ mix)  # [B, S, D], uses W as embedding
        loss_fn(hidden, weight, labels).backward()
        return weight.grad.clone(), mix.grad.clone()

    ref = grads(_reference)
    out = grads(lambda h, w, y: linear_cross_entropy(h, w, y, num_chunks=3))
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5, msg="tied weight grad")
    torch.testing.assert_close(out[1], ref[1], atol=1e-5, rtol=1e-5, msg="upstream grad")
    embedding_only = grads(lambda h, w, y: (h * 0).sum() + _reference(h, w.detach(), y))[0]
    assert embedding_only.abs().sum() > 0 and not torch.allclose(out[0], embedding_only)


def test_bf16_close_to_fp32_reference():
    """bf16 hidden/weight: bf16 matmuls, fp32 softmax and accumulation. Stated tolerance vs an
    all-fp32 reference on the same (bf16-rounded) values: loss 2e-4 relative, gradients 1e-2 of
    their max (measured 6e-5 and 3.6e-3; bf16's 8-bit mantissa), and at most 2x the error of
    plain CE on bf16 logits (measured 1.0x for hidden, 1.5x for weight: each chunk's [V, D]
    partial weight gradient is rounded to bf16 before the fp32 sum, as CPU has no bf16 x bf16 ->
    fp32 matmul)."""
    hidden, weight, labels = _inputs(dtype=torch.bfloat16)
    ref = _loss_and_grads(_reference, hidden.float(), weight.float(), labels)
    out = _loss_and_grads(
        lambda h, w, y: linear_cross_entropy(h, w, y, num_chunks=3), hidden, weight, labels
    )
    plain_bf16 = _loss_and_grads(
        lambda h, w, y: F.cross_entropy(
            (h @ w.T).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        ),
        hidden,
        weight,
        labels,
    )
    assert out[0].dtype == torch.float32
    assert out[1].dtype == torch.bfloat16 and out[2].dtype == torch.bfloat16
    torch.testing.assert_close(out[0], ref[0], atol=0, rtol=2e-4)
    for name, a, p, b in zip(("grad_hidden", "grad_weight"), out[1:], plain_bf16[1:], ref[1:]):
        err = ((a.float() - b).abs().max() / b.abs().max()).item()
        plain_err = ((p.float() - b).abs().max() / b.abs().max()).item()
        assert err < 1e-2 and err <= 2 * plain_err, f"{name}: {err:.2e} (plain {plain_err:.2e})"


def test_gradcheck_float64():
    hidden, weight, labels = _inputs(dtype=torch.float64)
    hidden = hidden[:, :4].detach().requires_grad_()  # tiny: 12 positions
    labels = labels[:, :4]
    assert torch.autograd.gradcheck(
        lambda h, w: linear_cross_entropy(h, w, labels, chunk_size=5), (hidden, weight)
    )


def test_memory_bounded_by_one_chunk():
    """Saved-for-backward bytes and the peak (PyTorch's own accounting) vs plain CE."""
    from torch.distributed._tools.mem_tracker import MemTracker

    T, Dm, Vm, chunks = 1024, 64, 8192, 8
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, Dm, generator=g, requires_grad=True)
    weight = torch.randn(Vm, Dm, generator=g, requires_grad=True)
    labels = torch.randint(0, Vm, (T,), generator=g)
    plain_logits_bytes = T * Vm * 4
    chunk_logits_bytes = plain_logits_bytes // chunks

    def measure(loss_fn):
        saved = []

        def pack(t):
            if t.data_ptr() != weight.data_ptr():  # the parameter itself costs nothing extra
                saved.append(t.numel() * t.element_size())
            return t

        hidden.grad = weight.grad = None
        tracker = MemTracker()
        tracker.track_external(hidden, weight)
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn().backward()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        return sum(saved), peak["Total"]

    lce_saved, lce_peak = measure(
        lambda: linear_cross_entropy(hidden, weight, labels, num_chunks=chunks)
    )
    ce_saved, ce_peak = measure(lambda: F.cross_entropy(hidden @ weight.T, labels, reduction="sum"))
    assert ce_saved >= plain_logits_bytes  # plain CE keeps the [T, V] log-softmax for backward
    assert lce_saved < plain_logits_bytes / 20  # LCE keeps [T, D] hidden rows, [T] targets and lse
    inputs_and_grads = 2 * (hidden.numel() + weight.numel()) * 4
    assert lce_peak <= 2 * chunk_logits_bytes + inputs_and_grads + (1 << 20), (lce_peak, ce_peak)
    assert lce_peak < 0.2 * ce_peak, (lce_peak, ce_peak)


def test_input_errors():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="dtype|bfloat16"):
        linear_cross_entropy(hidden, weight.to(torch.bfloat16), labels)
    with pytest.raises(ValueError, match="positions"):
        linear_cross_entropy(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="num_chunks"):
        linear_cross_entropy(hidden, weight, labels, num_chunks=0)


def test_fsdp2_forward_hidden_equals_plain_model(process_group):
    """The documented FSDP2 use: register forward_hidden, pass the (then unsharded) lm_head weight.
    Tied embeddings, 1-process gloo group: loss and full gradients equal the plain model + CE."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from runtime import ModelArgs, build_model
    from runtime.parallel import build_mesh

    args = ModelArgs(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 256, (2, 16), generator=g)
    labels = torch.randint(0, 256, (2, 16), generator=g)
    labels[0, :5] = IGNORE_INDEX

    ref_model = build_model(args, device="cpu")
    ref_model.init_weights(generator=torch.Generator().manual_seed(0))
    ref_loss = _reference(ref_model.forward_hidden(input_ids), ref_model.lm_head.weight, labels)
    ref_loss.backward()

    model = build_model(args, device="cpu")
    model.load_state_dict(ref_model.state_dict())
    mesh = build_mesh("cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    with pytest.raises(RuntimeError, match="unsharded lm_head.weight"):  # sharded: outside forward
        linear_cross_entropy(torch.zeros(1, 64), model.lm_head.weight, labels[0, :1])
    register_fsdp_forward_method(model, "forward_hidden")
    hidden = model.forward_hidden(input_ids)
    loss = linear_cross_entropy(hidden, model.lm_head.weight, labels, num_chunks=3)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    ref_grads = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.grad.full_tensor(), ref_grads[name].grad, atol=1e-6, rtol=1e-5, msg=name
        )
