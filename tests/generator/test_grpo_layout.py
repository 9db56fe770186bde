"""GRPO's GPU layout (--engine-gpus, --engine-tp): each node's GPUs split between the trainer's
processes and the rollout engines, vLLM tensor parallelism chosen by model size, every bad layout
refused with the numbers and the valid choices."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from generator.cli import cli, spec_from_options
from generator.render import render
from generator.spec import (
    Spec,
    SpecError,
    build_answers,
    engine_weight_note,
    trainer_gpus,
    validate_spec,
)

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)


def _spec(model="smollm2-135m", gpus=1, nodes=1, engine_gpus=None, engine_tp=None, algo="grpo"):
    return spec_from_options(
        algo, "lora", model, "", gpus, nodes, 1, 1, 1, 1, "bf16", None, "o", engine_gpus, engine_tp
    )


@pytest.mark.parametrize(
    ("model", "gpus", "expected"),
    [
        ("smollm2-135m", 1, (0, 1)),  # one GPU: the engines share it
        ("smollm2-135m", 2, (1, 1)),
        ("smollm2-135m", 8, (4, 1)),  # 0.27 GB of bf16 weights: one GPU per engine, 4 engines
        # Llama 3.3 70B: 141 GB of bf16 weights -> tp 4 puts 33 GiB on each engine GPU (<= 40)
        ("llama3.3-70b", 8, (4, 4)),
        ("qwen3-8b", 8, (4, 1)),  # 16 GB: one GPU each
    ],
)
def test_auto_layout(model, gpus, expected):
    spec = _spec(model, gpus)
    assert (spec.engine_gpus, spec.engine_tp) == expected
    validate_spec(spec)
    answers = build_answers(spec)
    assert answers["trainer_gpus"] == gpus - expected[0] == trainer_gpus(spec)
    assert answers["num_engines"] == max(1, expected[0] // expected[1])


def test_70b_script_config_and_launch_line(tmp_path):
    """The split layout at 8 GPUs (`--tricks none`: the plain script, not the default recipe,
    which is colocated at 70B): 4 trainer processes, one vLLM engine of 4 GPUs."""
    out = tmp_path / "g70"
    result = CliRunner().invoke(
        cli,
        [
            "new",
            "--algo",
            "grpo",
            "--model",
            "llama3.3-70b",
            "--gpus",
            "8",
            "--tricks",
            "none",
            "--out",
            str(out),
        ],  # fmt: skip
    )
    assert result.exit_code == 0, result.output
    assert "torchrun --nproc-per-node 4)" in result.output
    text = (out / "train.py").read_text()
    assert 'engine: str = "vllm"' in text
    assert "num_engines: int = 1 " in text
    assert "engine_tensor_parallel_size: int = 4 " in text
    assert "engine_gpu_memory_utilization: float = 0.85 " in text
    assert "--engine-gpus 4 --engine-tp 4" in text  # the command in the header reproduces it
    assert (
        "GPU layout (8 GPUs): the trainer's 4 process(es) on GPUs 0..3,\n1 engine(s) of 4 GPU(s) on GPUs 4..7 ("
        in text
    )
    # the explicit split is kept: 6 trainer GPUs, two engines of one GPU each
    spec = _spec("smollm2-135m", 8, engine_gpus=2, engine_tp=1)
    assert build_answers(spec)["num_engines"] == 2
    assert "engine_gpu_memory_utilization: float = 0.85 " in render(spec)
    # sharing the trainer's GPU leaves most of it to the trainer
    assert "engine_gpu_memory_utilization: float = 0.3 " in render(_spec("smollm2-135m", 1))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (Spec(algo="grpo", gpus=8, engine_gpus=8), ["--engine-gpus 8 with --gpus 8", "choose 0..7"]),
        (Spec(algo="grpo", gpus=2, engine_gpus=-1), ["--engine-gpus -1", "choose 0..1"]),
        (Spec(algo="grpo", gpus=2, engine_tp=2), ["--engine-tp 2 with --engine-gpus 0", "their own"]),
        # SmolLM2: 9 heads, 3 KV heads; tp must divide the engine GPUs and the heads
        (Spec(algo="grpo", gpus=8, engine_gpus=4, engine_tp=2), ["--engine-tp 2 with --engine-gpus 4", "9 attention heads", "[1]"]),
        (Spec(algo="grpo", model="llama3.3-70b", gpus=8, engine_gpus=4, engine_tp=3), ["choose one of [1, 2, 4]"]),
        (Spec(algo="grpo", gpus=4, engine_gpus=2, engine_tp=0), ["--engine-tp 0: must be >= 1"]),
        (Spec(algo="sft", gpus=2, engine_gpus=1), ["rollout engines exist only for --algo grpo"]),
    ],
)  # fmt: skip
def test_refused_layouts(spec, expected):
    with pytest.raises(SpecError) as e:
        validate_spec(spec)
    for part in expected:
        assert part in str(e.value), (part, str(e.value))


def test_cli_refuses_a_bad_layout_in_one_line(tmp_path):
    result = CliRunner().invoke(
        cli, ["new", "--algo", "grpo", "--gpus", "2", "--engine-gpus", "2", "--out", str(tmp_path)]
    )
    assert result.exit_code == 1
    assert result.output.startswith("Error: --engine-gpus 2 with --gpus 2")
    assert "Traceback" not in result.output
    assert not (tmp_path / "train.py").exists()


def test_grpo_lora_gets_the_same_layout():
    spec = _spec("llama3.3-70b", 8, algo="grpo-lora")
    assert (spec.engine_gpus, spec.engine_tp) == (4, 4)
    assert "engine_tensor_parallel_size: int = 4 " in render(spec)


def test_commands_spell_out_the_engine_layout_and_warn_on_big_engine_shards(tmp_path):
    """`--engine-gpus 0` at 8 GPUs is not the CLI default (4): the header's command and the
    printed plan line must keep it; an engine GPU holding > 40 GiB of weights is pointed out."""
    out = tmp_path / "e0"
    result = CliRunner().invoke(
        cli, ["new", "--algo", "grpo", "--model", "llama3.3-70b", "--gpus", "8",
              "--engine-gpus", "0", "--tricks", "none", "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "--gpus 8 --engine-gpus 0 --engine-tp 1" in (out / "train.py").read_text()
    assert (
        "scaffold plan --algo grpo --model llama3.3-70b --gpus 8 --engine-gpus 0" in result.output
    )
    assert "note: the GPU the engines share with the trainer holds 131.4 GiB" in result.output
    six = _spec("llama3.3-70b", 8, engine_gpus=6)  # tp must divide 6 and 64 heads: at most 2
    assert six.engine_tp == 2
    assert "6 engine GPU(s) per node holds 65.7 GiB" in engine_weight_note(six)
    assert engine_weight_note(_spec("llama3.3-70b", 8)) == ""  # the default: 32.9 GiB
    assert "--engine-gpus" not in _spec("smollm2-135m", 1).command()  # 1 GPU: nothing to spell
    assert "--engine" not in Spec(gpus=8).command()  # SFT has no engines


def test_regen_chooses_the_engine_layout_again(tmp_path):
    from generator.regen import parse_settings

    spec = _spec("llama3.3-70b", 8)  # 4 engine GPUs, tp 4
    assert (parse_settings(["engine_gpus=2"], spec).engine_tp) == 2  # tp 4 no longer divides
    smaller = parse_settings(["gpus=4"], spec)
    assert (smaller.engine_gpus, smaller.engine_tp) == (2, 2)
    assert parse_settings(["engine_tp=2"], spec).engine_gpus == 4  # kept
    sft = parse_settings(["algo=sft"], spec)
    assert (sft.engine_gpus, sft.engine_tp) == (0, 1)


def _colocated(model="smollm2-135m", gpus=1, engine_tp=None, algo="grpo"):
    return spec_from_options(
        algo, "lora", model, "", gpus, 1, 1, 1, 1, 1, "bf16", None, "o", None, engine_tp,
        layout="colocated",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("model", "gpus", "algo", "expected"),
    [
        ("smollm2-135m", 1, "grpo", (1, 1)),
        ("smollm2-135m", 8, "grpo", (1, 8)),  # one engine on each trainer GPU
        ("llama3.3-70b", 8, "grpo", (4, 2)),  # 131 GiB of bf16 weights: tp 4, two engines
        ("llama3.3-70b", 8, "grpo-lora", (4, 2)),
    ],
)
def test_colocated_layout_puts_engines_on_every_trainer_gpu(model, gpus, algo, expected):
    spec = _colocated(model, gpus, algo=algo)
    validate_spec(spec)
    answers = build_answers(spec)
    assert (spec.engine_gpus, trainer_gpus(spec)) == (0, gpus)
    assert (spec.engine_tp, answers["num_engines"]) == expected
    text = render(spec)
    assert 'layout: str = "colocated"' in text and 'rollout: str = "sync"' in text
    assert "restore_optimizer_state(offloaded)" in text and "pipeline.memory_stats()" in text
    assert "--layout colocated" in spec.command()
    if gpus > 1:
        assert f"torchrun --nproc-per-node {gpus} train.py --offload_optimizer true" in text
        assert "--ray_address auto" not in text


def test_split_script_has_no_colocated_lines():
    text = render(_spec("smollm2-135m", 8))
    assert "layout: str" not in text and "engine_sleep_level" not in text
    assert "offload_optimizer" not in text and "memory_stats" not in text
    assert "--layout" not in _spec("smollm2-135m", 8).command()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (Spec(algo="grpo", layout="shared"), ["--layout shared: choose one of split, colocated"]),
        (Spec(algo="grpo", gpus=8, engine_gpus=4, layout="colocated"), ["--engine-gpus 4", "take none of their own"]),
        (Spec(algo="grpo", gpus=8, nodes=2, layout="colocated"), ["--nodes 2: not done yet"]),
        (Spec(algo="grpo", gpus=8, engine_tp=2, layout="colocated"), ["--engine-tp 2 with --layout colocated --gpus 8", "[1]"]),
        (Spec(algo="sft", layout="colocated"), ["--layout colocated: rollout engines exist only for --algo grpo"]),
    ],
)  # fmt: skip
def test_refused_colocated_layouts(spec, expected):
    with pytest.raises(SpecError) as e:
        validate_spec(spec)
    for part in expected:
        assert part in str(e.value), (part, str(e.value))


def test_cli_and_regen_take_the_layout(tmp_path):
    from generator.regen import parse_settings

    out = tmp_path / "c"
    result = CliRunner().invoke(
        cli, ["new", "--algo", "grpo", "--gpus", "2", "--layout", "colocated", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "torchrun --nproc-per-node 2)" in result.output  # both GPUs train
    assert "--layout colocated" in result.output  # the printed `scaffold plan` command keeps it
    spec = _spec("smollm2-135m", 2)  # split: 1 trainer GPU, 1 engine GPU
    moved = parse_settings(["layout=colocated"], spec)
    assert (moved.layout, moved.engine_gpus, moved.engine_tp) == ("colocated", 0, 1)
    back = parse_settings(["layout=split"], moved)
    assert (back.layout, back.engine_gpus) == ("split", 1)
    assert parse_settings(["algo=sft"], moved).layout == "split"
