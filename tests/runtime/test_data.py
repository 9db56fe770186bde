"""runtime.data: file formats, SFT layouts, error messages, train/val split, real demo data, and
`infinite_batches` (epoch order, resume position)."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pytest
import torch

from runtime.data import load_rows, split_train_val, to_messages, to_unpaired

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
]


def write_json(path: Path, rows) -> str:
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return str(path)


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def convert(rows: list[dict], source: str = "src") -> list[list[dict]]:
    return [to_messages(row, i, source) for i, row in enumerate(rows)]


# --- layouts ----------------------------------------------------------------------------------


def test_messages_layout_json(tmp_path):
    source = write_json(tmp_path / "d.json", [{"messages": CHAT, "id": 7}])
    rows = load_rows(source)
    assert rows == [{"messages": CHAT, "id": 7}]
    assert convert(rows) == [CHAT]


def test_sharegpt_layout_jsonl(tmp_path):
    sharegpt = [{"from": "system", "value": "Be brief."}]
    sharegpt += [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    rows = [{"conversations": sharegpt}, {"conversations": CHAT}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n   \n" + json.dumps(rows[1]) + "\n")
    assert convert(load_rows(str(path))) == [CHAT, CHAT]


def test_alpaca_layout_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "instruction": ["Add.", "Greet."],
            "input": ["2 and 3", ""],
            "output": ["5", "Hello"],
            "system": ["Be brief.", None],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    got = convert(load_rows(str(tmp_path / "d.parquet")))
    assert got == [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add.\n\n2 and 3"},
            {"role": "assistant", "content": "5"},
        ],
        [{"role": "user", "content": "Greet."}, {"role": "assistant", "content": "Hello"}],
    ]


def test_prompt_completion_and_response_layouts():
    user_assistant = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert to_messages({"prompt": "Q", "completion": "A"}, 0, "s") == user_assistant
    assert to_messages({"prompt": "Q", "response": "A"}, 0, "s") == user_assistant
    conversational = {"prompt": CHAT[:2], "completion": CHAT[2:]}  # TRL conversational format
    assert to_messages(conversational, 0, "s") == CHAT


def test_json_file_with_json_lines_content(tmp_path):
    source = write_jsonl(tmp_path / "d.json", [{"prompt": "Q", "response": "A"}] * 3)
    assert len(load_rows(source)) == 3


def test_directory_goes_to_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    class FakeDataset:
        def to_list(self):
            return [{"messages": CHAT}]

    def fake_load_dataset(source, split):
        calls.append((source, split))
        return FakeDataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_rows(str(tmp_path), split="validation") == [{"messages": CHAT}]
    assert load_rows("org/some-dataset") == [{"messages": CHAT}]
    assert calls == [(str(tmp_path), "validation"), ("org/some-dataset", "train")]


def test_datasets_failure_is_explained(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def failing_load_dataset(source, split):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", failing_load_dataset)
    with pytest.raises(ValueError, match=r"could not load 'org/x'.*hub unreachable.*\.jsonl"):
        load_rows("org/x")


# --- file errors ------------------------------------------------------------------------------


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "c", \n')
    with pytest.raises(
        ValueError,
        match=rf"^{path}:3: invalid JSON \(Expecting property name.*: column 17\); each line",
    ):
        load_rows(str(path))


def test_malformed_json_names_position(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"a": 1},\n {"b": }]')
    with pytest.raises(ValueError, match=rf"^{path}:2:\d+: invalid JSON"):
        load_rows(str(path))


@pytest.mark.parametrize(
    ("name", "text"), [("e.json", ""), ("e.json", "[]"), ("e.jsonl", "\n \n"), ("e.jsonl", "")]
)
def test_empty_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path}: no rows"):
        load_rows(str(path))


def test_non_utf8_names_byte_offset(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "response": "x"}\n')
    with pytest.raises(ValueError, match=rf"^{path}: not valid UTF-8 at byte offset 15"):
        load_rows(str(path))


def test_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"messages": CHAT}]).encode())
    assert load_rows(str(path)) == [{"messages": CHAT}]


def test_non_object_rows(tmp_path):
    source = write_json(tmp_path / "d.json", [{"messages": CHAT}, ["not", "a", "row"]])
    with pytest.raises(ValueError, match=r"d\.json row 1: expected a JSON object, got list"):
        load_rows(source)
    source = write_json(tmp_path / "obj.json", {"data": [{"messages": CHAT}]})
    with pytest.raises(ValueError, match=r"expected a JSON list .* keys \['data'\]"):
        load_rows(source)
    source = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, 3])
    with pytest.raises(ValueError, match=r"d\.jsonl:2: expected a JSON object, got int"):
        load_rows(source)


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'"):
        load_rows(str(tmp_path / "d.csv"))


# --- row errors -------------------------------------------------------------------------------


def test_missing_columns_names_row_and_keys():
    with pytest.raises(
        ValueError, match=r"^f\.json row 4: expected one of the columns .*'messages'"
    ):
        to_messages({"question": "q", "answer": "a"}, 4, "f.json")
    with pytest.raises(ValueError, match=r"\(found: \['answer', 'question'\]\)"):
        to_messages({"question": "q", "answer": "a"}, 4, "f.json")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [*CHAT[:2], {"role": "assistant", "content": 3}]},
            r"^s row 0: messages\[2\]\.content must be a string, got int",
        ),
        (
            {"conversations": [{"from": "bot", "value": "x"}]},
            r"conversations\[0\]\.from is 'bot'; known roles are",
        ),
        ({"messages": [{"text": "x"}]}, r"messages\[0\] must have `role` and `content`"),
        ({"messages": "hi"}, r"`messages` must be a list"),
        ({"messages": CHAT[:2]}, r"^s row 0: no assistant message"),
        ({"instruction": ["x"], "output": "y"}, r"`instruction` must be a string, got list"),
        ({"instruction": "x", "input": 3, "output": "y"}, r"`input` must be a string or null"),
        ({"prompt": 1, "completion": "y"}, r"`prompt` must be a string or a message list"),
    ],
)
def test_row_errors(row, message):
    with pytest.raises(ValueError, match=message):
        to_messages(row, 0, "s")


def test_prompt_only_conversation_allowed_when_asked():
    assert to_messages({"messages": CHAT[:2]}, 0, "s", require_assistant=False) == CHAT[:2]


# --- train/val split --------------------------------------------------------------------------


def test_split_train_val():
    items = list(range(100))
    train, val = split_train_val(items, 0.1, seed=0)
    assert len(val) == 10 and sorted(train + val) == items
    assert split_train_val(items, 0.1, seed=0) == (train, val)  # deterministic
    assert split_train_val(items, 0.1, seed=1)[1] != val
    assert split_train_val(items[:3], 0.01, seed=0)[1] != []  # at least one val item
    assert len(split_train_val(items[:2], 0.99, seed=0)[0]) == 1  # at least one train item
    assert split_train_val(items, 0.0, seed=0) == (items, [])  # file order: the sampler shuffles
    assert train == sorted(train) and val == sorted(val) and sorted(train + val) == items
    assert split_train_val(items[:1], 0.5, seed=0) == ([0], [])
    with pytest.raises(ValueError, match="val_fraction=1.0"):
        split_train_val(items, 1.0, seed=0)


# --- real demo data ---------------------------------------------------------------------------


def test_real_alpaca_demo():
    from generator.assets import ensure_dataset

    source = str(ensure_dataset("alpaca_en_demo.json"))
    rows = load_rows(source)
    assert len(rows) == 999
    conversations = convert(rows, source)
    assert all([m["role"] for m in c] == ["user", "assistant"] for c in conversations)
    with_input = [i for i, r in enumerate(rows) if r["input"]]
    assert with_input
    i = with_input[0]
    expected = rows[i]["instruction"] + "\n\n" + rows[i]["input"]
    assert conversations[i][0]["content"] == expected
    assert conversations[i][1]["content"] == rows[i]["output"]


def test_real_dpo_demo_conversations():
    from generator.assets import ensure_dataset

    source = str(ensure_dataset("dpo_en_demo.json"))
    rows = load_rows(source)
    assert len(rows) == 300
    for i, row in enumerate(rows):
        prompt = to_messages(
            {"conversations": row["conversations"]}, i, source, require_assistant=False
        )
        assert prompt[-1]["role"] == "user"
        assert {m["role"] for m in prompt} <= {"system", "user", "assistant"}
        chosen = to_messages({"conversations": row["conversations"] + [row["chosen"]]}, i, source)
        assert chosen[-1] == {"role": "assistant", "content": row["chosen"]["value"]}
    with pytest.raises(ValueError, match=rf"{source} row 0: no assistant message"):
        to_messages(rows[0], 0, source)


def test_unpaired_rows_and_pairs_become_kto_examples():
    """TRL's unpaired layout (strings or conversational) is one example; a pair of any preference
    layout is two, chosen desirable then rejected undesirable; the errors name row and key."""
    user = [{"role": "user", "content": "Hi"}]
    reply = [{"role": "assistant", "content": "Hello"}]
    assert to_unpaired({"prompt": "Hi", "completion": "Hello", "label": False}, 0, "s") == [
        {"prompt": user, "completion": reply, "label": False}
    ]
    assert to_unpaired({"messages": CHAT[:2], "completion": reply, "label": True}, 0, "s") == [
        {"prompt": CHAT[:2], "completion": reply, "label": True}
    ]
    no = [{"role": "assistant", "content": "No."}]
    assert to_unpaired({"prompt": "Hi", "chosen": "Hello", "rejected": "No."}, 0, "s") == [
        {"prompt": user, "completion": reply, "label": True},
        {"prompt": user, "completion": no, "label": False},
    ]
    for row, message in [
        ({"prompt": "Hi", "completion": "Hello", "label": "true"}, r"s row 3: `label` must be true \(desirable\) or false \(undesirable\), got str 'true'"),
        ({"prompt": "Hi", "completion": "Hello", "label": None}, r"got null None"),
        ({"prompt": "Hi", "label": True}, r"s row 3: missing key `completion` \(found: \['label', 'prompt'\]\)"),
        ({"completion": "Hello", "label": True}, r"s row 3: missing the prompt: `prompt`, `conversations` or `messages`"),
        ({"prompt": "Hi", "completion": " ", "label": True}, r"s row 3: `completion` has no non-empty assistant reply"),
        ({"prompt": "Hi", "chosen": "Hello"}, r"s row 3: missing key `rejected`"),
        ({"text": "Hi"}, r"s row 3: expected `completion` and `label`"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            to_unpaired(row, 3, "s")


def test_pad_with_unsupervised_copies():
    from runtime.data import pad_with_unsupervised_copies

    examples = [{"id": i, "input_ids": [i] * (i + 1), "labels": [i] * (i + 1)} for i in range(5)]
    padded = pad_with_unsupervised_copies(examples, 4)
    assert len(padded) == 8 and padded[:5] == examples
    for copy, source in zip(padded[5:], examples[:3], strict=True):
        assert copy["input_ids"] == source["input_ids"] and copy["id"] == source["id"]
        assert copy["labels"] == [-100] * len(source["labels"])
    assert examples[0]["labels"] == [0]  # the originals are untouched
    assert pad_with_unsupervised_copies(examples, 5) == examples
    assert pad_with_unsupervised_copies(examples, 1) == examples
    assert pad_with_unsupervised_copies([], 4) == []


def _loader(data: list, rank: int, replicas: int = 2, batch_size: int = 2):
    """The scripts' training loader over `data`: shuffled, drop_last, resumable sampler."""
    from torch.utils.data import DataLoader

    from runtime import ResumableDistributedSampler

    sampler = ResumableDistributedSampler(
        data, num_replicas=replicas, rank=rank, shuffle=True, seed=5, drop_last=True
    )
    return DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)


def _take(batches, n: int) -> list:
    return [(position, batch.tolist()) for position, batch in itertools.islice(batches, n)]


def test_infinite_batches_walks_the_epochs_in_the_samplers_order():
    from runtime import infinite_batches

    data = list(range(11))  # 2 ranks x 2 per batch: 2 batches per epoch, 3 examples left over
    for rank in (0, 1):
        loader = _loader(data, rank)
        got = _take(infinite_batches(loader), 6)
        assert [p for p, _ in got] == [(0, 4), (0, 8), (1, 4), (1, 8), (2, 4), (2, 8)]
        for epoch in range(3):
            loader.sampler.set_position(epoch, 0)
            order = list(loader.sampler)  # this rank's share of the epoch's permutation
            assert [i for _, b in got[2 * epoch : 2 * epoch + 2] for i in b] == order[:4]
        assert got[0][1] != got[2][1]  # reshuffled every epoch


@pytest.mark.parametrize("stop", [1, 2, 3, 5])  # mid-epoch, at an epoch's end, later epochs
def test_infinite_batches_resumes_where_the_run_stopped(stop):
    """A fresh loader started at the position the run had after `stop` batches yields exactly
    the batches (and positions) the uninterrupted run yields next, on every rank."""
    from runtime import infinite_batches

    data = list(range(11))
    for rank in (0, 1):
        uninterrupted = _take(infinite_batches(_loader(data, rank)), 8)
        (epoch, samples), _ = uninterrupted[stop - 1]
        resumed = _take(infinite_batches(_loader(data, rank), epoch, samples), 8 - stop)
        assert resumed == uninterrupted[stop:]


def test_infinite_batches_without_a_full_batch_raises_instead_of_looping():
    from runtime import infinite_batches

    with pytest.raises(ValueError, match="epoch 0 of the data loader has no batch of 4"):
        next(infinite_batches(_loader(list(range(7)), 0, batch_size=4)))


def test_pad_batch_pads_each_key_with_its_value_and_counts_real_tokens():
    from runtime.data import pad_batch

    rows = [
        {"id": 7, "input_ids": [5, 6, 7], "labels": [6, 7, -100]},
        {"id": 2, "input_ids": [9], "labels": [-100]},
    ]
    batch = pad_batch(rows, {"input_ids": 0, "labels": -100}, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [9, 0, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, -100, -100], [-100] * 4]
    assert batch["num_tokens"].item() == 4 and batch["sample_ids"].tolist() == [7, 2]
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    wide = pad_batch(rows, {"input_ids": 1}, pad_to=6, ids=[3])  # DPO: one id for a pair's rows
    assert wide["input_ids"].shape == (2, 6) and wide["sample_ids"].tolist() == [3]


def test_build_dataloader_shards_disjointly_fills_evaluation_and_names_the_option():
    from runtime.data import build_dataloader, pad_batch

    examples = [{"id": i, "input_ids": [i + 1], "labels": [i + 1]} for i in range(10)]
    collate = functools.partial(pad_batch, pad_values={"input_ids": 0, "labels": -100})
    train = [build_dataloader(examples, collate, 2, r, 2, seed=0, train=True) for r in range(2)]
    seen = [[i for b in loader for i in b["sample_ids"].tolist()] for loader in train]
    assert (
        len(train[0]) == len(train[1]) == 2
    )  # 10 rows over 2 ranks, batches of 2: the last dropped
    assert not set(seen[0]) & set(seen[1]) and len(seen[0]) == len(seen[1]) == 4
    # evaluation: 10 rows on 3 ranks -> 2 unsupervised copies, so every rank runs 2 batches
    val = [build_dataloader(examples, collate, 2, r, 3, seed=0, train=False) for r in range(3)]
    batches = [list(loader) for loader in val]
    assert [len(b) for b in batches] == [2, 2, 2]
    supervised = sum(int((b["labels"] != -100).sum()) for rank in batches for b in rank)
    assert supervised == 10  # the copies add no supervised token
    repeat = build_dataloader(
        examples, collate, 2, 2, 3, seed=0, train=False, unsupervised_fill=False
    )
    assert sum(int((b["labels"] != -100).sum()) for b in repeat) == 4  # the sampler repeated rows
    with pytest.raises(
        ValueError,
        match=r"3 training pairs give no full micro-batch of 2 on each of 2 ranks; lower --micro_batch_size",
    ):
        build_dataloader(examples[:3], collate, 2, 0, 2, seed=0, train=True, what="pairs")
