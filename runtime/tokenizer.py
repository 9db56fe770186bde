"""Tokenizer and chat template, read from a Hugging Face tokenizer directory without `transformers`.

`Tokenizer.from_dir(path)` reads `tokenizer.json` (a fast tokenizer, via the `tokenizers` library),
`tokenizer_config.json` (special tokens, chat template), `chat_template.jinja` (where transformers 5
saves the template; it wins over the config entry, as in transformers) and `generation_config.json`
(extra stop ids). `apply_chat_template` renders with the same Jinja2 environment as transformers
(sandboxed, `trim_blocks`, `lstrip_blocks`, `loopcontrols`, `raise_exception`, `strftime_now`, a
non-escaping `tojson`), so the rendered text is byte-identical to `AutoTokenizer.apply_chat_template`.

`render_with_assistant_spans` returns the character spans the model must learn (each assistant turn,
including its end-of-turn token). The script maps them to token positions with
`encode_with_offsets` and masks by position, never by token id: for SmolLM2 pad == eos, so masking
by id would also mask the real end-of-turn token.

No tensors here. Offsets and spans are Python character indices into the rendered text.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (HF's assistant-mask tag) and render its body.

    transformers uses the tag to track assistant tokens; we compute spans by prefix rendering instead
    (`render_with_assistant_spans`), so here the tag only has to parse and render like transformers.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that rejects underscore attributes (as transformers does, to block sandbox escapes)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named `self`, so that `namespace(self=...)` works (same trick as jinja2's Namespace).
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace "
                f"(got {name!r}); rename the attribute."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>`, `&` and `'`; transformers' (and ours) does not.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in the same Jinja2 environment transformers uses.

    Args:
        template: the Jinja2 source of the chat template.

    Returns:
        The compiled template (cached per source string).

    Raises:
        ValueError: the template has a Jinja syntax error (the message gives the line).
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(
            f"chat template has a Jinja syntax error at line {e.lineno}: {e.message}; "
            "fix the template (tokenizer_config.json `chat_template` or chat_template.jinja)."
        ) from e


def _read_json(path: Path) -> dict | None:
    """Read a JSON object file; None when it does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e}); re-save or re-download the file.") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at top level, got {type(data).__name__}.")
    return data


def _token_content(value: Any, key: str, path: Path) -> str | None:
    """A special token entry as a string: it may be a string, a dict with "content", or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{path}: `{key}` must be a string or an object with a string `content`, got {value!r}."
    )


def _parse_chat_templates(value: Any, path: Path) -> dict[str, str]:
    """`chat_template` from tokenizer_config.json as {name: template}; a plain string is "default"."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(
        f"{path}: `chat_template` must be a string or a list of {{name, template}} objects, "
        f"got {type(value).__name__}."
    )


def _generation_eos_ids(generation_config: dict | None, path: Path) -> list[int]:
    """`eos_token_id` of generation_config.json (int, list of ints, or absent) as a list."""
    value = (generation_config or {}).get("eos_token_id")
    if value is None:
        return []
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path}: `eos_token_id` must be an int or a list of ints, got {value!r}.")
    return list(ids)


class Tokenizer:
    """A Hugging Face fast tokenizer plus its special tokens, stop ids and chat template.

    Build it with `Tokenizer.from_dir(model_dir)`.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        chat_templates: dict[str, str],
        tokenizer_config: dict,
        generation_config: dict | None,
        source: str,
    ) -> None:
        """Wrap an already loaded tokenizer (use `from_dir` instead of calling this directly).

        Args:
            tokenizer: the `tokenizers.Tokenizer` from tokenizer.json.
            special_tokens: {"bos_token": "<s>", ...}, only the tokens that are set.
            chat_templates: {name: jinja source}; "default" is the one `apply_chat_template` uses.
            tokenizer_config: the raw tokenizer_config.json object (kept for `save`).
            generation_config: the raw generation_config.json object, or None if absent.
            source: where it was loaded from, for error messages.

        Raises:
            ValueError: a special token is not in the vocabulary.
        """
        self._tok = tokenizer
        self._special_tokens = dict(special_tokens)
        self._chat_templates = dict(chat_templates)
        self._tokenizer_config = dict(tokenizer_config)
        self._generation_config = generation_config
        self.source = source
        self._special_ids = {k: self._token_id(k, v) for k, v in self._special_tokens.items()}
        self._generation_eos = _generation_eos_ids(
            generation_config, Path(source) / "generation_config.json"
        )

    def _token_id(self, key: str, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"{self.source}: {key}={token!r} (tokenizer_config.json) is not in the vocabulary "
                "of tokenizer.json; fix the token string or re-export the tokenizer."
            )
        return token_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory.

        Args:
            model_dir: directory with tokenizer.json and, optionally, tokenizer_config.json,
                special_tokens_map.json, chat_template.jinja and generation_config.json.

        Returns:
            The loaded Tokenizer.

        Raises:
            FileNotFoundError: `model_dir` or its tokenizer.json does not exist.
            ValueError: a file is not valid JSON or has a field of the wrong type.
        """
        root = Path(model_dir).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(
                f"tokenizer directory {root} does not exist; pass a Hugging Face model directory "
                "(with tokenizer.json), e.g. one from `scaffold assets`."
            )
        tokenizer_path = root / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(
                f"{tokenizer_path} not found; expected a Hugging Face tokenizer directory with "
                "tokenizer.json (fast tokenizer). Slow-only tokenizers (tokenizer.model) are not "
                "supported: convert once with `AutoTokenizer.from_pretrained(d).save_pretrained(d)`."
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as e:  # tokenizers raises a bare Exception on schema errors
            raise ValueError(
                f"{tokenizer_path}: not a valid `tokenizers` file ({e}); "
                "re-export it with a recent `tokenizers`/transformers."
            ) from e
        config_path = root / "tokenizer_config.json"
        config = _read_json(config_path) or {}
        special_map = _read_json(root / "special_tokens_map.json") or {}
        special: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = config[key] if key in config else special_map.get(key)
            content = _token_content(value, key, config_path)
            if content is not None:
                special[key] = content
        templates = _parse_chat_templates(config.get("chat_template"), config_path)
        if (root / CHAT_TEMPLATE_FILE).is_file():
            templates["default"] = (root / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        generation = _read_json(root / "generation_config.json")
        return cls(tok, special, templates, config, generation, str(root))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, including added tokens (transformers' `len(tokenizer)`)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of `bos_token` in tokenizer_config.json, or None if it has none."""
        return self._special_ids.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of `eos_token`; falls back to the first generation_config eos id; else None."""
        if "eos_token" in self._special_ids:
            return self._special_ids["eos_token"]
        return self._generation_eos[0] if self._generation_eos else None

    @property
    def pad_token_id(self) -> int | None:
        """Id of `pad_token`, falling back to `eos_token_id` when no pad token is set."""
        return self._special_ids.get("pad_token", self.eos_token_id)

    def special_token(self, key: str) -> str | None:
        """The string of special token `key` ("pad_token", "unk_token", ... as tokenizer_config.json
        names them), or None when it is not set."""
        return self._special_tokens.get(key)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` (a whole vocabulary entry, e.g. "<|endoftext|>"), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (special tokens as their strings), or None."""
        return self._tok.id_to_token(token_id)

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: eos plus generation_config's eos ids, deduplicated, sorted."""
        ids = set(self._generation_eos)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return sorted(ids)

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None if the tokenizer has none."""
        return self._chat_templates.get("default")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`.

        Args:
            text: the text; special-token strings in it (e.g. "<|im_end|>") become their ids.
            add_special_tokens: apply tokenizer.json's post-processor (e.g. a BOS). Off by default,
                because a rendered chat template already contains its special tokens.

        Returns:
            The token ids.
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's character span in it (no special tokens added).

        Args:
            text: the text to encode.

        Returns:
            (ids, offsets): offsets[k] = (start, end) character indices into `text` of token k.
            With byte-level BPE a character split over several tokens gives them the same span.
        """
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(o) for o in encoding.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids.

        Args:
            ids: token ids.
            skip_special_tokens: drop special tokens (eos, im_start, ...) from the text.

        Returns:
            The decoded text.
        """
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """Render a conversation with the chat template, exactly as transformers does.

        Args:
            messages: [{"role": ..., "content": ...}, ...]; keys whose value is None are dropped.
            add_generation_prompt: append the header that starts an assistant turn.
            **kwargs: extra template variables (e.g. `tools`, `enable_thinking`); they override
                the special-token variables.

        Returns:
            The rendered text (special tokens as strings; encode with add_special_tokens=False).

        Raises:
            ValueError: the tokenizer has no chat template, or a message is not a dict.
            jinja2.exceptions.TemplateError: the template called `raise_exception`.
        """
        template = self.chat_template
        if template is None:
            named = sorted(self._chat_templates)
            raise ValueError(
                f"{self.source} has no default chat template"
                + (f" (named templates: {named})" if named else "")
                + "; add `chat_template` to tokenizer_config.json or a chat_template.jinja file, "
                "or use a model's instruct tokenizer."
            )
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}.")
            chat.append({k: v for k, v in message.items() if v is not None})
        variables = {"tools": None, "documents": None, **self._special_tokens, **kwargs}
        return compile_chat_template(template).render(
            messages=chat, add_generation_prompt=add_generation_prompt, **variables
        )

    def render_with_assistant_spans(
        self, messages: list[dict]
    ) -> tuple[str, list[tuple[int, int]]]:
        """Render a conversation and locate, per assistant message, the text the model must learn.

        Span of assistant message i: from the end of render(messages[:i], add_generation_prompt=True)
        to the end of render(messages[:i+1]), minus trailing whitespace after the end-of-turn token
        (so for SmolLM2 "<|im_end|>" is inside the span and the "\\n" after it is not).

        Args:
            messages: [{"role", "content"}, ...] with at least one assistant message.

        Returns:
            (text, spans): the full rendering (add_generation_prompt=False) and one [start, end)
            character span into it per assistant message, in order.

        Raises:
            ValueError: no chat template, or the template is not prefix-stable (rendering a longer
                conversation changes the text of an earlier part, e.g. templates that drop the
                reasoning of earlier turns); such templates cannot be masked by prefix rendering.
        """
        text = self.apply_chat_template(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.apply_chat_template(messages[:i], add_generation_prompt=True)
            upto = self.apply_chat_template(messages[: i + 1])
            if not upto.startswith(prompt):
                bad = f"render(messages[:{i}]) + generation prompt"
            elif not text.startswith(upto):
                bad = f"render(messages[:{i + 1}])"
            else:
                bad = None
            if bad is not None:
                raise ValueError(
                    f"the chat template of {self.source} is not prefix-stable: for assistant "
                    f"message {i}, {bad} is not a prefix of the longer rendering, so the assistant "
                    "spans cannot be located. Use a prefix-stable template (set `chat_template` in "
                    "tokenizer_config.json) or build the masks for this template by hand."
                )
            end = max(len(prompt), len(upto.rstrip()))
            spans.append((len(prompt), end))
        return text, spans

    def save(self, out_dir: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json.

        `from_dir(out_dir)` and transformers' `AutoTokenizer.from_pretrained(out_dir)` both read it back.

        Args:
            out_dir: directory to write into (created if missing; existing files are replaced).
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out / "tokenizer.json"))
        config = dict(self._tokenizer_config)
        config.update(self._special_tokens)
        if set(self._chat_templates) == {"default"}:
            config["chat_template"] = self._chat_templates["default"]
        elif self._chat_templates:
            config["chat_template"] = [
                {"name": k, "template": v} for k, v in self._chat_templates.items()
            ]
        (out / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        if self.chat_template is not None:
            (out / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")
        if self._generation_config is not None:
            (out / "generation_config.json").write_text(
                json.dumps(self._generation_config, indent=2) + "\n", encoding="utf-8"
            )


def check_vocab_fits(tokenizer: Tokenizer, model_dir: str | Path) -> None:
    """Fail at setup when the tokenizer can emit ids past the model's embedding table.

    Such ids otherwise surface only inside the first forward, as an index error in the
    embedding (or a device-side assert on CUDA). A model vocab larger than the tokenizer's
    (padded embeddings) is fine.

    Args:
        tokenizer: the loaded tokenizer.
        model_dir: the model's Hugging Face directory (its config.json gives vocab_size).

    Raises:
        ValueError: tokenizer.vocab_size > the model's vocab_size (both numbers named).
    """
    from runtime.checkpoint import CONFIG_NAME, read_hf_config

    model_vocab = read_hf_config(model_dir).get("vocab_size")
    if isinstance(model_vocab, int) and tokenizer.vocab_size > model_vocab:
        raise ValueError(
            f"tokenizer {tokenizer.source}/tokenizer.json has {tokenizer.vocab_size} tokens but "
            f"{Path(model_dir) / CONFIG_NAME} has vocab_size={model_vocab}: token ids >= "
            f"{model_vocab} have no embedding row. Use the tokenizer saved with these weights "
            "(or resize the embeddings to the tokenizer before training)."
        )


def check_same_tokenizer(student_dir: str | Path, teacher_dir: str | Path) -> None:
    """Refuse a teacher whose tokenizer.json vocabulary differs from the student's (distillation).

    Raises:
        ValueError: the two vocabularies (token -> id, added tokens included) differ; the message
            names both directories and a first differing token.
    """
    student = Tokenizer.from_dir(student_dir)._tok.get_vocab(with_added_tokens=True)
    teacher = Tokenizer.from_dir(teacher_dir)._tok.get_vocab(with_added_tokens=True)
    if student != teacher:
        diff = sorted(set(student.items()) ^ set(teacher.items()), key=lambda kv: kv[1])[:1]
        example = f"; e.g. token {diff[0][0]!r} -> id {diff[0][1]} in only one" if diff else ""
        raise ValueError(
            f"tokenizer mismatch: teacher {Path(teacher_dir)}/tokenizer.json ({len(teacher)} tokens) "
            f"and student {Path(student_dir)}/tokenizer.json ({len(student)} tokens) differ{example}; "
            "distillation compares token distributions, so pick a teacher with the student's "
            "tokenizer (the same model family)"
        )
