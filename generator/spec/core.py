"""The Spec: what the user asked for, as saved in `.scaffold/spec.json`; and the generator's errors."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, fields

from generator import __version__
from generator.features import ALGOS

DTYPES = ("bf16", "fp32")
LAYOUTS = ("split", "colocated")  # GRPO's --layout
# --cp-mode: runtime.context_parallel.CP_MODES, repeated so that the spec imports no torch
CP_MODES = ("allgather", "ring")
# algorithms with rollout engines (--engine-gpus, --engine-tp): the GRPO skeleton's
ROLLOUT_ALGOS = tuple(name for name, algo in ALGOS.items() if algo.skeleton == "grpo")


class ScaffoldError(Exception):
    """Base of every error the generator reports to the user (the CLI prints it as one line)."""


class SpecError(ScaffoldError, ValueError):
    """An invalid option or combination of options."""


@dataclass(frozen=True)
class Spec:
    """What `scaffold new` was asked for. Saved as `.scaffold/spec.json` next to the script."""

    algo: str = "sft"
    peft: str = "lora"  # adapter type for algo lora/qlora: lora or dora
    model: str = "smollm2-135m"  # catalog name or a local Hugging Face directory
    tricks: tuple[str, ...] = ()
    gpus: int = 1  # processes per node
    nodes: int = 1
    tp: int = 1  # tensor-parallel degree (within a node)
    cp: int = 1  # context-parallel degree
    # how attention reaches the other cp ranks' K/V (CP_MODES): "allgather" (each rank gathers
    # the whole sequence's K/V, Llama 3) or "ring" (K/V blocks passed around the cp ranks)
    cp_mode: str = "allgather"
    dp_replicate: int = 1  # HSDP replica groups; dp_shard = gpus * nodes / (dp_replicate * cp * tp)
    ep: int = 1  # expert-parallel degree (MoE models): experts sharded over ep ranks
    # GRPO's rollout engines: GPUs per node they get (the trainer takes the other gpus -
    # engine_gpus; 0 = the engines share the trainer's GPUs, or run on CPU) and GPUs per engine
    # (vLLM tensor_parallel_size)
    engine_gpus: int = 0
    engine_tp: int = 1
    # GRPO's layout: "split" (engines awake on their own GPUs, or sharing the trainer's where none
    # is left) or "colocated" (engines on the trainer's GPUs, asleep while it steps)
    layout: str = "split"
    dtype: str = "bf16"
    dataset: str = "alpaca_en_demo.json"
    out: str = "."
    teacher: str = ""  # algo kd: the teacher, catalog name or local HF dir ("" = the model itself)
    # the GPU (a name of GPU_MEMORY_GIB or GiB) `scaffold new` chose the tricks for, when --tricks
    # was not given and the plain script did not fit it (generator.recipe); "" = tricks as given
    fit_for: str = ""
    # the header's lines on why (generator.recipe.recipe_note), recorded with the choice
    fit_note: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"generator_version": __version__, "spec": asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "spec.json") -> Spec:
        try:
            data = json.loads(text)["spec"]
        except (ValueError, KeyError, TypeError) as e:
            raise SpecError(
                f"{source}: not a scaffold spec ({e}); re-create it with `scaffold new`"
            ) from e
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"{source}: unknown spec keys {unknown}; valid keys: {sorted(known)}")
        for key in ("tricks", "fit_note"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)  # fields missing in older spec.json files (e.g. peft) take defaults

    def layout_options(self) -> list[str]:
        """The parallel-layout fields a command line must spell out: those off their defaults,
        and GRPO's engine layout whenever a node has more than 1 GPU (the CLI then chooses it,
        so leaving it out would mean a possibly different layout)."""
        default = Spec()
        names = ["gpus", "nodes", "tp", "cp", "cp_mode", "dp_replicate", "ep"]
        changed = [n for n in names if getattr(self, n) != getattr(default, n)]
        if self.algo in ROLLOUT_ALGOS and (
            self.gpus > 1 or (self.engine_gpus, self.engine_tp) != (0, 1)
        ):
            changed += ["engine_gpus", "engine_tp"]
        if self.layout != default.layout:
            changed.append("layout")
        return changed

    def command(self) -> str:
        """The canonical `scaffold new` command that reproduces this spec (printed in the header)."""
        default = Spec()
        parts = ["scaffold", "new", "--algo", self.algo, "--model", self.model]
        if self.peft != default.peft:
            parts += ["--peft", self.peft]
        if self.tricks:
            parts += ["--tricks", ",".join(self.tricks)]
        names = [
            n for n in ("dtype", "dataset", "teacher") if getattr(self, n) != getattr(default, n)
        ]
        for name in (*self.layout_options(), *names):
            parts += [f"--{name.replace('_', '-')}", str(getattr(self, name))]
        parts += ["--out", self.out]
        return shlex.join(parts)
