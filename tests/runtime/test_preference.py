"""Preference rows (`to_preference`), LoRA adapters off (`adapters_disabled`) and the teacher
tokenizer check (`check_same_tokenizer`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from runtime import adapters_disabled, add_lora, check_same_tokenizer, init_lora, to_preference

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
