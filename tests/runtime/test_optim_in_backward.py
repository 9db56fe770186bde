"""Optimizer-in-backward vs the standard `clip_grad_norm_` + `opt.step()` loop: identical
parameters (fp32 CPU, torch.equal) with AdamW + weight decay + the warmup/cosine LambdaLR, with
gradient accumulation and clipping; exact resume; FSDP2 (1-process gloo); torchao AdamW8bit and
AdamW4bit (also over FSDP2 DTensor parameters, equal to the plain model); a non-finite gradient
never reaches a weight through its own hook, and makes grad_norm() non-finite on every FSDP rank."""

from __future__ import annotations

import copy
import functools
import io
import math

import pytest
import torch

from runtime import ModelArgs, build_model, cosine_schedule_with_warmup
from runtime.loss import IGNORE_INDEX, cross_entropy_sum
from runtime.optim_in_backward import setup_optimizer_in_backward

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

ARGS = ModelArgs(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
)  # fmt: skip
LR, WEIGHT_DECAY, WARMUP, MAX_STEPS = 1e-2, 0.1, 2, 6
CLIP = 0.5  # below the tiny model's grad norm (~1.5-3 here), so clipping is active


def _model():
    model = build_model(ARGS, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model


def _micro_batches(step: int, n: int) -> list[dict]:
    """n micro-batches of [2, 16] tokens for optimizer step `step` (deterministic)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(n):
        input_ids = torch.randint(0, ARGS.vocab_size, (2, 16), generator=g)
        labels = torch.randint(0, ARGS.vocab_size, (2, 16), generator=g)
        labels[:, :4] = IGNORE_INDEX  # a masked prompt
        out.append({"input_ids": input_ids, "labels": labels})
    return out


def _loss(model, mb: dict, num_supervised: int) -> torch.Tensor:
    return cross_entropy_sum(model(mb["input_ids"]), mb["labels"]) / num_supervised


def _groups(model):
    """The script's groups: decay on matrices, none on norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _reference_steps(model, steps, accum, max_grad_norm, fused=None):
    """The standard loop. Returns the per-step grad norms."""
    opt = torch.optim.AdamW(_groups(model), lr=LR, fused=fused)
    sched = cosine_schedule_with_warmup(opt, WARMUP, MAX_STEPS)
    norms = []
    for step in range(steps):
        mbs = _micro_batches(step, accum)
        num_supervised = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in mbs)
        for mb in mbs:
            _loss(model, mb, num_supervised).backward()
        clip = max_grad_norm if max_grad_norm is not None else float("inf")
        # over the optimizer's parameter order: the norm of a stack is order-sensitive at 1 ulp
        params = [p for g in opt.param_groups for p in g["params"]]
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return norms


def _build_in_backward(model, accum, max_grad_norm, optimizer_cls=torch.optim.AdamW, **kwargs):
    opt = setup_optimizer_in_backward(
        _groups(model), functools.partial(optimizer_cls, lr=LR, **kwargs), accum, max_grad_norm
    )
    return opt, cosine_schedule_with_warmup(opt, WARMUP, MAX_STEPS)


def _in_backward_steps(model, opt, sched, steps, accum, start=0):
    """The train loop of `setup_optimizer_in_backward`'s docstring. Returns per-step grad norms."""
    norms = []
    for step in range(start, start + steps):
        mbs = _micro_batches(step, accum)
        num_supervised = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in mbs)
        for _ in opt.backward_passes():
            for i, mb in enumerate(mbs):
                opt.is_last_micro_batch = i == len(mbs) - 1
                _loss(model, mb, num_supervised).backward()
        norms.append(opt.grad_norm())
        opt.step()
        opt.zero_grad()
        sched.step()
    return norms


def _assert_params_equal(a, b, exact=True):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        pa = pa.full_tensor() if hasattr(pa, "full_tensor") else pa
        if exact:
            assert torch.equal(pa, pb), f"{name}: max diff {(pa - pb).abs().max():.3e}"
        else:
            torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    "accum,max_grad_norm,fused",
    [(1, None, None), (2, None, None), (1, CLIP, None), (2, CLIP, None), (2, CLIP, True)],
    ids=["plain", "accum2", "clip", "accum2_clip", "accum2_clip_fused"],
)  # fmt: skip
def test_equals_standard_loop(accum, max_grad_norm, fused):
    ref, model = _model(), _model()
    ref_norms = _reference_steps(ref, 4, accum, max_grad_norm, fused)
    opt, sched = _build_in_backward(model, accum, max_grad_norm, fused=fused)
    norms = _in_backward_steps(model, opt, sched, 4, accum)
    _assert_params_equal(model, ref)  # bit-identical
    assert [n.item() for n in norms] == [n.item() for n in ref_norms]  # logged norm: exact too
    assert (
        sched.get_last_lr()[0]
        == cosine_schedule_with_warmup(
            torch.optim.SGD([torch.zeros(1)], lr=LR), WARMUP, MAX_STEPS
        ).lr_lambdas[0](4)
        * LR
    )  # the scheduler drove every per-parameter optimizer
    assert len({g["lr"] for g in opt.param_groups}) == 1
    if max_grad_norm is not None:
        assert max(n.item() for n in ref_norms) > max_grad_norm, "clipping was never active"


def test_gradients_freed_one_at_a_time():
    model = _model()
    live = []

    class RecordingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            live.append(sum(p.grad is not None for p in model.parameters()))
            return super().step(closure)

    opt, sched = _build_in_backward(model, 1, None, RecordingAdamW)
    _in_backward_steps(model, opt, sched, 1, 1)
    assert len(live) == len(list(model.parameters()))  # one step per parameter
    assert max(live) == 1  # only the stepping parameter's gradient exists at any step
    assert all(p.grad is None for p in model.parameters())


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize(
    "accum,max_grad_norm", [(1, None), (2, CLIP)], ids=["plain", "accum2_clip"]
)
def test_resume_is_exact(accum, max_grad_norm):
    """3 steps, save model + optimizer + scheduler, rebuild everything fresh, load, 2 more steps
    == 5 continuous steps (torch.equal)."""
    continuous = _model()
    opt, sched = _build_in_backward(continuous, accum, max_grad_norm)
    _in_backward_steps(continuous, opt, sched, 5, accum)

    first = _model()
    opt, sched = _build_in_backward(first, accum, max_grad_norm)
    _in_backward_steps(first, opt, sched, 3, accum)
    checkpoint = _round_trip(
        {
            "model": first.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
        }
    )
    resumed = _model()
    resumed.load_state_dict(checkpoint["model"])
    opt, sched = _build_in_backward(resumed, accum, max_grad_norm)
    opt.load_state_dict(checkpoint["optimizer"])
    sched.load_state_dict(checkpoint["scheduler"])
    _in_backward_steps(resumed, opt, sched, 2, accum, start=3)
    _assert_params_equal(resumed, continuous)


def test_misuse_raises():
    model = _model()
    opt, _ = _build_in_backward(model, 2, None)
    mb = _micro_batches(0, 1)[0]
    # the loop forgot is_last_micro_batch: the first backward would step after 1 of 2
    with pytest.raises(RuntimeError, match="is_last_micro_batch"):
        _loss(model, mb, 1).backward()
    model = _model()
    opt, _ = _build_in_backward(model, 2, None)
    opt.is_last_micro_batch = False
    _loss(model, mb, 1).backward()
    with pytest.raises(RuntimeError, match="still hold gradients"):
        opt.step()  # nothing was stepped: must not pass silently
    model = _model()
    opt, _ = _build_in_backward(model, 1, CLIP)
    with pytest.raises(RuntimeError, match="backward_passes"):
        _loss(model, mb, 1).backward()  # clipping outside the two-pass loop
    with pytest.raises(ValueError, match="max_grad_norm"):
        _build_in_backward(_model(), 1, 0.0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        _build_in_backward(_model(), 0, None)
    with pytest.raises(ValueError, match="twice"):
        p = torch.nn.Parameter(torch.zeros(2))
        setup_optimizer_in_backward([p, p], torch.optim.AdamW)
    with pytest.raises(ValueError, match="require grad"):
        setup_optimizer_in_backward([torch.zeros(2)], torch.optim.AdamW)


def test_fsdp2_one_process_equals_plain(process_group):
    """Hooks on FSDP2's sharded DTensor parameters (run after reduce-scatter), with accumulation
    and clipping: the same parameters and grad norms as the standard non-FSDP loop."""
    from torch.distributed.fsdp import fully_shard

    from runtime.parallel import build_mesh, disable_fsdp_gradient_division

    ref, model = _model(), _model()
    ref_norms = _reference_steps(ref, 3, 2, CLIP)
    mesh = build_mesh("cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    disable_fsdp_gradient_division(model)
    opt, sched = _build_in_backward(model, 2, CLIP)
    assert all(hasattr(p, "device_mesh") for p in opt.params)  # hooks sit on DTensor params
    norms = _in_backward_steps(model, opt, sched, 3, 2)
    _assert_params_equal(model, ref, exact=False)
    torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms), atol=0, rtol=1e-5)


@pytest.mark.parametrize(
    "name, state_cls", [("AdamW8bit", "OptimState8bit"), ("AdamW4bit", "OptimState4bit")]
)
def test_torchao_low_bit_smoke(name, state_cls):
    """One tiny case (the first step compiles for a few seconds): parameters move, the low-bit
    state and the scheduler drive it, and resume after 1 step equals 2 continuous steps."""
    optimizer_cls = getattr(pytest.importorskip("torchao.optim"), name)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, bias=False)  # 4096 elements: the smallest quantized tensor
    x = torch.randn(8, 64)

    def run(module, steps, state=None):
        opt = setup_optimizer_in_backward(module, functools.partial(optimizer_cls, lr=1e-2))
        sched = cosine_schedule_with_warmup(opt, 1, 4)
        if state is not None:
            opt.load_state_dict(state[0])
            sched.load_state_dict(state[1])
        for _ in range(steps):
            module(x).square().mean().backward()
            opt.step()
            sched.step()
        return opt, sched

    continuous = copy.deepcopy(layer)
    opt, _ = run(continuous, 2)
    assert not torch.equal(continuous.weight, layer.weight)
    (state,) = opt.state.values()
    assert type(state["exp_avg"]).__name__ == state_cls
    first = copy.deepcopy(layer)
    opt, sched = run(first, 1)
    assert opt.param_groups[0]["lr"].item() == pytest.approx(1e-2)  # warmup 1/2 -> full lr
    checkpoint = _round_trip((first.state_dict(), opt.state_dict(), sched.state_dict()))
    resumed = copy.deepcopy(layer)
    resumed.load_state_dict(checkpoint[0])
    run(resumed, 1, checkpoint[1:])
    torch.testing.assert_close(resumed.weight, continuous.weight, atol=0, rtol=0)


def test_torchao_adamw4bit_over_fsdp2_equals_plain(process_group):
    """AdamW4bit over FSDP2's DTensor parameters (standard step and in backward) equals AdamW4bit
    on the plain model: the same 4-bit state (blocks of 128; tensors of >= 4096 elements are
    quantized: q/o_proj, the MLP and the embedding here) and the same parameters after 3 steps.
    The AOTAutograd cache is off as in the script (its DTensor key ignores the state subclass)."""
    from torch.distributed.fsdp import fully_shard

    from runtime.parallel import build_mesh, disable_fsdp_gradient_division

    AdamW4bit = pytest.importorskip("torchao.optim").AdamW4bit
    torch._functorch.config.enable_autograd_cache = False
    mesh = build_mesh("cpu")

    def sharded():
        model = _model()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
        disable_fsdp_gradient_division(model)
        return model

    ref, standard, in_backward = _model(), sharded(), sharded()
    factory = functools.partial(AdamW4bit, lr=LR)
    opts = {
        "ref": (ref, factory(_groups(ref))),
        "standard": (standard, factory(_groups(standard))),
        "in_backward": (in_backward, setup_optimizer_in_backward(_groups(in_backward), factory)),
    }
    for step in range(3):
        (mb,) = _micro_batches(step, 1)
        for model, opt in opts.values():
            _loss(model, mb, 1).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    quantized = [
        s
        for s in opts["standard"][1].state.values()
        if "4bit" in repr(type(s["exp_avg"].to_local()))
    ]
    assert len(quantized) >= 5
    for name, model in (("standard", standard), ("in_backward", in_backward)):
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), q, atol=1e-6, rtol=1e-5, msg=f"{name} {n}")


def _poison(grad: torch.Tensor) -> torch.Tensor:
    """The gradient with element [0, 0] set to inf."""
    grad = grad.clone()
    grad[0, 0] = float("inf")
    return grad


class _PoisonedGradient(torch.autograd.Function):
    """Identity forward; backward `_poison`s the gradient (works on FSDP's unsharded weight)."""

    @staticmethod
    def forward(ctx, weight):
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return _poison(grad)


class _Chain(torch.nn.Module):
    """first -> bad -> last: backward reaches last's parameters first, then bad's, then first's.
    poison=True makes bad.weight's gradient inf through `_PoisonedGradient` (first's stays
    finite: the activations' gradients are clean)."""

    def __init__(self):
        super().__init__()
        self.first, self.bad, self.last = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, poison: bool):
        weight = _PoisonedGradient.apply(self.bad.weight) if poison else self.bad.weight
        h = torch.nn.functional.linear(self.first(x).tanh(), weight, self.bad.bias).tanh()
        return self.last(h).square().sum()


def _one_step(model, opt, x, poison: bool) -> torch.Tensor:
    for _ in opt.backward_passes():
        model(x, poison).backward()
    norm = opt.grad_norm()
    opt.step()
    opt.zero_grad()
    return norm


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_non_finite_gradient_without_clipping_stops_the_step_at_that_parameter():
    """max_grad_norm=None (one pass): the bad parameter and every one whose hook runs after it
    keep their values, those before it keep their update, grad_norm() is not finite, every
    gradient is freed, and the next (finite) step steps everything again."""
    torch.manual_seed(0)
    model, x = _Chain(), torch.randn(4, 8)
    order = []  # hooks run in registration order: this one before the optimizer's
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    opt = setup_optimizer_in_backward(model, functools.partial(torch.optim.AdamW, lr=0.1))
    before = _snapshot(model)
    # a hook on the leaf itself keeps its place in the backward order (a Function would move it)
    handle = model.bad.weight.register_hook(_poison)
    assert not torch.isfinite(_one_step(model, opt, x, poison=False))
    handle.remove()
    bad = order.index("bad.weight")
    assert 0 < bad < len(order) - 1  # hooks ran both before and after the bad one
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(order[:bad])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    before = _snapshot(model)
    assert torch.isfinite(_one_step(model, opt, x, poison=False))
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_non_finite_gradient_with_clipping_steps_nothing():
    torch.manual_seed(0)
    model, x = _Chain(), torch.randn(4, 8)
    opt = setup_optimizer_in_backward(
        model, functools.partial(torch.optim.AdamW, lr=0.1), max_grad_norm=1.0
    )
    before = _snapshot(model)
    assert not torch.isfinite(_one_step(model, opt, x, poison=True))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _poisoned_on_rank_1(rank, world_size):
    """FSDP2 over 2 ranks, no clipping; only rank 1's gradient of bad.weight[0, 0] is inf, and
    after the reduce-scatter that element is in rank 0's shard. Returns (grad_norm, this rank's
    bad.weight shard unchanged, bad.weight finite everywhere)."""
    from torch.distributed.fsdp import fully_shard

    from runtime.parallel import build_mesh, disable_fsdp_gradient_division

    torch.manual_seed(0)
    model = _Chain()
    fully_shard(model, mesh=build_mesh("cpu")["dp_shard"])
    disable_fsdp_gradient_division(model)
    opt = setup_optimizer_in_backward(model, functools.partial(torch.optim.AdamW, lr=0.1))
    shard = model.bad.weight.to_local().detach().clone()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    norm = _one_step(model, opt, x, poison=rank == 1)
    unchanged = torch.equal(model.bad.weight.to_local(), shard)
    return norm.item(), unchanged, bool(torch.isfinite(model.bad.weight.full_tensor()).all())


def test_non_finite_gradient_on_one_fsdp_rank_makes_the_norm_non_finite_on_every_rank():
    from tests.helpers import spawn

    (norm0, unchanged0, finite0), (norm1, _, finite1) = spawn(_poisoned_on_rank_1, 2)
    assert not math.isfinite(norm0) and not math.isfinite(norm1)
    assert unchanged0  # rank 0 saw the inf in its shard: not stepped
    assert finite0 and finite1
