"""torchtune components for the SFT benchmark: a SmolLM2 chat tokenizer and the Alpaca dataset.

torchtune 0.6.1 has no tokenizer for SmolLM2 (a GPT-2 style byte-level BPE shipped as
`tokenizer.json`) and no model tokenizer that renders a Hugging Face chat template
(`HuggingFaceModelTokenizer` arrived after 0.6.1). The least-bad option is a small model tokenizer
built on torchtune's own `HuggingFaceBaseTokenizer` (which loads `tokenizer.json` with the
`tokenizers` library), rendering ChatML exactly like SmolLM2's `chat_template.jinja`:

    <|im_start|>system\\n{default system prompt}<|im_end|>\\n      (inserted when no system turn)
    <|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n{output}<|im_end|>\\n

Each text piece between special tokens is encoded on its own, which is what `tokenizers` does to
the rendered string, so the token ids equal TRL's `apply_chat_template` ids. The loss mask equals
TRL's completion-only mask: system and user turns and the `<|im_start|>assistant\\n` header are
masked; the answer, its `<|im_end|>` and the final `\\n` are trained. Sequences are cut to
`max_seq_len` keeping the start (TRL's `keep_start`), with no extra EOS appended (the template
already ends every turn with `<|im_end|>`, SmolLM2's EOS).

`pad_id` is `<|endoftext|>` (id 0), not `<|im_end|>`: torchtune's collator pads with `pad_id`, and
a pad id that never occurs in the data lets the benchmark recipe count real (non-pad) tokens by id.
Padded positions carry label -100 and sit after the real tokens, so under the causal mask they
change nothing for the real ones. torchtune 0.6.1's collator pads only to the longest sequence of
the batch; with `pad_to_max_seq_len=True` the tokenizer pads every sample to `max_seq_len`
(masked), so batches have the fixed shape the other tools use.

Referenced from `torchtune_sft.yaml` as `torchtune_components.<name>`; `torchtune_run.py` puts this
directory on PYTHONPATH.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torchtune.data import Message
from torchtune.datasets import SFTDataset
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer, ModelTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_data import SMOLLM2_DEFAULT_SYSTEM, user_content  # noqa: E402


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class SmolLM2ChatTokenizer(ModelTokenizer, Transform):
    """ChatML model tokenizer for SmolLM2 over a Hugging Face `tokenizer.json`.

    Args:
        path: the Hugging Face model directory (holds tokenizer.json, tokenizer_config.json).
        max_seq_len: cut token sequences to this length (keep the start); None = no limit.
        pad_to_max_seq_len: pad every sample with `pad_id` (masked) to exactly `max_seq_len`.
    """

    def __init__(
        self, path: str, max_seq_len: int | None = None, pad_to_max_seq_len: bool = False
    ) -> None:
        if pad_to_max_seq_len and max_seq_len is None:
            raise ValueError("pad_to_max_seq_len=True needs max_seq_len")
        model_dir = Path(path)
        self.base = HuggingFaceBaseTokenizer(
            str(model_dir / "tokenizer.json"),
            tokenizer_config_json_path=str(model_dir / "tokenizer_config.json"),
        )
        vocab = self.base.tokenizer
        self.im_start_id = vocab.token_to_id("<|im_start|>")
        self.im_end_id = vocab.token_to_id("<|im_end|>")
        self.eos_id = self.im_end_id
        self.bos_id = self.im_start_id
        self.pad_id = vocab.token_to_id("<|endoftext|>")
        self.max_seq_len = max_seq_len
        self.pad_to_max_seq_len = pad_to_max_seq_len
        self._newline = self.encode("\n")

    @property
    def vocab_size(self) -> int:
        return self.base.tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of plain text (no BOS/EOS unless asked)."""
        return self.base.encode(text, add_bos=add_bos, add_eos=add_eos)

    def decode(self, token_ids: list[int]) -> str:
        return self.base.decode(token_ids)

    def _encode_turn(self, role: str, text: str, masked: bool) -> tuple[list[int], list[bool]]:
        """`<|im_start|>{role}\\n{text}<|im_end|>\\n` and its mask (True = no loss)."""
        body = self.encode(f"{role}\n{text}")
        tokens = [self.im_start_id, *body, self.im_end_id, *self._newline]
        if masked:
            return tokens, [True] * len(tokens)
        # The header `<|im_start|>{role}\n` is prompt; the rest (answer, <|im_end|>, \n) is trained.
        n_header = 1 + _common_prefix_length(self.encode(f"{role}\n"), body)
        return tokens, [True] * n_header + [False] * (len(tokens) - n_header)

    def tokenize_messages(
        self, messages: list[Message], add_eos: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Render and tokenize a conversation like SmolLM2's chat template.

        `add_eos` is accepted for the ModelTokenizer interface and ignored: the template already
        closes every turn with `<|im_end|>` (the EOS token).
        """
        tokens: list[int] = []
        mask: list[bool] = []
        if not messages or messages[0].role != "system":
            turn_tokens, turn_mask = self._encode_turn("system", SMOLLM2_DEFAULT_SYSTEM, True)
            tokens += turn_tokens
            mask += turn_mask
        for message in messages:
            turn_tokens, turn_mask = self._encode_turn(
                message.role, message.text_content, message.masked
            )
            tokens += turn_tokens
            mask += turn_mask
        if self.max_seq_len is not None:
            tokens, mask = tokens[: self.max_seq_len], mask[: self.max_seq_len]
        if self.pad_to_max_seq_len:
            n_pad = self.max_seq_len - len(tokens)
            tokens, mask = tokens + [self.pad_id] * n_pad, mask + [True] * n_pad
        return tokens, mask

    def __call__(self, sample: dict[str, Any], inference: bool = False) -> dict[str, Any]:
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages)
        sample["tokens"] = tokens
        sample["mask"] = mask
        return sample


def smollm2_tokenizer(
    path: str, max_seq_len: int | None = None, pad_to_max_seq_len: bool = False
) -> SmolLM2ChatTokenizer:
    """Builder used by the YAML config."""
    return SmolLM2ChatTokenizer(path, max_seq_len, pad_to_max_seq_len)


class AlpacaToChat(Transform):
    """Alpaca row -> [user, assistant] messages, the user turn masked (see sft_data.py)."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        return {
            "messages": [
                Message(role="user", content=user_content(sample), masked=True),
                Message(role="assistant", content=sample["output"], masked=False),
            ]
        }


def alpaca_chat_dataset(tokenizer: ModelTokenizer, data_files: str) -> SFTDataset:
    """A local Alpaca JSON file (instruction/input/output) as a chat SFT dataset."""
    return SFTDataset(
        source="json",
        data_files=data_files,
        split="train",
        message_transform=AlpacaToChat(),
        model_transform=tokenizer,
    )
