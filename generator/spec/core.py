"""The spec (what the user asked for) and the answers (every value the templates print).

All validation happens here, in Python, before any template is rendered; templates only arrange text.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from generator import __version__
from generator.catalog import MODELS
from generator.features import (
    ALGOS,
    PARALLEL_FEATURES,
    PEFT_ALGOS,
    PEFT_METHODS,
    REF_MODE_HELP,
    REF_MODES,
    TRICKS,
)

DTYPES = ("bf16", "fp32")


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
    dp_replicate: int = 1  # HSDP replica groups; dp_shard = gpus * nodes / (dp_replicate * cp * tp)
    ep: int = 1  # expert-parallel degree (MoE models): experts sharded over ep ranks
    # GRPO's rollout engines: GPUs per node they get (the trainer takes the other gpus -
    # engine_gpus; 0 = the engines share the trainer's GPUs, or run on CPU) and GPUs per engine
    # (vLLM tensor_parallel_size)
    engine_gpus: int = 0
    engine_tp: int = 1
    dtype: str = "bf16"
    dataset: str = "alpaca_en_demo.json"
    out: str = "."
    teacher: str = ""  # algo kd: the teacher, catalog name or local HF dir ("" = the model itself)

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
        if "tricks" in data:
            data["tricks"] = tuple(data["tricks"])
        return cls(**data)  # fields missing in older spec.json files (e.g. peft) take defaults

    def layout_options(self) -> list[str]:
        """The parallel-layout fields a command line must spell out: those off their defaults,
        and GRPO's engine layout whenever a node has more than 1 GPU (the CLI then chooses it,
        so leaving it out would mean a possibly different layout)."""
        default = Spec()
        names = ["gpus", "nodes", "tp", "cp", "dp_replicate", "ep"]
        changed = [n for n in names if getattr(self, n) != getattr(default, n)]
        if self.algo in ROLLOUT_ALGOS and (
            self.gpus > 1 or (self.engine_gpus, self.engine_tp) != (0, 1)
        ):
            changed += ["engine_gpus", "engine_tp"]
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


def validate_spec(spec: Spec) -> None:
    """Raise SpecError naming the option, the bad value and the valid choices."""
    if spec.algo not in ALGOS:
        raise SpecError(f"unknown algorithm {spec.algo!r}; valid: {', '.join(ALGOS)}")
    if spec.peft not in PEFT_METHODS:
        raise SpecError(f"--peft {spec.peft!r}; valid: {', '.join(PEFT_METHODS)}")
    if spec.teacher and spec.algo != "kd":
        raise SpecError(f"--teacher {spec.teacher} is for --algo kd (distillation); drop it")
    if spec.teacher and spec.teacher not in MODELS:
        if not (Path(spec.teacher).expanduser() / "config.json").is_file():
            raise SpecError(
                f"--teacher {spec.teacher!r}: neither a catalog model (`scaffold list models`) nor "
                "a local Hugging Face directory with config.json"
            )
    if spec.peft != Spec.peft and spec.algo not in PEFT_ALGOS:
        raise SpecError(
            f"--peft {spec.peft} needs an adapter algorithm (--algo {' or '.join(PEFT_ALGOS)}); "
            f"--algo {spec.algo} trains all parameters"
        )
    if spec.model not in MODELS and not (Path(spec.model).expanduser() / "config.json").is_file():
        raise SpecError(
            f"unknown model {spec.model!r}; valid: {', '.join(MODELS)}, "
            "or a local Hugging Face directory containing config.json"
        )
    unknown = [t for t in spec.tricks if t not in TRICKS]
    if unknown:
        raise SpecError(f"unknown trick(s) {unknown}; valid: {', '.join(TRICKS) or 'none yet'}")
    allowed = ALGOS[spec.algo].tricks
    refused = [t for t in spec.tricks if allowed is not None and t not in allowed]
    if refused:
        raise SpecError(
            f"--algo {spec.algo} does not take --tricks {','.join(refused)} (those tricks rewrite "
            f"the SFT cross-entropy or optimizer step, which {spec.algo} replaces with its own); "
            f"valid for {spec.algo}: {', '.join(allowed)} (`scaffold list algos`)"
        )
    if len(set(spec.tricks)) != len(spec.tricks):
        raise SpecError(f"--tricks lists a trick twice: {list(spec.tricks)}")
    for t in spec.tricks:
        for other, why in TRICKS[t].conflicts.items():
            if other in spec.tricks:
                keep_t = ",".join(x for x in spec.tricks if x != other)
                keep_other = ",".join(x for x in spec.tricks if x != t)
                raise SpecError(
                    f"--tricks {t} and {other} cannot be combined: {why}; drop one of them: "
                    f"--tricks {keep_t} or --tricks {keep_other}"
                )
        for need in TRICKS[t].requires:
            if need not in spec.tricks:
                raise SpecError(
                    f"--tricks {t} needs {need}; add it: --tricks {','.join([*spec.tricks, need])}"
                )
    if spec.dtype not in DTYPES:
        raise SpecError(f"--dtype {spec.dtype!r}; valid: {', '.join(DTYPES)}")
    if spec.gpus < 1 or spec.nodes < 1:
        raise SpecError(f"--gpus {spec.gpus} and --nodes {spec.nodes} must both be >= 1")
    if spec.ep != 1:
        _validate_ep(spec)
    if not spec.dataset.strip():
        raise SpecError(
            "--dataset is empty; give a .json/.jsonl/.parquet path or a Hugging Face dataset name"
        )
    _validate_parallel(spec)
    _validate_engines(spec)


# What tensor parallel has been made right for: the SFT skeleton's full-parameter model. The
# refusals say why (a feature whose modules the TP plan does not cover, or an untested pairing).
_TP_ALGOS = ("sft",)
# HSDP (--dp-replicate) is only a 2-D FSDP mesh: every algorithm on the SFT skeleton takes it (LoRA's
# frozen NF4 base and KD's whole teacher included; tests/distributed/test_fsdp_adapters_kd.py).
_HSDP_ALGOS = tuple(name for name, algo in ALGOS.items() if algo.skeleton == "sft")
_TP_REFUSED_TRICKS = {
    "compile": "per-block torch.compile of DTensor (tensor-parallel) blocks is not tested here",
}


def model_config(spec: Spec) -> dict:
    """The HF config.json fields of --model (catalog entry or local directory)."""
    entry = MODELS.get(spec.model)
    if entry:
        return entry.config
    from runtime.checkpoint import read_hf_config

    try:
        return read_hf_config(Path(spec.model).expanduser())
    except (ValueError, OSError) as e:
        raise SpecError(f"--model {spec.model}: {e}") from e


def _tricks_flag(tricks) -> str:
    """`--tricks a,b`, or `no --tricks` when none are left."""
    kept = ",".join(tricks)
    return f"--tricks {kept}" if kept else "no --tricks"


def _validate_parallel(spec: Spec) -> None:
    """The parallel plan: degrees multiply to the world size, TP fits the model and one node."""
    degrees = {"tp": spec.tp, "cp": spec.cp, "dp_replicate": spec.dp_replicate}
    for name, value in degrees.items():
        if value < 1:
            raise SpecError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    world = spec.gpus * spec.nodes
    others = spec.tp * spec.cp * spec.dp_replicate
    if world % others:
        valid = [d for d in range(1, world + 1) if world % d == 0]
        raise SpecError(
            f"--gpus {spec.gpus} x --nodes {spec.nodes} = {world} process{'es' * (world != 1)} "
            f"is not divisible by dp_replicate*cp*tp = {spec.dp_replicate}*{spec.cp}*{spec.tp} = {others} "
            f"(dp_shard = world / that must be a whole number >= 1); choose degrees whose product "
            f"divides {world}: one of {valid}"
        )
    if spec.tp > spec.gpus:
        raise SpecError(
            f"--tp {spec.tp} > --gpus {spec.gpus} (per node): tensor parallel all-gathers and "
            "reduce-scatters activations in every block, which needs the intra-node links "
            f"(NVLink); keep tp <= {spec.gpus} and scale across nodes with data parallel"
        )
    if (spec.tp > 1 or spec.cp > 1) and spec.algo not in _TP_ALGOS:
        raise SpecError(
            f"--algo {spec.algo} with --tp {spec.tp} --cp {spec.cp}: tensor and context parallel "
            f"are wired into full-parameter SFT only (--algo {', '.join(_TP_ALGOS)}); use --tp 1 "
            "--cp 1 (FSDP over all GPUs, or HSDP with --dp-replicate"
            f"{' for --algo ' + ', '.join(_HSDP_ALGOS) if spec.algo not in _HSDP_ALGOS else ''})"
        )
    if spec.dp_replicate > 1 and spec.algo not in _HSDP_ALGOS:
        raise SpecError(
            f"--algo {spec.algo} with --dp-replicate {spec.dp_replicate}: HSDP is wired into the "
            f"SFT skeleton (--algo {', '.join(_HSDP_ALGOS)}); use --dp-replicate 1 (FSDP over all "
            "GPUs)"
        )
    if spec.cp > 1:
        _validate_cp(spec, world)
    if spec.tp > 1:
        refused = [t for t in spec.tricks if t in _TP_REFUSED_TRICKS]
        if refused:
            raise SpecError(
                f"--tricks {refused[0]} with --tp {spec.tp}: {_TP_REFUSED_TRICKS[refused[0]]}; "
                f"drop it ({_tricks_flag(t for t in spec.tricks if t not in refused)}) "
                "or use --tp 1"
            )
        from runtime.parallel import check_tp_degree  # imports torch: only when TP is asked for

        config = model_config(spec)
        try:
            check_tp_degree(
                spec.tp,
                config["num_attention_heads"],
                config.get("num_key_value_heads", config["num_attention_heads"]),
                config["vocab_size"],
                config.get("model_type", "llama"),
            )
        except ValueError as e:
            raise SpecError(f"--model {spec.model} --tp {spec.tp}: {e}") from e


# algorithms with rollout engines (--engine-gpus, --engine-tp): the GRPO skeleton's
ROLLOUT_ALGOS = tuple(name for name, algo in ALGOS.items() if algo.skeleton == "grpo")
# bf16 weights per engine GPU at most when --engine-tp is chosen automatically: room for vLLM's KV
# cache on an 80 GB card (and most of a 141 GB one)
ENGINE_WEIGHT_GIB_PER_GPU = 40.0


def trainer_gpus(spec: Spec) -> int:
    """Trainer processes per node: the GPUs the rollout engines do not take."""
    return spec.gpus - spec.engine_gpus


def _engine_tp_choices(config: dict, engine_gpus: int) -> list[int]:
    """vLLM tensor_parallel_size values for an engine on `engine_gpus` GPUs: each divides the
    engine GPUs and the attention heads, and divides or is a multiple of the KV heads (vLLM
    replicates KV heads when tp exceeds them)."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    return [
        t
        for t in range(1, max(engine_gpus, 1) + 1)
        if max(engine_gpus, 1) % t == 0 and heads % t == 0 and (kv % t == 0 or t % kv == 0)
    ]


def resolve_engine_layout(
    spec: Spec, engine_gpus: int | None, engine_tp: int | None
) -> tuple[int, int]:
    """(engine_gpus, engine_tp) of a GRPO spec, choosing what was not given (None).

    engine_gpus: half of each node's GPUs (none at 1 GPU: the engines share it). engine_tp: the
    smallest valid tensor_parallel_size that puts at most ENGINE_WEIGHT_GIB_PER_GPU of bf16
    weights on each engine GPU (the largest valid one if none does). Other algorithms: (0, 1).
    """
    if spec.algo not in ROLLOUT_ALGOS:
        return (engine_gpus or 0, engine_tp or 1)
    if engine_gpus is None:
        engine_gpus = spec.gpus // 2
    if engine_tp is None:
        engine_tp = 1
        if engine_gpus > 0 and (spec.model in MODELS or Path(spec.model).expanduser().is_dir()):
            from runtime.models.llama import ModelArgs

            config = model_config(spec)
            weight_gib = 2 * ModelArgs.from_hf_config(config).num_params() / 2**30
            choices = _engine_tp_choices(config, engine_gpus)
            fitting = [t for t in choices if weight_gib / t <= ENGINE_WEIGHT_GIB_PER_GPU]
            engine_tp = fitting[0] if fitting else choices[-1]
    return engine_gpus, engine_tp


def engine_weight_note(spec: Spec) -> str:
    """A warning when each engine GPU would hold more than ENGINE_WEIGHT_GIB_PER_GPU of bf16
    weights (an explicit --engine-gpus / --engine-tp, or no valid tensor_parallel_size that
    small), else ""."""
    if spec.algo not in ROLLOUT_ALGOS:
        return ""
    from runtime.models.llama import ModelArgs

    weight_gib = 2 * ModelArgs.from_hf_config(model_config(spec)).num_params() / 2**30
    per_gpu = weight_gib / spec.engine_tp
    if per_gpu <= ENGINE_WEIGHT_GIB_PER_GPU:
        return ""
    where = (
        f"each of the {spec.engine_gpus} engine GPU(s) per node"
        if spec.engine_gpus
        else "the GPU the engines share with the trainer"
    )
    return (
        f"note: {where} holds {per_gpu:.1f} GiB of bf16 weights (engine_tp {spec.engine_tp}), "
        f"more than {ENGINE_WEIGHT_GIB_PER_GPU:g} GiB, leaving little room for vLLM's KV cache on "
        "an 80 GB card; "
        + (
            "a larger --engine-tp (on --engine-gpus divisible by it) spreads them"
            if spec.engine_gpus
            else "give the engines GPUs of their own (--engine-gpus) with --engine-tp"
        )
    )


def _validate_engines(spec: Spec) -> None:
    """--engine-gpus / --engine-tp: GRPO only; the trainer keeps at least one GPU per node."""
    if spec.algo not in ROLLOUT_ALGOS:
        given = [f"--engine-gpus {spec.engine_gpus}"] * (spec.engine_gpus != 0)
        given += [f"--engine-tp {spec.engine_tp}"] * (spec.engine_tp != 1)
        if given:
            raise SpecError(
                f"{' '.join(given)}: rollout engines exist only for --algo "
                f"{', '.join(ROLLOUT_ALGOS)}; drop {'it' if len(given) == 1 else 'both'}"
            )
        return
    if not 0 <= spec.engine_gpus < spec.gpus:
        raise SpecError(
            f"--engine-gpus {spec.engine_gpus} with --gpus {spec.gpus}: the engines take GPUs "
            f"from each node and the trainer needs at least one; choose 0..{spec.gpus - 1} "
            "(0 = the engines share the trainer's GPUs)"
        )
    if spec.engine_tp < 1:
        raise SpecError(f"--engine-tp {spec.engine_tp}: must be >= 1")
    if spec.engine_gpus == 0 and spec.engine_tp != 1:
        raise SpecError(
            f"--engine-tp {spec.engine_tp} with --engine-gpus 0: engines that share the "
            "trainer's GPUs run on one GPU each; give them GPUs of their own (--engine-gpus) "
            "or use --engine-tp 1"
        )
    if spec.engine_gpus:
        config = model_config(spec)
        choices = _engine_tp_choices(config, spec.engine_gpus)
        if spec.engine_tp not in choices:
            raise SpecError(
                f"--engine-tp {spec.engine_tp} with --engine-gpus {spec.engine_gpus} and "
                f"--model {spec.model} ({config['num_attention_heads']} attention heads, "
                f"{config.get('num_key_value_heads', config['num_attention_heads'])} KV heads): "
                "tensor_parallel_size must divide the engine GPUs and the heads; choose one "
                f"of {choices}"
            )


# Context parallel (runtime.context_parallel) is tested for full SFT, alone and with FSDP, HSDP,
# TP, lce and ac; these pairings are refused, each with the reason.
_CP_REFUSED_TRICKS = {
    "packing": "packed rows need a block-causal document mask, and the context-parallel "
    "attention is plain causal over whole rows",
    "compile": "per-block torch.compile of the K/V all-gather attention is not tested here",
    "offload": "activation offloading (CUDA) with the context-parallel attention is not tested",
}


def _validate_cp(spec: Spec, world: int) -> None:
    """--cp: SFT's dense models; rows split into 2*cp equal chunks (times tp under TP)."""
    refused = [t for t in spec.tricks if t in _CP_REFUSED_TRICKS]
    if refused:
        raise SpecError(
            f"--tricks {refused[0]} with --cp {spec.cp}: {_CP_REFUSED_TRICKS[refused[0]]}; drop "
            f"it ({_tricks_flag(t for t in spec.tricks if t not in refused)}) or use --cp 1"
        )
    config = model_config(spec)
    if config.get("model_type", "llama") in MOE_FAMILIES:
        raise SpecError(
            f"--cp {spec.cp} with --model {spec.model} ({config['model_type']}): context parallel "
            "is tested on dense models only (the MoE router and its load-balancing loss see "
            "each rank's tokens); use --cp 1"
        )
    entry = MODELS.get(spec.model)
    max_seq_len = (
        entry.default_max_seq_len if entry else min(2048, config["max_position_embeddings"])
    )
    # 2*cp chunks per row, each split again over tp by sequence parallel
    if max_seq_len % (2 * spec.cp * spec.tp):
        valid = [
            c
            for c in range(1, world + 1)
            if world % (c * spec.tp) == 0 and max_seq_len % (2 * c * spec.tp) == 0
        ]
        chunks = f"2*cp*tp={2 * spec.cp * spec.tp}" if spec.tp > 1 else f"2*cp={2 * spec.cp}"
        raise SpecError(
            f"--cp {spec.cp}: max_seq_len={max_seq_len} (the default of --model {spec.model}) is "
            f"not divisible by {chunks}; context parallel cuts every row into 2*cp equal chunks"
            f"{' (and sequence parallel each into tp)' if spec.tp > 1 else ''}; choose --cp in "
            f"{valid}"
        )


MOE_FAMILIES = ("qwen3_moe",)  # model families with experts (`--ep` shards them)
EP_TRICKS_REFUSED = {
    "optim-in-bwd": "it steps each parameter inside backward, before the expert-parallel "
    "gradient norm over all ranks' experts exists",
}


def _validate_ep(spec: Spec) -> None:
    """--ep: MoE model, experts divisible, ep = every rank (the first restriction: each expert on
    exactly one rank, the other parameters FSDP-sharded over the same ranks)."""
    world = spec.gpus * spec.nodes
    if spec.ep < 1:
        raise SpecError(f"--ep {spec.ep} must be >= 1 (1 = no expert parallelism)")
    if spec.algo != "sft":
        raise SpecError(
            f"--ep {spec.ep} is available for --algo sft only (got --algo {spec.algo}); use --ep 1"
        )
    entry = MODELS.get(spec.model)
    if entry:
        family, num_experts = entry.family, entry.config.get("num_experts", 0)
    else:
        try:
            config = json.loads((Path(spec.model).expanduser() / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise SpecError(f"--model {spec.model}: cannot read config.json ({e})") from e
        family, num_experts = config.get("model_type"), config.get("num_experts", 0)
    if family not in MOE_FAMILIES:
        moe = [name for name, e in MODELS.items() if e.family in MOE_FAMILIES]
        raise SpecError(
            f"--ep {spec.ep} shards experts, but --model {spec.model} ({family}) has none; use "
            f"--ep 1, or a mixture-of-experts model ({', '.join(MOE_FAMILIES)} family: "
            f"{', '.join(moe)} or a local directory of that family)"
        )
    if num_experts % spec.ep:
        valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise SpecError(
            f"--ep {spec.ep} does not divide num_experts={num_experts} of {spec.model}; "
            f"valid --ep: {', '.join(map(str, valid))}"
        )
    if spec.ep != world:
        raise SpecError(
            f"--ep {spec.ep} must equal the number of ranks, --gpus {spec.gpus} x --nodes "
            f"{spec.nodes} = {world}: each expert lives on exactly one rank and the other "
            f"parameters are FSDP-sharded over the same ranks; set --ep {world} or change --gpus"
        )
    others = {n: getattr(spec, n) for n in ("tp", "cp", "dp_replicate") if getattr(spec, n) != 1}
    if others:
        name, value = next(iter(others.items()))
        raise SpecError(
            f"--ep {spec.ep} with --{name.replace('_', '-')} {value}: expert parallel spans every "
            f"rank as the FSDP shard dim (ep = dp_shard), so it takes no other parallel dim yet; "
            f"use --{name.replace('_', '-')} 1"
        )
    refused = [t for t in spec.tricks if t in EP_TRICKS_REFUSED]
    if refused:
        raise SpecError(
            f"--ep {spec.ep} and --tricks {refused[0]} cannot be combined: "
            f"{EP_TRICKS_REFUSED[refused[0]]}; drop one of them"
        )


def _local_model_answers(path: Path) -> dict:
    """Answers for `--model DIR`: its config.json (model_type llama, qwen2, qwen3 or qwen3_moe)
    selects the family; an unsupported or broken config is a SpecError naming the file."""
    from runtime.checkpoint import read_hf_config
    from runtime.models.llama import ModelArgs

    config_path = path / "config.json"
    try:  # read_hf_config's errors name config.json (invalid JSON, not an object)
        args = ModelArgs.from_hf_config(read_hf_config(path), source=str(config_path))
    except (ValueError, OSError) as e:
        raise SpecError(f"--model {path}: {e}") from e
    return {
        "model_name": path.name,
        "model_path": str(path.resolve()),
        "hf_repo_id": "",
        "family": args.model_type,
        "max_seq_len": min(2048, args.max_position_embeddings),
        "lr": 2e-5,
        "micro_batch_size": 4,
    }


# helpers: module-level functions a feature adds (after the Model section).
# Additive slots collect every enabled feature's lines; override slots (loss, optimizer,
# backward_and_step, ...) replace the skeleton's default body, so at most one feature may fill
# each; `model_inputs` is single too: it defines the one `model_kwargs` dict.
SLOTS = (
    "title", "imports", "config_fields", "validate", "model_setup", "fsdp_kwargs", "after_shard",
    "load_weights", "helpers", "loss_setup", "model_inputs", "loss", "optimizer_cls", "optimizer",
    "datasets", "collate", "backward_and_step", "startup_print", "save", "docstring_notes",
)  # fmt: skip
OVERRIDE_SLOTS = (
    "title", "load_weights", "model_inputs", "loss", "optimizer_cls", "optimizer",
    "backward_and_step", "save",
)  # fmt: skip


def feature_slots(templates: list[str]) -> dict[str, list[str]]:
    """For each slot, the feature templates (in order) that define a macro of that name."""
    from generator.render import environment

    filled = {slot: [] for slot in SLOTS}
    for name in templates:
        module = environment().get_template(f"features/{name}.py.jinja").module
        for slot in SLOTS:
            if hasattr(module, slot):
                filled[slot].append(name)
    for slot in OVERRIDE_SLOTS:
        if len(filled[slot]) > 1:
            raise SpecError(
                f"features {filled[slot]} both replace the {slot!r} section; choose one"
            )
    return filled


def _collate_args(spec: Spec) -> str:
    """collate's padding: rows split over tp (sequence parallel) and into 2*cp chunks (cp)."""
    if spec.cp > 1:
        return ", pad_to_multiple_of=2 * cfg.cp" + (" * cfg.tp" if spec.tp > 1 else "")
    return ", pad_to_multiple_of=cfg.tp" if spec.tp > 1 else ""


def build_answers(spec: Spec) -> dict:
    """Every value the templates print, computed once (after `validate_spec`)."""
    validate_spec(spec)
    entry = MODELS.get(spec.model)
    if entry:
        model = {
            "model_name": entry.name,
            "model_path": entry.name,
            "hf_repo_id": entry.hf_repo_id,
            "family": entry.family,
            "max_seq_len": entry.default_max_seq_len,
            "lr": entry.default_lr,
            "micro_batch_size": entry.default_micro_batch_size,
        }
    else:
        model = _local_model_answers(Path(spec.model).expanduser())
    # kd's teacher: a catalog name keeps its Hub id; a directory its absolute path; none = the model
    if spec.teacher in MODELS:
        model["teacher_path"], model["teacher_hf_repo_id"] = (
            spec.teacher,
            MODELS[spec.teacher].hf_repo_id,
        )
    elif spec.teacher:
        model["teacher_path"] = str(Path(spec.teacher).expanduser().resolve())
        model["teacher_hf_repo_id"] = ""
    else:
        model["teacher_path"], model["teacher_hf_repo_id"] = (
            model["model_path"],
            model["hf_repo_id"],
        )
    # The algorithm's template first (it adds the adapters before tricks wrap the blocks), then the
    # tricks in registry order, not CLI order.
    algo = ALGOS[spec.algo]
    ordered_tricks = [name for name in TRICKS if name in spec.tricks]
    features = [algo.template] if algo.template else []
    # the parallel plan next: TP before activation checkpointing, compile and FSDP (torchtitan)
    features += [name for name, on in PARALLEL_FEATURES.items() if on(spec)]
    features += [TRICKS[name].template for name in ordered_tricks]
    if algo.lr is not None:
        model["lr"] = algo.lr
    slots = feature_slots(features)
    # A `model_inputs` slot defines `model_kwargs` (extra model arguments: positions, masks).
    forward_args = 'batch["input_ids"]' + (", **model_kwargs" if slots["model_inputs"] else "")
    ref_modes = REF_MODES.get(spec.algo, ())
    return {
        **model,
        "algo": spec.algo,
        "peft": spec.peft,
        "dataset": spec.dataset,
        "dtype": spec.dtype,
        "gpus": spec.gpus,
        "nodes": spec.nodes,
        "ep": spec.ep,
        "world_size": trainer_gpus(spec) * spec.nodes,
        # GRPO: the trainer's processes per node, and the rollout engines' GPU layout
        "trainer_gpus": trainer_gpus(spec),
        "engine_gpus": spec.engine_gpus,
        "engine_tp": spec.engine_tp,
        "num_engines": max(1, spec.nodes * spec.engine_gpus // spec.engine_tp),
        "tp": spec.tp,
        "cp": spec.cp,
        "dp_replicate": spec.dp_replicate,
        # extra build_mesh arguments and collate padding of the parallel features
        "mesh_args": (", cp=cfg.cp" if spec.cp > 1 else "")
        + (", tp=cfg.tp" if spec.tp > 1 else ""),
        "collate_args": _collate_args(spec),
        # FSDP's shard dim: under cp the cp ranks hold weight shards too (torchtitan's dp_shard_cp)
        "fsdp_shard_dim": "dp_shard_cp" if spec.cp > 1 else "dp_shard",
        # decoding feeds 1 token per step, which sequence / context parallel cannot split
        "sample_max_new_tokens": 0 if spec.tp > 1 or spec.cp > 1 else 48,
        "gradient_accumulation_steps": 1,
        "warmup_steps": 10,
        "max_steps": 100,
        "eval_every_steps": 25,
        "skeleton": algo.skeleton,
        "adapters": algo.template == "lora",
        "ref_modes": list(ref_modes),
        "ref_modes_literal": repr(tuple(ref_modes)),
        "ref_mode": ref_modes[0] if ref_modes else "",
        "ref_mode_help": {m: REF_MODE_HELP[m] for m in ref_modes},
        # GRPO's default generator engine: the runtime's KV-cache sampler for one process (CPU
        # or a single GPU), vLLM (one GPU per engine actor) for multi-GPU specs
        "engine": "vllm" if spec.gpus * spec.nodes > 1 else "runtime",
        "features": features,
        "slots": slots,
        "forward_args": forward_args,
        # compiled blocks are specialised to one shape (dynamic=False): pad every batch to it
        "pad_to_max_seq_len": "compile" in spec.tricks,
        "version": __version__,
        "command": spec.command(),
    }
