"""Model catalog: every entry builds on meta with the published parameter count; local
directories of every supported family are accepted as --model."""

from __future__ import annotations

import json

import pytest

from generator.catalog import _ARCHITECTURES, FAMILIES, MODELS
from generator.spec import Spec, SpecError, build_answers
from runtime.models.llama import HF_ARCHITECTURES, ModelArgs, build_model

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

# Published sizes, in parameters. "total" counts a tied head once; "non_embedding" excludes the
# input embedding and the output head; "active" = per token (MoE), embedding and head included.
# Sources:
#   hub: the safetensors parameter count the Hugging Face Hub shows on the model page
#        (exact; for SmolLM2 / Llama the file stores no duplicate tied head).
#   card: the "Number of Parameters" lines of the Qwen model card on the Hub (Qwen2.5-*-Instruct,
#        Qwen3-*), rounded by Qwen to 0.01B-1B. For the tied Qwen3 <= 4B the card's total is
#        too coarse (Qwen3-1.7B: "1.7B" vs 1.72B), so the card's non-embedding figure is used.
PUBLISHED = {
    "smollm2-135m": [("total", 134_515_008, "hub")],
    "smollm2-360m": [("total", 361_821_120, "hub")],
    "smollm2-1.7b": [("total", 1_711_376_384, "hub")],
    "llama3.2-1b": [("total", 1_235_814_400, "hub")],
    "llama3.2-3b": [("total", 3_212_749_824, "hub")],
    "llama3.1-8b": [("total", 8_030_261_248, "hub")],
    "llama3.1-70b": [("total", 70_553_706_496, "hub")],
    "llama3.3-70b": [("total", 70_553_706_496, "hub")],
    "llama3.1-405b": [("total", 405_853_388_800, "hub")],
    "qwen2.5-0.5b": [("total", 0.49e9, "card"), ("non_embedding", 0.36e9, "card")],
    "qwen2.5-1.5b": [("total", 1.54e9, "card"), ("non_embedding", 1.31e9, "card")],
    "qwen2.5-3b": [("total", 3.09e9, "card"), ("non_embedding", 2.77e9, "card")],
    "qwen2.5-7b": [("total", 7.61e9, "card"), ("non_embedding", 6.53e9, "card")],
    "qwen2.5-14b": [("total", 14.7e9, "card"), ("non_embedding", 13.1e9, "card")],
    "qwen2.5-32b": [("total", 32.5e9, "card"), ("non_embedding", 31.0e9, "card")],
    "qwen2.5-72b": [("total", 72.7e9, "card"), ("non_embedding", 70.0e9, "card")],
    "qwen3-0.6b": [("non_embedding", 0.44e9, "card")],
    "qwen3-1.7b": [("non_embedding", 1.4e9, "card")],
    "qwen3-4b": [("non_embedding", 3.6e9, "card")],
    "qwen3-8b": [("total", 8.2e9, "card"), ("non_embedding", 6.95e9, "card")],
    "qwen3-14b": [("total", 14.8e9, "card"), ("non_embedding", 13.2e9, "card")],
    "qwen3-32b": [("total", 32.8e9, "card"), ("non_embedding", 31.2e9, "card")],
    # The card's "3.3B activated" is 3.353B cut (not rounded) to one decimal: 1.6% off, so the
    # active count is checked in test_moe_active_params instead.
    "qwen3-30b-a3b": [("total", 30_532_122_624, "hub"), ("non_embedding", 29.9e9, "card")],
    "qwen3-235b-a22b": [
        ("total", 235e9, "card"),
        ("non_embedding", 234e9, "card"),
        ("active", 22e9, "card"),
    ],
}
TOLERANCE = 0.01


def _count(args: ModelArgs, kind: str) -> int:
    if kind == "active":
        return args.num_active_params()
    if kind == "total":
        return args.num_params()
    embed_and_head = args.vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)
    return args.num_params() - embed_and_head


def test_catalog_has_the_issue_models_and_known_families():
    required = {
        *("llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "llama3.3-70b"),
        *("llama3.1-405b", "smollm2-135m", "smollm2-360m", "smollm2-1.7b"),
        *(f"qwen2.5-{s}" for s in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")),
        *(f"qwen3-{s}" for s in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")),
        *("qwen3-30b-a3b", "qwen3-235b-a22b"),
    }
    assert required <= set(MODELS)
    assert set(PUBLISHED) == set(MODELS), "every catalog entry needs its published size here"
    for e in MODELS.values():
        assert e.family in FAMILIES and e.family == e.config["model_type"], e.name
    assert set(FAMILIES) == set(HF_ARCHITECTURES)
    assert all(HF_ARCHITECTURES[t] == a for t, a in _ARCHITECTURES.items())


@pytest.mark.parametrize("name", list(MODELS))
def test_entry_builds_on_meta_with_published_size(name):
    e = MODELS[name]
    args = ModelArgs.from_hf_config(e.config, source=f"catalog:{name}")
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args
    model = build_model(args, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    assert args.max_position_embeddings == e.config["max_position_embeddings"]
    for kind, published, source in PUBLISHED[name]:
        ours = _count(args, kind)
        err = abs(ours - published) / published
        assert err <= TOLERANCE, (
            f"{name} {kind}: {ours:,} vs {published:,.0f} ({source}), {err:.2%}"
        )


def test_moe_active_params():
    a3b = ModelArgs.from_hf_config(MODELS["qwen3-30b-a3b"].config)
    assert a3b.num_active_params() == 3_353_032_704  # published "3.3B activated"
    # Per MoE layer only 8 of 128 experts run: the gap is 120 experts x 3 projections x 48 layers.
    assert a3b.num_params() - a3b.num_active_params() == 48 * 120 * 3 * 2048 * 768
    dense = ModelArgs.from_hf_config(MODELS["qwen3-8b"].config)
    assert dense.num_active_params() == dense.num_params()


def _write_config(path, cfg: dict):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b", "qwen3-30b-a3b", "llama3.2-1b"])
def test_local_directory_selects_family(tmp_path, name):
    entry = MODELS[name]
    model_dir = _write_config(tmp_path / "my-ckpt", entry.config)
    answers = build_answers(Spec(model=str(model_dir)))
    assert answers["family"] == entry.family
    assert answers["model_path"] == str(model_dir.resolve())
    assert answers["max_seq_len"] == 2048


def test_local_directory_of_unsupported_family_is_a_spec_error(tmp_path):
    cfg = {**MODELS["qwen3-0.6b"].config, "model_type": "gemma3"}
    cfg["architectures"] = ["Gemma3ForCausalLM"]
    model_dir = _write_config(tmp_path / "gemma", cfg)
    with pytest.raises(SpecError) as err:
        build_answers(Spec(model=str(model_dir)))
    msg = str(err.value)
    assert str(model_dir / "config.json") in msg and "'gemma3'" in msg
    assert "'qwen3'" in msg and "'qwen3_moe'" in msg and "'llama'" in msg
