"""Generator: every spec in the matrix renders to formatted, ruff-clean Python; examples/ match a
fresh render byte for byte; bad specs give one-line errors naming the option and valid choices."""

from __future__ import annotations

import ast
import functools
import itertools
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from generator.catalog import MODELS
from generator.cli import cli
from generator.features import TRICKS, refusal
from generator.render import FIRST_PARTY, render, ruff_bin
from generator.spec import Spec, SpecError

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

REPO = Path(__file__).resolve().parents[2]
RL_ALGOS = ("grpo", "grpo-lora", "ppo")


def _allowed(combo) -> bool:
    return not any(other in combo for t in combo for other in TRICKS[t].conflicts)


_ALLOWED = [
    c
    for n in range(len(TRICKS) + 1)
    for c in itertools.combinations(sorted(TRICKS), n)
    if _allowed(c)
]
# every trick alone, every allowed pair, and every maximal allowed stack (all 2^n subsets would be
# hundreds of renders; slots interact pairwise, and the maximal stacks hold every slot at once)
TRICK_SETS = [c for c in _ALLOWED if len(c) <= 2] + [
    c for c in _ALLOWED if len(c) > 2 and not any(set(c) < set(d) for d in _ALLOWED)
]
# every allowed trick set on the default model; model, dtype and GPU count varied around it
MATRIX = [Spec(tricks=t, out="runs/x") for t in TRICK_SETS] + [
    Spec(model=m, tricks=t, dtype=d, gpus=g, out="runs/x")
    for m, t, d, g in itertools.product(
        ["llama3.3-70b", "qwen3-30b-a3b"],
        [(), ("ac", "lce", "optim-in-bwd")],
        ["bf16", "fp32"],
        [8],
    )
]
# the adapter algorithms: each with no trick, every trick, and DoRA; on a Qwen3 model at 8 GPUs
MATRIX += [
    Spec(algo=algo, peft=peft, tricks=t, out="runs/x")
    for algo, peft, t in itertools.product(
        ["lora", "qlora"], ["lora", "dora"], [(), ("ac", "lce", "optim-in-bwd", "adamw8bit")]
    )
] + [Spec(algo="qlora", peft="dora", model="qwen3-30b-a3b", gpus=8, out="runs/x")]
# DPO (all parameters, LoRA, DoRA) and distillation: no trick and every trick they take
MATRIX += [
    Spec(algo=algo, peft=peft, tricks=t, out="runs/x")
    for algo, peft, t in [
        ("dpo", "lora", ()),
        ("dpo", "lora", ("ac", "adamw8bit")),
        ("dpo-lora", "lora", ()),
        ("dpo-lora", "dora", ("ac", "adamw8bit")),
        ("kd", "lora", ()),
        ("kd", "lora", ("ac", "optim-in-bwd", "adamw8bit")),
    ]
] + [
    Spec(algo="dpo-lora", model="qwen3-30b-a3b", gpus=8, out="runs/x"),
    Spec(algo="kd", model="llama3.3-70b", dtype="fp32", gpus=8, out="runs/x"),
]
# GRPO (all parameters, LoRA, DoRA): no trick, the one it takes, and the 70B multi-GPU render
# (vLLM engines)
MATRIX += [
    Spec(algo=algo, peft=peft, tricks=t, dataset="chain_sum.jsonl", out="runs/x")
    for algo, peft, t in [
        ("grpo", "lora", ()),
        ("grpo", "lora", ("ac",)),
        ("grpo-lora", "lora", ()),
        ("grpo-lora", "dora", ("ac",)),
    ]
] + [
    Spec(algo=algo, model="llama3.3-70b", gpus=8, dataset="chain_sum.jsonl", out="runs/x")
    for algo in RL_ALGOS
]
# every trick on the algorithms it reached with the shared partials: each alone, and the two
# maximal stacks (one per low-bit optimizer; offload is refused with ac)
LOW_BITS = ("adamw8bit", "adamw4bit")
_STACKS = [("packing", "ac", "compile", "lce", "optim-in-bwd", low) for low in LOW_BITS]
MATRIX += [
    Spec(algo=algo, tricks=t, out="runs/x")
    for algo in ("kd", "dpo", "dpo-lora", "grpo", "grpo-lora")
    for t in [*((name,) for name in TRICKS if refusal(name, algo) is None), *_STACKS]
]
# PPO (the GRPO skeleton with a value head): every trick it takes alone, and its maximal stacks
# (packing and lce are refused)
MATRIX += [
    Spec(algo="ppo", tricks=t, out="runs/x")
    for t in [
        *((name,) for name in TRICKS if refusal(name, "ppo") is None),
        *(("ac", "compile", "optim-in-bwd", low) for low in LOW_BITS),
    ]
]
# the precision recipes on the SFT skeleton, each with the memory stack they compose with
MATRIX += [
    Spec(algo=algo, tricks=t, gpus=g, out="runs/x")
    for algo in ("sft", "kd")
    for t in [("bf16-sr", "cpu-offload", "ac", "lce", "optim-in-bwd", low) for low in LOW_BITS]
    for g in (1, 8)
]


def _spec_id(s: Spec) -> str:
    return f"{s.algo}-{s.peft}-{s.model}-{'+'.join(s.tricks) or 'none'}-{s.dtype}-g{s.gpus}"


@functools.cache
def _rendered(spec: Spec) -> str:
    return render(spec)


@pytest.fixture(scope="module")
def matrix_lint(tmp_path_factory) -> dict[str, list[str]]:
    """Every matrix spec rendered into its own file, then one `ruff check` (E, F, W, I, B) and one
    `ruff format --check` over all of them (two processes, not two per spec): {spec id: the
    problems ruff reports in its file}."""
    root = tmp_path_factory.mktemp("matrix")
    paths = {}
    for spec in MATRIX:
        path = root / f"{len(paths):03d}.py"
        path.write_text(_rendered(spec))
        paths[path.name] = _spec_id(spec)
    problems: dict[str, list[str]] = {i: [] for i in paths.values()}
    check = [
        ruff_bin(),
        "check",
        "--isolated",
        *FIRST_PARTY,
        "--line-length",
        "100",
        "--select",
        "E,F,W,I,B",
        "--ignore",
        "E501",
        "--output-format",
        "concise",
        ".",
    ]
    fmt = [ruff_bin(), "format", "--isolated", "--line-length", "100", "--check", "."]
    for cmd in (check, fmt):
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        for line in (proc.stdout + proc.stderr).splitlines():
            hit = [name for name in paths if name in line]
            if hit:
                problems[paths[hit[0]]].append(line)
        # every non-zero exit must come with a line naming a file (else ruff itself failed)
        assert proc.returncode == 0 or any(problems.values()), proc.stdout + proc.stderr
    return problems


@pytest.mark.parametrize("spec", MATRIX, ids=_spec_id)
def test_matrix_renders_clean(spec, matrix_lint):
    text = _rendered(spec)
    assert render(spec) == text  # deterministic
    ast.parse(text)
    for marker in ("{{", "{%", "{#"):
        assert marker not in text
    assert spec.command() in text  # the header names the exact command
    assert matrix_lint[_spec_id(spec)] == []  # ruff check and ruff format --check are clean
    banners = [line for line in text.splitlines() if line.startswith("# === ")]
    assert banners == [
        "# === 1. Imports ===",
        "# === 2. Config ===",
        "# === 3. Distributed + mesh ===",
        "# === 4. Model ===",
        "# === 5. Loss ===",
        "# === 6. Optimizer + LR schedule ===",
        "# === 7. Data ===",
        *(  # numbered without a gap: only the RL skeleton has a Rollout section
            ["# === 8. Rollout ===", "# === 9. train_step ===", "# === 10. main ==="]
            if spec.algo in RL_ALGOS
            else ["# === 8. train_step ===", "# === 9. main ==="]
        ),
    ]


def test_unused_trick_leaves_no_trace():
    plain = render(Spec(out="o"))
    assert (
        "        checkpoint(layer)" not in plain and "enable_activation_checkpointing" not in plain
    )
    with_ac = render(Spec(out="o", tricks=("ac",)))
    assert "from torch.distributed._composable import checkpoint" in with_ac
    assert "enable_activation_checkpointing: bool = True" in with_ac


def test_examples_match_fresh_render():
    result = CliRunner().invoke(cli, ["regen", "--check", str(REPO / "examples")])
    assert result.exit_code == 0, result.output
    assert "match their templates" in result.output


def test_regen_check_detects_drift(tmp_path):
    runner = CliRunner()
    out = tmp_path / "run"
    assert runner.invoke(cli, ["new", "--out", str(out)]).exit_code == 0
    assert runner.invoke(cli, ["regen", "--check", str(tmp_path)]).exit_code == 0
    (out / "train.py").write_text((out / "train.py").read_text() + "# edit\n")
    result = runner.invoke(cli, ["regen", "--check", str(tmp_path)])
    # a hand edit over a current base: --check fails, but says regen has nothing to merge (as
    # `scaffold regen` itself says "up to date"), not that regen would update it
    assert result.exit_code != 0 and f"edited: {out / 'train.py'}" in result.output
    assert "drift:" not in result.output and "nothing to merge" in result.output
    assert "up to date" in runner.invoke(cli, ["regen", str(out)]).output
    # a base that is not the fresh render (what a template change leaves): drift, regen merges
    base = out / ".scaffold" / "train.py.base"
    base.write_text(base.read_text().replace("import torch\n", "import torch  # old\n", 1))
    result = runner.invoke(cli, ["regen", "--check", str(tmp_path)])
    assert result.exit_code != 0 and f"drift: {base}" in result.output
    assert "update each directory with `scaffold regen DIR`" in result.output


def test_new_writes_spec_and_base_and_refuses_overwrite(tmp_path):
    runner = CliRunner()
    out = tmp_path / "run"
    result = runner.invoke(
        cli, ["new", "--algo", "sft", "--model", "smollm2-135m", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    text = (out / "train.py").read_text()
    assert (out / ".scaffold" / "train.py.base").read_text() == text
    assert Spec.from_json((out / ".scaffold" / "spec.json").read_text()) == Spec(out=str(out))
    again = runner.invoke(cli, ["new", "--out", str(out)])
    assert again.exit_code == 1 and "exists" in again.output and "--force" in again.output
    assert runner.invoke(cli, ["new", "--out", str(out), "--force"]).exit_code == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt5"], "unknown model 'gpt5'; valid: smollm2-135m"),
        (["--algo", "reinforce"], "unknown algorithm 'reinforce'; valid: sft"),
        (
            ["--tricks", "warp"],
            "unknown trick(s) ['warp']; valid: packing, ac, offload, compile, lce",
        ),
        (["--tricks", "ac,ac"], "lists a trick twice"),
        (["--dtype", "fp16"], "--dtype 'fp16'; valid: bf16, fp32"),
        (["--gpus", "0"], "--gpus 0 and --nodes 1 must both be >= 1"),
        (["--peft", "dora"], "--peft dora needs an adapter algorithm (--algo lora or qlora or"),
        (
            ["--algo", "qlora", "--model", "qwen3-0.6b", "--gpus", "2", "--tp", "2"],
            "--algo qlora with --tp 2: torchao 0.18's NF4Tensor splits only along dim 0",
        ),
        (
            [
                "--algo",
                "kd",
                "--model",
                "qwen3-0.6b",
                "--tp",
                "2",
                "--gpus",
                "2",
                "--tricks",
                "lce",
            ],
            "--tricks lce with --tp 2: not built yet for kd",
        ),
        (["--algo", "qlora", "--peft", "vera"], "--peft 'vera'; valid: lora, dora"),
        (
            ["--ep", "2", "--gpus", "2"],
            "--ep 2 shards experts, but --model smollm2-135m (llama) has none; use --ep 1, or a "
            "mixture-of-experts model (qwen3_moe family: qwen3-30b-a3b, qwen3-235b-a22b",
        ),
        (
            ["--model", "qwen3-30b-a3b", "--ep", "3", "--gpus", "3"],
            "--ep 3 does not divide num_experts=128 of qwen3-30b-a3b; valid --ep: 1, 2, 4, 8,",
        ),
        (
            ["--model", "qwen3-30b-a3b", "--ep", "4", "--gpus", "6"],
            "--ep 4 must divide the number of ranks, --gpus 6 x --nodes 1 = 6: the experts are "
            "sharded over groups of ep ranks and replicated over world / ep, the other parameters "
            "FSDP-sharded over all; choose --ep among [1, 2, 3, 6]",
        ),
        (
            ["--model", "qwen3-30b-a3b", "--ep", "2", "--gpus", "2", "--tricks", "optim-in-bwd"],
            "--ep 2 and --tricks optim-in-bwd cannot be combined",
        ),
        (["--ep", "0"], "--ep 0 must be >= 1"),
    ],
)
def test_cli_errors_are_one_line(args, message, tmp_path):
    result = CliRunner().invoke(cli, ["new", *args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.count("\n") == 1


def test_local_model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    with pytest.raises(SpecError, match="mistral"):
        render(Spec(model=str(tmp_path), out="o"))


def test_list_and_help():
    runner = CliRunner()
    listed = runner.invoke(cli, ["list"])
    assert listed.exit_code == 0
    for name in MODELS:
        assert name in listed.output
    assert "sft" in listed.output and "ac" in listed.output
    assert "lora" in listed.output and "qlora" in listed.output and "dora" in listed.output
    assert "0.13B" in listed.output  # smollm2-135m: 134.5 M parameters
    support = runner.invoke(cli, ["list", "support"]).output.splitlines()
    header = support[1].split()
    assert header == [
        "sft", "lora", "qlora", "dpo", "dpo-lora", "grpo", "grpo-lora", "ppo", "rm", "kd",
    ]  # fmt: skip
    rows = {
        line.split()[0]: line.split()[1:]
        for line in support[2:]
        if not line.strip().startswith("no:")
    }
    assert rows["optim-in-bwd"] == ["yes"] * 10
    # ppo refuses lce and packing (its value head, GAE per row: not built yet); the reward model
    # has no lm_head (no lce) and no packed scoring yet
    refused = ("lce", "packing")
    for t in refused:
        assert rows[t] == ["yes"] * 7 + ["no", "no", "yes"], t
    # every trick on every algorithm, but the precision recipes: on the full-parameter algorithms
    precision = ("bf16-sr", "cpu-offload")
    assert all(rows[t] == ["yes"] * 10 for t in TRICKS if t not in (*precision, *refused))
    assert rows["bf16-sr"] == ["yes", "no", "no", "yes", "no", "yes", "no", "yes", "yes", "yes"]
    assert rows["cpu-offload"] == ["yes", "no", "no", "yes", "no", "yes", "no", "yes", "yes", "yes"]
    # TP and CP: every skeleton, full parameters and LoRA; TP not for qlora (NF4 splits on dim 0)
    assert rows["--tp"] == ["yes", "yes", "no", "yes", "yes", "yes", "yes", "yes", "yes", "yes"]
    assert rows["--cp"] == ["yes"] * 10
    assert rows["--dp-replicate"] == ["yes"] * 10  # HSDP: every algorithm, rm too
    assert rows["--ep"] == ["yes"] * 10  # EP: every algorithm on a MoE model
    assert any(line.strip().startswith("no: --tp with qlora: torchao") for line in support)
    helped = runner.invoke(cli, ["new", "--help"])
    assert helped.exit_code == 0 and "--model" in helped.output and "--tricks" in helped.output


def test_spec_json_round_trips_peft_and_reads_old_files():
    spec = Spec(algo="qlora", peft="dora", out="o")
    assert Spec.from_json(spec.to_json()) == spec
    assert "--algo qlora" in spec.command() and "--peft dora" in spec.command()
    assert "--peft" not in Spec(algo="lora", out="o").command()
    old = '{"generator_version": "0.1.0", "spec": {"algo": "sft", "model": "smollm2-135m", "out": "o"}}'
    assert Spec.from_json(old) == Spec(out="o")  # written before --peft existed


def test_adapter_algorithms_render_their_template():
    lora = render(Spec(algo="lora", out="o"))
    assert lora.startswith('"""LoRA supervised fine-tuning of smollm2-135m')
    assert "lr: float = 0.0002" in lora and "use_dora: bool = False" in lora
    assert "quantize_base" not in lora and "ignored_params" not in lora
    qdora = render(Spec(algo="qlora", peft="dora", out="o"))
    assert qdora.startswith('"""QLoRA (DoRA adapters) supervised fine-tuning')
    assert "quantize_base=True" in qdora and "use_dora: bool = True" in qdora
    assert "ignored_params" in qdora and "QLoRA (Dettmers et al. 2023" in qdora
    with_lce = render(Spec(algo="lora", tricks=("lce",), out="o"))
    assert "which the lce loss bypasses" in with_lce and "lce loss bypasses" not in lora


def test_preference_and_distillation_algorithms_render_their_parts():
    dpo = render(Spec(algo="dpo", dataset="dpo_en_demo.json", out="o"))
    assert dpo.startswith('"""DPO (Direct Preference Optimization) of smollm2-135m')
    assert 'ref_mode: str = "separate"' in dpo and 'REF_MODES = ("separate", "precomputed")' in dpo
    assert "adapters_disabled" not in dpo and "--algo dpo-lora" in dpo  # the refusal names the fix
    lora = render(Spec(algo="dpo-lora", dataset="dpo_en_demo.json", out="o"))
    assert lora.startswith('"""LoRA DPO (Direct Preference Optimization)')
    assert (
        'ref_mode: str = "adapters-off"' in lora
        and "with adapters_disabled(model, check_frozen_base=during_training):" in lora
    )
    assert "add_lora(" in lora and "save_adapter(" in lora
    kd = render(Spec(algo="kd", out="o"))
    assert kd.startswith('"""Knowledge distillation into smollm2-135m')
    assert "def load_teacher(" in kd and "kd_kl_sum(" in kd and "check_same_tokenizer(" in kd
    kd_lce = render(Spec(algo="kd", tricks=("lce",), out="o"))
    assert "chunked_kd_loss(" in kd_lce and "kd_kl_sum(" not in kd_lce
    assert render(Spec(out="o")).count("load_teacher") == 0


def test_grpo_renders_its_skeleton_and_engine_choice():
    grpo = render(Spec(algo="grpo", dataset="chain_sum.jsonl", out="o"))
    assert grpo.startswith('"""GRPO (Group Relative Policy Optimization) of smollm2-135m')
    assert 'engine: str = "runtime"' in grpo and 'dataset: str = "chain_sum.jsonl"' in grpo
    assert (
        "def grpo_loss(" in grpo and "REWARD_FUNCS = [" in grpo and "checkpoint(layer)" not in grpo
    )
    big = render(
        Spec(algo="grpo", model="llama3.3-70b", gpus=8, dataset="chain_sum.jsonl", out="o")
    )
    assert 'engine: str = "vllm"' in big and "torchrun --nproc-per-node 8" in big
    with_ac = render(Spec(algo="grpo", tricks=("ac",), dataset="chain_sum.jsonl", out="o"))
    assert "checkpoint(layer)" in with_ac
    # TP over the trainer's ranks (the GPUs the engines leave): loss-parallel log-probs
    tp = render(Spec(algo="grpo", model="qwen3-0.6b", gpus=4, engine_gpus=0, tp=2, out="o"))
    assert "target_logprobs(logits, targets)" in tp and "tp: int = 2" in tp
    with pytest.raises(SpecError, match=r"--tp 2 > 1 trainer GPUs \(per node\)"):
        render(Spec(algo="grpo", model="qwen3-0.6b", gpus=4, nodes=2, engine_gpus=3, tp=2, out="o"))


def test_new_picks_the_algorithms_demo_dataset(tmp_path):
    result = CliRunner().invoke(cli, ["new", "--algo", "dpo", "--out", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert 'dataset: str = "dpo_en_demo.json"' in (tmp_path / "d" / "train.py").read_text()


def test_expert_parallel_renders_only_with_ep(tmp_path):
    """--ep 8 on an MoE model adds the ep field, its check, the expert sharding and the
    expert-parallel grad norm; --ep 1 renders none of it."""
    from generator.render import render

    spec = Spec(model="qwen3-30b-a3b", gpus=8, ep=8, out="o")
    text = render(spec)
    for line in (
        "    ep: int = 8  # expert-parallel degree",
        '    ep_mesh, ep_replicas = expert_meshes(mesh["dp_shard"], cfg.ep)',
        '    fsdp_kwargs["ignored_params"] = apply_expert_parallel(model, ep_mesh, ep_replicas)',
        "    all_reduce_expert_grads(model)  # EP x FSDP: each expert's replicas sum their ep groups' parts",
    ):
        assert line in text, line
    assert "--ep 8" in spec.command()
    plain = render(Spec(model="qwen3-30b-a3b", gpus=8, out="o"))
    assert not any(
        x in plain for x in ("apply_expert_parallel", "all_reduce_expert_grads", "ep: int")
    )


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo"])
def test_cpu_offload_gives_cuda_runs_gloo_for_the_cpu_shards(algo):
    """With cpu-offload the shards and gradients are CPU tensors, which NCCL cannot gather or
    reduce: the script asks for gloo beside NCCL (`cuda:nccl,cpu:gloo`); without it, NCCL alone.
    The header says where the frozen reference lives."""
    from runtime.parallel import process_group_backend

    call = "init_distributed(cfg.device, cpu_collectives=True)"
    offloaded, plain = (render(Spec(algo=algo, tricks=t, out="o")) for t in (("cpu-offload",), ()))
    assert call in offloaded and call not in plain
    # the header's memory line: DPO's and GRPO's frozen reference is offloaded with the policy
    reference = "a separate frozen reference 2 (bf16), in host memory too"
    assert (reference in " ".join(offloaded.split())) == (algo != "sft")
    assert process_group_backend("cuda", cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend("cuda") == "nccl"
    assert process_group_backend("cpu", cpu_collectives=True) == "gloo"


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (2, 1), (8, 1), (1, 2)])
def test_multi_gpu_scripts_default_to_real_run_settings(gpus, nodes):
    """A script for several GPUs is a real run: it checkpoints every 50 steps, and GRPO's rows
    get reasoning-task lengths (512 prompt + 1024 completion tokens); one process (the CPU demo,
    a single-GPU trial) writes no checkpoints and keeps the chain_sum demo's 256 + 64."""
    from generator.plan_estimate import config_defaults

    multi = gpus * nodes > 1
    sft = config_defaults(render(Spec(gpus=gpus, nodes=nodes, out="o")))
    grpo = config_defaults(
        render(Spec(algo="grpo", gpus=gpus, nodes=nodes, dataset="chain_sum.jsonl", out="o"))
    )
    assert sft["save_every_steps"] == grpo["save_every_steps"] == (50 if multi else 0)
    lengths = (grpo["max_prompt_len"], grpo["max_new_tokens"])
    assert lengths == ((512, 1024) if multi else (256, 64))


def test_multi_gpu_grpo_keeps_short_rows_where_the_context_is_short(tmp_path):
    """512 + 1024 tokens need a context of 1536: a model with less keeps the demo's 256 + 64."""
    import json

    from generator.plan_estimate import config_defaults

    hf = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=512,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=1e5, tie_word_embeddings=True,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    spec = Spec(algo="grpo", model=str(tmp_path), gpus=2, dataset="chain_sum.jsonl", out="o")
    cfg = config_defaults(render(spec))
    assert (cfg["max_prompt_len"], cfg["max_new_tokens"], cfg["save_every_steps"]) == (256, 64, 50)
