"""Fixtures for running emitted scripts: a tiny random Llama with a 512-token cut of SmolLM2's
tokenizer (and one with the real 49,152-token tokenizer, for the tests about it), the real
SmolLM2-135M, a slice of the real alpaca data; for the GRPO scripts a tiny model that can learn a
simple reward, a slice of chain_sum and a local Ray. Helpers (no fixtures) are in helpers.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from generator.assets import ensure_chain_sum, ensure_dataset, ensure_smollm2
from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint
from tests.helpers import (
    EXAMPLES,
    SMALL_VOCAB,
    TINY_CONFIG,
    first_short_pairs,
    import_script,
    small_tokenizer_files,
)

# Under pytest-xdist (`make test TEST_WORKERS=2`) each worker gets its share of the cores, and the
# scripts it starts inherit it through OMP_NUM_THREADS: two workers at 2 intra-op threads each on 2
# cores would spin against each other. In-process and subprocess runs of one test see the same count.
if "PYTEST_XDIST_WORKER" in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


# Seconds each of the heaviest modules took in the 2-worker run of 4e38369 (tests/README.md):
# they are collected first, heaviest first, and within each its `slow` tests first
HEAVY_MODULES = {
    "tests/recipes/test_precision.py": 800,  # learning tier; its other tests are short
    "tests/generator/test_plan_speed.py": 320,  # 3395004: 239 + 127 + 53 s; matrices trimmed
    "tests/recipes/test_compose.py": 185,
    "tests/generator/test_plan.py": 134,
    "tests/recipes/test_resume.py": 200,  # + the interrupt and records tests (issue 47)
    "tests/recipes/test_grpo.py": 160,  # + the real-model format-share run
    "tests/recipes/test_grpo_colocated.py": 96,
    "tests/recipes/test_sft.py": 81,
    "tests/distributed/test_grpo_ranks.py": 64,
    "tests/runtime/test_rollout.py": 58,
    "tests/recipes/test_grpo_lora.py": 53,
    "tests/distributed/test_parallel_examples.py": 48,
    "tests/recipes/test_tricks.py": 47,
    "tests/generator/test_recipe.py": 36,
    # added 2026-12-05 (their seconds in the contended runs of that day, not yet a quiet CI's)
    "tests/distributed/test_expert_parallel.py": 250,  # + ppo (EP 2, EP 2 x FSDP 2), plans-rest
    "tests/recipes/test_ppo.py": 140,  # + the real-model losses on one batch
    "tests/distributed/test_dpo_parallel.py": 95,
    "tests/recipes/test_rm.py": 90,  # the held-out test (571 s) is in the learning tier
    "tests/distributed/test_ppo_ranks.py": 80,
    "tests/distributed/test_reshard_algorithms.py": 300,  # 9 cases since plans-rest
    "tests/recipes/test_grpo_iterations.py": 45,
    "tests/distributed/test_lora_kd_plans.py": 35,
    "tests/recipes/test_rl_real_task.py": 1760,  # 5 GRPO loss types + PPO on SmolLM2-135M, 206-387 s each at 1 thread (3395004)
    "tests/distributed/test_fsdp_rm.py": 45,  # + HSDP and TP (plans-rest)
    # added 2026-12-05, issue 21 (contended runs: 12 torchrun + Ray runs)
    "tests/distributed/test_grpo_parallel.py": 520,
}


# Single tests that take most of their module's time, started before whole modules: the learning
# tier is a dozen such runs, and the longest one started last would run on alone at the end.
HEAVY_TESTS = {
    "tests/recipes/test_rm.py::test_real_smollm2_held_out_accuracy_rises_above_chance": 571,
}


def pytest_collection_modifyitems(config, items):
    """Runs the longest work first: the tests of HEAVY_TESTS, then the modules of HEAVY_MODULES
    heaviest first, then the rest in their usual order; in each module its `slow` tests first, the
    rest in file order.

    pytest-xdist hands out tests in collection order, so the minutes-long tests (the real-model
    precision curves) start at once and the many short ones fill the workers' time after them;
    collected in file order they could start late and run on alone at the end. A module's tests
    stay together, so a worker sets up its module fixtures once per run of them."""
    root = Path(str(config.rootpath))
    modules = [Path(str(item.path)).relative_to(root).as_posix() for item in items]
    first: dict[str, int] = {}  # each module's first position
    for i, module in enumerate(modules):
        first.setdefault(module, i)
    order = sorted(
        range(len(items)),
        key=lambda i: (
            -HEAVY_TESTS.get(f"{modules[i]}::{items[i].originalname}", 0),
            -HEAVY_MODULES.get(modules[i], 0),
            first[modules[i]],
            items[i].get_closest_marker("slow") is None,
        ),
    )  # sorted() is stable: file order within a module's slow and other tests
    items[:] = [items[i] for i in order]


@pytest.fixture
def learning(request):
    """`learning(figure, steps, first, last, bound)`: one row of `make test-learning`'s table for
    this test (a test may add several): what was measured (`figure`), over how many optimizer
    steps, its value at the start and the end of the run (means over the windows the test's own
    assertion compares; `first` None for a figure of the whole run, such as a gap between two
    curves) and the bound the test asserts, as text. Call it before asserting, so a
    failing run shows its row too. Rows travel in the test report's `user_properties`, so a
    pytest-xdist worker's rows reach the table printed by the controller."""

    def record(figure: str, steps: int, first: float | None, last: float, bound: str) -> None:
        row = dict(figure=figure, steps=steps, first=first, last=last, bound=bound)
        request.node.user_properties.append(("learning", row))

    return record


def pytest_terminal_summary(terminalreporter):
    """Prints the learning tier's table (test, steps, first -> last, bound, seconds, outcome) after
    a run that recorded rows through the `learning` fixture."""
    rows = []
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", None) != "call":
                continue
            for key, row in report.user_properties:
                if key == "learning":
                    rows.append((report.nodeid.split("::", 1)[-1], row, report.duration, outcome))
    if not rows:
        return
    terminalreporter.write_sep("=", "learning tier: the real-model runs")
    terminalreporter.write_line(
        "| test | steps | figure: first -> last | bound | seconds | result |"
    )
    terminalreporter.write_line("|---|---|---|---|---|---|")
    for test, row, seconds, outcome in sorted(rows, key=lambda r: r[0]):
        first = "" if row["first"] is None else f"{row['first']:.4g} -> "
        terminalreporter.write_line(
            f"| {test} | {row['steps']} | {row['figure']}: {first}{row['last']:.4g}"
            f" | {row['bound']} | {seconds:.1f} | {outcome} |"
        )


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return ensure_smollm2()


@pytest.fixture(scope="session")
def alpaca_path() -> Path:
    return ensure_dataset("alpaca_en_demo.json")


def _tiny_tokenized_llama(vocab_size: int = SMALL_VOCAB):
    """The tiny random Llama of the parity tests (seed 0), sized for a tokenizer of `vocab_size`."""
    args = ModelArgs(
        **{**TINY_CONFIG, "vocab_size": vocab_size},
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory, smollm2_dir) -> Path:
    """SmolLM2's tokenizer cut to 512 ids, ChatML without a default system message (helpers)."""
    out = tmp_path_factory.mktemp("small_tokenizer")
    small_tokenizer_files(smollm2_dir, out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, small_tokenizer_dir) -> Path:
    """2-layer, hidden-64 Llama (random, seed 0) with the 512-token cut of SmolLM2's tokenizer:
    scripts run on it in a fraction of the time the 49,152-row output layer took."""
    out = tmp_path_factory.mktemp("tiny_llama")
    model = _tiny_tokenized_llama()
    save_hf_checkpoint(model, out, model.args.to_hf_config())
    copy_tokenizer_files(small_tokenizer_dir, out)
    return out


@pytest.fixture(scope="session")
def tiny_real_vocab_dir(tmp_path_factory, smollm2_dir) -> Path:
    """The same tiny Llama with SmolLM2's real tokenizer (vocab 49,152): for the tests about that
    tokenizer, or whose other model (a SmolLM2 teacher) must share it."""
    out = tmp_path_factory.mktemp("tiny_llama_real_vocab")
    model = _tiny_tokenized_llama(49152)
    save_hf_checkpoint(model, out, model.args.to_hf_config())
    copy_tokenizer_files(smollm2_dir, out)
    return out


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory, alpaca_path) -> Path:
    """The first 40 real alpaca rows (short runs still see real text)."""
    rows = json.loads(alpaca_path.read_text())[:40]
    path = tmp_path_factory.mktemp("data") / "alpaca40.json"
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="session")
def sft_script():
    return import_script(EXAMPLES / "sft_smollm2" / "train.py", "sft_smollm2_train")


@pytest.fixture(scope="module")
def process_group():
    """A 1-process gloo group in this process (torn down only if this fixture created it)."""
    import torch.distributed as dist

    from runtime.parallel import init_distributed

    created = not dist.is_initialized()
    init_distributed("cpu")
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """Tests that build the emitted script's model in-process create a 1-process group; destroy a
    group the test itself created, so the next test can create its own (module-scoped fixtures
    that own a group are left alone)."""
    import torch.distributed as dist

    existed = dist.is_initialized()
    yield
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray with 2 CPUs per test module (GRPO rollout tests), shut down after it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def even_model_dir(tmp_path_factory, small_tokenizer_dir) -> Path:
    """A tiny random Llama (the small tokenizer) whose embedding's first coordinate is +0.1 for even
    and -0.1 for odd token ids: "emit even ids" is then one direction of the hidden state, which
    a few GRPO steps can learn (starting near 50%)."""
    out = tmp_path_factory.mktemp("even_llama")
    model = _tiny_tokenized_llama()
    args = model.args
    with torch.no_grad():
        even = torch.arange(args.vocab_size) % 2 == 0
        model.model.embed_tokens.weight[:, 0] = torch.where(even, 0.1, -0.1)
    save_hf_checkpoint(model, out, args.to_hf_config())
    copy_tokenizer_files(small_tokenizer_dir, out)
    return out


@pytest.fixture(scope="session")
def short_pairs(tmp_path_factory, tiny_model_dir) -> Path:
    """For the tiny model: 4 real dpo_en_demo pairs within 192 tokens of its 512-token tokenizer
    (about 2x the real tokenizer's counts)."""
    return first_short_pairs(tmp_path_factory.mktemp("pairs"), tiny_model_dir, 192)


@pytest.fixture(scope="session")
def chain_sum_64(tmp_path_factory) -> Path:
    """The first 64 rows of the real chain_sum.jsonl (GRPO prompts)."""
    rows = ensure_chain_sum().read_text().splitlines()[:64]
    path = tmp_path_factory.mktemp("data") / "chain_sum64.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="session")
def run_once(tmp_path_factory):
    """`run_once(name, compute)`: `compute()`'s JSON value, computed once per test run even when
    pytest-xdist spreads the tests over workers: the first worker to ask computes it under a file
    lock in the run's shared temporary directory and the others read it. (Without xdist the value
    is kept in this process only: the parent of a lone run's basetemp holds every past run.)"""
    from filelock import FileLock

    values: dict = {}

    def once(name: str, compute):
        if name in values:
            return values[name]
        if "PYTEST_XDIST_WORKER" not in os.environ:
            values[name] = compute()
            return values[name]
        path = tmp_path_factory.getbasetemp().parent / f"run_once_{name}.json"
        with FileLock(f"{path}.lock"):
            if not path.is_file():
                path.write_text(json.dumps(compute()))
            values[name] = json.loads(path.read_text())
        return values[name]

    return once
