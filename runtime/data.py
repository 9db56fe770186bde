"""Loading SFT rows and normalising them to chat messages.

`load_rows` reads a local `.json` (a list of objects; JSON Lines content is accepted too), `.jsonl`
or `.parquet` file, or hands a directory or Hub name to `datasets.load_dataset`. `to_messages` turns
the common SFT layouts into `[{"role", "content"}, ...]`:

| layout            | columns                                             | example source        |
|-------------------|-----------------------------------------------------|-----------------------|
| OpenAI messages   | `messages`: [{role, content}]                       | TRL, OpenAI fine-tune |
| ShareGPT          | `conversations`: [{from, value}] or [{role, content}] | LLaMA-Factory, Vicuna |
| Alpaca            | `instruction`, `input` (optional), `output`, `system` (optional) | Stanford Alpaca |
| prompt/completion | `prompt`, `completion` (strings or message lists)   | TRL                   |
| prompt/response   | `prompt`, `response`                                | many Hub sets         |

Preference rows (DPO) are normalised by `to_preference` to a prompt conversation plus the chosen
and the rejected continuation:

| layout                 | columns                                                        | example source |
|------------------------|----------------------------------------------------------------|----------------|
| TRL explicit prompt    | `prompt`, `chosen`, `rejected`: strings or message lists       | TRL, UltraFeedback binarized |
| TRL implicit prompt    | `chosen`, `rejected`: full conversations sharing the prompt    | Anthropic HH (TRL form) |
| ShareGPT preference    | `conversations` + `chosen`/`rejected` {from, value} (or lists) | LLaMA-Factory dpo_en_demo |
| messages + preference  | `messages` + `chosen`/`rejected`                               | |

KTO's unpaired rows are normalised by `to_unpaired` to examples of a prompt, one continuation and
its label: TRL's unpaired preference layout (`prompt`, `conversations` or `messages`; `completion`;
`label`, true = desirable), or any preference row above, which gives two (chosen: desirable,
rejected: undesirable), as TRL's `unpair_preference_dataset`.

Every error names the file (or source), the row and the key, so a bad row in a 100k-row file is
found without a debugger. No tensors here. `infinite_batches` walks a resumable loader over the
epochs, for the training loop.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
}
LAYOUTS = (
    "'messages'",
    "'conversations'",
    "'instruction'+'output'",
    "'prompt'+'completion'",
    "'prompt'+'response'",
)


def load_rows(source: str, split: str = "train") -> list[dict]:
    """Load a dataset as a list of row dicts.

    Args:
        source: a local `.json` / `.jsonl` / `.parquet` file; anything else (a directory, a Hub
            dataset name) goes to `datasets.load_dataset(source, split=split)`.
        split: the split to load through `datasets` (ignored for local files).

    Returns:
        The rows, in file order.

    Raises:
        FileNotFoundError: `source` ends in .json/.jsonl/.parquet but no such file exists.
        ValueError: the file is not UTF-8, has invalid JSON, a row that is not an object, no rows,
            an unsupported suffix, or `datasets` could not load `source`.
    """
    path = Path(source).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".json":
            rows = _load_json(path)
        elif suffix == ".jsonl":
            rows = _parse_jsonl(path, _read_utf8(path))
        elif suffix == ".parquet":
            rows = _load_parquet(path)
        else:
            raise ValueError(
                f"{path}: unsupported file type {suffix!r}; accepted local files are "
                f"{', '.join(FILE_SUFFIXES)} (or pass a directory / Hub dataset name that "
                "datasets.load_dataset can read)."
            )
    elif path.suffix.lower() in FILE_SUFFIXES:
        raise FileNotFoundError(f"{path}: no such file; check the data path in the config.")
    else:
        rows = _load_with_datasets(source, split)
    if not rows:
        raise ValueError(f"{source}: no rows; point the data path at a non-empty dataset.")
    return rows


def _read_utf8(path: Path) -> str:
    """The file's text; a leading UTF-8 BOM is dropped."""
    data = path.read_bytes()
    bom = b"\xef\xbb\xbf"
    skip = len(bom) if data.startswith(bom) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = e.start + skip
        line = data.count(b"\n", 0, offset) + 1  # the row's line in a JSON Lines file
        raise ValueError(
            f"{path}: not valid UTF-8 at byte offset {offset} (line {line}: {e.reason}); "
            "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
        ) from e


def _load_json(path: Path) -> list[dict]:
    """A .json file holding a list of objects (or, like `datasets`, JSON Lines)."""
    text = _read_utf8(path)
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several top-level values: JSON Lines saved as .json
            return _parse_jsonl(path, text)
        raise ValueError(
            f"{path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg}); fix the file at that position."
        ) from e
    if not isinstance(data, list):
        found = f"an object with keys {sorted(data)}" if isinstance(data, dict) else _kind(data)
        raise ValueError(
            f"{path}: expected a JSON list of row objects (or JSON Lines), got {found}; "
            "store the rows as a top-level list."
        )
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ValueError(f"{path} row {i}: expected a JSON object, got {_kind(row)}.")
    return data


def _parse_jsonl(path: Path, text: str) -> list[dict]:
    """Parse JSON Lines text: one object per line, blank lines skipped."""
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: invalid JSON ({e.msg}: column {e.colno}); "
                "each line must hold one complete JSON object."
            ) from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {_kind(row)}.")
        rows.append(row)
    return rows


def _load_parquet(path: Path) -> list[dict]:
    """Rows of a .parquet file."""
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses
        raise ValueError(f"{path}: could not read as Parquet ({e}); check the file.") from e


def _load_with_datasets(source: str, split: str) -> list[dict]:
    """Rows from `datasets.load_dataset(source, split=split)`."""
    try:
        import datasets

        dataset = datasets.load_dataset(source, split=split)
    except Exception as e:  # datasets raises many unrelated types (network, builder, split)
        raise ValueError(
            f"could not load {source!r} (split {split!r}) with datasets.load_dataset: "
            f"{type(e).__name__}: {str(e).rstrip('.')}. "
            f"Local paths ending in {', '.join(FILE_SUFFIXES)} are read "
            "directly; anything else must be a directory or a Hub dataset that "
            "datasets.load_dataset can read (the Hub needs network access)."
        ) from e
    return dataset.to_list()


def _kind(value: Any) -> str:
    """Short type name for error messages."""
    return "null" if value is None else type(value).__name__


def to_messages(
    row: dict, index: int, source: str, *, require_assistant: bool = True
) -> list[dict]:
    """Normalise one row of a common SFT layout to chat messages.

    Args:
        row: one row from `load_rows`; the layout is picked by its columns (see module docstring),
            trying messages, conversations, instruction/output, prompt/completion, prompt/response.
        index: the row's index, for error messages.
        source: the file or dataset name, for error messages.
        require_assistant: demand at least one assistant message with non-blank content (SFT).
            Set False to convert a prompt-only conversation (e.g. the `conversations` of a DPO
            row).

    Returns:
        [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]

    Raises:
        ValueError: no known layout, an unknown role, a non-string content, or no assistant
            message with content; the message names the source, row and key.
    """
    where = f"{source} row {index}"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a dict (one row), got {_kind(row)}.")
    if "messages" in row:
        messages = _message_list(row["messages"], "messages", where)
    elif "conversations" in row:
        messages = _message_list(row["conversations"], "conversations", where)
    elif "instruction" in row and "output" in row:
        messages = _from_alpaca(row, where)
    elif "prompt" in row and ("completion" in row or "response" in row):
        answer_key = "completion" if "completion" in row else "response"
        messages = _turn(row["prompt"], "user", "prompt", where)
        messages += _turn(row[answer_key], "assistant", answer_key, where)
    else:
        raise ValueError(
            f"{where}: expected one of the columns {', '.join(LAYOUTS)} (found: {sorted(row)}); "
            "rename the columns or convert the rows to `messages`."
        )
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    if require_assistant and not replies:
        raise ValueError(
            f"{where}: no assistant message, so there is nothing to train on; add the answer "
            "(role 'assistant' / from 'gpt') or drop the row."
        )
    if require_assistant and not any(r.strip() for r in replies):
        raise ValueError(
            f"{where}: every assistant reply is empty, so there is nothing to train on but the "
            "end-of-turn token; fill in the answer or drop the row."
        )
    return messages


def _message_list(value: Any, key: str, where: str) -> list[dict]:
    """Validate a list of {role, content} or ShareGPT {from, value} messages."""
    if not isinstance(value, list):
        raise ValueError(
            f"{where}: `{key}` must be a list of {{role, content}} objects, got {_kind(value)}."
        )
    messages = []
    for i, message in enumerate(value):
        name = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: {name} must be an object, got {_kind(message)}.")
        if "role" in message and "content" in message:
            role_key, content_key = "role", "content"
        elif "from" in message and "value" in message:
            role_key, content_key = "from", "value"
        else:
            raise ValueError(
                f"{where}: {name} must have `role` and `content` (or ShareGPT `from` and "
                f"`value`) keys (found: {sorted(message)})."
            )
        role = message[role_key]
        if not isinstance(role, str) or role not in ROLE_ALIASES:
            raise ValueError(
                f"{where}: {name}.{role_key} is {role!r}; known roles are {sorted(ROLE_ALIASES)}."
            )
        content = message[content_key]
        if not isinstance(content, str):
            raise ValueError(
                f"{where}: {name}.{content_key} must be a string, got {_kind(content)}."
            )
        messages.append({"role": ROLE_ALIASES[role], "content": content})
    return messages


def _turn(value: Any, role: str, key: str, where: str) -> list[dict]:
    """A prompt/completion column: a plain string (one `role` message) or a message list."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return _message_list(value, key, where)
    raise ValueError(f"{where}: `{key}` must be a string or a message list, got {_kind(value)}.")


def _from_alpaca(row: dict, where: str) -> list[dict]:
    """Alpaca: user = instruction (+ "\\n\\n" + input when non-empty), assistant = output."""
    for key in ("instruction", "output"):
        if not isinstance(row[key], str):
            raise ValueError(f"{where}: `{key}` must be a string, got {_kind(row[key])}.")
    for key in ("input", "system"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise ValueError(f"{where}: `{key}` must be a string or null, got {_kind(row[key])}.")
    user = row["instruction"]
    if row.get("input"):
        user = f"{user}\n\n{row['input']}"
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": row["output"]})
    return messages


PREFERENCE_PROMPT_KEYS = ("prompt", "conversations", "messages")


def to_preference(row: dict, index: int, source: str) -> dict:
    """Normalise one preference row (DPO) to {"prompt", "chosen", "rejected"} message lists.

    Args:
        row: one row from `load_rows` (see the preference layouts in the module docstring).
        index: the row's index, for error messages.
        source: the file or dataset name, for error messages.

    Returns:
        {"prompt": [messages], "chosen": [messages], "rejected": [messages]}: the shared
        conversation, then each continuation (usually one assistant message; a string becomes
        one). prompt + chosen is the chosen conversation.

    Raises:
        ValueError: a missing `chosen` / `rejected` key, a bad message, an empty continuation or
            a continuation without an assistant message; the message names source, row and key.
    """
    where = f"{source} row {index}"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a dict (one row), got {_kind(row)}.")
    for key in ("chosen", "rejected"):
        if key not in row:
            # TRL's unpaired rows (completion + label) read only by the DPO script's kto loss
            unpaired = "completion" in row and "label" in row
            raise ValueError(
                f"{where}: missing key `{key}` (found: {sorted(row)}); a preference row needs "
                "`chosen` and `rejected` (plus `prompt`, `conversations` or `messages`)"
                + (
                    "; this row is an unpaired (KTO) one, which --loss_type kto reads."
                    if unpaired
                    else "."
                )
            )
    prompt_key = next((k for k in PREFERENCE_PROMPT_KEYS if k in row), None)
    if prompt_key is None:  # TRL implicit prompt: two full conversations sharing a prefix
        chosen = _message_list(row["chosen"], "chosen", where)
        rejected = _message_list(row["rejected"], "rejected", where)
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        prompt = _turn(row[prompt_key], "user", prompt_key, where)
        chosen = _continuation(row["chosen"], "chosen", where)
        rejected = _continuation(row["rejected"], "rejected", where)
    for key, messages in (("chosen", chosen), ("rejected", rejected)):
        _require_reply(messages, key, where, "compare")
    if not prompt:
        raise ValueError(f"{where}: the prompt (`{prompt_key or 'chosen'}`) is empty; add it.")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def to_unpaired(row: dict, index: int, source: str) -> list[dict]:
    """Normalise one row to KTO's unpaired examples, {"prompt", "completion", "label"} each.

    Args:
        row: one row from `load_rows`: TRL's unpaired layout (`prompt`, `conversations` or
            `messages`, then `completion` and a bool `label`), or a preference row
            (`to_preference`'s layouts: it has `chosen` / `rejected` and no `completion`/`label`).
        index: the row's index, for error messages.
        source: the file or dataset name, for error messages.

    Returns:
        [{"prompt": [messages], "completion": [messages], "label": bool}]: one example for an
        unpaired row; two for a pair, its chosen reply (label True, desirable) then its rejected
        one (label False).

    Raises:
        ValueError: neither layout, a missing `completion` / `label` / prompt key, a `label`
            that is not true or false (1, "yes", null), a bad message, or an empty completion;
            the message names source, row and key.
    """
    where = f"{source} row {index}"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a dict (one row), got {_kind(row)}.")
    if "completion" not in row and "label" not in row:
        if "chosen" in row or "rejected" in row:  # a pair: two examples (TRL's unpairing)
            pref = to_preference(row, index, source)
            return [
                {"prompt": pref["prompt"], "completion": pref["chosen"], "label": True},
                {"prompt": pref["prompt"], "completion": pref["rejected"], "label": False},
            ]
        raise ValueError(
            f"{where}: expected `completion` and `label` (an unpaired row, with `prompt`, "
            f"`conversations` or `messages`) or `chosen` and `rejected` (a pair) (found: "
            f"{sorted(row)})."
        )
    for key in ("completion", "label"):
        if key not in row:
            raise ValueError(
                f"{where}: missing key `{key}` (found: {sorted(row)}); an unpaired row needs "
                "`completion` and `label` (true: desirable, false: undesirable), plus `prompt`, "
                "`conversations` or `messages`."
            )
    label = row["label"]
    if not isinstance(label, bool):
        raise ValueError(
            f"{where}: `label` must be true (desirable) or false (undesirable), got "
            f"{_kind(label)} {label!r}."
        )
    prompt_key = next((k for k in PREFERENCE_PROMPT_KEYS if k in row), None)
    if prompt_key is None:
        raise ValueError(
            f"{where}: missing the prompt: `prompt`, `conversations` or `messages` (found: "
            f"{sorted(row)})."
        )
    prompt = _turn(row[prompt_key], "user", prompt_key, where)
    completion = _continuation(row["completion"], "completion", where)
    _require_reply(completion, "completion", where, "train on")
    if not prompt:
        raise ValueError(f"{where}: the prompt (`{prompt_key}`) is empty; add it.")
    return [{"prompt": prompt, "completion": completion, "label": label}]


def _require_reply(messages: list[dict], key: str, where: str, purpose: str) -> None:
    """Raises ValueError (naming `where` and `key`) unless `messages` hold a non-empty assistant
    reply: without one there is nothing to `purpose`."""
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise ValueError(
            f"{where}: `{key}` has no non-empty assistant reply, so there is nothing to "
            f"{purpose}; fill it in or drop the row."
        )


def _continuation(value: Any, key: str, where: str) -> list[dict]:
    """A chosen/rejected column: a string, one {role, content}/{from, value} dict, or a list."""
    if isinstance(value, dict):
        return _message_list([value], key, where)
    return _turn(value, "assistant", key, where)


def prompt_messages(messages: list[dict]) -> list[dict]:
    """A conversation up to (not including) its last assistant message: the prompt that reply
    answers, which the script's end-of-run `sample` asks again by default."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    return messages if last is None else messages[:last]


def split_train_val(items: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """Split off a random validation part; both parts keep the items' original order.

    The training part is shuffled by the sampler, so keeping the file order here means that with
    val_fraction=0 the sampler sees exactly the file's items in the file's order, as torchtune's
    and TRL's samplers do (same seed, same sample sequence).

    Args:
        items: the examples (any objects).
        val_fraction: share of items for validation, in [0, 1). When > 0 and there are at least
            2 items, validation gets at least 1 item and training keeps at least 1.
        seed: selects the validation items; the same items and seed always give the same split.

    Returns:
        (train, val): lists of the items, each in the original relative order.

    Raises:
        ValueError: val_fraction outside [0, 1).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"val_fraction={val_fraction} must be in [0, 1); use e.g. 0.05 for 5% validation."
        )
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = int(len(items) * val_fraction)
    if val_fraction > 0 and len(items) >= 2:
        n_val = min(max(n_val, 1), len(items) - 1)
    val_ids = set(order[:n_val])
    val = [item for i, item in enumerate(items) if i in val_ids]
    train = [item for i, item in enumerate(items) if i not in val_ids]
    return train, val


def pad_with_unsupervised_copies(examples: list[dict], multiple: int) -> list[dict]:
    """Append copies of the first examples, with every label IGNORE_INDEX, until the count is a
    multiple of `multiple` (the data-parallel size).

    For evaluation: every rank then runs as many forwards (FSDP's collectives must pair up), and
    the copies add no loss and no supervised token, so a mean over supervised tokens is the same
    on any number of ranks. (`DistributedSampler` pads by repeating examples, which counts them
    twice.)

    Args:
        examples: dicts with a "labels" list (other keys are copied unchanged).
        multiple: >= 1.

    Returns:
        A new list: the examples, then len(examples) % multiple == 0 after the copies.
    """
    from runtime.loss import IGNORE_INDEX

    missing = -len(examples) % multiple if examples else 0
    copies = [
        {
            **examples[i % len(examples)],
            "labels": [IGNORE_INDEX] * len(examples[i % len(examples)]["labels"]),
        }
        for i in range(missing)
    ]
    return examples + copies


def infinite_batches(loader, epoch: int = 0, samples_consumed: int = 0) -> Iterator:
    """Yield ((epoch, samples_consumed), batch) forever, reshuffling every epoch.

    samples_consumed counts the examples of the epoch's global order used by all data-parallel
    ranks together, so a resumed run (also on another number of ranks) starts right after them;
    the yielded position is the one after that batch, i.e. what a checkpoint saved right then must
    record (`TrainState.epoch`, `.samples_consumed`).

    Args:
        loader: a DataLoader with a fixed `batch_size` whose sampler is a
            `ResumableDistributedSampler` (training: shuffle and drop_last).
        epoch, samples_consumed: where to start (0, 0 fresh; a resumed run's TrainState).

    Yields:
        ((epoch, samples_consumed), batch): the loader's batch and the position after it.

    Raises:
        ValueError: a whole epoch gave no batch (without it this would loop forever, yielding
            nothing); scripts check `len(loader)` first, with a message about their own options.
    """
    per_batch = loader.batch_size * loader.sampler.num_replicas  # one micro-batch on every rank
    while True:
        loader.sampler.set_position(epoch, samples_consumed)
        whole_epoch, yielded = samples_consumed == 0, False
        for batch in loader:
            samples_consumed += per_batch
            yielded = True
            yield (epoch, samples_consumed), batch
        if whole_epoch and not yielded:
            raise ValueError(
                f"epoch {epoch} of the data loader has no batch of {loader.batch_size} on each of "
                f"{loader.sampler.num_replicas} ranks: lower the micro-batch size or add data"
            )
        epoch, samples_consumed = epoch + 1, 0


def pad_batch(
    rows: list[dict],
    pad_values: dict[str, int],
    pad_to: int = 0,
    pad_to_multiple_of: int = 1,
    ids: list[int] | None = None,
) -> dict:
    """Right-pad token lists into [B, S] tensors: the batch of every recipe's `collate`.

    Args:
        rows: dicts with a list[int] under every key of `pad_values` (equal lengths within a row)
            and, unless `ids` is given, an int "id" (the row's number in the dataset).
        pad_values: key -> the value its padding takes (pad_token_id for input_ids, IGNORE_INDEX
            for labels, so padding is never supervised). The first key counts the tokens.
        pad_to: a minimum S (a fixed shape for benchmarks; 0 = the longest row).
        pad_to_multiple_of: S is rounded up to a multiple of it (tensor and context parallel
            split the sequence).
        ids: the batch's sample ids when they are not the rows' own (DPO: one id per pair, whose
            chosen and rejected sequences are two rows).

    Returns:
        {key: [B, S] int64 for each key of pad_values, "num_tokens": scalar int64 (the first
        key's non-padding tokens), "sample_ids": int64 (the rows' ids, [B], or `ids`)}.
    """
    import torch

    first = next(iter(pad_values))
    S = max(pad_to, max(len(row[first]) for row in rows))
    S = -(-S // pad_to_multiple_of) * pad_to_multiple_of
    batch = {}
    for key, value in pad_values.items():
        padded = torch.full((len(rows), S), value, dtype=torch.long)
        for i, row in enumerate(rows):
            padded[i, : len(row[key])] = torch.tensor(row[key], dtype=torch.long)
        batch[key] = padded
    batch["num_tokens"] = torch.tensor(sum(len(row[first]) for row in rows))
    batch["sample_ids"] = torch.tensor([row["id"] for row in rows] if ids is None else ids)
    return batch


def build_dataloader(
    examples: list[dict],
    collate_fn,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    train: bool,
    what: str = "examples",
    unsupervised_fill: bool = True,
):
    """The data loader of one data-parallel rank: a disjoint shard of `examples`.

    Training shuffles by (seed, epoch) and drops the last partial batch; the sampler
    (`ResumableDistributedSampler`) can start an epoch part-way, which is how a resumed run
    continues. Evaluation keeps the order, and every rank runs as many forwards (FSDP's
    collectives must pair up): with `unsupervised_fill` the examples are first filled up to a
    multiple of dp_size with copies that have no supervised token (`pad_with_unsupervised_copies`:
    they add no loss), else the sampler repeats examples as `DistributedSampler` does.

    Args:
        examples: the dataset (dicts that `collate_fn` batches).
        collate_fn: list[dict] -> batch dict.
        batch_size: examples per rank per forward (the micro-batch size).
        dp_rank, dp_size: this rank's place among the data-parallel ranks.
        seed: the shuffle's seed.
        train: shuffle and drop_last (True) or evaluation order (False).
        what: what the examples are called in the error ("examples", "pairs").
        unsupervised_fill: evaluation's fill (examples with a "labels" list); see above.

    Returns:
        A torch DataLoader of `collate_fn` batches.

    Raises:
        ValueError: train and the data give no full batch on each rank (the run could not take
            a step); the message names --micro_batch_size.
    """
    from torch.utils.data import DataLoader

    from runtime.train_state import ResumableDistributedSampler

    if not train and unsupervised_fill:
        examples = pad_with_unsupervised_copies(examples, dp_size)
    sampler = ResumableDistributedSampler(
        examples, num_replicas=dp_size, rank=dp_rank, shuffle=train, seed=seed, drop_last=train
    )
    loader = DataLoader(
        examples, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=train
    )
    if train and len(loader) == 0:
        raise ValueError(
            f"{len(examples)} training {what} give no full micro-batch of {batch_size} "
            f"on each of {dp_size} ranks; lower --micro_batch_size or add data"
        )
    return loader
