"""The emitted reward-model script (examples/rm_smollm2): the Bradley-Terry loss with margin and
centring against its closed form, the scored token against transformers' pooling rule, the saved
checkpoint against `AutoModelForSequenceClassification` (equal scores, tiny random model), the
saved RM as a GRPO reward, and a short run on real preference data (SmolLM2-135M,
dpo_en_demo.json, whole replies) that raises the held-out pair accuracy from the untrained
model's to above chance and lowers the held-out loss."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from generator.assets import ensure_dataset
from runtime import RewardModelFunction, Tokenizer, score_index
from tests.helpers import first_short_pairs, import_script, read_metrics, run_grpo

REPO = Path(__file__).resolve().parents[2]
RM = REPO / "examples" / "rm_smollm2" / "train.py"


@pytest.fixture(scope="module")
def rm_script():
    return import_script(RM, "rm_smollm2_train")


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory, tiny_model_dir, short_pairs, rm_script) -> Path:
    """A reward model trained 3 steps from the tiny random Llama (a fresh head, lr 1e-2 so every
    weight moved): out_dir/model."""
    out = tmp_path_factory.mktemp("tiny_rm")
    rm_script.main([
        "--model", str(tiny_model_dir), "--dataset", str(short_pairs), "--out_dir", str(out),
        "--dtype", "fp32", "--device", "cpu", "--max_steps", "3", "--lr", "1e-2",
        "--warmup_steps", "0", "--micro_batch_size", "2", "--max_seq_len", "192",
        "--val_fraction", "0", "--eval_every_steps", "0",
    ])  # fmt: skip
    return out / "model"


@pytest.mark.fast
def test_reward_loss_equals_closed_form(rm_script):
    chosen = torch.tensor([1.5, -0.25, 0.0, 3.0])
    rejected = torch.tensor([0.5, 0.75, 0.0, -1.0])
    margin = torch.tensor([0.0, 0.5, 1.0, 2.0])

    def softplus(x):
        return math.log1p(math.exp(x))

    # -log sigmoid(d) = softplus(-d)
    for coef in (0.0, 0.01, 0.5):
        want = [
            softplus(-(c - r - m)) + coef * (c + r) ** 2
            for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist(), strict=True)
        ]
        got = rm_script.reward_loss(chosen, rejected, margin, coef)
        torch.testing.assert_close(got, torch.tensor(want), msg=f"coef={coef}")
    # TRL's RewardTrainer loss on the same batch: the mean of the per-pair losses
    trl = -torch.nn.functional.logsigmoid(chosen - rejected - margin).mean() + 0.01 * torch.mean(
        (chosen + rejected) ** 2
    )
    torch.testing.assert_close(rm_script.reward_loss(chosen, rejected, margin, 0.01).mean(), trl)


@pytest.mark.fast
def test_score_index_is_the_last_token_that_is_not_padding():
    pad = 0
    ids = torch.tensor([
        [5, 6, 2, 7, 0, 0],  # right padding
        [0, 0, 5, 6, 2, 9],  # left padding: the last position
        [5, 0, 6, 2, 0, 0],  # a pad id inside the row does not end it
        [0, 0, 0, 0, 0, 0],  # padding only: 0, as transformers' argmax gives
    ])  # fmt: skip
    assert score_index(ids, pad).tolist() == [3, 5, 3, 0]


@pytest.mark.fast
def test_pad_token_the_template_writes_is_refused_without_an_unk(
    rm_script, small_tokenizer_dir, tmp_path
):
    """With pad = <|im_end|> (the template's end of turn) and no unk token, no padding token can
    be told from a row's last token: one error naming the file and what to set."""
    shutil.copytree(small_tokenizer_dir, tmp_path / "tok")
    config_path = tmp_path / "tok" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("unk_token")
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"pad_token \('<\|im_end\|>'\) and unk_token \(None\)"):
        rm_script.reward_pad_token_id(Tokenizer.from_dir(tmp_path / "tok"))
    config["pad_token"] = "<|endoftext|>"  # never written by the template: taken as it is
    config_path.write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(tmp_path / "tok")
    assert rm_script.reward_pad_token_id(tokenizer) == tokenizer.token_to_id("<|endoftext|>")


def test_collate_scores_the_last_real_token_and_reads_margins(
    rm_script, tiny_model_dir, short_pairs, tmp_path
):
    """The chat template's end-of-turn token (SmolLM2's pad = eos = <|im_end|>) is never taken
    for padding: the RM pads with a token the template never writes, and each row is scored at
    its last real token even when truncation ends it on <|im_end|>."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    pad = rm_script.reward_pad_token_id(tokenizer)
    assert tokenizer.pad_token_id == tokenizer.token_to_id("<|im_end|>")
    assert pad == tokenizer.token_to_id("<|endoftext|>") != tokenizer.pad_token_id
    rows = json.loads(short_pairs.read_text())
    rows[1]["margin"] = 2.5
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(rows[:2]))
    cfg = rm_script.Config(model=str(tiny_model_dir), dataset=str(data), val_fraction=0.0)
    pairs, _ = rm_script.build_datasets(cfg, tokenizer)
    end = tokenizer.token_to_id("<|im_end|>")
    # cut the first chosen reply right after its <|im_end|>: its last real token is then pad-like
    ids = pairs[0]["chosen"]["input_ids"]
    pairs[0]["chosen"]["input_ids"] = ids[: len(ids) - ids[::-1].index(end)]
    batch = rm_script.collate(pairs, pad)
    lengths = [len(p[k]["input_ids"]) for k in ("chosen", "rejected") for p in pairs]
    assert batch["score_index"].tolist() == [n - 1 for n in lengths]
    assert batch["input_ids"][0, batch["score_index"][0]] == end
    assert batch["margin"].tolist() == [0.0, 2.5]


def test_saved_model_scores_equal_in_transformers(rm_script, tiny_rm, short_pairs):
    """transformers' AutoModelForSequenceClassification, fed by the saved tokenizer with padding,
    gives the scores of the script's own forward and of the runtime's reward function."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    config = json.loads((tiny_rm / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_rm, dtype=torch.float32).eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == config["pad_token_id"]
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_rm)
    assert hf_tokenizer.pad_token_id == config["pad_token_id"]

    tokenizer = Tokenizer.from_dir(tiny_rm)
    cfg = rm_script.Config(
        model=str(tiny_rm), dataset=str(short_pairs), val_fraction=0.0, max_seq_len=192
    )
    pairs, _ = rm_script.build_datasets(cfg, tokenizer)
    batch = rm_script.collate(pairs, config["pad_token_id"])
    # the script's model, loaded back from the saved reward model (its head included)
    dist_info, mesh = rm_script.setup_distributed(rm_script.Config(device="cpu", dtype="fp32"))
    model = rm_script.setup_model(
        rm_script.Config(device="cpu", dtype="fp32", max_seq_len=192), tiny_rm, mesh, "cpu"
    )
    with torch.no_grad():
        chosen, rejected = rm_script.pair_rewards(model, batch)
    ours = torch.cat([chosen, rejected])

    rows = [json.loads(short_pairs.read_text())[p["id"]] for p in pairs]
    texts = [
        tokenizer.decode(p[k]["input_ids"], skip_special_tokens=False)
        for k in ("chosen", "rejected")
        for p in pairs
    ]
    enc = hf_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert torch.equal(enc["input_ids"], batch["input_ids"])  # the same rows, padded alike
    with torch.no_grad():
        theirs = hf(**enc).logits[:, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)

    # the reward function GRPO calls: the same conversations, rendered and scored on their own
    prefs = [rm_script.to_preference(row, i, "pairs") for i, row in enumerate(rows)]
    direct = RewardModelFunction(tiny_rm).score(
        [pref["prompt"] for pref in prefs] * 2,
        [pref[k][-1]["content"] for k in ("chosen", "rejected") for pref in prefs],
    )
    torch.testing.assert_close(torch.tensor(direct), theirs, atol=1e-5, rtol=1e-5)


def test_real_smollm2_fits_four_pairs(rm_script, smollm2_dir, tmp_path):
    """CI's real-model reward-model run (the held-out rise is the learning tier's, below):
    SmolLM2-135M with its seeded random score head on the first 4 real dpo_en_demo pairs within
    128 tokens, micro-batches of 2 (each pair back every 2 steps), 6 steps at lr 2e-5 without
    warmup, fp32: the last 2 steps' pair loss is below the first 2 steps' and every pair is
    ranked right by the end."""
    data = first_short_pairs(tmp_path, smollm2_dir, 128)
    out = tmp_path / "out"
    rm_script.main([
        "--model", str(smollm2_dir), "--dataset", str(data), "--out_dir", str(out),
        "--dtype", "fp32", "--device", "cpu", "--max_steps", "6", "--lr", "2e-5",
        "--warmup_steps", "0", "--micro_batch_size", "2", "--max_seq_len", "128",
        "--val_fraction", "0", "--eval_every_steps", "0", "--save_every_steps", "0",
    ])  # fmt: skip
    rows = [r for r in read_metrics(out) if "loss" in r]
    losses, accuracy = [r["loss"] for r in rows], [r["accuracy"] for r in rows]
    print(f"rm on 4 real pairs: loss {losses}, accuracy {accuracy}")
    assert len(rows) == 6
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    assert accuracy[-2:] == [1.0, 1.0], accuracy


@pytest.mark.slow
@pytest.mark.learning
def test_real_smollm2_held_out_accuracy_rises_above_chance(
    rm_script, smollm2_dir, tmp_path, learning
):
    """SmolLM2-135M on dpo_en_demo.json, fp32 on the CPU, whole replies (max_seq_len 512 keeps 198
    of the 300 pairs: 139 to train, 59 held out): 7 steps of 4 pairs raise the held-out pair
    accuracy from the untrained model's (the pretrained decoder under the seeded random head,
    evaluated first) to above 0.5, and lower the held-out loss.

    Measured (benchmarks/RESULTS.md, "Reward model on the demo pairs"): untrained 0.424 (25/59),
    loss 0.7297; after 7 steps 0.58, loss 0.6856; after 14, 0.61. A random head's expected
    accuracy is 0.5 (w and -w are equally likely); this seed's is below it. Cut at 128 or 256
    tokens the pairs teach no preference that transfers (the held-out accuracy stays at the
    untrained head's), which is why the rows are whole here."""
    data = ensure_dataset("dpo_en_demo.json")
    settings = dict(model=str(smollm2_dir), dataset=str(data), dtype="fp32", device="cpu",
                    max_seq_len=512, val_fraction=0.3, micro_batch_size=4)  # fmt: skip
    cfg = rm_script.Config(**settings)
    _, mesh = rm_script.setup_distributed(cfg)
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    pad = rm_script.reward_pad_token_id(tokenizer)
    _, val_set = rm_script.build_datasets(cfg, tokenizer)
    val_loader = rm_script.build_dataloader(
        val_set, lambda b: rm_script.collate(b, pad), 4, 0, 1, 0, train=False,
        unsupervised_fill=False,
    )  # fmt: skip
    model = rm_script.setup_model(cfg, smollm2_dir, mesh, torch.device("cpu"))
    before = rm_script.evaluate(model, val_loader, cfg, "cpu")
    del model
    rm_script.destroy_distributed()
    out = tmp_path / "out"
    rm_script.main([
        *(f"--{k}={v}" for k, v in settings.items()), "--out_dir", str(out), "--max_steps", "7",
        "--lr", "2e-5", "--warmup_steps", "2", "--min_lr_ratio", "1.0", "--eval_every_steps", "0",
        "--save_every_steps", "0",
    ])  # fmt: skip
    after = read_metrics(out)[-1]
    print(f"held out ({len(val_set)} pairs): before {before}, after 7 steps {after}")
    learning("held-out pair accuracy", 7, before["val_accuracy"], after["val_accuracy"],
             "> 0.5 and rise >= 0.1")  # fmt: skip
    learning("held-out loss", 7, before["val_loss"], after["val_loss"], "falls")
    assert len(val_set) == 59
    assert after["val_accuracy"] > 0.5, (before, after)
    assert after["val_accuracy"] >= before["val_accuracy"] + 0.1, (before, after)  # 6+ pairs
    assert after["val_loss"] < before["val_loss"], (before, after)


@pytest.mark.parametrize("recipe", ["grpo_smollm2", "ppo_smollm2"])
def test_grpo_takes_the_saved_reward_model_as_a_reward(
    recipe, tiny_rm, ray_session, even_model_dir, chain_sum_64, tmp_path, monkeypatch
):
    """GRPO and PPO (the GRPO skeleton) with --reward_model: every rollout's reward_model value
    is the RM's score of its (question, completion), computed here directly, and its total the
    weighted sum with the script's other reward."""
    grpo = import_script(REPO / "examples" / recipe / "train.py", f"{recipe}_with_rm")
    seen = []
    train_step = grpo.train_step

    def recording_step(model, reference, optimizer, scheduler, rollouts, *args, **kwargs):
        seen.extend(rollouts)
        return train_step(model, reference, optimizer, scheduler, rollouts, *args, **kwargs)

    monkeypatch.setattr(grpo, "train_step", recording_step)
    history = run_grpo(
        grpo, even_model_dir, chain_sum_64, tmp_path / "out", "--max_steps", "2",
        "--reward_model", str(tiny_rm), "--reward_weights", "1.0,0.5",
    )  # fmt: skip
    assert len(history) == 2 and len(seen) == 2 * 2 * 4
    cfg = grpo.Config(model=str(even_model_dir), dataset=str(chain_sum_64))
    questions = {
        tuple(ex["prompt_ids"]): ex["prompt"]
        for ex in grpo.load_prompts(cfg, Tokenizer.from_dir(even_model_dir))
    }
    reward_model = RewardModelFunction(tiny_rm)
    direct = reward_model.score(
        [questions[tuple(r.prompt_ids)] for r in seen], [r.completion for r in seen]
    )
    got = [r.rewards["reward_model"] for r in seen]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(direct), atol=1e-5, rtol=1e-5)
    assert len(set(got)) > 1  # distinct completions, distinct scores: not one constant
    for r in seen:
        want = r.rewards["even_token_reward"] + 0.5 * r.rewards["reward_model"]
        assert abs(r.reward - want) < 1e-6


def test_grpo_reward_weights_count_the_reward_model(tiny_rm):
    grpo = import_script(REPO / "examples" / "grpo_smollm2" / "train.py", "grpo_with_rm_weights")
    cfg = grpo.Config(reward_model=str(tiny_rm))  # the default reward_weights: 2 entries
    with pytest.raises(
        ValueError,
        match=r"reward_weights has 2 entries for 3 reward functions \(the last: --reward_model\)",
    ):
        grpo.validate(cfg)
