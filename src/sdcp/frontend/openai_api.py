"""The OpenAI-compatible API's requests and answers, without I/O (the gateway is the adapter).

Every parameter of `/v1/completions` and `/v1/chat/completions` that vLLM accepts is either
implemented or refused with a 400 naming it; an unknown one is ignored and named, as vLLM ignores
it, or refused as OpenAI refuses it in strict mode (docs/services.md lists which is which). Errors
take OpenAI's shape.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

from sdcp.frontend.schemas import SchemaError, ascii_classes, closed_schema
from sdcp.frontend.stops import ChoiceText, one_token_stops, stop_token_ids
from sdcp.frontend.text import ChatTemplateError, TextCodec
from sdcp.frontend.tool_calls import (
    MAX_NESTING,
    ToolsError,
    ToolUse,
    hermes_messages,
    nested_deeper,
    parse_tools,
    tool_message_fields,
)
from sdcp.grammar import ConstraintError, check, check_start, gbnf_to_lark, grammar_tokenizer
from sdcp.protocol.logprobs import LOGPROB_SCALE
from sdcp.protocol.messages import (
    MAX_CONSTRAINT_TEXT,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    Constraint,
    Sampling,
    TokenLogprob,
)

__all__ = [
    "Choice",
    "ChoiceText",
    "Generation",
    "OpenAIError",
    "Prompt",
    "Speculation",
    "chat_logprobs",
    "check_nesting",
    "check_unicode",
    "completion_logprobs",
    "error_body",
    "parse_detokenize",
    "parse_generation",
    "parse_tokenize",
    "token_stop_reason",
]

# The most choices one request may ask for (n times the number of prompts): each is a session.
MAX_CHOICES = 16
# vLLM takes any number of stop strings; this bounds the work of matching them.
MAX_STOP_STRINGS = 16
# OpenAI's and vLLM's max_tokens of a completions request that gives none (chat fills the context).
DEFAULT_COMPLETION_TOKENS = 16
# SDCP 4.1: m_max .le 64, the most a request's speculative.max_tokens may ask.
MAX_DRAFT_TOKENS = 64
# The most drafter models a request's speculative.drafters may name.
MAX_DRAFTER_MODELS = 16
# vLLM bounds repetition_penalty only from below; this keeps it a number the profile can carry.
REPETITION_PENALTY_MAX = 1000.0


class OpenAIError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(
        self, message: str, param: str | None = None, *, status: int = 400, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind
        self.param = param
        self.code: str | None = {401: "invalid_api_key", 404: "model_not_found"}.get(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _refused(param: str, why: str) -> OpenAIError:
    return OpenAIError(f"'{param}' is not supported by this server: {why}", param=param)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its tokens and (for echo) its text."""

    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Choice:
    """One session of a request: the choice index it answers and the prompt it continues."""

    index: int
    prompt: Prompt
    # The prompt's first choice (j = 0 of its n): usage counts its prompt.
    first_of_prompt: bool


@dataclass(frozen=True)
class Speculation:
    """A request's ``speculative`` member (docs/services.md, "Per-request speculation"): whether
    drafters propose at all, the most tokens a proposal holds (the contract's m_max), the drafter
    models permitted (the contract's drafters), and whether the answer's usage reports acceptance."""

    enabled: bool = True
    max_tokens: int | None = None
    drafters: tuple[bytes, ...] | None = None
    report: bool = False


@dataclass(frozen=True)
class Generation:
    """A parsed request: what every session of it decodes and how its answer is written."""

    chat: bool
    choices: tuple[Choice, ...]
    max_tokens: int
    rule: int
    sampling: Sampling | None
    stop_texts: tuple[str, ...]
    stop_ids: tuple[int, ...]
    min_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    # None: no log-probabilities; else the alternatives per token.
    logprobs: int | None
    echo: bool
    skip_special_tokens: bool
    include_stop_str: bool
    user: str | None
    request_id: str | None
    # The output's language (structured output: response_format, vLLM's guided_*), or None.
    constraint: Constraint | None = None
    # Members that no parameter reads, ignored (vLLM's behaviour; strict mode refuses them instead).
    ignored: tuple[str, ...] = ()
    # How a chat answer's tool calls are read from its text (sdcp.frontend.tool_calls), or None.
    tool_parser: str | None = None
    # What the request asks of speculation (its ``speculative`` member).
    speculation: Speculation = Speculation()

    @property
    def prompt_tokens(self) -> int:
        # Usage counts each prompt once, however many choices continue it.
        return sum(len(choice.prompt.ids) for choice in self.choices if choice.first_of_prompt)


# -- parameters --------------------------------------------------------------------------------------
#
# Each parameter either has a reader (implemented) or a default that it may only repeat (accepted
# at that value, refused otherwise with a 400 naming it).

_COMMON_IMPLEMENTED = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "n",
        "best_of",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_options",
        "logprobs",
        "min_tokens",
        "ignore_eos",
        "user",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "request_id",
        # The target distribution's shaping (_shaping): OpenAI's penalties and logit_bias, vLLM's
        # repetition_penalty and min_p.
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_p",
        # Per-request speculation (_speculation).
        "speculative",
        # Structured output (_constraint): OpenAI's and vLLM's spellings.
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "structured_outputs",
    }
)
_COMPLETIONS_IMPLEMENTED = _COMMON_IMPLEMENTED | {"prompt", "echo", "add_special_tokens"}
_CHAT_IMPLEMENTED = _COMMON_IMPLEMENTED | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "add_generation_prompt",
    "parallel_tool_calls",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
}
# Members OpenAI's API defines that mean nothing to this server (stored completions, a reasoning
# model's effort, the caller's tags): accepted in strict mode too, and named as ignored.
_ACCEPTED_IGNORED = frozenset({"metadata", "store", "reasoning_effort"})

# Accepted at the value that changes nothing (None, which is "absent", always is).
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "length_penalty": (1, 1.0),
    "suffix": ("",),
    "use_beam_search": (False,),
    "functions": ([],),
    "function_call": ("none",),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "continue_final_message": (False,),
    "priority": (0,),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    # The json_schema language has no whitespace outside strings (docs/interpretations.md).
    "guided_whitespace_pattern": (),
    "logits_processors": (),
    "truncate_prompt_tokens": (),
    "documents": (),
    "chat_template": (),
    "mm_processor_kwargs": (),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "service_tier": ("auto", "default"),
    "web_search_options": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "cache_salt": (),
}


def parse_generation(
    body: object,
    codec: TextCodec,
    *,
    served: Sequence[str],
    chat: bool,
    context: int | None = None,
    strict: bool = False,
    close_json_objects: bool = True,
) -> Generation:
    """Validate a completions or chat request and tokenize it; raises OpenAIError (400, or 404 for
    a model this gateway does not serve). ``context``: the positions a session may fill, where the
    target holds fewer than the codec's model. A member no parameter reads is ignored and listed in
    ``Generation.ignored``, as vLLM does; ``strict`` refuses it, as OpenAI does. Tokenization makes
    this CPU work: run it off the loop. ``close_json_objects``: a JSON schema's objects that name
    their properties allow no others unless they say so (sdcp.frontend.schemas)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    implemented = _CHAT_IMPLEMENTED if chat else _COMPLETIONS_IMPLEMENTED
    ignored = []
    for key, value in body.items():
        if key in implemented or value is None:
            continue
        if key in _ACCEPTED_IGNORED:
            ignored.append(key)
            continue
        if key not in _NEUTRAL:
            if strict:
                raise OpenAIError(f"Unrecognized request argument supplied: {key}", param=key)
            ignored.append(key)
            continue
        if not any(_same(value, neutral) for neutral in _NEUTRAL[key]):
            raise _refused(key, f"only {_neutral_text(key)} is accepted")
    model = body.get("model")
    if model is not None and model not in served:
        raise OpenAIError(f"The model '{model}' does not exist", status=404, param="model")
    reader = _Reader(body)
    context = context if context is not None else codec.context_length
    tool_use = _tool_use(body, close_objects=close_json_objects) if chat else None
    prompts = _chat_prompt(reader, codec, context, tool_use) if chat else _completion_prompts(reader, codec, context)
    n = reader.integer("n", 1, low=1, high=MAX_CHOICES)
    best_of = reader.integer("best_of", n, low=1, high=MAX_CHOICES)
    if best_of != n:
        raise _refused("best_of", "it must equal n (choices are not ranked)")
    if n * len(prompts) > MAX_CHOICES:
        raise OpenAIError(f"n times the number of prompts must be at most {MAX_CHOICES}", param="n")
    choices = tuple(Choice(p * n + j, prompt, j == 0) for p, prompt in enumerate(prompts) for j in range(n))
    longest = max(len(prompt.ids) for prompt in prompts)
    max_tokens = _max_tokens(reader, context, longest, chat)
    temperature = reader.number("temperature", 1.0, low=0.0, high=2.0)
    top_p = reader.number("top_p", 1.0, low=0.0, high=1.0, low_open=True)
    top_k = reader.integer("top_k", 0, low=-1, high=codec.vocab_size)
    seed = reader.integer("seed", None, low=0, high=2**64 - 1)
    stop_texts = reader.strings("stop", MAX_STOP_STRINGS)
    extra_stop_ids = reader.token_ids("stop_token_ids", codec.vocab_size)
    ignore_eos = reader.boolean("ignore_eos", False)
    min_tokens = reader.integer("min_tokens", 0, low=0, high=max_tokens)
    stream = reader.boolean("stream", False)
    include_usage, continuous_usage = _stream_options(reader, stream)
    logprobs = _logprobs(reader, chat)
    echo = False if chat else reader.boolean("echo", False)
    if echo and logprobs is not None:
        raise _refused("echo", "echo with logprobs would need the prompt's log-probabilities")
    if chat:
        # Only chat reads it; on completions it is an ignored member like any other.
        reader.boolean("parallel_tool_calls", True)
    user = reader.text("user")
    request_id = reader.text("request_id")
    constrained = _constraint(reader, close_objects=close_json_objects)
    if tool_use is not None and tool_use.constraint is not None:
        if constrained is not None:
            raise OpenAIError("a tool_choice that forces a call is a constraint: give no other", param="tool_choice")
        constrained = ("tool_choice", tool_use.constraint)
    constraint = None if constrained is None else constrained[1]
    if constraint is not None and ignore_eos:
        # A text of the language ends with a stop token: without one the session could not end.
        raise _refused("ignore_eos", "structured output ends each choice at its end-of-text token")
    # Under a constraint a stop token is no text, so a one-token stop string is matched in the
    # text instead (a JSON output's "}" must stay a token of the output).
    stop_ids = stop_token_ids(codec, stop_texts if constraint is None else (), extra_stop_ids, ignore_eos=ignore_eos)
    if constrained is not None:
        _check_start(codec, *constrained, stop_ids)
    # OpenAI's default temperature is 1; temperature 0 is greedy decoding, i.e. rule 1 (SDCP 6.4).
    greedy = temperature == 0.0
    shaping = _shaping(reader, codec.vocab_size)
    sampling = None
    if not greedy:
        sampling = Sampling(
            temperature_milli=round(temperature * 1000),
            top_k=top_k if top_k > 0 else None,
            top_p_milli=round(top_p * 1000) if top_p < 1.0 else None,
            seed=seed,
            **shaping,
        )
    elif shaping.keys() - {"min_p_milli"}:
        # Rule 1 takes the argmax of the shaped logits: the penalties and the bias change it, min_p
        # (like top-k and top-p) does not, so a greedy contract carries only the former.
        sampling = Sampling(**{member: value for member, value in shaping.items() if member != "min_p_milli"})
    return Generation(
        chat=chat,
        choices=choices,
        max_tokens=max_tokens,
        rule=1 if greedy else 2,
        sampling=sampling,
        stop_texts=stop_texts,
        stop_ids=stop_ids,
        min_tokens=min_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        logprobs=logprobs,
        echo=echo,
        skip_special_tokens=reader.boolean("skip_special_tokens", True),
        include_stop_str=reader.boolean("include_stop_str_in_output", False),
        user=user,
        request_id=request_id,
        constraint=constraint,
        ignored=tuple(ignored),
        tool_parser=None if tool_use is None else tool_use.parser,
        speculation=_speculation(reader),
    )


def _shaping(reader: _Reader, vocab_size: int) -> dict[str, Any]:
    """The sampling profile's shaping members (docs/interpretations.md, "Penalties, logit_bias and
    min_p"), in thousandths, each left out at its neutral value: OpenAI's presence_penalty and
    frequency_penalty (-2 to 2) and logit_bias (at most 300 token ids, each to -100 to 100), vLLM's
    repetition_penalty (0.001 to 1000; 1 is none) and min_p (0 to 1)."""
    members: dict[str, Any] = {}
    for key in ("presence_penalty", "frequency_penalty"):
        value = round(reader.number(key, 0.0, low=-2.0, high=2.0) * 1000)
        if value:
            members[f"{key}_milli"] = value
    # Thousandths, as the profile carries them: the least penalty is 0.001.
    repetition = round(reader.number("repetition_penalty", 1.0, low=0.001, high=REPETITION_PENALTY_MAX) * 1000)
    if repetition != 1000:
        members["repetition_penalty_milli"] = repetition
    min_p = round(reader.number("min_p", 0.0, low=0.0, high=1.0) * 1000)
    if min_p:
        members["min_p_milli"] = min_p
    bias = reader.logit_bias("logit_bias", vocab_size)
    if bias:
        members["logit_bias_milli"] = bias
    return members


def _tool_use(body: dict[str, Any], *, close_objects: bool) -> ToolUse | None:
    try:
        return parse_tools(body, close_objects=close_objects)
    except ToolsError as exc:
        raise OpenAIError(str(exc), param=exc.param) from exc


# The members that name an output's language, and the constraint kind each gives.
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "lark"}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def _constraint(reader: _Reader, *, close_objects: bool) -> tuple[str, Constraint] | None:
    """The output's language from ``response_format`` (OpenAI: json_object, json_schema), vLLM's
    ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (Lark or GBNF) or its
    ``structured_outputs``; at most one of them. ``guided_decoding_backend`` names an engine: ours
    is llguidance whatever it says. A JSON schema's objects are closed where ``close_objects`` or
    the schema is ``strict`` (sdcp.frontend.schemas)."""
    reader.text("guided_decoding_backend")
    given: list[tuple[str, str, object]] = []
    strict = False
    response_format = reader.body.get("response_format")
    if response_format is not None:
        formatted = _response_format(response_format)
        if formatted is not None:
            kind, value, strict = formatted
            given.append(("response_format", kind, value))
    for member, kind in _GUIDED.items():
        if reader.body.get(member) is not None:
            given.append((member, kind, reader.body[member]))
    structured = reader.body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise OpenAIError("'structured_outputs' must be an object", param="structured_outputs")
        for key, value in structured.items():
            if value is None or value is False:
                continue
            if key == "json_object" and value is True:
                given.append(("structured_outputs.json_object", "json_schema", {"type": "object"}))
            elif key in _STRUCTURED:
                given.append((f"structured_outputs.{key}", _STRUCTURED[key], value))
            else:
                raise _refused(f"structured_outputs.{key}", "json, regex, choice, grammar and json_object are")
    if not given:
        return None
    if len(given) > 1:
        raise OpenAIError(f"give one of {', '.join(member for member, _, _ in given)}", param=given[1][0])
    member, kind, value = given[0]
    # json_object mode's {"type": "object"} names no properties: closing leaves it any object.
    constraint = Constraint(
        kind=kind, text=_constraint_text(member, kind, value, close_objects=close_objects, strict=strict)
    )
    try:
        check(constraint)
    except ConstraintError as exc:
        raise OpenAIError(f"'{member}' names no language this server can apply: {exc}", param=member) from exc
    return member, constraint


def _check_start(codec: TextCodec, member: str, constraint: Constraint, stop_ids: Sequence[int]) -> None:
    """Refuse a language that no output can start, over the model's tokens and the request's stop
    tokens (``sdcp.grammar.check_start``): its session would have no token to decide."""
    try:
        check_start(
            constraint, grammar_tokenizer(codec.tokenizer_definition, codec.vocab_size), stop_ids, codec.vocab_size
        )
    except ConstraintError as exc:
        raise OpenAIError(f"'{member}' names a language this model cannot write: {exc}", param=member) from exc


# OpenAI's rule for a response format's name.
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _response_format(value: object) -> tuple[str, object, bool] | None:
    """OpenAI's ``response_format``: None for text, else the constraint kind, its value and
    whether the schema is ``strict``."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", {"type": "object"}, False
    if kind == "json_schema" and isinstance(value, dict):
        described = value.get("json_schema")
        if not isinstance(described, dict):
            raise OpenAIError("'response_format.json_schema' must be an object", param="response_format")
        name = described.get("name")
        if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
            raise OpenAIError(
                "'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'",
                param="response_format",
            )
        strict = described.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise OpenAIError("'response_format.json_schema.strict' must be a boolean", param="response_format")
        # OpenAI's json_schema without a schema allows any JSON value.
        return "json_schema", described.get("schema", {}), bool(strict)
    raise OpenAIError(
        "'response_format.type' must be one of 'text', 'json_object', 'json_schema'", param="response_format"
    )


def _constraint_text(member: str, kind: str, value: object, *, close_objects: bool, strict: bool) -> str:
    if kind == "json_schema":
        # A schema comes as an object or as its JSON text (vLLM takes both).
        if isinstance(value, str):
            if len(value) > MAX_CONSTRAINT_TEXT:
                raise OpenAIError(f"'{member}' is longer than {MAX_CONSTRAINT_TEXT} characters", param=member)
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise OpenAIError(f"'{member}' is not JSON: {exc}", param=member) from exc
            check_nesting(value)
        if not isinstance(value, dict | bool):
            raise OpenAIError(f"'{member}' must be a JSON schema (an object or its JSON text)", param=member)
        try:
            text = json.dumps(closed_schema(value, close=close_objects, strict=strict))
        except SchemaError as exc:
            raise OpenAIError(f"'{member}': {exc}", param=member) from exc
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise OpenAIError(f"'{member}' must be a non-empty list of strings", param=member)
        text = json.dumps(value)
    else:
        if not isinstance(value, str) or not value:
            raise OpenAIError(f"'{member}' must be a non-empty string", param=member)
        # vLLM's guided_grammar is Lark or GBNF (llama.cpp's); the constraint carries Lark. A
        # regex's \d, \w, \s are ASCII, as xgrammar reads them.
        try:
            text = gbnf_to_lark(value) if kind == "lark" else ascii_classes(value) if kind == "regex" else value
        except ConstraintError as exc:
            raise OpenAIError(f"'{member}': {exc}", param=member) from exc
    if len(text) > MAX_CONSTRAINT_TEXT:
        raise OpenAIError(f"'{member}' is longer than {MAX_CONSTRAINT_TEXT} characters", param=member)
    return text


def parse_tokenize(body: object, codec: TextCodec, *, served: Sequence[str], context: int | None = None) -> list[int]:
    """vLLM's ``POST /tokenize``: ``prompt`` (with ``add_special_tokens``) or chat ``messages``
    (with ``add_generation_prompt`` and ``tools``), as the completions and chat endpoints would
    tokenize them. A prompt too large for the ``context`` by its size alone is refused untokenized,
    as there."""
    members = ("prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools")
    reader = _small_request(body, served, members)
    if "messages" in reader.body:
        return list(_chat_prompt(reader, codec, context, _tool_use(reader.body, close_objects=True))[0].ids)
    prompt = reader.body.get("prompt")
    if not isinstance(prompt, str):
        raise OpenAIError("'prompt' must be a string (or give 'messages')", "prompt")
    _check_size(prompt, codec, context, "prompt")
    return codec.encode(prompt, add_special_tokens=reader.boolean("add_special_tokens", True))


def parse_detokenize(body: object, codec: TextCodec, *, served: Sequence[str]) -> str:
    """vLLM's ``POST /detokenize``: ``tokens`` back to text."""
    reader = _small_request(body, served, ("tokens",))
    return codec.decode(reader.token_ids("tokens", codec.vocab_size))


def _small_request(body: object, served: Sequence[str], members: Sequence[str]) -> _Reader:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    for key in body:
        if key != "model" and key not in members:
            raise OpenAIError(f"Unrecognized request argument supplied: {key}", key)
    model = body.get("model")
    if model is not None and model not in served:
        raise OpenAIError(f"The model '{model}' does not exist", "model", status=404)
    return _Reader(body)


def _same(value: object, neutral: object) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return bool(value == neutral)


def _neutral_text(key: str) -> str:
    values = _NEUTRAL[key]
    shown = " or ".join(repr(v) for v in values)
    return f"null or {shown}" if shown else "null"


class _Reader:
    """Typed reads of the request's members; each failure names its parameter."""

    def __init__(self, body: dict[str, object], within: str = "") -> None:
        self.body = body
        # The member that holds this object when it is nested ("stream_options."), for the errors.
        self._within = within

    def _get(self, key: str) -> object:
        return self.body.get(key)

    def _invalid(self, key: str, requirement: str) -> OpenAIError:
        name = self._within + key
        return OpenAIError(f"'{name}' {requirement}", param=name)

    @overload
    def integer(self, key: str, default: int, *, low: int, high: int) -> int: ...

    @overload
    def integer(self, key: str, default: None, *, low: int, high: int) -> int | None: ...

    def integer(self, key: str, default: int | None, *, low: int, high: int) -> int | None:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self._invalid(key, f"must be an integer in [{low}, {high}]")
        return value

    def number(self, key: str, default: float, *, low: float, high: float, low_open: bool = False) -> float:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._invalid(key, "must be a number")
        if not (low < value if low_open else low <= value) or value > high:
            bracket = "(" if low_open else "["
            raise self._invalid(key, f"must be a number in {bracket}{low}, {high}]")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._invalid(key, "must be a boolean")
        return value

    def text(self, key: str) -> str | None:
        value = self._get(key)
        if value is not None and not isinstance(value, str):
            raise self._invalid(key, "must be a string")
        return value

    def strings(self, key: str, most: int) -> tuple[str, ...]:
        value = self._get(key)
        texts = [value] if isinstance(value, str) else value
        if texts is None:
            return ()
        if not isinstance(texts, list) or len(texts) > most or not all(isinstance(s, str) and s for s in texts):
            raise self._invalid(key, f"must be a non-empty string or a list of up to {most} of them")
        return tuple(texts)

    def logit_bias(self, key: str, vocab_size: int) -> tuple[tuple[int, int], ...]:
        """OpenAI's logit_bias: token ids (as JSON object keys) to a bias from -100 to 100, in
        thousandths, in ascending token order."""
        value = self._get(key)
        if value is None:
            return ()
        requirement = f"must map at most {MAX_LOGIT_BIAS} token ids below {vocab_size} to numbers in [-100, 100]"
        if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
            raise self._invalid(key, requirement)
        bias: dict[int, int] = {}
        for token, amount in value.items():
            if not re.fullmatch(r"[0-9]{1,10}", token) or int(token) >= vocab_size or int(token) in bias:
                raise self._invalid(key, requirement)
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not -100 <= amount <= 100:
                raise self._invalid(key, requirement)
            bias[int(token)] = round(amount * 1000)
        return tuple(sorted(bias.items()))

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        value = self._get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(_is_token(t, vocab_size) for t in value):
            raise self._invalid(key, f"must be a list of token ids below {vocab_size}")
        return tuple(value)


def _is_token(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def check_nesting(value: object) -> None:
    """Refuse with a 400 a request body that nests arrays and objects deeper than ``MAX_NESTING``
    levels, before anything reads it: no parameter needs as many, and writing such a value out
    again (a schema as the constraint's text, a tool into the prompt) could exhaust the stack."""
    if nested_deeper(value, MAX_NESTING):
        raise OpenAIError(f"the request body nests arrays and objects more than {MAX_NESTING} levels deep")


def check_unicode(value: object) -> None:
    """JSON may escape half of a UTF-16 surrogate pair (``"\\ud800"``): Python reads it into a
    string that is no Unicode text, which no tokenizer takes. Refused with a 400 before anything
    reads the request (the strings and keys of ``value``, at any depth)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise OpenAIError("the request body holds a lone UTF-16 surrogate (an escape \\ud800-\\udfff)")
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_size(text: str, codec: TextCodec, context: int | None, param: str) -> None:
    """Refuse, before it is tokenized, a text that cannot fit the context by its size alone: no token
    covers more than ``codec.max_token_bytes`` of it, so it is at least that fraction of its UTF-8
    bytes in tokens. Its characters bound its bytes from below; they are counted first, free."""
    if context is None:
        return
    most = context * codec.max_token_bytes
    # A character is 1 to 4 bytes: the bytes are counted (a copy) only where the characters leave it open.
    if 4 * len(text) <= most or (len(text) <= most and _utf8_size(text) <= most):
        return
    at_least = -(-_utf8_size(text) // codec.max_token_bytes)
    raise OpenAIError(
        f"This model's maximum context length is {context} tokens. However, your prompt is at least "
        f"{at_least} tokens ({len(text)} characters; no token is longer than {codec.max_token_bytes} bytes).",
        param=param,
    )


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _completion_prompts(reader: _Reader, codec: TextCodec, context: int | None) -> list[Prompt]:
    """`prompt`: a string, a list of strings, a list of token ids or a list of such lists."""
    value = reader.body.get("prompt")
    add_special = reader.boolean("add_special_tokens", True)
    what = "'prompt' must be a non-empty string, a list of them, a list of token ids or a list of such lists"
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token(t, 2**63) for t in value)):
        items: list[Any] = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise OpenAIError(what, param="prompt")
    if len(items) > MAX_CHOICES:
        raise OpenAIError(f"at most {MAX_CHOICES} prompts per request", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str) and item:
            _check_size(item, codec, context, "prompt")
            ids = codec.encode(item, add_special_tokens=add_special)
            prompts.append(Prompt(tuple(ids), item))
        elif isinstance(item, list) and item and all(_is_token(t, 2**63) for t in item):
            if not all(_is_token(t, codec.vocab_size) for t in item):
                raise OpenAIError(
                    f"prompt token ids must be below the vocabulary size {codec.vocab_size}", param="prompt"
                )
            prompts.append(Prompt(tuple(item), codec.decode(item)))
        else:
            raise OpenAIError(what, param="prompt")
        if not prompts[-1].ids:
            raise OpenAIError("a prompt encodes to no tokens", param="prompt")
    return prompts


def _chat_prompt(
    reader: _Reader, codec: TextCodec, context: int | None, tool_use: ToolUse | None = None
) -> list[Prompt]:
    messages = reader.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    tools = list(tool_use.tools) if tool_use is not None else []
    if not codec.template_reads_tools:
        # The template would drop tools and calls: they go into the messages' text.
        rendered, tools = hermes_messages(rendered, tools), []
    try:
        text = codec.render_chat(
            rendered,
            add_generation_prompt=reader.boolean("add_generation_prompt", True),
            tools=tools or None,
            variables=_template_variables(reader),
        )
    except ChatTemplateError as exc:
        raise OpenAIError(str(exc), param="messages") from exc
    _check_size(text, codec, context, "messages")
    ids = codec.encode(text, add_special_tokens=False)
    if not ids:
        raise OpenAIError("the messages encode to no tokens", param="messages")
    return [Prompt(tuple(ids), text)]


# The variables the gateway gives every chat template itself.
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
_TEMPLATE_VARIABLES = 16
_TEMPLATE_TEXT = 1024


def _template_variables(reader: _Reader) -> dict[str, object]:
    """vLLM's ``chat_template_kwargs``: at most 16 variables of the chat template, each a JSON
    scalar (a string of at most 1024 characters), none of those the gateway gives it."""
    given = reader.body.get("chat_template_kwargs")
    if given is None:
        return {}
    if not isinstance(given, dict) or len(given) > _TEMPLATE_VARIABLES:
        raise OpenAIError(
            f"'chat_template_kwargs' must be an object of at most {_TEMPLATE_VARIABLES} members",
            param="chat_template_kwargs",
        )
    for key, value in given.items():
        if not key.isidentifier() or key in _TEMPLATE_OWN:
            raise OpenAIError(
                f"'chat_template_kwargs.{key[:64]}' is no variable a request may set", param="chat_template_kwargs"
            )
        scalar = (
            value is None
            or isinstance(value, bool | int | float)
            or (isinstance(value, str) and len(value) <= _TEMPLATE_TEXT)
        )
        if not scalar:
            raise OpenAIError(
                f"'chat_template_kwargs.{key[:64]}' must be a number, a boolean, null or a string of at most "
                f"{_TEMPLATE_TEXT} characters",
                param="chat_template_kwargs",
            )
    return dict(given)


# OpenAI's roles; "developer" (its newer name for "system") is rendered as "system", which every
# chat template knows.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _message(message: object, index: int) -> dict[str, Any]:
    """A chat message of text: content a string or a list of text parts (or none, on an assistant
    message that calls tools); an assistant's ``tool_calls`` and a tool message's ``tool_call_id``."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise OpenAIError(f"'{where}' must be an object with a string 'role'", param="messages")
    role = _ROLES.get(message["role"])
    if role is None:
        raise OpenAIError(
            f"'{where}.role' must be one of {', '.join(sorted(_ROLES))}, not {message['role'][:64]!r}", param="messages"
        )
    for key in message:
        if key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
            raise _refused(f"{where}.{key}", "only role, content, name, tool_calls and tool_call_id are read")
    try:
        fields = tool_message_fields(message, where)
    except ToolsError as exc:
        raise OpenAIError(str(exc), param=exc.param) from exc
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise OpenAIError(f"'{where}.content': only text parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    if content is None and "tool_calls" in fields:
        # OpenAI's assistant message that only calls tools has no content.
        content = ""
    if not isinstance(content, str):
        raise OpenAIError(f"'{where}.content' must be a string or a list of text parts", param="messages")
    return {"role": role, "content": content, **fields}


def _max_tokens(reader: _Reader, context: int | None, prompt_tokens: int, chat: bool) -> int:
    """By default what fits the context after the longest prompt (chat) or 16 tokens (completions,
    at most what fits); more than fits is a 400, as in vLLM."""
    key = "max_completion_tokens" if chat and reader.body.get("max_completion_tokens") is not None else "max_tokens"
    room = None if context is None else context - prompt_tokens
    if room is not None and room < 1:
        raise OpenAIError(
            f"This model's maximum context length is {context} tokens. However, your prompt is "
            f"{prompt_tokens} tokens, which leaves no room for a completion.",
            param="messages" if chat else "prompt",
        )
    requested = reader.integer(key, None, low=1, high=2**32 - 1)
    if requested is None:
        if not chat:
            return DEFAULT_COMPLETION_TOKENS if room is None else min(DEFAULT_COMPLETION_TOKENS, room)
        if room is None:
            raise OpenAIError(f"'{key}' is required: the model's context length is unknown", param=key)
        return room
    if room is not None and requested > room:
        raise OpenAIError(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the "
            "completion). Please reduce the prompt or the completion length.",
            param=key,
        )
    return requested


# The members of ``speculative``.
_SPECULATION_MEMBERS = ("enabled", "max_tokens", "drafters", "report")


def _speculation(reader: _Reader) -> Speculation:
    """``speculative``: a boolean (enabled or not), or an object of ``enabled``, ``max_tokens``
    (1 to 64, SDCP 4.1's bound on m_max), ``drafters`` (drafter model digests, in hex) and
    ``report`` (acceptance in the usage)."""
    value = reader.body.get("speculative")
    if value is None:
        return Speculation()
    if isinstance(value, bool):
        return Speculation(enabled=value)
    if not isinstance(value, dict):
        raise OpenAIError("'speculative' must be a boolean or an object", param="speculative")
    for key in value:
        if key not in _SPECULATION_MEMBERS:
            raise OpenAIError(
                f"'speculative' has no member {key!r} (it has {', '.join(_SPECULATION_MEMBERS)})", param="speculative"
            )
    inner = _Reader(value, within="speculative.")
    enabled = inner.boolean("enabled", True)
    max_tokens = inner.integer("max_tokens", None, low=1, high=MAX_DRAFT_TOKENS)
    drafters = value.get("drafters")
    if drafters is not None:
        if (
            not isinstance(drafters, list)
            or not 0 < len(drafters) <= MAX_DRAFTER_MODELS
            or not all(isinstance(d, str) and re.fullmatch(r"[0-9a-fA-F]{64}", d) for d in drafters)
        ):
            raise OpenAIError(
                f"'speculative.drafters' must list 1 to {MAX_DRAFTER_MODELS} drafter model digests "
                "(64 hexadecimal digits each)",
                param="speculative.drafters",
            )
        drafters = tuple(bytes.fromhex(d) for d in drafters)
    if not enabled and (max_tokens is not None or drafters is not None):
        raise OpenAIError(
            "'speculative.enabled' is false: no drafter proposes, so max_tokens and drafters have nothing to bound",
            param="speculative.enabled",
        )
    return Speculation(enabled, max_tokens, drafters, inner.boolean("report", False))


def _stream_options(reader: _Reader, stream: bool) -> tuple[bool, bool]:
    options = reader.body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise OpenAIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", param="stream_options")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise OpenAIError(f"Unrecognized stream option: {key}", param="stream_options")
    inner = _Reader(options, within="stream_options.")
    include = inner.boolean("include_usage", False)
    return include, include and inner.boolean("continuous_usage_stats", False)


def _logprobs(reader: _Reader, chat: bool) -> int | None:
    """Completions: ``logprobs`` is the number of alternatives; chat: a boolean and ``top_logprobs``."""
    if not chat:
        return reader.integer("logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
    wanted = reader.boolean("logprobs", False)
    top = reader.integer("top_logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise OpenAIError("'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")
    return (top or 0) if wanted else None


# -- answers -------------------------------------------------------------------------------------------


def choice_text(codec: TextCodec, generation: Generation) -> ChoiceText:
    """The text of one of ``generation``'s choices, with its stop strings."""
    return ChoiceText(
        codec,
        generation.stop_texts,
        include_stop=generation.include_stop_str,
        min_tokens=generation.min_tokens,
        skip_special_tokens=generation.skip_special_tokens,
    )


def token_stop_reason(codec: TextCodec, generation: Generation, token: int) -> str | int | None:
    """vLLM's ``stop_reason`` of a choice that its verifier ended at the stop token ``token``:
    None for an end-of-text token, the stop string that is this one token, else the token's id
    (``stop_token_ids``)."""
    if token in codec.end_of_text_tokens():
        return None
    return one_token_stops(codec, generation.stop_texts).get(token, token)


Logprobs = Sequence[tuple[int, TokenLogprob | None]]


def _value(micro: int | None) -> float | None:
    return None if micro is None else micro / LOGPROB_SCALE


def completion_logprobs(entries: Logprobs, token_text: Callable[[int], str], offset: int) -> dict[str, Any]:
    """The `logprobs` of a completions choice for these tokens; ``offset`` is where the first one's
    text starts in the choice's text."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in entries:
        text = token_text(token)
        tokens.append(text)
        values.append(_value(entry.logprob) if entry else None)
        alternatives = entry.top if entry and entry.top is not None else ()
        tops.append({token_text(a.token): a.logprob / LOGPROB_SCALE for a in alternatives} if entry else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: Logprobs, token_text: Callable[[int], str]) -> dict[str, Any]:
    """The `logprobs` of a chat choice for these tokens."""

    def described(token: int, micro: int | None) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": _value(micro), "bytes": list(text.encode("utf-8"))}

    content = []
    for token, entry in entries:
        item = described(token, entry.logprob if entry else None)
        alternatives = entry.top if entry and entry.top is not None else ()
        item["top_logprobs"] = [described(a.token, a.logprob) for a in alternatives]
        content.append(item)
    return {"content": content}
