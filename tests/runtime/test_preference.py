"""Preference rows (`to_preference`), LoRA adapters off (`adapters_disabled`), the teacher
tokenizer check (`check_same_tokenizer`), and DPO's reference (runtime/preference.py): the frozen
CPU copy, the precomputed table against each pair scored alone, its file and resume refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from runtime import (
    IGNORE_INDEX,
    ModelArgs,
    adapters_disabled,
    add_lora,
    build_model,
    check_same_tokenizer,
    frozen_cpu_copy,
    init_lora,
    load_hf_checkpoint,
    load_reference_logprobs,
    precompute_reference_logprobs,
    read_hf_config,
    reference_logprobs,
    to_preference,
)

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

USER = {"role": "user", "content": "Hi?"}
GOOD = {"role": "assistant", "content": "Hello!"}
BAD = {"role": "assistant", "content": "Go away."}


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away."},  # TRL, strings
        {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},  # TRL, conversational
        {"chosen": [USER, GOOD], "rejected": [USER, BAD]},  # TRL, implicit prompt
        {  # LLaMA-Factory / ShareGPT (dpo_en_demo.json)
            "conversations": [{"from": "human", "value": "Hi?"}],
            "chosen": {"from": "gpt", "value": "Hello!"},
            "rejected": {"from": "gpt", "value": "Go away."},
        },
        {"messages": [USER], "chosen": GOOD, "rejected": BAD},
    ],
    ids=["trl-strings", "trl-messages", "trl-implicit", "sharegpt", "messages"],
)
def test_to_preference_reads_the_common_layouts(row):
    assert to_preference(row, 0, "d.json") == {
        "prompt": [USER],
        "chosen": [GOOD],
        "rejected": [BAD],
    }


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "Hi?", "chosen": "Hello!"}, r"d\.json row 3: missing key `rejected`"),
        ({"prompt": "Hi?", "chosen": "", "rejected": "No"}, r"row 3: `chosen` has no non-empty"),
        ({"prompt": "Hi?", "chosen": 1, "rejected": "No"}, r"row 3: `chosen` must be a string"),
        (
            {"conversations": [{"from": "x", "value": "a"}], "chosen": "a", "rejected": "b"},
            r"row 3: conversations\[0\]\.from is 'x'",
        ),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, None),  # an empty string prompt is allowed
    ],
)
def test_to_preference_errors_name_file_row_and_key(row, message):
    if message is None:
        assert to_preference(row, 3, "d.json")["prompt"] == [{"role": "user", "content": ""}]
        return
    with pytest.raises(ValueError, match=message):
        to_preference(row, 3, "d.json")


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.q_proj(x))


def test_adapters_disabled_gives_the_base_and_refuses_a_drifting_base():
    torch.manual_seed(0)
    model = _Tiny()
    x = torch.randn(2, 4)
    base = model(x).detach()
    with pytest.raises(ValueError, match="no LoRA adapters.*--algo dpo-lora.*--ref_mode separate"):
        with adapters_disabled(model):
            pass
    add_lora(model, ["q_proj"], rank=2, alpha=4.0)
    init_lora(model, seed=0)
    with torch.no_grad():
        model.q_proj.lora_B.weight.normal_()  # the adapted model now differs from the base
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name
    assert not torch.allclose(model(x), base)
    with adapters_disabled(model):
        torch.testing.assert_close(model(x), base)
    assert not torch.allclose(model(x), base)  # adapters back on after the block
    model.norm.weight.requires_grad = True  # now the "base" would train too
    with pytest.raises(ValueError, match=r"1 non-adapter parameters are trainable \(e\.g\. norm"):
        with adapters_disabled(model):
            pass


def test_check_same_tokenizer(tiny_model_dir, tmp_path):
    check_same_tokenizer(tiny_model_dir, tiny_model_dir)
    other = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append(
        {
            "id": 49152,
            "content": "<|x|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }  # fmt: skip
    )
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"tokenizer mismatch: teacher .*teacher/tokenizer\.json"):
        check_same_tokenizer(tiny_model_dir, other)


# --- DPO's reference (runtime/preference.py) ---


def _tiny_policy(model_dir):
    """The tiny Llama of `tiny_model_dir`, in fp32 on CPU, loaded from its checkpoint."""
    args = ModelArgs.from_hf_config(read_hf_config(model_dir))
    model = build_model(args, device="meta")
    model.to_empty(device=torch.device("cpu"))
    model.init_rope()
    load_hf_checkpoint(model, model_dir)
    return model


def _sequence(prompt_len: int, reply_len: int, seed: int) -> dict:
    """Random ids; pre-shifted labels supervise the reply's tokens only (as the DPO script's)."""
    ids = torch.randint(
        0, 512, (prompt_len + reply_len,), generator=torch.Generator().manual_seed(seed)
    )
    labels = [IGNORE_INDEX] * (prompt_len - 1) + ids[prompt_len:].tolist() + [IGNORE_INDEX]
    return {"input_ids": ids.tolist(), "labels": labels}


def _pairs(ids) -> list[dict]:
    """Pairs of different lengths (so batches pad), with the given pair ids."""
    return [
        {"id": i, "chosen": _sequence(3 + i, 2 + i % 3, 2 * i), "rejected": _sequence(3 + i, 4, 2 * i + 1)}
        for i in ids
    ]  # fmt: skip


def _collate(pairs: list[dict]) -> dict:
    """The scored layout: P chosen rows, then their P rejected ones, right-padded; sample_ids [P]."""
    sequences = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    S = max(len(seq["input_ids"]) for seq in sequences)
    input_ids = torch.zeros(len(sequences), S, dtype=torch.long)
    labels = torch.full((len(sequences), S), IGNORE_INDEX, dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq["input_ids"])] = torch.tensor(seq["input_ids"])
        labels[i, : len(seq["labels"])] = torch.tensor(seq["labels"])
    return {
        "input_ids": input_ids,
        "labels": labels,
        "sample_ids": torch.tensor([p["id"] for p in pairs]),
    }


def _logprobs(model, batch: dict) -> torch.Tensor:
    """[2P] fp32: the sum over each row's supervised positions of log p(label)."""
    logp = model(batch["input_ids"]).float().log_softmax(-1)  # [2P, S, V]
    labels = batch["labels"]
    token_logps = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)  # [2P, S]
    return (token_logps * (labels != IGNORE_INDEX)).sum(-1)


def _alone(model, seq: dict) -> float:
    """One sequence's summed reply log-prob, scored alone (no batch, no padding)."""
    ids = torch.tensor(seq["input_ids"])
    with torch.no_grad():
        logp = model(ids[None]).float().log_softmax(-1)[0]  # [S, V]
    return sum(logp[t, y].item() for t, y in enumerate(seq["labels"]) if y != IGNORE_INDEX)


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    return _tiny_policy(tiny_model_dir)


def test_precomputed_table_equals_each_pair_scored_alone(tiny_policy):
    """Pair ids 0, 1, 3, 4, 6 in batches of 2 (the last one partial, rows padded): row i of the
    table is pair i's (chosen, rejected) log-probs; the ids no pair holds stay 0."""
    pairs = _pairs([0, 1, 3, 4, 6])
    tiny_policy.train()
    table = precompute_reference_logprobs(tiny_policy, pairs, _logprobs, _collate, 2, 0, 1, "cpu")
    assert table.shape == (7, 2) and table.dtype == torch.float32 and table.device.type == "cpu"
    want = torch.zeros(7, 2)
    for p in pairs:
        want[p["id"]] = torch.tensor(
            [_alone(tiny_policy, p["chosen"]), _alone(tiny_policy, p["rejected"])]
        )
    torch.testing.assert_close(table, want, atol=1e-4, rtol=1e-5)
    assert table[[2, 5]].abs().sum() == 0 and (table[[0, 1, 3, 4, 6]] < 0).all()
    assert tiny_policy.training  # back in train mode for the first step
    # packed rows: the pair ids are each row's sample_ids, not a row id
    packs = [{"sample_ids": [0, 1], "pairs": pairs[:2]}, {"sample_ids": [6], "pairs": pairs[4:]}]
    packed = precompute_reference_logprobs(
        tiny_policy, packs, _logprobs, lambda rows: _collate([p for r in rows for p in r["pairs"]]),
        2, 0, 1, "cpu",
    )  # fmt: skip
    assert packed.shape == (7, 2)
    torch.testing.assert_close(packed[[0, 1, 6]], want[[0, 1, 6]], atol=1e-4, rtol=1e-5)


def test_reference_logprobs_reads_the_table_or_scores_the_reference(tiny_policy):
    pairs = _pairs([0, 1, 2, 3])
    table = torch.arange(8.0).view(4, 2)  # row i: (2i, 2i + 1)
    batch = _collate([pairs[3], pairs[1]])  # sample_ids [3, 1]
    # chosen of pairs 3, 1, then their rejected
    assert reference_logprobs(None, table, batch, _logprobs).tolist() == [6.0, 2.0, 7.0, 3.0]
    got = reference_logprobs(tiny_policy, None, batch, _logprobs)
    want = [_alone(tiny_policy, pairs[i][k]) for k in ("chosen", "rejected") for i in (3, 1)]
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-4, rtol=1e-5)
    assert not got.requires_grad  # no graph through the reference
    with pytest.raises(ValueError, match="needs a reference model or a precomputed table"):
        reference_logprobs(None, None, batch, _logprobs)


def test_frozen_cpu_copy_holds_the_checkpoint_frozen_in_the_compute_dtype(
    tiny_model_dir, tiny_policy
):
    args = ModelArgs.from_hf_config(read_hf_config(tiny_model_dir))
    copy = frozen_cpu_copy(args, tiny_model_dir, torch.bfloat16)
    assert not copy.training
    assert {(p.dtype, p.device.type, p.requires_grad) for p in copy.parameters()} == {
        (torch.bfloat16, "cpu", False)
    }
    want = dict(tiny_policy.named_parameters())
    for name, param in copy.named_parameters():
        assert torch.equal(param, want[name].detach().to(torch.bfloat16)), name


def test_precomputed_table_is_saved_read_back_on_resume_and_refused_for_other_data(
    tiny_policy, tmp_path
):
    pairs = _pairs([0, 1, 2])
    path = tmp_path / "reference_logps.pt"
    fields = {"model": "m", "dataset": "d.json", "max_seq_len": 96, "dtype": "fp32"}
    scoring = (tiny_policy, pairs, _logprobs, _collate, 2, 0, 1, "cpu")

    table = load_reference_logprobs(path, fields, None, False, *scoring)
    assert not path.exists()  # only the main process writes
    table = load_reference_logprobs(path, fields, None, True, *scoring)
    torch.testing.assert_close(table, precompute_reference_logprobs(*scoring[:4], 2, 0, 1, "cpu"))
    saved = torch.load(path)
    assert saved["computed_from"] == fields | {"pairs": 3}
    assert torch.equal(saved["reference_logps"], table)

    def moved_policy(model, batch):  # a resume must not score with the trained policy
        raise AssertionError("a resumed run recomputed the reference")

    resumed = (tiny_policy, pairs, moved_policy, _collate, 2, 0, 1, "cpu")
    checkpoint = tmp_path / "checkpoints" / "step_000002"  # this run's own checkpoint
    assert torch.equal(load_reference_logprobs(path, fields, checkpoint, True, *resumed), table)
    # another run's checkpoint (resumed in a new out_dir): that run's table, copied here
    new_path = tmp_path / "new_run" / "reference_logps.pt"
    new_path.parent.mkdir()
    got = load_reference_logprobs(new_path, fields, checkpoint, False, *resumed)
    assert torch.equal(got, table) and not new_path.exists()  # only the main process copies
    assert torch.equal(load_reference_logprobs(new_path, fields, checkpoint, True, *resumed), table)
    assert torch.load(new_path)["computed_from"] == saved["computed_from"]
    other = fields | {"max_seq_len": 64, "dtype": "bf16"}
    with pytest.raises(
        ValueError,
        match=r"reference_logps\.pt was computed for other data: max_seq_len 96 \(now 64\), "
        r"dtype 'fp32' \(now 'bf16'\); resume with the same values, or start over in a new --out_dir",
    ):
        load_reference_logprobs(path, other, checkpoint, True, *resumed)
    with pytest.raises(ValueError, match=r"pairs 3 \(now 2\)"):
        load_reference_logprobs(
            path, fields, checkpoint, True, tiny_policy, pairs[:2], *resumed[2:]
        )
    path.unlink()
    with pytest.raises(
        ValueError,
        match=r"ref_mode='precomputed' resumes from a checkpoint but .*reference_logps\.pt is "
        r"missing, .*--resume none",
    ):
        load_reference_logprobs(path, fields, checkpoint, True, *resumed)
    with pytest.raises(ValueError, match=r"new_run/gone\.pt \(nor .*/gone\.pt, beside"):
        load_reference_logprobs(new_path.parent / "gone.pt", fields, checkpoint, True, *resumed)
