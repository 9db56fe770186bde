"""runtime.tokenizer: parity with transformers on the real SmolLM2 tokenizer, template features, spans."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import jinja2
import pytest

from runtime.data import load_rows, to_messages
from runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.fast  # in `make test-fast` (tests/README.md)

# A Llama-3-style template exercising the Jinja features real templates use: bos_token, loop.first /
# loop.last, raise_exception, tojson (no HTML escaping), strftime_now, namespace, loopcontrols and
# the {% generation %} tag.
LLAMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=0) %}"
    "{% if tools %}<|start_header_id|>tools<|end_header_id|>\n\n"
    "{{ tools | tojson(indent=2) }}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}{% endif %}"
    "{% if message['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
    "{% if loop.last and add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{% endfor %}"
    "{% if date %}[{{ ns.turns }} turns, {{ strftime_now('%Y') }}]{% endif %}"
)

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": " 5\n"},
    ],
    "unicode": [
        {"role": "user", "content": "Übersetze: 日本語 😀 & <tag> 'q' \"dq\"\n\ttab"},
        {"role": "assistant", "content": "Japanisch — ✓"},
    ],
}

STRINGS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "naïve café 日本語 😀 e\u0301",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # comment\n\n\n",
    "12345 + 67890 = 80235",
    "",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from generator.assets import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tok(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def make_dir(
    tmp_path: Path,
    model_dir: Path,
    config_update: dict | None = None,
    jinja: str | None = None,
    generation: dict | None = None,
) -> Path:
    """A tokenizer directory with SmolLM2's tokenizer.json and the given config files."""
    out = tmp_path / "tok"
    out.mkdir()
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.update(config_update or {})
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (out / "chat_template.jinja").write_text(jinja)
    if generation is not None:
        (out / "generation_config.json").write_text(json.dumps(generation))
    return out


# --- parity with transformers on the real tokenizer -------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(tok, hf_tok, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_default_system_prompt_injected(tok):
    text = tok.apply_chat_template(CONVERSATIONS["user_only"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("text", STRINGS)
def test_encode_decode_offsets_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    enc_ids, offsets = tok.encode_with_offsets(text)
    assert enc_ids == ids
    hf_offsets = hf_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert offsets == [tuple(o) for o in hf_offsets["offset_mapping"]]
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens_and_no_bos(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.eos_token_id == tok.pad_token_id == hf_tok.eos_token_id == 2
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert 2 in tok.stop_token_ids
    ids = tok.encode("Hello", add_special_tokens=True)
    assert ids == tok.encode("Hello") == hf_tok.encode("Hello")  # nothing prepended
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([2, *ids]) == "Hello"


# --- assistant spans --------------------------------------------------------------------------


def check_spans(tok: Tokenizer, messages: list[dict]) -> None:
    """Spans cover exactly `content<|im_end|>` of each assistant turn, on token boundaries."""
    text, spans = tok.render_with_assistant_spans(messages)
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    assert text == tok.apply_chat_template(messages)
    assert len(spans) == len(assistant)
    for (start, end), content in zip(spans, assistant, strict=True):
        assert text[:start].endswith("<|im_start|>assistant\n")
        assert text[start:end] == content + "<|im_end|>"
        assert text[end:].startswith("\n")
    ids, offsets = tok.encode_with_offsets(text)
    boundaries = {0} | {end for _, end in offsets}
    for start, end in spans:  # masking by position needs spans on token boundaries
        assert start in boundaries and end in boundaries
        inside = [i for i, (a, b) in zip(ids, offsets, strict=True) if start <= a and b <= end]
        assert tok.decode(inside, skip_special_tokens=False) == text[start:end]


def test_spans_on_real_alpaca_rows(tok):
    from generator.assets import ensure_dataset

    source = str(ensure_dataset("alpaca_en_demo.json"))
    rows = load_rows(source)
    for i in (0, 1, 2, 500, 998):
        check_spans(tok, to_messages(rows[i], i, source))


def test_spans_multi_turn_real_dpo_rows(tok):
    from generator.assets import ensure_dataset

    source = str(ensure_dataset("dpo_en_demo.json"))
    rows = load_rows(source)
    long_rows = [i for i, r in enumerate(rows) if len(r["conversations"]) >= 5][:3]
    assert long_rows
    for i in long_rows:
        row = {"conversations": rows[i]["conversations"] + [rows[i]["chosen"]]}
        messages = to_messages(row, i, source)
        assert sum(m["role"] == "assistant" for m in messages) >= 3
        check_spans(tok, messages)
    check_spans(tok, CONVERSATIONS["multi_turn"])
    check_spans(tok, CONVERSATIONS["unicode"])


def test_template_not_prefix_stable_raises(tmp_path, model_dir):
    # Puts the number of messages first: every longer conversation rewrites the start.
    template = (
        "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = Tokenizer.from_dir(make_dir(tmp_path, model_dir, jinja=template))
    with pytest.raises(ValueError, match="not prefix-stable"):
        tok.render_with_assistant_spans(CONVERSATIONS["with_system"])


# --- a second template: Jinja features and parity ---------------------------------------------


def test_llama_style_template_matches_transformers(tmp_path, model_dir):
    transformers = pytest.importorskip("transformers")
    config = {"chat_template": LLAMA_STYLE_TEMPLATE, "bos_token": "<|endoftext|>"}
    path = make_dir(tmp_path, model_dir, config_update=config)
    tok, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    tools = [{"name": "lookup", "description": "a <b> & 'c' — ü", "parameters": {}}]
    messages = CONVERSATIONS["with_system"] + [
        {"role": "tool", "content": "skipped"},
        {"role": "user", "content": "  Again?  "},
    ]
    for kwargs in ({}, {"tools": tools}, {"date": True}):
        for gen in (False, True):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
            theirs = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, **kwargs
            )
            assert ours == theirs
    text = tok.apply_chat_template(messages, tools=tools, date=True)
    assert text.startswith("<|endoftext|><|start_header_id|>tools")
    assert "\"a <b> & 'c' — ü\"" in text  # tojson: no HTML escaping, no \u escapes
    assert "skipped" not in text and f"[4 turns, {datetime.now():%Y}]" in text
    text, spans = tok.render_with_assistant_spans(messages)
    assert [text[a:b] for a, b in spans] == ["Paris<|eot_id|>"]


def test_raise_exception_and_sandbox(tmp_path, model_dir):
    path = make_dir(tmp_path, model_dir, config_update={"chat_template": LLAMA_STYLE_TEMPLATE})
    tok = Tokenizer.from_dir(path)
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="system message must come first"):
        tok.apply_chat_template(bad)
    (path / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}{{ ns }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(path).apply_chat_template(bad)


# --- loading variants, save, errors -----------------------------------------------------------


def test_template_sources_and_token_forms(tmp_path, model_dir):
    config = {
        "chat_template": [
            {"name": "default", "template": "D{{ messages | length }}"},
            {"name": "tool_use", "template": "T"},
        ],
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": None,
    }
    path = make_dir(tmp_path, model_dir, config_update=config, generation={"eos_token_id": [2, 0]})
    tok = Tokenizer.from_dir(path)
    assert tok.chat_template == "D{{ messages | length }}"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2  # pad falls back to eos
    assert tok.stop_token_ids == [0, 2]
    (path / "chat_template.jinja").write_text("J")  # the file wins, as in transformers
    assert Tokenizer.from_dir(path).chat_template == "J"


def test_save_round_trip(tmp_path, tok, hf_tok):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "saved"
    tok.save(out)
    assert {p.name for p in out.iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    again = Tokenizer.from_dir(out)
    assert again.chat_template == tok.chat_template
    assert again.stop_token_ids == tok.stop_token_ids
    assert again.encode(STRINGS[2]) == tok.encode(STRINGS[2])
    messages = CONVERSATIONS["multi_turn"]
    hf_again = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_again.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(
        messages
    )


def test_load_errors(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    path = make_dir(tmp_path, model_dir)
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: invalid JSON"):
        Tokenizer.from_dir(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        Tokenizer.from_dir(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ValueError, match="`chat_template` must be a string"):
        Tokenizer.from_dir(path)
    (path / "tokenizer_config.json").write_text("{}")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match="generation_config.json: `eos_token_id`"):
        Tokenizer.from_dir(path)
    (path / "generation_config.json").unlink()
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_id is None and tok.stop_token_ids == []
    with pytest.raises(ValueError, match=f"{path}.*no default chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    (path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid `tokenizers` file"):
        Tokenizer.from_dir(path)
