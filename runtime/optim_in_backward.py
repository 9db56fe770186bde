"""Optimizer step inside backward: one optimizer per parameter, stepped from the parameter's
post-accumulate-grad hook, so each gradient is freed right after it is used instead of all
gradients living until `optimizer.step()`.

Saves up to the whole gradient memory (one parameter's gradient at a time is alive) with
gradient_accumulation_steps=1. Supports what the usual implementations refuse:
- an LR scheduler (`cosine_schedule_with_warmup`, any LRScheduler) across all per-parameter
  optimizers, unchanged: the wrapper's `param_groups` are the per-parameter optimizers' own group
  dicts, so the scheduler writes every lr directly;
- exact resume: `state_dict()` / `load_state_dict()` of every per-parameter optimizer;
- `gradient_accumulation_steps > 1`: hooks step only on the micro-batch the train loop marks as
  last (gradients then live across micro-batches, so that part of the memory saving is gone);
- `max_grad_norm` clipping, exactly as `clip_grad_norm_`, by running each step's micro-batches
  twice (a norm pass, then a step pass: 2x forward + backward time, no extra memory; see
  `OptimizerInBackward.backward_passes`);
- FSDP2 DTensor parameters (FSDP2 runs the hooks on the sharded parameter after its
  reduce-scatter) and the grad norm for logging;
- a NaN/inf gradient: with clipping no parameter is stepped (the norm pass sees it first);
  without, no parameter is stepped from the bad one on (`OptimizerInBackward.backward_passes`).

Reference:
    PyTorch tutorial "How to save memory by fusing the optimizer step into the backward pass"
    (https://pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html);
    torchtune `OptimizerInBackwardWrapper` (torchtune/training/memory.py); Lv et al. 2023, "Full
    Parameter Fine-tuning for Large Language Models with Limited Resources" (LOMO,
    https://arxiv.org/abs/2306.09782) (fused update; their exact clipping also takes a 2nd pass).
    Differs from reference: torchtune refuses accumulation, clipping and a plain LRScheduler; here
    all three are exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

_CLIP_EPS = 1e-6  # clip_grad_norm_'s: max_norm / (total_norm + 1e-6), so results match exactly


def setup_optimizer_in_backward(
    params: nn.Module | Iterable[torch.Tensor] | Iterable[dict],
    optimizer_factory: Callable[[list[dict]], torch.optim.Optimizer],
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
) -> OptimizerInBackward:
    """Create one optimizer per parameter and step it from the parameter's gradient hook.

    Train loop (the same for every option; `optimizer.step()`/`zero_grad()` are no-ops kept so
    that the LR scheduler's order check and the usual loop shape still hold):

        for _ in optimizer.backward_passes():  # ("norm", "step") with max_grad_norm, else ("step",)
            for i, micro_batch in enumerate(micro_batches):
                optimizer.is_last_micro_batch = i == len(micro_batches) - 1
                loss_fn(model, micro_batch).backward()  # the last one steps, inside backward
        grad_norm = optimizer.grad_norm()  # global, before clipping (as clip_grad_norm_ returns)
        optimizer.step()
        scheduler.step()

    Args:
        params: a module (its parameters with requires_grad), or parameters, or torch-style param
            groups (`{"params": [...], "weight_decay": 0.0}`) whose options go to that group's
            per-parameter optimizers. Under FSDP2, call after `fully_shard` (the DTensor params).
        optimizer_factory: called once per parameter with `[{"params": [p], **group_options}]`,
            returns an optimizer, e.g. `functools.partial(torch.optim.AdamW, lr=2e-5)` or
            torchao's `AdamW8bit` the same way.
        gradient_accumulation_steps: micro-batches per optimizer step; the hooks check that
            each parameter received exactly this many gradients when it steps.
        max_grad_norm: clip the global L2 norm to this (exactly `clip_grad_norm_`), None = no
            clipping. Costs a second forward + backward per step (see `backward_passes`).

    Returns:
        The OptimizerInBackward (pass it to the LR scheduler as the optimizer).

    Raises:
        ValueError: no trainable parameter, a parameter listed twice or not requiring grad,
            gradient_accumulation_steps < 1, or max_grad_norm <= 0.
    """
    groups = _param_groups(params)
    if gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps={gradient_accumulation_steps}; it must be >= 1."
        )
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(
            f"max_grad_norm={max_grad_norm}; pass a positive norm, or None to disable clipping."
        )
    flat = [(p, {k: v for k, v in g.items() if k != "params"}) for g in groups for p in g["params"]]
    optimizers = [optimizer_factory([{**options, "params": [p]}]) for p, options in flat]
    optimizer = OptimizerInBackward(
        [p for p, _ in flat], optimizers, gradient_accumulation_steps, max_grad_norm
    )
    for index, (p, _) in enumerate(flat):
        hook = functools.partial(optimizer._on_grad_ready, index)
        optimizer._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
    return optimizer


def _param_groups(params) -> list[dict]:
    """Normalise a module / parameters / param groups to param groups; check trainability."""
    if isinstance(params, nn.Module):
        groups = [{"params": [p for p in params.parameters() if p.requires_grad]}]
    else:
        items = list(params)
        is_groups = bool(items) and isinstance(items[0], dict)
        groups = (
            [{**g, "params": list(g["params"])} for g in items]
            if is_groups
            else [{"params": items}]
        )
    flat = [p for g in groups for p in g["params"]]
    if not flat:
        raise ValueError("setup_optimizer_in_backward got no trainable parameter.")
    if len({id(p) for p in flat}) != len(flat):
        raise ValueError(
            "a parameter appears twice in the param groups (a tied weight listed twice?); list "
            "each parameter once, e.g. from model.parameters()."
        )
    frozen = [i for i, p in enumerate(flat) if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"parameters at positions {frozen[:5]} do not require grad, so their hook would never "
            "step; pass only trainable parameters."
        )
    return groups


class OptimizerInBackward(torch.optim.Optimizer):
    """Per-parameter optimizers stepped inside backward, behind one `Optimizer` for the scheduler.

    A class (STYLE prefers functions) because `LRScheduler` requires an `Optimizer` instance.
    `Optimizer.__init__` is deliberately not called: it would copy the param groups, while
    sharing the per-parameter optimizers' group dicts is what makes a scheduler drive them all.
    Build it with `setup_optimizer_in_backward`.

    Attributes:
        is_last_micro_batch: set by the train loop before each backward; True = this backward
            steps. Leave it True when gradient_accumulation_steps=1.
        optimizers: [N] the per-parameter optimizers, in parameter order.
    """

    def __init__(self, params, optimizers, gradient_accumulation_steps, max_grad_norm):
        self.params = params
        self.optimizers = optimizers
        self.defaults = optimizers[0].defaults
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.is_last_micro_batch = True
        self._phase = "step" if max_grad_norm is None else None  # None: outside backward_passes
        self._clip_coef: torch.Tensor | None = None
        self._norms: list[torch.Tensor | None] = [None] * len(params)  # local L2 norm per param
        self._grads_seen = [0] * len(params)  # micro-batch gradients since the last step
        self._saw_non_finite = False  # single pass: a non-finite gradient stopped this step
        self._hook_handles = []

    @property
    def param_groups(self) -> list[dict]:
        """The per-parameter optimizers' own group dicts (one per parameter), read afresh each
        time: `load_state_dict` replaces those dicts, and the scheduler must write the new ones."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        """Parameter -> optimizer state, across all per-parameter optimizers (read-only view)."""
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def __repr__(self) -> str:
        return (
            f"OptimizerInBackward({len(self.optimizers)} x {type(self.optimizers[0]).__name__}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
            f"max_grad_norm={self.max_grad_norm})"
        )

    def backward_passes(self) -> Iterator[str]:
        """Yield the backward passes of one optimizer step; run all micro-batches in each.

        Without clipping: one pass, "step". With max_grad_norm: first "norm" (the hooks record
        each parameter's gradient norm and free the gradient, no step), then the global norm and
        `clip_coef = min(1, max_norm / (norm + 1e-6))` are computed (one all-reduce under
        FSDP), then "step" (the same micro-batches again: the hooks scale each gradient by
        clip_coef and step). Clipping needs the global norm before the first step, and any
        one-pass scheme would either keep all gradients (losing the memory saving) or clip with a
        stale norm (a different optimizer). Cost: 2x forward + backward per step; memory: as
        without clipping. A non-finite global norm ends the step after the norm pass: no
        parameter is updated and `grad_norm()` returns that norm. The step pass must replay the
        same micro-batches (and the same RNG state if the model uses dropout) so that its
        gradients are the ones that were measured.

        Without clipping each hook checks its own gradient before stepping (one device-to-host
        copy of its norm). A non-finite one is not stepped, nor is any parameter whose hook runs
        after it in this step (their gradients are freed), and `grad_norm()` is then not finite
        on every rank, so the train loop stops without saving. The parameters whose hooks ran
        before the bad one keep their update: they stepped before it existed, and an all-or-
        nothing step needs the global norm before the first step, which is the norm pass that
        max_grad_norm gives (under FSDP the other ranks likewise step their shards up to where
        their own gradients go bad, if ever).
        """
        self._norms = [None] * len(self.params)
        self._saw_non_finite = False
        try:
            if self.max_grad_norm is not None:
                self._phase, self._clip_coef = "norm", None
                yield "norm"
                total_norm = self.grad_norm()
                if not torch.isfinite(total_norm):  # NaN/inf before any step: skip the step
                    return  # pass, no weight changes; grad_norm() reports it to the train loop
                self._clip_coef = torch.clamp(
                    self.max_grad_norm / (total_norm + _CLIP_EPS), max=1.0
                )
            self._phase = "step"
            yield "step"
        finally:
            self._phase = "step" if self.max_grad_norm is None else None

    @torch.no_grad()
    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of params[index]: record the norm, then clip/step/free."""
        self._grads_seen[index] += 1
        seen, expected = self._grads_seen[index], self.gradient_accumulation_steps
        if not self.is_last_micro_batch and seen < expected:
            return  # accumulate
        if not (self.is_last_micro_batch and seen == expected):
            raise RuntimeError(
                f"parameter {index} {tuple(param.shape)} got {seen} micro-batch gradients with "
                f"is_last_micro_batch={self.is_last_micro_batch}, but gradient_accumulation_steps="
                f"{expected}; set optimizer.is_last_micro_batch = (i == {expected} - 1) before "
                "each backward (and do not skip FSDP's gradient sync on non-last micro-batches)."
            )
        self._grads_seen[index] = 0
        if self._phase is None:
            raise RuntimeError(
                f"max_grad_norm={self.max_grad_norm} needs the micro-batches to run inside "
                "`for _ in optimizer.backward_passes():` (a norm pass, then a step pass)."
            )
        grad = param.grad
        local_grad = grad.to_local() if isinstance(grad, DTensor) else grad  # no_grad: an alias
        if self._phase == "norm" or self._clip_coef is None:
            self._norms[index] = torch.linalg.vector_norm(local_grad)
        if self._phase == "norm":
            param.grad = None  # measured; the step pass recomputes it
            return
        if self._clip_coef is None and not self._saw_non_finite:
            # single pass: no global norm exists yet, so each gradient is checked on its own
            self._saw_non_finite = not bool(torch.isfinite(self._norms[index]))
        if self._saw_non_finite:
            self.optimizers[index].zero_grad(set_to_none=True)  # not stepped: this step is void
            return
        if self._clip_coef is not None:
            local_grad.mul_(self._clip_coef.to(local_grad.device))
        self.optimizers[index].step()
        self.optimizers[index].zero_grad(set_to_none=True)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the latest step's gradients (before clipping), like clip_grad_norm_.

        Bit-identical to `clip_grad_norm_` over the parameters in this optimizer's order (plain
        tensors); another order (e.g. model.parameters() when the groups split decay/no-decay)
        differs in the last bit, as any reordered fp32 sum would.

        Returns:
            Scalar fp32 tensor (a plain tensor, also under FSDP). A collective under FSDP with
            more than one rank: call it on every rank. Not finite (on every rank) when a
            gradient of the step was not: the bad parameter's norm enters the global sum.

        Raises:
            RuntimeError: some parameter received no gradient in the latest step.
        """
        missing = [i for i, n in enumerate(self._norms) if n is None]
        if missing:
            raise RuntimeError(
                f"{len(missing)} of {len(self.params)} parameters (first: {missing[:5]}) got no "
                "gradient in the latest step; every trainable parameter must be used in the loss."
            )
        by_layout: dict = {}  # (mesh, placements) or None -> local norms of those params
        for p, norm in zip(self.params, self._norms):
            key = (p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None
            by_layout.setdefault(key, []).append(norm)
        if list(by_layout) == [None]:  # plain tensors: exactly clip_grad_norm_'s arithmetic
            return torch.linalg.vector_norm(torch.stack(by_layout[None]))
        squares = []
        for key, norms in by_layout.items():
            local_square = torch.linalg.vector_norm(torch.stack(norms)) ** 2
            if key is not None:  # sum the squares over the mesh dims the params are sharded on
                mesh, placements = key
                partial = [Partial() if pl.is_shard() else Replicate() for pl in placements]
                local_square = DTensor.from_local(local_square, mesh, partial).full_tensor()
            squares.append(local_square)
        return torch.stack(squares).sum().sqrt()

    def step(self, closure=None) -> None:
        """No-op: the steps ran inside backward. Kept for the LR scheduler and the loop shape.
        Ends the step: a loop without `backward_passes` steps again after a non-finite gradient.

        Raises:
            RuntimeError: gradients are still pending (the last backward did not step).
        """
        pending = sum(p.grad is not None for p in self.params)
        if pending:
            raise RuntimeError(
                f"{pending} parameters still hold gradients at optimizer.step(): the last "
                "backward ran with is_last_micro_batch=False, so nothing was stepped; set it to "
                "True for the last micro-batch."
            )
        self._saw_non_finite = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop any pending gradients (after a step there are none)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """Every per-parameter optimizer's state_dict, in parameter order (under FSDP2 the
        states are DTensor shards, as a regular optimizer's would be)."""
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore `state_dict()`'s output into optimizers built for the same parameters.

        Raises:
            ValueError: the number of per-parameter optimizers differs.
        """
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(
                f"checkpoint has {len(saved)} per-parameter optimizer states but this run has "
                f"{len(self.optimizers)} trainable parameters; resume with the same model and "
                "trainable set (LoRA targets, frozen modules)."
            )
        for opt, opt_state in zip(self.optimizers, saved):
            opt.load_state_dict(opt_state)

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks (the parameters then need a regular optimizer)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
