"""An SFT script emitted for each model family (`scaffold new --model <local HF dir>`) trains 3 steps
on a tiny random model of that family with the small tokenizer and real alpaca rows (in this
process: the script's main())."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from generator.cli import cli
from runtime import ModelArgs, build_model, copy_tokenizer_files, save_hf_checkpoint
from tests.helpers import SMALL_VOCAB, TINY_CONFIG, import_script, read_metrics

TINY = {
    **TINY_CONFIG,
    "vocab_size": SMALL_VOCAB,
    "rope_theta": 100000.0,
    "max_position_embeddings": 4096,
}
FAMILIES = {
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False),
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_emitted_script_trains_each_family(family, tmp_path, small_tokenizer_dir, small_dataset):
    model_dir = tmp_path / f"tiny-{family}"
    args = ModelArgs(**TINY, **FAMILIES[family])
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, model_dir, args.to_hf_config())
    copy_tokenizer_files(small_tokenizer_dir, model_dir)

    data = tmp_path / "four.json"  # 4 real rows, micro-batch 4: every step sees the same batch
    data.write_text(json.dumps(json.loads(small_dataset.read_text())[:4]))
    run = tmp_path / "run"
    result = CliRunner().invoke(
        cli, ["new", "--model", str(model_dir), "--dtype", "fp32", "--out", str(run)]
    )
    assert result.exit_code == 0, result.output
    assert f"({family} family)" in (run / "train.py").read_text()
    script = import_script(run / "train.py", f"family_{family}_train")
    script.main(
        ["--max_steps", "3", "--warmup_steps", "0", "--lr", "2e-3",
         "--dataset", str(data), "--micro_batch_size", "4", "--max_seq_len", "64", "--val_fraction", "0",
         "--sample_max_new_tokens", "2", "--out_dir", str(run / "out")]
    )  # fmt: skip
    losses = [r["loss"] for r in read_metrics(run / "out")]
    # ~ln(vocab) at init, a random model's uniform guess: the same window relative to ln(vocab)
    # as the 9..12 that was used around ln(49152) = 10.8
    low, high = 0.83 * math.log(SMALL_VOCAB), 1.11 * math.log(SMALL_VOCAB)
    assert len(losses) == 3 and all(low < x < high for x in losses), losses
    assert losses[2] < losses[1] < losses[0], losses
    saved = json.loads((run / "out" / "model" / "config.json").read_text())
    assert saved["model_type"] == family


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory, small_tokenizer_dir):
    """The qwen3_moe family's tiny random model (4 experts, top 2) with the small tokenizer."""
    model_dir = tmp_path_factory.mktemp("tiny-moe")
    args = ModelArgs(**TINY, **FAMILIES["qwen3_moe"])
    model = build_model(args, device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_checkpoint(model, model_dir, args.to_hf_config())
    copy_tokenizer_files(small_tokenizer_dir, model_dir)
    return model_dir


def test_lora_on_a_mixture_of_experts_names_why_the_experts_are_not_adapted():
    from runtime.lora import add_lora

    model = build_model(ModelArgs(**TINY, **FAMILIES["qwen3_moe"]), device="cpu")
    with pytest.raises(ValueError, match=r"\['gate_proj'\] are only the MoE experts' projections"):
        add_lora(model, ["q_proj", "gate_proj"], rank=2, alpha=4.0)


@pytest.mark.parametrize("algo", ["lora", "qlora", "dpo", "dpo-lora", "kd", "rm", "grpo"])
def test_every_algorithm_trains_a_mixture_of_experts(
    algo, tiny_moe_dir, tmp_path, small_dataset, short_pairs, chain_sum_64, ray_session
):
    """MoE for every algorithm, 1 process (EP on ranks: tests/distributed/test_expert_parallel.py):
    each skeleton's script for a qwen3_moe model trains on it. LoRA, QLoRA, DPO, DPO-LoRA, KD and
    the reward model repeat one batch, whose loss must fall; GRPO's engine samples from the
    trained experts after each weight sync (3 steps, the loss finite and the policy versions
    advancing); grpo-lora's MoE run is test_expert_parallel's 1-process reference."""
    run = tmp_path / "run"
    result = CliRunner().invoke(
        cli, ["new", "--algo", algo, "--model", str(tiny_moe_dir), "--dtype", "fp32", "--out", str(run)]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    script = import_script(run / "train.py", f"moe_{algo}_train")
    out = str(run / "out")
    if algo == "grpo":
        from tests.helpers import run_grpo

        history = run_grpo(
            script, tiny_moe_dir, chain_sum_64, out, "--max_steps", "3", "--rollout", "sync"
        )
        assert [m["policy_versions"] for m in history] == [[v] * 8 for v in (0, 1, 2)]
        assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in history)
        return
    pairs = algo in ("dpo", "dpo-lora", "rm")  # short_pairs: 4 pairs, micro-batch 4
    data = short_pairs if pairs else tmp_path / "four.json"
    if not pairs:  # 4 real rows, micro-batch 4: every step sees the same batch
        data.write_text(json.dumps(json.loads(small_dataset.read_text())[:4]))
    extra = ["--teacher", str(tiny_moe_dir)] if algo == "kd" else []
    extra += [] if algo == "rm" else ["--sample_max_new_tokens", "0"]  # an RM does not sample
    lr = {"lora": "2e-2", "qlora": "2e-2", "dpo": "1e-3", "dpo-lora": "2e-2", "kd": "2e-3", "rm": "1e-3"}[algo]  # fmt: skip
    script.main(
        ["--max_steps", "3", "--warmup_steps", "0", "--lr", lr, "--dataset", str(data),
         "--micro_batch_size", "4", "--val_fraction", "0", "--out_dir", out,
         "--max_seq_len", "192" if pairs else "64", *extra]
    )  # fmt: skip
    losses = [r["loss"] for r in read_metrics(run / "out")]
    assert len(losses) == 3 and losses[2] < losses[0], losses
    if algo == "lora":  # attention adapters (the MoE default), loadable by PEFT onto HF's model
        peft, transformers = pytest.importorskip("peft"), pytest.importorskip("transformers")
        saved = run / "out" / "model"
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
        with_adapters = peft.PeftModel.from_pretrained(base, saved).eval()
        names = [n for n, _ in with_adapters.named_parameters() if ".lora_B" in n]
        assert {n.split(".lora_B")[0].rsplit(".", 1)[-1] for n in names} == {
            "q_proj", "k_proj", "v_proj", "o_proj",
        }  # fmt: skip
        merged = transformers.AutoModelForCausalLM.from_pretrained(saved / "merged").eval()
        ids = torch.randint(0, SMALL_VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(
                with_adapters(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5
            )
