"""Text in and out of token ids for a front end, with the `tokenizers` library alone (no torch, no
transformers): a host that runs only the gateway installs neither (docs/deploy.md).

A model directory as `sdcp models fetch` writes it holds `tokenizer.json`, `tokenizer_config.json`
(special tokens), `chat_template.jinja` (or the template inside the tokenizer configuration) and
`config.json` (the context length). Chat templates render as transformers renders them: Jinja in a
sandbox with trim_blocks and lstrip_blocks, then encoded without added special tokens.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from sdcp.protocol.contract import tokenizer_definition_digest

__all__ = ["ChatTemplateError", "IncrementalDecoder", "TextCodec", "load_text_codec"]

# Tokens that end a generation besides the configured eos token (ChatML and GPT-2 style models).
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")

# What a decoder shows for bytes that are not (yet) a whole UTF-8 character.
_REPLACEMENT = "\ufffd"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's chat template."""


class TextCodec:
    """A model's tokenizer, chat template and context length."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        context_length: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.context_length = context_length
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_model_dir(cls, path: Path) -> TextCodec:
        config = _json(path / "tokenizer_config.json")
        special = {key: _token_text(config[key]) for key in ("bos_token", "eos_token", "unk_token") if config.get(key)}
        template_file = path / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        model_config = _json(path / "config.json")
        context = model_config.get("max_position_embeddings")
        return cls(
            Tokenizer.from_file(str(path / "tokenizer.json")),
            special_tokens=special,
            chat_template=template if isinstance(template, str) else None,
            context_length=context if isinstance(context, int) else None,
        )

    @cached_property
    def tokenizer_definition(self) -> str:
        """The tokenizer's definition (its ``tokenizer.json``), as structured output reads it."""
        return str(self.tokenizer.to_str())

    @cached_property
    def tokenizer_digest(self) -> bytes:
        """The digest a contract names for this tokenizer (SDCP 4.1), as ``sdcp.models.weights.digests``
        computes it from transformers' tokenizer: SHA-256 of its definition as canonical JSON."""
        return tokenizer_definition_digest(self.tokenizer_definition)

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text that one token stands for: a text of b bytes is at least
        b / max_token_bytes tokens, known without tokenizing it. A normalizer may shorten the text
        before it is split (NFC composes up to three characters into one of a third of their
        bytes), so with one the bound is three times the longest token."""
        longest = max(
            (len(self.token_text(token).encode("utf-8")) for token in range(self.vocab_size)),
            default=1,
        )
        return max(1, longest) * (1 if self.tokenizer.normalizer is None else 3)

    def warm(self) -> None:
        """Do once now what a server's first request would: the tokenizer's digest (its whole
        definition as canonical JSON), the longest token, the chat template's compilation and a
        first encoding (a fresh gateway's first request took 300 ms more than the next ones)."""
        _ = self.tokenizer_digest, self.max_token_bytes
        rendered = "Hi"
        if self.chat_template is not None:
            # A template that refuses this conversation is compiled at the first request instead.
            with contextlib.suppress(ChatTemplateError):
                rendered = self.render_chat([{"role": "user", "content": "Hi"}])
        self.encode(rendered, add_special_tokens=False)

    # -- ids ---------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token: int) -> str:
        """One token as text (an incomplete UTF-8 sequence shows as U+FFFD)."""
        return self.decode([token], skip_special_tokens=False)

    def end_of_text_tokens(self) -> list[int]:
        """The tokens that end a generation: a contract's default stop list."""
        names = [self.special_tokens.get("eos_token"), *_END_MARKERS]
        unknown = self.special_tokens.get("unk_token")
        ids = {self.tokenizer.token_to_id(name) for name in names if name and name != unknown}
        return sorted(token for token in ids if token is not None)

    # -- chat --------------------------------------------------------------------------------------

    @cached_property
    def template_reads_tools(self) -> bool:
        """Whether the chat template renders tool definitions (reads a ``tools`` variable), as the
        templates of models trained to call tools do; transformers passes ``tools`` to any template,
        and one that does not read them drops them."""
        if self.chat_template is None:
            return False
        environment = _compiled(self.chat_template).environment
        return "tools" in jinja2.meta.find_undeclared_variables(environment.parse(self.chat_template))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, object] | None = None,
    ) -> str:
        """The messages through the chat template; ``tools`` (OpenAI's tool definitions) are given
        to it as transformers' ``apply_chat_template(tools=...)`` gives them, ``variables`` as its
        keyword arguments (vLLM's ``chat_template_kwargs``: ``enable_thinking``, say)."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return _compiled(self.chat_template).render(
                **(variables or {}),
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.special_tokens.get("bos_token", ""),
                eos_token=self.special_tokens.get("eos_token", ""),
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        rendered = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(rendered, add_special_tokens=False)


class IncrementalDecoder:
    """The text of a growing sequence of tokens, piece by piece, at a cost that grows with the new
    tokens rather than with the whole sequence; the pieces join into the text of all the tokens.

    Each step decodes a window: the tokens of the previous step, whose text is already out, then
    the new ones. The leading tokens give the decoder its context (a token's text may depend on the
    one before it, as sentencepiece's leading space does), and only the text past theirs is new. A
    character whose bytes span tokens decodes as U+FFFD until its last token arrives, so trailing
    U+FFFD is held back until the following tokens decide it, or until `finish`.
    """

    def __init__(self, codec: TextCodec, *, skip_special_tokens: bool = True) -> None:
        self._codec = codec
        self._skip_special_tokens = skip_special_tokens
        self._tokens: list[int] = []
        # Each step decodes the tokens from `_prefix` on; the text of those before `_read` is out.
        self._prefix = 0
        self._read = 0
        # How many characters of the window's text are out.
        self._given = 0

    def add(self, tokens: Sequence[int]) -> str:
        """The new text that these tokens decide (possibly none yet)."""
        self._tokens.extend(tokens)
        return self._advance(final=False)

    def finish(self) -> str:
        """The text still held back: the tokens ended, whatever they decode to is final."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        text = self._decode(self._prefix)
        decided = text if final else text.rstrip(_REPLACEMENT)
        piece = decided[self._given :]
        self._given = max(self._given, len(decided))
        if piece and len(decided) == len(text):
            # The window's text ends on a whole character: the next window starts at this step's tokens.
            self._prefix, self._read = self._read, len(self._tokens)
            self._given = len(self._decode(self._prefix))
        return piece

    def _decode(self, start: int) -> str:
        return self._codec.decode(self._tokens[start:], skip_special_tokens=self._skip_special_tokens)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = _raise
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return environment.from_string(template)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else {}


def _token_text(value: object) -> str:
    # Older configurations write special tokens as {"content": ...} objects.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value)


def load_text_codec(name_or_path: str, home: Path | None = None) -> TextCodec:
    """The text codec of the bundled model, a local model directory or a tiny test model."""
    from sdcp.models.weights.paths import TINY_DRAFT_NAME, TINY_NAME, model_dir

    if name_or_path in (TINY_NAME, TINY_DRAFT_NAME):
        # Built in code by transformers, for tests only.
        from sdcp.models.hf import tiny

        tokenizer = tiny.tiny_tokenizer()
        return TextCodec(
            tokenizer.backend_tokenizer,
            special_tokens={"eos_token": tiny.END_OF_TEXT, "bos_token": tiny.END_OF_TEXT},
            context_length=int(tiny.tiny_config().max_position_embeddings),
        )
    return TextCodec.from_model_dir(model_dir(name_or_path, home))
