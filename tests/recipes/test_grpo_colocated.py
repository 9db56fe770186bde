"""GRPO's colocated layout (`scaffold new --layout colocated`) end to end on CPU, on a local Ray
(2 CPUs) with the tiny random model: the engines and the trainer share the process's device, the
engines sleep after every batch (their weights freed at level 2) and each weight sync wakes and
reloads them. Sync mode's sampler log-probs equal the trainer's at every step (which after a
level-2 sleep holds only if the sync reached the woken engine: until then it refuses to sample),
the sleep frees and the wake restores the engine's weight bytes (its own accounting, counted
from its parameters' storages), and the losses equal the split layout's sync run bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from generator.render import render
from generator.spec import Spec
from runtime import ModelArgs, build_model, load_hf_checkpoint, read_hf_config
from tests.helpers import import_script, run_grpo

REPO = Path(__file__).resolve().parents[2]
KEYS = (
    "reward",
    "loss",
    "grad_norm",
    "clip_ratio/region_mean",
    "sampling/importance_sampling_ratio/mean",
)


@pytest.fixture(scope="module")
def colocated_script(tmp_path_factory):
    spec = Spec(algo="grpo", layout="colocated", dataset="chain_sum.jsonl", out="o")
    path = tmp_path_factory.mktemp("colocated") / "train.py"
    path.write_text(render(spec))
    return import_script(path, "grpo_colocated_train")


@pytest.fixture(scope="module")
def split_script():
    return import_script(REPO / "examples" / "grpo_smollm2" / "train.py", "grpo_split_train")


def _recording_gaps(script, monkeypatch) -> list[float]:
    """Per micro-batch: max |trainer log-prob - sampler log-prob| over completion tokens."""
    gaps, loss = [], script.grpo_loss

    def recording(logprobs, old_logprobs, sampler_logprobs, advantages, mask, *args, **kwargs):
        gaps.append(((old_logprobs - sampler_logprobs).abs() * mask).max().item())
        return loss(logprobs, old_logprobs, sampler_logprobs, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(script, "grpo_loss", recording)
    return gaps


def _weight_mib(model_dir) -> float:
    """The engine's weights as its storages hold them: fp32, a tied head counted once."""
    model = build_model(ModelArgs.from_hf_config(read_hf_config(model_dir)), device="cpu")
    load_hf_checkpoint(model, model_dir)
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    return sum(storages.values()) / 2**20


def test_colocated_sync_matches_split_and_sleep_frees_the_weights(
    colocated_script, split_script, ray_session, even_model_dir, chain_sum_64, tmp_path, monkeypatch
):
    split = run_grpo(split_script, even_model_dir, chain_sum_64, tmp_path / "split", "--rollout", "sync", "--max_steps", "3")  # fmt: skip
    gaps = _recording_gaps(colocated_script, monkeypatch)
    runs = {
        level: run_grpo(
            colocated_script, even_model_dir, chain_sum_64, tmp_path / f"level{level}", "--max_steps", "3",
            "--engine_sleep_level", str(level), "--offload_optimizer", "true",
        )
        for level in (2, 1)
    }  # fmt: skip
    # sync: every sample from the policy being trained, sampled with the weights the trainer has
    assert len(gaps) == 6 and max(gaps) <= 1e-5, gaps
    for level, history in runs.items():
        for step, metrics in enumerate(history, start=1):
            assert metrics["policy_versions"] == [step - 1] * 8
        assert [[m[k] for k in KEYS] for m in history] == [[m[k] for k in KEYS] for m in split], (
            level
        )
    weights = _weight_mib(even_model_dir)
    # steps 1 and 2 sync (no push after the last step): the batch's sleep, then the sync's wake
    for m in runs[2][:2]:
        assert m["engine_slept_mib"] == pytest.approx(weights, rel=0, abs=1e-9)
        assert m["engine_woke_mib"] == pytest.approx(weights, rel=0, abs=1e-9)
    # a CPU engine's device is host memory: level 1 has nowhere to move the weights to, frees none
    assert all(m["engine_slept_mib"] == 0 == m["engine_woke_mib"] for m in runs[1][:2])
    assert weights == 427_264 / 2**20  # the tiny model: 0.41 MiB of fp32 weights, tied head once


def test_colocated_refuses_overlapping_rollouts(colocated_script):
    cfg = colocated_script.Config(rollout="async")
    with pytest.raises(colocated_script.ConfigError, match="generation cannot overlap training"):
        colocated_script.validate(cfg)
    assert colocated_script.Config().rollout == "sync"  # the colocated script's default
    colocated_script.validate(colocated_script.Config(layout="split", rollout="async"))


@pytest.mark.fast
def test_colocated_cpu_offload_refuses_offload_optimizer(tmp_path):
    """Under cpu-offload the optimizer state lives in host memory already: the colocated script
    refuses --offload_optimizer in one line, and its header does not recommend it."""
    spec = Spec(algo="grpo", gpus=2, layout="colocated", tricks=("cpu-offload",), out=str(tmp_path))
    text = render(spec)
    assert "--offload_optimizer true" not in text and "nothing of its own" in text
    (tmp_path / "train.py").write_text(text)
    script = import_script(tmp_path / "train.py", "colocated_cpu_offload")
    with pytest.raises(script.ConfigError, match="offload_optimizer=True with trick cpu-offload"):
        script.validate(script.Config(offload_optimizer=True, engine="runtime"))
    script.validate(script.Config(engine="runtime"))
    assert "--offload_optimizer true" in render(
        Spec(algo="grpo", gpus=2, layout="colocated", out="o")
    )


def test_colocated_grpo_lora_syncs_the_merged_policy_into_woken_engines(
    ray_session, even_model_dir, chain_sum_64, tmp_path, monkeypatch
):
    """grpo-lora: the engines hold a plain model, so after a level-2 sleep every sync must bring
    the merged weights W + lora_scale * B A; the sampler's log-probs then equal the trainer's
    (adapters on) at every step."""
    spec = Spec(algo="grpo-lora", layout="colocated", dataset="chain_sum.jsonl", out="o")
    path = tmp_path / "lora" / "train.py"
    path.parent.mkdir()
    path.write_text(render(spec))
    script = import_script(path, "grpo_lora_colocated_train")
    gaps = _recording_gaps(script, monkeypatch)
    history = run_grpo(script, even_model_dir, chain_sum_64, tmp_path / "run", "--max_steps", "3")
    assert len(gaps) == 3 and max(gaps) <= 1e-5, gaps
    assert history[-1]["loss"] != 0  # the adapters moved the policy (B starts at 0)
    assert history[0]["engine_slept_mib"] == pytest.approx(_weight_mib(even_model_dir), abs=1e-9)


def test_colocated_resume_with_offloaded_optimizer_replays_the_run(
    colocated_script, ray_session, even_model_dir, chain_sum_64, tmp_path
):
    """3 colocated steps straight == 2 steps, stop, resume to 3, with the optimizer state
    offloaded across every sync and a checkpoint at every step: each save first restores the
    offloaded state (its storages are empty in between), so the checkpoint holds it whole."""
    common = ("--save_every_steps", "1", "--resume", "auto", "--offload_optimizer", "true")

    def run(out: str, steps: int) -> list[dict]:
        return run_grpo(
            colocated_script, even_model_dir, chain_sum_64, tmp_path / out, *common,
            "--max_steps", str(steps),
        )  # fmt: skip

    straight, first, resumed = run("a", 3), run("b", 2), run("b", 3)
    assert (len(first), len(resumed)) == (2, 1)
    assert [[m[k] for k in KEYS] for m in straight] == [
        [m[k] for k in KEYS] for m in first + resumed
    ]
    assert straight[2]["loss"] != straight[1]["loss"]


def test_colocated_bf16_sr_recipe_matches_split_and_syncs_bf16_weights(
    ray_session, even_model_dir, chain_sum_64, tmp_path, monkeypatch
):
    """The 70B default recipe (`scaffold new --algo grpo --model llama3.3-70b --gpus 8`: colocated,
    --tricks ac,adamw8bit,bf16-sr) on the tiny model in bf16: the same 3 sync steps as the split
    layout with that recipe, metric for metric; every sample is scored by the weights the
    trainer has (the engines get the bf16 weights themselves, no rounding on the way: the
    sampler's log-probs equal the trainer's within 1e-5), and a level-2 sleep frees the
    engine's weights."""
    tricks = ("ac", "adamw8bit", "bf16-sr")
    scripts = {}
    for layout in ("split", "colocated"):
        spec = Spec(algo="grpo", layout=layout, tricks=tricks, dataset="chain_sum.jsonl", out="o")
        path = tmp_path / layout / "train.py"
        path.parent.mkdir()
        path.write_text(render(spec))
        scripts[layout] = import_script(path, f"grpo_{layout}_bf16_sr_train")
    flags = ("--dtype", "bf16", "--rollout", "sync", "--max_steps", "3")
    split = run_grpo(scripts["split"], even_model_dir, chain_sum_64, tmp_path / "s", *flags)
    gaps = _recording_gaps(scripts["colocated"], monkeypatch)
    history = run_grpo(scripts["colocated"], even_model_dir, chain_sum_64, tmp_path / "c", *flags)
    assert len(gaps) == 3 and max(gaps) <= 1e-5, gaps  # one micro-batch a step; measured 0
    assert [[m[k] for k in KEYS] for m in history] == [[m[k] for k in KEYS] for m in split]
    assert history[2]["loss"] != history[1]["loss"]
    assert history[0]["engine_slept_mib"] > 0
