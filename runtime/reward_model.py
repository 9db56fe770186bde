"""Reward models: a decoder with a scalar `score` head, saved as a Hugging Face
sequence-classification checkpoint, and read back as a reward function for GRPO.

The RM script (`scaffold new --algo rm`) trains `SequenceClassifier(num_labels=1)` with the
Bradley-Terry loss; this module is its bookkeeping: which padding token the checkpoint declares,
which token of a row is scored, loading a causal LM's decoder under a fresh head, the save in
Hugging Face layout, and `RewardModelFunction` (a saved RM as a plain reward function).

Pooling, as transformers' `GenericForSequenceClassification` (Llama, Qwen2, Qwen3, Qwen3-MoE):
the score of a row is the head at the rightmost token that is not `config.pad_token_id` (left or
right padding alike). A padding token the chat template itself writes (SmolLM2's pad is its
end-of-turn `<|im_end|>`) could be the last real token of a row; `reward_pad_token_id` picks one
the template never writes, and the saved tokenizer pads with it too.

Reference:
    Ouyang et al. 2022, "Training language models to follow instructions with human feedback",
    arXiv:2203.02155, sec. 3.5 (a scalar head on the last token); Hugging Face TRL's
    RewardTrainer (AutoModelForSequenceClassification, num_labels=1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from runtime.checkpoint import (
    checkpoint_shapes,
    copy_tokenizer_files,
    load_hf_checkpoint,
    read_hf_config,
    save_hf_checkpoint,
)
from runtime.dtensors import copy_into
from runtime.models.args import HF_SEQUENCE_CLASSIFICATION_ARCHITECTURES, ModelArgs
from runtime.models.llama import SequenceClassifier, build_sequence_classifier
from runtime.tokenizer import Tokenizer

# A conversation whose rendering shows which special tokens the chat template writes.
_PROBE = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
# HF's default init of a new head's weights when config.json has no initializer_range
_HF_INITIALIZER_RANGE = 0.02


def reward_pad_token_id(tokenizer: Tokenizer) -> int:
    """The padding id a reward model pads with and declares as `config.pad_token_id`.

    The tokenizer's pad token when the chat template never writes it, else its unk token when
    the template never writes that: a pad the template writes (SmolLM2: pad = eos = `<|im_end|>`)
    would make transformers skip a row's last real token when it is that token (a row cut at
    max_seq_len right after it).

    Raises:
        ValueError: neither token is set apart from the template's own tokens; the message says
            to set `pad_token` in tokenizer_config.json.
    """
    written = set(tokenizer.encode(tokenizer.apply_chat_template(_PROBE)))
    for key in ("pad_token", "unk_token"):
        token = tokenizer.special_token(key)
        token_id = tokenizer.token_to_id(token) if token is not None else None
        if token_id is not None and token_id not in written:
            return token_id
    raise ValueError(
        f"{tokenizer.source}: the tokenizer's pad_token ({tokenizer.special_token('pad_token')!r}) "
        f"and unk_token ({tokenizer.special_token('unk_token')!r}) are unset or written by the chat "
        "template, so a reward model could not tell a row's last token from padding; set "
        "`pad_token` in tokenizer_config.json to a special token the template never writes"
    )


def score_index(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """The position each row is scored at: its rightmost token that is not `pad_token_id`
    (transformers' rule; 0 for a row of padding only).

    Args:
        input_ids: [B, S] int64.

    Returns:
        [B] int64.
    """
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(-1)


def load_reward_weights(model: nn.Module, model_dir: str | os.PathLike, seed: int) -> None:
    """Fill a `SequenceClassifier` (plain or FSDP-sharded, after `to_empty`) from `model_dir`.

    A saved reward model (its checkpoint has `score.weight`) loads whole. A causal LM gives the
    decoder (`model.*`; its `lm_head` is not used) and the new head is drawn from
    N(0, initializer_range), as transformers initialises `score` (TRL's RewardTrainer starts from
    that); the draw depends on `seed` alone, so every rank holds the same head.

    Raises:
        ValueError: a decoder weight is missing from the checkpoint, or a shape differs
            (`load_hf_checkpoint`).
    """
    shapes = checkpoint_shapes(model_dir)
    if "score.weight" in shapes:
        load_hf_checkpoint(model, model_dir)
        return
    decoder = [n for n, _ in model.named_parameters() if n != "score.weight"]
    missing = [n for n in decoder if n not in shapes]
    if missing:
        raise ValueError(
            f"{model_dir}: the checkpoint lacks decoder weights {missing[:4]}"
            f"{' and more' if len(missing) > 4 else ''}; expected a causal LM or a reward model "
            "of the same architecture"
        )
    load_hf_checkpoint(model, model_dir, strict=False, exclude=("score.weight",))
    std = read_hf_config(model_dir).get("initializer_range", _HF_INITIALIZER_RANGE)
    generator = torch.Generator().manual_seed(seed)
    head = model.score.weight
    copy_into(head, torch.randn(tuple(head.shape), generator=generator) * std)


def reward_model_config(model_dir: str | os.PathLike, pad_token_id: int) -> dict:
    """config.json of the reward model trained from `model_dir`: the source's, with the
    `*ForSequenceClassification` architecture, one label and `pad_token_id` (what
    `AutoModelForSequenceClassification` reads to pool)."""
    config = read_hf_config(model_dir)
    config["architectures"] = [HF_SEQUENCE_CLASSIFICATION_ARCHITECTURES[config["model_type"]]]
    config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    config["pad_token_id"] = pad_token_id
    return config


def save_reward_model(
    model: nn.Module,
    model_dir: str | os.PathLike,
    path: str | os.PathLike,
    tokenizer: Tokenizer,
    pad_token_id: int,
    config: dict,
    is_main: bool,
) -> None:
    """The trained reward model in Hugging Face layout: model.safetensors (`model.*`,
    `score.weight`) and `reward_model_config`'s config.json, the tokenizer files of `model_dir`
    with `pad_token` set to the model's padding token (so `tokenizer(..., padding=True)` pads as
    it pools), and the run's resolved config as training_config.json.

    Collective under FSDP (every rank calls it); rank 0 (`is_main`) writes.
    """
    save_hf_checkpoint(model, path, reward_model_config(model_dir, pad_token_id))
    if not is_main:
        return
    path = Path(path)
    copied = copy_tokenizer_files(model_dir, path)
    pad = tokenizer.id_to_token(pad_token_id)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if name in copied:
            data = json.loads((path / name).read_text(encoding="utf-8"))
            data["pad_token"] = pad
            (path / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    (path / "training_config.json").write_text(json.dumps(config, indent=2))


# path -> (model, tokenizer, pad id, max tokens): each process loads a reward model once
_LOADED: dict[str, tuple[SequenceClassifier, Tokenizer, int, int]] = {}


class RewardModelFunction:
    """A saved reward model as a GRPO reward function: `fn(prompt=..., completion=..., **kwargs)`
    -> the RM's score of the conversation (user: prompt, assistant: completion) rendered with the
    RM's chat template, as its training rendered a pair's replies.

    The instance pickles as its path (Ray ships it to the reward workers); each process loads the
    weights once, at its first call, in fp32 on the CPU (the reward workers are CPU actors), and
    keeps them for the process's life. `__name__` is "reward_model" (the GRPO script's per-function
    metric key).

    Args:
        path: a reward-model directory (`save_reward_model`'s layout).

    Raises:
        ValueError: config.json is not a one-label sequence classifier with a pad_token_id, or
            its decoder is not one the runtime builds (`ModelArgs.from_hf_config`).
    """

    __name__ = "reward_model"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(Path(path).expanduser().resolve())
        config = read_hf_config(self.path)
        archs = config.get("architectures") or []
        where = f"reward_model={str(path)!r}: config.json"
        if not set(archs) & set(HF_SEQUENCE_CLASSIFICATION_ARCHITECTURES.values()):
            raise ValueError(
                f"{where} has architectures {archs}, not a *ForSequenceClassification; expected a "
                "reward model (the out_dir/model of `scaffold new --algo rm`)"
            )
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if labels != 1:
            raise ValueError(
                f"{where} has {labels} labels; a reward model has one (a scalar score)"
            )
        if config.get("pad_token_id") is None:
            raise ValueError(
                f"{where} has no pad_token_id; the score is taken at the last token that is not "
                "padding, so set it"
            )
        ModelArgs.from_hf_config(config, source=str(Path(self.path) / "config.json"))

    def __call__(self, prompt, completion: str, **kwargs) -> float:
        return self.score([prompt], [completion])[0]

    def score(self, prompts: list, completions: list[str]) -> list[float]:
        """Scores of B conversations in one forward.

        Args:
            prompts: per conversation a user message (str) or a message list ({"role", "content"}).
            completions: per conversation the assistant's reply.

        Returns:
            B floats (fp32 scores). Rows longer than the RM's training max_seq_len are cut at
            the end, as its training cut them.
        """
        model, tokenizer, pad_id, max_len = self._load()
        rows = []
        for prompt, completion in zip(prompts, completions, strict=True):
            turns = (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            )
            text = tokenizer.apply_chat_template(
                [*turns, {"role": "assistant", "content": completion}]
            )
            rows.append(tokenizer.encode(text)[:max_len])
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
        with torch.no_grad():
            scores = model(input_ids, score_index(input_ids, pad_id))  # [B, 1]
        return scores[:, 0].float().tolist()

    def _load(self) -> tuple[SequenceClassifier, Tokenizer, int, int]:
        if self.path not in _LOADED:
            config = read_hf_config(self.path)
            args = ModelArgs.from_hf_config(config, source=self.path)
            model = build_sequence_classifier(args, num_labels=1, device="cpu")
            load_hf_checkpoint(model, self.path)
            model.init_rope()
            training = Path(self.path) / "training_config.json"
            trained_len = (
                json.loads(training.read_text()).get("max_seq_len") if training.is_file() else None
            )
            max_len = trained_len or args.max_position_embeddings
            _LOADED[self.path] = (
                model.eval(),
                Tokenizer.from_dir(self.path),
                config["pad_token_id"],
                max_len,
            )
        return _LOADED[self.path]

    def __repr__(self) -> str:
        return f"RewardModelFunction({self.path!r})"
