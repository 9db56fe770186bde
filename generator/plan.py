"""`scaffold plan`: per-rank peak memory of the emitted training step, simulated with fake tensors.

The planner renders the script of a Spec into a temporary directory, imports it, and runs the
script's own functions (`setup_distributed`, `build_sft_model`, `build_optimizer`, `train_step`)
for two optimizer steps under `FakeTensorMode` (tensors carry shapes and dtypes, no memory), with a
fake process group of the target world size (`gpus * nodes`; backend "fake", so collectives are
no-ops) and PyTorch's `MemTracker` counting every tensor by category. The answer is therefore the
memory of what the script does (its FSDP2 wrapping, its 1-process fp32 exception, the tricks'
code), not of a formula. Only rank 0 is simulated: FSDP2 shards evenly, so every rank holds the
same bytes up to rounding.

What is simulated, and what is not:
- Device: tensors live on a fake CPU device (FSDP2's CUDA path creates CUDA streams and
  events, which need a CUDA build and device; its CPU path runs anywhere). The bytes per tensor
  are the same on a GPU; not modelled: stream-ordered reuse of FSDP's all-gather buffers, the CUDA
  context and NCCL buffers (about 0.5-1 GiB), caching-allocator fragmentation, cuBLAS workspaces.
  The verdict therefore keeps `HEADROOM` of the GPU's memory free.
- The synthetic batch: micro_batch_size rows of max_seq_len tokens, every position supervised
  (the largest logits a batch of that size can produce), gradient_accumulation_steps = 1.
- Data-dependent branches take the path of a healthy step: `torch.isfinite(grad_norm)` is True
  (the optimizer steps), a boolean mask selects every position, and a number read on the host
  (the step's `.item()` metrics) is 0, so the script's train_step runs unchanged.
- DTensor's sharding propagation gets a fake mode of its own (as on real tensors), so its
  global-shape metadata tensors are not counted (`_separate_propagation_fake_mode`).
- Weights are not loaded (`load_hf_checkpoint` is skipped: it copies into the already sharded
  parameters and frees each source tensor at once).
- Not simulated (the plan says so instead of printing a number): --tricks compile (inductor
  fuses temporaries, which fake tensors cannot model), offload (pinned host copies on a side
  stream), --algo qlora (NF4 quantization happens inside the checkpoint load), kd (the teacher is
  loaded from disk), dpo, dpo-lora, grpo and grpo-lora (their own skeletons, not yet driven by
  the planner).

Reference: torchtitan `scripts/estimate/estimation.py` (FakeTensorMode + fake process group +
FSDPMemTracker around one training step); PyTorch `torch.distributed._tools.mem_tracker`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from generator.features import ALGOS, TRICKS
from generator.spec import ScaffoldError, Spec, model_config, validate_spec

GIB = 2**30
# GPU name -> total memory in GiB as nvidia-smi reports it (MiB / 1024). --gpu-memory also takes
# a number of GiB.
GPU_MEMORY_GIB = {
    "a10-24": 22.5,  # 23028 MiB
    "l4-24": 22.5,  # 23034 MiB
    "rtx4090-24": 24.0,  # 24564 MiB
    "a100-40": 40.0,  # 40960 MiB
    "a100-80": 80.0,  # 81920 MiB
    "h100-80": 79.6,  # 81559 MiB (SXM and PCIe)
    "h200-141": 140.4,  # 143771 MiB
}
# Share of the GPU's memory the verdict keeps free for what the simulation does not see: CUDA
# context, NCCL buffers, allocator fragmentation (typically 5-10% of an 80 GB card in FSDP runs).
HEADROOM = 0.10
# Tricks the planner may add to make a run fit, with a rough cost rank (lower = cheaper to turn
# on): lce is free (one more matmul), 8-bit AdamW changes the update slightly, ac costs about 1/3
# more compute, optim-in-bwd rules out gradient accumulation, 4-bit AdamW moves the update most.
FIT_TRICKS = {"lce": 1, "adamw8bit": 2, "ac": 3, "optim-in-bwd": 4, "adamw4bit": 5}
MAX_SUGGESTED_WORLD = 1024  # "more GPUs" doubles the GPU count up to this many in all
UNSIMULATED_TRICKS = {
    "compile": "inductor fuses temporaries, which fake tensors cannot model",
    "offload": "activations move to pinned host memory on a side stream, outside the simulation",
}
UNSIMULATED_ALGOS = {
    "qlora": "NF4 quantization of the base happens inside the checkpoint load, which the plan skips",
    "kd": "the teacher is loaded from disk while the model is built",
    "dpo": "the DPO skeleton is not driven by the planner yet",
    "dpo-lora": "the DPO skeleton is not driven by the planner yet",
    "grpo": "the GRPO skeleton (rollouts on Ray) is not driven by the planner yet",
    "grpo-lora": "the GRPO skeleton (rollouts on Ray) is not driven by the planner yet",
}
# MemTracker category -> row of the report
ROWS = {
    "parameters": ("Parameter", "Buffer"),
    "gradients": ("Gradient",),
    "optimizer state": ("Optstate",),
    "activations": ("Activation",),
    "temporaries": ("Temp", "Other"),
}


class PlanError(ScaffoldError, ValueError):
    """A bad `scaffold plan` option, or a configuration the planner cannot simulate."""


@dataclass(frozen=True)
class PlanResult:
    """Rank 0's memory at the peak of two simulated optimizer steps (bytes)."""

    spec: Spec
    micro_batch_size: int
    max_seq_len: int
    world_size: int
    categories: dict  # row of ROWS -> bytes at the peak
    peak: int  # bytes, all categories, at the peak
    logits: int  # bytes of the largest lm_head output ([B, S, V] or [T, V]); 0 under lce
    seconds: float  # wall time of the simulation

    def to_json(self) -> dict:
        return {**asdict(self), "spec": asdict(self.spec)}

    @classmethod
    def from_json(cls, data: dict) -> PlanResult:
        spec = dict(data["spec"], tricks=tuple(data["spec"]["tricks"]))
        return cls(**{**data, "spec": Spec(**spec)})


def parse_gpu_memory(value: str) -> tuple[str, float]:
    """`--gpu-memory` as (label, GiB): a name of GPU_MEMORY_GIB or a positive number of GiB.

    Raises:
        PlanError: unknown name (the message lists the names) or a number <= 0.
    """
    key = value.strip().lower()
    if key in GPU_MEMORY_GIB:
        return key, GPU_MEMORY_GIB[key]
    try:
        gib = float(key)
    except ValueError:
        names = ", ".join(f"{n} ({g:g} GiB)" for n, g in GPU_MEMORY_GIB.items())
        raise PlanError(
            f"--gpu-memory {value!r}: not a GPU name or a number of GiB; valid names: {names}"
        ) from None
    if not gib > 0 or gib != gib or gib == float("inf"):
        raise PlanError(f"--gpu-memory {value!r}: must be a number of GiB > 0, e.g. 80")
    return f"{gib:g} GiB", gib


def check_simulable(spec: Spec, micro_batch_size: int, max_seq_len: int) -> None:
    """Raise PlanError when the planner cannot give a right number for `spec` (names why)."""
    validate_spec(spec)
    if spec.algo in UNSIMULATED_ALGOS:
        raise PlanError(
            f"scaffold plan cannot simulate --algo {spec.algo}: {UNSIMULATED_ALGOS[spec.algo]}; "
            f"it simulates --algo {', '.join(a for a in ALGOS if a not in UNSIMULATED_ALGOS)}"
        )
    blocked = [t for t in spec.tricks if t in UNSIMULATED_TRICKS]
    if blocked:
        why = "; ".join(f"{t}: {UNSIMULATED_TRICKS[t]}" for t in blocked)
        kept = ",".join(t for t in spec.tricks if t not in UNSIMULATED_TRICKS)
        them = "it" if len(blocked) == 1 else "them"
        raise PlanError(
            f"scaffold plan cannot simulate --tricks {','.join(blocked)} ({why}); plan without "
            f"{them} ({f'--tricks {kept}' if kept else 'no --tricks'}): the memory without {them} "
            "is an upper bound"
        )
    if model_config(spec).get("num_experts", 0):
        raise PlanError(
            f"scaffold plan does not simulate mixture-of-experts models (--model {spec.model}): "
            "the router decides at run time how many tokens each expert gets (the expert "
            "batches and all-to-all sizes are data that fake tensors do not have)"
        )
    # checked against real gloo runs: FSDP2, TP (+ sequence and loss parallel), TP x FSDP, HSDP, CP
    if micro_batch_size < 1 or max_seq_len < 1:
        raise PlanError(
            f"--micro-batch-size {micro_batch_size} and --max-seq-len {max_seq_len} must be >= 1"
        )


# --- the simulation (runs in a child process: it owns the fake process group) ---------------


def _data_dependent_answers():
    """A dispatch mode that answers the questions fake tensors cannot: every boolean mask is all
    True (`nonzero`, boolean indexing), every boolean host sync (`if torch.isfinite(x)`) is True,
    and a number read on the host (`.item()`, `.tolist()`: the step's metrics) is 0. So the
    script's train_step runs unchanged, host syncs included."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    fused_in_place_steps = (aten._fused_adamw_.default, aten._fused_adam_.default)

    def all_true_nonzero(mask):  # [N, mask.dim()] int64 indices of every element
        return torch.empty((mask.numel(), mask.dim()), dtype=torch.long, device=mask.device)

    class DataDependentAnswers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):
                return NotImplemented  # as MemTracker: let DTensor desugar into local ops first
            kwargs = kwargs or {}
            if func in fused_in_place_steps:
                # the real kernel updates params and states in place (no new memory); fake
                # tensors run its functional form, whose param-sized outputs would be counted
                return None
            if func is aten.nonzero.default:
                return all_true_nonzero(args[0])
            if func is aten.index.Tensor:
                x, indices = args
                expanded = []
                for i in indices:
                    if i is not None and i.dtype is torch.bool:
                        expanded += all_true_nonzero(i).unbind(1)
                    else:
                        expanded.append(i)
                return func(x, expanded)
            if func is aten._local_scalar_dense.default:
                # bool: the healthy-step branch; a number (.item() of a metric, .tolist() of
                # sample ids): 0, a placeholder the step only reports (nothing is sized by it)
                return True if args[0].dtype is torch.bool else 0
            return func(*args, **kwargs)

    return DataDependentAnswers()


@contextlib.contextmanager
def _separate_propagation_fake_mode():
    """Give DTensor's sharding propagation a fake mode of its own while the step runs.

    DTensor computes each op's output metadata by running the op on global-shape tensors under
    `detect_fake_mode() or FakeTensorMode()` (torch.distributed.tensor._sharding_prop). On real
    tensors that is a private fake mode, and MemTracker skips its ops (it counts only ops under
    the fake mode that was active when it was entered). Under the planner's FakeTensorMode,
    detect_fake_mode() returns the planner's own mode, so MemTracker counted the global-shape
    propagation tensors as allocations: inside optimizer.step() (the lazy `zeros_like` state and
    the fused update of every DTensor parameter) as optimizer state, 3x the real state for
    SmolLM2-135M (3.01 vs 1.00 GiB). A separate mode restores what a real run does.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    detect = _sharding_prop.detect_fake_mode
    propagation_mode = FakeTensorMode()
    _sharding_prop.detect_fake_mode = lambda *args: propagation_mode
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect


@contextlib.contextmanager
def _real_mesh_ops():
    """Build the meshes FSDP derives while wrapping (`DeviceMesh._concatenate` of the dp and tp
    meshes for a TP-sharded parameter) on real tensors.

    A DeviceMesh is a small int tensor of ranks plus this rank's coordinates, found with
    `nonzero`; under the planner's FakeTensorMode that is a data-dependent op on a real tensor
    and fails. The mesh is process-group metadata, not memory the plan counts.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate

    def real_concatenate(meshes):
        with unset_fake_temporarily():
            return concatenate(meshes)

    DeviceMesh._concatenate = staticmethod(real_concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)


@contextlib.contextmanager
def _causal_bias_outside_modes():
    """Create context parallel's `CausalBias` masks outside the dispatch modes.

    `causal_lower_right(L, S)` is a tensor subclass that holds two lengths and no data (SDPA
    materialises or dispatches it per call); creating one under any TorchDispatchMode fails
    (MemTracker's, on real tensors too, or the FakeTensorMode: "the raw Tensor object is already
    associated to a python object"). Its own bytes are nil, so nothing the plan counts moves.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    import runtime.context_parallel as cp

    make = cp.causal_lower_right

    def real_causal_lower_right(*sizes):
        with _disable_current_modes():
            return make(*sizes)

    cp.causal_lower_right = real_causal_lower_right
    try:
        yield
    finally:
        cp.causal_lower_right = make


@contextlib.contextmanager
def _fake_to_empty():
    """`Module.to_empty` for a model built on meta under FakeTensorMode.

    The 1-process fp32 script leaves its model unwrapped and calls `model.to_empty(device)`
    (a model under fully_shard, with DTensor parameters, keeps PyTorch's own `to_empty`).
    PyTorch swaps fake parameters in place (`torch.utils.swap_tensors`), which refuses a tied
    parameter (embed_tokens.weight is lm_head.weight). This replacement gives every parameter and
    buffer an uninitialised tensor of the same shape and dtype on `device`, keeping ties (one new
    tensor per original): the bytes `to_empty` allocates on a real device.
    """
    import torch

    original = torch.nn.Module.to_empty

    def to_empty(module, *, device, recurse=True):
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in module.parameters()):  # FSDP2: its own path works
            return original(module, device=device, recurse=recurse)
        new = {}
        for sub in module.modules() if recurse else [module]:
            for name, t in [*sub._parameters.items(), *sub._buffers.items()]:
                if t is None:
                    continue
                if id(t) not in new:
                    empty = torch.empty_like(t, device=device)
                    is_param = isinstance(t, torch.nn.Parameter)
                    new[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if is_param else empty
                table = sub._parameters if name in sub._parameters else sub._buffers
                table[name] = new[id(t)]
        return module

    torch.nn.Module.to_empty = to_empty
    try:
        yield
    finally:
        torch.nn.Module.to_empty = original


class _NoHook:
    """Stands in for a hook handle MemTracker would remove on exit."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _peak_tracker():
    """PyTorch's MemTracker reduced to the global peak by category.

    MemTracker also keeps per-module snapshots: it deep-copies a snapshot per module state and
    scans every tracked module on every op (most of its cost: 46 s of CPU for two SmolLM2 steps),
    and it refuses a module that runs forward twice in one step, which optimizer-in-backward with
    clipping does (a norm pass, then a step pass). This subclass keeps what decides the peak and
    its categories (each module's parameters and gradient hooks are registered on its first
    forward; an activation-checkpoint recompute in backward counts as activations, not
    temporaries) and drops the per-module statistics. Overrides private hooks of
    torch.distributed._tools.mem_tracker (PyTorch 2.13).
    """
    import weakref

    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    class PeakTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._seen = WeakIdKeyDictionary()  # modules whose parameters are registered

        def _pre_fw_hook(self, module, inputs):
            if module not in self._seen:
                for param in module.parameters():  # frozen (LoRA's base): no gradient to hook
                    if not param.requires_grad:
                        self._param_to_grad_hook_handles.setdefault(param, (_NO_HOOK, _NO_HOOK))
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
                self._seen[module] = True
            elif self._mod_tracker.is_bw and self._ac_mod is None:  # AC recompute starts
                self._ac_mod = weakref.ref(module)
                self._in_ac = True

        def _post_fw_hook(self, module, inputs, outputs):
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod = None
                self._in_ac = False

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    return PeakTracker()


def synthetic_batch(micro_batch_size: int, max_seq_len: int, packing: bool) -> dict:
    """A collated micro-batch of the script's layout: [B, S] int64 ids, every label supervised."""
    import torch

    B, S = micro_batch_size, max_seq_len
    batch = {
        "input_ids": torch.zeros(B, S, dtype=torch.long),
        "labels": torch.zeros(B, S, dtype=torch.long),  # 0 != IGNORE_INDEX: all supervised
        "num_tokens": torch.tensor(B * S),
        "sample_ids": torch.arange(B),
    }
    if packing:  # one document per row
        batch["position_ids"] = torch.arange(S).expand(B, S).contiguous()
        batch["document_ids"] = torch.zeros(B, S, dtype=torch.long)
    return batch


def import_script(path: Path, name: str):
    """Import a rendered train.py as a module (importing it has no side effects, STYLE.md §2)."""
    import importlib.util

    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def measure_step(
    script, model_dir: Path, micro_batch_size: int, max_seq_len: int, spec: Spec, fake: bool
) -> dict:
    """Build the script's model and optimizer and run two `train_step`s under `MemTracker`.

    Needs a default process group (fake for the plan, gloo for a real measurement). With
    fake=True everything runs under FakeTensorMode and the weights are not loaded; with
    fake=False the same calls run on real CPU tensors (tests compare the two).

    Returns:
        {"categories": {row: bytes}, "peak": bytes, "logits": bytes} of this rank at the peak.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = script.Config(
        model=str(model_dir), micro_batch_size=micro_batch_size, max_seq_len=max_seq_len,
        device="cpu", dtype=spec.dtype,
    )  # fmt: skip
    packing = "packing" in spec.tricks
    script.validate(cfg)
    dist_info, mesh = script.setup_distributed(cfg)
    fake_mode = FakeTensorMode() if fake else contextlib.nullcontext()
    loader = script.load_hf_checkpoint
    if fake:  # no weights to read: the parameters are fake
        script.load_hf_checkpoint = lambda *args, **kwargs: None
    try:
        with fake_mode, torch.compiler.set_stance("force_eager"):
            with _fake_to_empty() if fake else contextlib.nullcontext(), _real_mesh_ops():
                model = script.build_sft_model(cfg, model_dir, mesh, dist_info.device)
            optimizer, scheduler = script.build_optimizer(cfg, model)
            # rows padded as the script's collate pads them: to a multiple of tp (sequence parallel)
            padded_len = -(-max_seq_len // spec.tp) * spec.tp
            batch = synthetic_batch(micro_batch_size, padded_len, packing)
            logits = [0]
            hook = model.lm_head.register_forward_hook(
                lambda mod, args, out: logits.__setitem__(0, max(logits[0], out.nbytes))
            )
            tracker = _peak_tracker()
            optimizers = getattr(optimizer, "optimizers", optimizer)  # optimizer-in-backward
            tracker.track_external(model, optimizers)
            answers = _data_dependent_answers() if fake else contextlib.nullcontext()
            propagation = _separate_propagation_fake_mode() if fake else contextlib.nullcontext()
            dp_group = mesh["dp"].get_group()
            with propagation, tracker, answers, _causal_bias_outside_modes():
                for _ in range(2):  # step 1 creates the optimizer state; step 2 holds it
                    script.train_step(
                        model, optimizer, scheduler, [batch], cfg, dist_info.device, dp_group
                    )
            hook.remove()
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        script.load_hf_checkpoint = loader
    (per_device,) = snapshot.values()
    by_name = {getattr(k, "value", str(k)): v for k, v in per_device.items()}
    categories = {row: sum(by_name.get(c, 0) for c in cats) for row, cats in ROWS.items()}
    del model, optimizer, scheduler
    return {"categories": categories, "peak": by_name["Total"], "logits": logits[0]}


def _model_dir_for(spec: Spec, tmp: Path) -> Path:
    """A directory with the model's config.json only (the plan reads no weights)."""
    from generator.catalog import MODELS

    entry = MODELS.get(spec.model)
    if entry is None:
        return Path(spec.model).expanduser().resolve()
    model_dir = tmp / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(entry.config))
    return model_dir


def _simulate_here(spec: Spec, micro_batch_size: int, max_seq_len: int, index: int) -> PlanResult:
    """One simulation in this process (which must have no process group yet)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from generator.render import render

    start = time.perf_counter()
    world = spec.gpus * spec.nodes
    with tempfile.TemporaryDirectory(prefix="scaffold-plan-") as tmp:
        tmp = Path(tmp)
        (tmp / "train.py").write_text(render(spec))
        script = import_script(tmp / "train.py", f"scaffold_plan_{index}")
        model_dir = _model_dir_for(spec, tmp)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world))
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            measured = measure_step(
                script, model_dir, micro_batch_size, max_seq_len, spec, fake=True
            )
        finally:
            dist.destroy_process_group()
    return PlanResult(
        spec=spec, micro_batch_size=micro_batch_size, max_seq_len=max_seq_len, world_size=world,
        seconds=time.perf_counter() - start, **measured,
    )  # fmt: skip


def simulate(
    specs: list[Spec], micro_batch_size: int, max_seq_len: int, progress=None
) -> list[PlanResult]:
    """Simulate each spec in one child process (the fake process group and the imported scripts
    stay out of the caller). `progress(line)` receives one line per spec as it starts.

    Raises:
        PlanError: a spec the planner cannot simulate, or the child failed (its last line).
    """
    for spec in specs:
        check_simulable(spec, micro_batch_size, max_seq_len)
    request = {
        "specs": [asdict(s) for s in specs],
        "micro_batch_size": micro_batch_size,
        "max_seq_len": max_seq_len,
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")])),
    }
    # stderr to a file: the child's warnings (torchao's import lines) must not fill a pipe
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "generator.plan"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
        )  # fmt: skip
        proc.stdin.write(json.dumps(request))
        proc.stdin.close()
        results = []
        for line in proc.stdout:
            if not line.startswith(_MESSAGE):
                continue  # anything else the script's code printed
            msg = json.loads(line[len(_MESSAGE) :])
            if "start" in msg and progress:
                progress(msg["start"])
            if "result" in msg:
                results.append(PlanResult.from_json(msg["result"]))
            if "error" in msg:
                proc.wait()
                raise PlanError(msg["error"])
        status = proc.wait()
        stderr.seek(0)
        last = (stderr.read().strip().splitlines() or ["no output"])[-1]
    if status != 0 or len(results) != len(specs):
        raise PlanError(f"the memory simulation failed: {last} (SCAFFOLD_DEBUG=1 shows more)")
    return results


_MESSAGE = "scaffold-plan: "  # prefix of the child's JSON lines on stdout


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def _child() -> None:
    """`python -m generator.plan`: read a request on stdin, print one JSON line per event."""
    request = json.loads(sys.stdin.read())
    for index, data in enumerate(request["specs"]):
        spec = Spec(**dict(data, tricks=tuple(data["tricks"])))
        print(_MESSAGE + json.dumps({"start": describe_spec(spec)}), flush=True)
        try:
            result = _simulate_here(
                spec, request["micro_batch_size"], request["max_seq_len"], index
            )
        except PlanError as e:
            print(_MESSAGE + json.dumps({"error": str(e)}), flush=True)
            return
        except Exception as e:
            if os.environ.get("SCAFFOLD_DEBUG"):
                raise
            msg = f"simulating {describe_spec(spec)} failed: {type(e).__name__}: {e}"
            print(_MESSAGE + json.dumps({"error": " ".join(msg.split())[:2000]}), flush=True)
            return
        print(_MESSAGE + json.dumps({"result": result.to_json()}), flush=True)


# --- verdict and suggestions --------------------------------------------------------------------


def describe_spec(spec: Spec) -> str:
    tricks = ",".join(spec.tricks) or "no tricks"
    degrees = (("tp", spec.tp), ("cp", spec.cp), ("dp_replicate", spec.dp_replicate))
    mesh = "".join(f", {name} {n}" for name, n in degrees if n > 1)
    ranks = spec.gpus * spec.nodes
    return f"{spec.model} {spec.algo} {spec.dtype}, {tricks}, {ranks} rank(s){mesh}"


def plan_command(spec: Spec, gpu_memory: str) -> str:
    """The `scaffold plan` command line for `spec` (non-default options only)."""
    default = Spec()
    parts = ["scaffold", "plan", "--algo", spec.algo, "--model", spec.model]
    if spec.peft != default.peft:
        parts += ["--peft", spec.peft]
    if spec.tricks:
        parts += ["--tricks", ",".join(spec.tricks)]
    for name in ("gpus", "nodes", "tp", "cp", "dp_replicate", "dtype"):
        if getattr(spec, name) != getattr(default, name):
            parts += [f"--{name.replace('_', '-')}", str(getattr(spec, name))]
    return shlex.join([*parts, "--gpu-memory", gpu_memory])


def fits(result: PlanResult, gpu_gib: float) -> bool:
    """Peak within the GPU's memory less HEADROOM."""
    return result.peak <= (1 - HEADROOM) * gpu_gib * GIB


def _candidate_trick_sets(spec: Spec) -> list[tuple[str, ...]]:
    """Trick sets to try, cheapest first: every combination of FIT_TRICKS that the algorithm
    accepts and the registry allows together, added to spec.tricks; ordered by number of added
    tricks, then by summed cost."""
    allowed = ALGOS[spec.algo].tricks
    pool = [
        t for t in FIT_TRICKS
        if t not in spec.tricks and (allowed is None or t in allowed)
        and not any(o in spec.tricks for o in TRICKS[t].conflicts)
    ]  # fmt: skip
    sets = []
    for n in range(1, len(pool) + 1):
        for combo in itertools.combinations(pool, n):
            if any(o in combo for t in combo for o in TRICKS[t].conflicts):
                continue
            sets.append(combo)
    return sorted(sets, key=lambda c: (len(c), sum(FIT_TRICKS[t] for t in c)))


def _with_tricks(spec: Spec, added: tuple[str, ...]) -> Spec:
    order = list(TRICKS)
    return replace(spec, tricks=tuple(sorted((*spec.tricks, *added), key=order.index)))


@dataclass(frozen=True)
class Suggestion:
    """What makes a run fit: added tricks, and a GPU count per node if tricks alone do not."""

    added_tricks: tuple[str, ...]
    gpus: int
    result: PlanResult


def suggest(
    base: PlanResult, gpu_gib: float, micro_batch_size: int, max_seq_len: int, progress=None
) -> Suggestion | None:
    """The cheapest change that fits, found by simulating candidates.

    Tricks: first all candidate tricks together (if even they do not fit, no subset does: each
    trick only removes memory), then the candidate sets in `_candidate_trick_sets` order, one
    simulation each, stopping at the first that fits. Then GPUs: with all candidate tricks, the
    GPU count per node doubles until the run fits (up to MAX_SUGGESTED_WORLD ranks in all).

    Returns:
        The Suggestion, or None if nothing tried fits.
    """
    spec = base.spec
    candidates = _candidate_trick_sets(spec)
    everything = candidates[-1] if candidates else ()
    sim = lambda specs: simulate(specs, micro_batch_size, max_seq_len, progress)  # noqa: E731
    if candidates:
        (full,) = sim([_with_tricks(spec, everything)])
        if fits(full, gpu_gib):
            for combo in candidates[:-1]:
                (result,) = sim([_with_tricks(spec, combo)])
                if fits(result, gpu_gib):
                    return Suggestion(combo, spec.gpus, result)
            return Suggestion(everything, spec.gpus, full)
    gpus = spec.gpus * 2
    while gpus * spec.nodes <= MAX_SUGGESTED_WORLD:
        (result,) = sim([_with_tricks(replace(spec, gpus=gpus), everything)])
        if fits(result, gpu_gib):
            return Suggestion(everything, gpus, result)
        gpus *= 2
    return None


def format_result(result: PlanResult, gpu_label: str, gpu_gib: float) -> str:
    """The per-rank table and the verdict, as `scaffold plan` prints them."""
    r = result
    lines = [
        f"memory per rank: {describe_spec(r.spec)}; micro-batch {r.micro_batch_size} x "
        f"{r.max_seq_len} tokens (every position supervised), 2 simulated steps "
        f"({r.seconds:.1f} s, fake tensors on CPU); what is live at the peak moment "
        "(parameters include gathered bf16 copies in flight; gradients and activations are "
        "those alive then, not their maxima)",
    ]
    for row, nbytes in r.categories.items():
        lines.append(f"  {row:16} {nbytes / GIB:9.2f} GiB")
    lines.append(
        f"  {'of which logits':16} {r.logits / GIB:9.2f} GiB  (largest lm_head output; "
        "0 = the [T, V] logits never exist)"
    )
    lines.append(f"  {'peak':16} {r.peak / GIB:9.2f} GiB  (sum of the rows at the peak)")
    budget = (1 - HEADROOM) * gpu_gib
    verdict = "fits" if fits(r, gpu_gib) else "does NOT fit"
    lines.append(
        f"verdict: {verdict} on {gpu_label} ({gpu_gib:g} GiB; {budget:.1f} GiB usable after "
        f"{HEADROOM:.0%} headroom for CUDA context, NCCL buffers and fragmentation)"
    )
    return "\n".join(lines)


def format_suggestion(s: Suggestion | None, base: Spec) -> str:
    if s is None:
        return (
            "nothing tried fits: all of the tricks " + ", ".join(FIT_TRICKS)
            + f" and up to {MAX_SUGGESTED_WORLD} GPUs; lower --micro-batch-size or --max-seq-len"
        )  # fmt: skip
    r = s.result
    parts = []
    if s.added_tricks:
        parts.append("--tricks " + ",".join(r.spec.tricks))
    if s.gpus != base.gpus:
        parts.append(f"--gpus {s.gpus}" + (f" --nodes {base.nodes}" if base.nodes > 1 else ""))
    return (
        f"fits with {' '.join(parts)}: peak {r.peak / GIB:.2f} GiB per rank "
        f"(smallest change tried, cheapest first)"
    )


if __name__ == "__main__":
    _child()
