"""sdcp.frontend.openai_api on its own: how completions and chat requests are read and refused,
what their answers' logprobs look like, and how a choice's text is cut at stop strings; with the
bundled model's tokenizer, without sockets or models (tests/e2e/test_openai_api.py is the gateway's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from sdcp.frontend.openai_api import (
    _NEUTRAL,
    MAX_CHOICES,
    MAX_STOP_STRINGS,
    Generation,
    OpenAIError,
    chat_logprobs,
    check_unicode,
    choice_text,
    completion_logprobs,
    error_body,
    parse_detokenize,
    parse_generation,
    parse_tokenize,
)
from sdcp.frontend.text import TextCodec, load_text_codec
from sdcp.protocol.messages import Alternative, Sampling, TokenLogprob

SERVED = ("smollm2",)
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_text_codec("smollm2")


def completion(codec: TextCodec, **body: Any) -> Generation:
    return parse_generation({"prompt": "Hello", **body}, codec, served=SERVED, chat=False)


def chat(codec: TextCodec, **body: Any) -> Generation:
    return parse_generation({"messages": CHAT, **body}, codec, served=SERVED, chat=True)


def refusal(codec: TextCodec, body: object, *, chat: bool = False, strict: bool = False) -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        parse_generation(body, codec, served=SERVED, chat=chat, strict=strict)
    return refused.value


def assert_bad_parameter(error: OpenAIError, param: str) -> None:
    """OpenAI's 400: an invalid_request_error that names the parameter, in OpenAI's error shape."""
    assert error.status == 400
    assert error.body() == {
        "error": {"message": error.message, "type": "invalid_request_error", "param": param, "code": None}
    }


# -- the request as a whole ---------------------------------------------------------------------------


@pytest.mark.parametrize("body", [[1, 2], "prompt", None, 5])
def test_a_body_that_is_not_an_object_is_a_400(codec: TextCodec, body: object) -> None:
    error = refusal(codec, body)
    assert error.status == 400 and error.param is None and "JSON object" in error.message


@pytest.mark.parametrize(
    ("member", "is_chat"),
    [
        ("no_such_parameter", False),
        ("no_such_parameter", True),
        # Members of the other endpoint: ignored there, as vLLM ignores them.
        ("messages", False),
        ("max_completion_tokens", False),
        ("top_logprobs", False),
        ("add_generation_prompt", False),
        ("parallel_tool_calls", False),
        ("prompt", True),
        ("echo", True),
        ("add_special_tokens", True),
    ],
)
def test_an_unknown_member_is_ignored_and_named_as_vllm_does(codec: TextCodec, member: str, is_chat: bool) -> None:
    body: dict[str, object] = {"messages": CHAT} if is_chat else {"prompt": "Hello"}
    plain = parse_generation(body, codec, served=SERVED, chat=is_chat)
    generation = parse_generation({**body, member: 1, "another": [2]}, codec, served=SERVED, chat=is_chat)
    assert generation.ignored == (member, "another")
    assert replace(generation, ignored=()) == plain


@pytest.mark.parametrize("is_chat", [False, True])
def test_in_strict_mode_an_unknown_member_is_refused_as_openai_refuses_it(codec: TextCodec, is_chat: bool) -> None:
    body = {"messages": CHAT} if is_chat else {"prompt": "Hello"}
    for member in ("no_such_parameter", "prompt" if is_chat else "messages"):
        error = refusal(codec, {**body, member: 1}, chat=is_chat, strict=True)
        assert_bad_parameter(error, member)
        assert error.message == f"Unrecognized request argument supplied: {member}"


def test_an_unknown_member_that_is_null_is_ignored(codec: TextCodec) -> None:
    assert completion(codec, no_such_parameter=None).max_tokens == completion(codec).max_tokens


@pytest.mark.parametrize(("member", "neutral"), [(k, v) for k, values in _NEUTRAL.items() for v in (None, *values)])
@pytest.mark.parametrize("is_chat", [False, True])
def test_a_parameter_at_the_value_that_changes_nothing_is_accepted(
    codec: TextCodec, member: str, neutral: object, is_chat: bool
) -> None:
    plain = chat(codec) if is_chat else completion(codec)
    assert (chat(codec, **{member: neutral}) if is_chat else completion(codec, **{member: neutral})) == plain


@pytest.mark.parametrize("member", sorted(_NEUTRAL))
def test_a_parameter_at_any_other_value_is_a_400_naming_it(codec: TextCodec, member: str) -> None:
    error = refusal(codec, {"prompt": "Hello", member: "something else"})
    assert_bad_parameter(error, member)
    assert error.message.startswith(f"'{member}' is not supported by this server: only null")


@pytest.mark.parametrize(
    ("member", "value"),
    # Booleans and numbers are not interchangeable: false is not 0, nor 1 true.
    [("priority", False), ("use_beam_search", 0), ("spaces_between_special_tokens", 1), ("continue_final_message", 0)],
)
def test_a_neutral_value_must_match_in_type_too(codec: TextCodec, member: str, value: object) -> None:
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", member: value}), member)


@pytest.mark.parametrize("strict", [False, True])
def test_members_agent_sdks_send_are_accepted_and_named_as_ignored(codec: TextCodec, strict: bool) -> None:
    members = {"metadata": {"run": "1"}, "store": True, "reasoning_effort": "low", "user": "u-1"}
    body = {"messages": CHAT, "parallel_tool_calls": False, **members}
    generation = parse_generation(body, codec, served=SERVED, chat=True, strict=strict)
    assert sorted(generation.ignored) == ["metadata", "reasoning_effort", "store"]
    assert generation.user == "u-1"
    assert replace(generation, ignored=(), user=None) == chat(codec)


def test_a_developer_message_is_a_system_message_and_other_roles_are_a_400(codec: TextCodec) -> None:
    def text(role: str) -> str:
        messages = [{"role": role, "content": "Be brief."}, *CHAT]
        return parse_generation({"messages": messages}, codec, served=SERVED, chat=True).choices[0].prompt.text

    assert text("developer") == text("system")
    error = refusal(codec, {"messages": [{"role": "wizard", "content": "x"}]}, chat=True)
    assert_bad_parameter(error, "messages")
    assert "wizard" in error.message


def test_chat_template_kwargs_are_the_templates_variables(codec: TextCodec) -> None:
    thinking = replace_template(codec, "{% if enable_thinking %}think {% endif %}{{ messages[0].content }}")
    body: dict[str, Any] = {"messages": CHAT}
    plain = parse_generation(body, thinking, served=SERVED, chat=True).choices[0].prompt.text
    asked = (
        parse_generation(
            {**body, "chat_template_kwargs": {"enable_thinking": True}}, thinking, served=SERVED, chat=True
        )
        .choices[0]
        .prompt.text
    )
    assert (plain, asked) == ("Say hi.", "think Say hi.")
    for bad in ({"messages": "x"}, {"x": [1]}, {"x": "y" * 2000}, {f"v{i}": i for i in range(17)}, ["x"]):
        error = refusal(codec, {"messages": CHAT, "chat_template_kwargs": bad}, chat=True)
        assert_bad_parameter(error, "chat_template_kwargs")


def replace_template(codec: TextCodec, template: str) -> TextCodec:
    copy = TextCodec.__new__(TextCodec)
    copy.__dict__.update(codec.__dict__)
    copy.chat_template = template
    return copy


def test_the_model_is_the_served_one_or_absent(codec: TextCodec) -> None:
    assert completion(codec, model="smollm2") == completion(codec)
    error = refusal(codec, {"prompt": "Hello", "model": "gpt-4"})
    assert error.status == 404 and error.param == "model"
    assert error.body()["error"] | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


# -- prompts and messages -------------------------------------------------------------------------------


def test_a_prompt_is_text_or_token_ids_and_lists_of_them(codec: TextCodec) -> None:
    hello, world = codec.encode("Hello"), codec.encode(" world")
    assert [c.prompt.ids for c in completion(codec, prompt="Hello").choices] == [tuple(hello)]
    as_list = completion(codec, prompt=["Hello", " world"]).choices
    assert [(c.prompt.ids, c.prompt.text) for c in as_list] == [(tuple(hello), "Hello"), (tuple(world), " world")]
    ids = completion(codec, prompt=hello + world).choices
    assert [(c.prompt.ids, c.prompt.text) for c in ids] == [(tuple(hello + world), "Hello world")]
    lists = completion(codec, prompt=[hello, world]).choices
    assert [c.prompt.text for c in lists] == ["Hello", " world"]


@pytest.mark.parametrize(
    "prompt", ["", [], [[]], [""], 5, None, [1.5], [True], [[1], "x", 3], {"text": "Hello"}, ["x"] * (MAX_CHOICES + 1)]
)
def test_a_malformed_prompt_is_a_400_naming_it(codec: TextCodec, prompt: object) -> None:
    assert_bad_parameter(refusal(codec, {"prompt": prompt}), "prompt")


def test_prompt_token_ids_must_be_in_the_vocabulary(codec: TextCodec) -> None:
    error = refusal(codec, {"prompt": [1, codec.vocab_size]})
    assert_bad_parameter(error, "prompt")
    assert str(codec.vocab_size) in error.message
    assert completion(codec, prompt=[codec.vocab_size - 1]).choices[0].prompt.ids == (codec.vocab_size - 1,)


def test_add_special_tokens_is_a_boolean(codec: TextCodec) -> None:
    assert completion(codec, add_special_tokens=False).choices[0].prompt.ids == tuple(codec.encode("Hello"))
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", "add_special_tokens": "no"}), "add_special_tokens")


def test_chat_messages_are_rendered_with_the_template(codec: TextCodec) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?", "name": "ann"}]
    (choice,) = chat(codec, messages=messages).choices
    expected = codec.render_chat([{"role": m["role"], "content": m["content"]} for m in messages])
    assert choice.prompt.text == expected and choice.prompt.ids == tuple(
        codec.encode(expected, add_special_tokens=False)
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]}]
    assert chat(codec, messages=parts).choices == chat(codec).choices
    without = chat(codec, add_generation_prompt=False).choices[0].prompt.ids
    assert without == tuple(codec.encode_chat(CHAT, add_generation_prompt=False))
    assert without != chat(codec).choices[0].prompt.ids


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"content": "x"}], "messages"),
        (["hi"], "messages"),
        ([{"role": "user"}], "messages"),
        ([{"role": "user", "content": 5}], "messages"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ],
)
def test_malformed_messages_are_a_400_naming_them(codec: TextCodec, messages: object, param: str) -> None:
    assert_bad_parameter(refusal(codec, {"messages": messages}, chat=True), param)


def test_chat_needs_a_chat_template(codec: TextCodec) -> None:
    plain = TextCodec(codec.tokenizer, context_length=codec.context_length)
    error = refusal(plain, {"messages": CHAT}, chat=True)
    assert_bad_parameter(error, "messages")
    assert "no chat template" in error.message


# -- choices and usage ------------------------------------------------------------------------------------


def test_each_prompt_gets_n_choices_and_usage_counts_each_prompt_once(codec: TextCodec) -> None:
    generation = completion(codec, prompt=["Hello", " world", "Hello"], n=2)
    assert [(c.index, c.prompt.text, c.first_of_prompt) for c in generation.choices] == [
        (0, "Hello", True),
        (1, "Hello", False),
        (2, " world", True),
        (3, " world", False),
        (4, "Hello", True),
        (5, "Hello", False),
    ]
    # A prompt repeated in the list counts once per occurrence, not once per choice.
    assert generation.prompt_tokens == 2 * len(codec.encode("Hello")) + len(codec.encode(" world"))
    assert chat(codec, n=3).prompt_tokens == len(codec.encode_chat(CHAT))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": MAX_CHOICES + 1}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"best_of": 2}, "best_of"),
        ({"prompt": ["a", "b", "c"], "n": 6}, "n"),
    ],
)
def test_choices_are_bounded(codec: TextCodec, body: dict[str, Any], param: str) -> None:
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", **body}), param)


def test_best_of_may_repeat_n(codec: TextCodec) -> None:
    assert len(completion(codec, n=3, best_of=3).choices) == 3
    assert len(completion(codec, prompt=["a"] * 4, n=4).choices) == MAX_CHOICES


# -- max_tokens ---------------------------------------------------------------------------------------------


def test_max_tokens_defaults_to_16_for_completions_and_the_context_for_chat(codec: TextCodec) -> None:
    # OpenAI's and vLLM's defaults: 16 tokens for a completion, what fits the context for a chat.
    assert codec.context_length is not None
    assert completion(codec, prompt=["Hello", "Hello there, world"]).max_tokens == 16
    assert chat(codec).max_tokens == codec.context_length - len(codec.encode_chat(CHAT))
    # Never more than fits after the longest prompt.
    near_full = [1] * (codec.context_length - 5)
    assert completion(codec, prompt=[[1], near_full]).max_tokens == 5


def test_max_tokens_is_taken_up_to_the_context(codec: TextCodec) -> None:
    assert codec.context_length is not None
    room = codec.context_length - len(codec.encode("Hello"))
    assert completion(codec, max_tokens=7).max_tokens == 7
    assert completion(codec, max_tokens=room).max_tokens == room
    error = refusal(codec, {"prompt": "Hello", "max_tokens": room + 1})
    assert_bad_parameter(error, "max_tokens")
    assert f"maximum context length is {codec.context_length} tokens" in error.message


def test_chat_prefers_max_completion_tokens(codec: TextCodec) -> None:
    assert chat(codec, max_tokens=5).max_tokens == 5
    assert chat(codec, max_tokens=5, max_completion_tokens=9).max_tokens == 9
    assert chat(codec, max_tokens=5, max_completion_tokens=None).max_tokens == 5
    assert_bad_parameter(
        refusal(codec, {"messages": CHAT, "max_completion_tokens": 0}, chat=True), "max_completion_tokens"
    )


@pytest.mark.parametrize("value", [0, -1, "ten", 1.5, True, 2**32])
def test_max_tokens_is_a_positive_integer(codec: TextCodec, value: object) -> None:
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", "max_tokens": value}), "max_tokens")


def test_a_prompt_that_fills_the_context_is_a_400(codec: TextCodec) -> None:
    small = TextCodec(codec.tokenizer, chat_template=codec.chat_template, context_length=3)
    assert_bad_parameter(refusal(small, {"prompt": [1, 2, 3]}), "prompt")
    assert_bad_parameter(refusal(small, {"messages": CHAT}, chat=True), "messages")
    assert completion(small, prompt=[1, 2]).max_tokens == 1


def test_without_a_known_context_a_chat_needs_max_tokens(codec: TextCodec) -> None:
    unbounded = TextCodec(codec.tokenizer, chat_template=codec.chat_template)
    error = refusal(unbounded, {"messages": CHAT}, chat=True)
    assert_bad_parameter(error, "max_tokens")
    assert "required" in error.message
    assert completion(unbounded).max_tokens == 16
    assert completion(unbounded, max_tokens=100_000).max_tokens == 100_000


def test_a_prompt_too_large_for_the_context_is_refused_by_its_size_before_it_is_tokenized(codec: TextCodec) -> None:
    assert codec.context_length is not None
    # No token of the bundled model stands for more than 81 bytes (a newline and 80 spaces).
    assert codec.max_token_bytes == 81
    most = codec.context_length * codec.max_token_bytes
    calls = []

    class Counting(TextCodec):
        def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
            calls.append(len(text))
            return super().encode(text, add_special_tokens=add_special_tokens)

    counted = Counting(codec.tokenizer, chat_template=codec.chat_template, context_length=codec.context_length)
    # One byte over what context_length tokens can stand for: refused, never tokenized.
    for prompt in ("x" * (most + 1), "é" * (most // 2 + 1)):
        error = refusal(counted, {"prompt": prompt})
        assert_bad_parameter(error, "prompt")
        assert f"maximum context length is {codec.context_length} tokens" in error.message
        tokenize = refusal(counted, {"prompt": ["Hello", prompt]})
        assert tokenize.param == "prompt"
        with pytest.raises(OpenAIError) as refused:
            parse_tokenize({"prompt": prompt}, counted, served=SERVED, context=codec.context_length)
        assert refused.value.param == "prompt"
    big_message = [{"role": "user", "content": "x" * (most + 1)}]
    assert_bad_parameter(refusal(counted, {"messages": big_message}, chat=True), "messages")
    # Only the small prompt before the large one in a list was tokenized (once per loop).
    assert calls == [len("Hello")] * 2
    # Within the bound, the tokens decide: this one is tokenized, and then too long.
    error = refusal(counted, {"prompt": "word " * 9000})
    assert calls[-1] == len("word " * 9000) and "your prompt is 9001 tokens" in error.message


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "\ud800"},
        {"messages": [{"role": "user", "content": "a\udfffb"}]},
        {"prompt": "Hi", "stop": ["\udc00"]},
        {"prompt": "Hi", "\ud83d": 1},
        {"prompt": "Hi", "user": {"deep": [["\udbff"]]}},
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400(body: dict[str, object]) -> None:
    with pytest.raises(OpenAIError) as refused:
        check_unicode(body)
    assert refused.value.status == 400 and "surrogate" in refused.value.message
    # A pair is one character, and text.
    check_unicode({"prompt": "\ud83c\udf89".encode("utf-16", "surrogatepass").decode("utf-16")})


# -- sampling -----------------------------------------------------------------------------------------------


def test_temperature_zero_is_rule_1_and_anything_else_rule_2_with_a_profile(codec: TextCodec) -> None:
    greedy = completion(codec, temperature=0, top_k=5, seed=3)
    assert (greedy.rule, greedy.sampling) == (1, None)
    default = completion(codec)
    assert (default.rule, default.sampling) == (2, Sampling(temperature_milli=1000))
    tuned = completion(codec, temperature=0.7, top_p=0.9, top_k=40, seed=5)
    assert tuned.sampling == Sampling(temperature_milli=700, top_k=40, top_p_milli=900, seed=5)
    # The values that change nothing are left out of the profile.
    assert completion(codec, top_k=-1, top_p=1).sampling == Sampling(temperature_milli=1000)
    assert completion(codec, top_k=0, temperature=2).sampling == Sampling(temperature_milli=2000)


@pytest.mark.parametrize(
    ("member", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", "hot"),
        ("temperature", float("nan")),
        ("temperature", True),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 1.0),
        ("top_k", 10**6),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", "7"),
    ],
)
def test_sampling_parameters_out_of_range_are_a_400_naming_them(codec: TextCodec, member: str, value: object) -> None:
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", member: value}), member)


# -- stopping ---------------------------------------------------------------------------------------------------


def test_stop_strings_of_one_token_stop_at_the_verifier_and_longer_ones_in_the_text(codec: TextCodec) -> None:
    (one_token,) = codec.encode("STOP", add_special_tokens=False)
    assert len(codec.encode(" the end", add_special_tokens=False)) > 1
    generation = completion(codec, stop=["STOP", " the end"])
    assert generation.stop_texts == ("STOP", " the end")
    assert generation.stop_ids == tuple(sorted({one_token, *codec.end_of_text_tokens()}))
    assert completion(codec, stop="STOP").stop_texts == ("STOP",)
    assert completion(codec).stop_ids == tuple(codec.end_of_text_tokens())


def test_stop_token_ids_and_ignore_eos(codec: TextCodec) -> None:
    assert completion(codec, stop_token_ids=[7, 9]).stop_ids == tuple(sorted({7, 9, *codec.end_of_text_tokens()}))
    assert completion(codec, stop_token_ids=[7], ignore_eos=True).stop_ids == (7,)
    assert completion(codec, ignore_eos=True).stop_ids == ()


@pytest.mark.parametrize(
    ("member", "value"),
    [
        ("stop", ""),
        ("stop", [""]),
        ("stop", 5),
        ("stop", [5]),
        ("stop", {"text": "x"}),
        ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
        ("stop_token_ids", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [49152]),
        ("ignore_eos", "yes"),
        ("include_stop_str_in_output", 1),
        ("skip_special_tokens", "no"),
    ],
)
def test_malformed_stop_parameters_are_a_400_naming_them(codec: TextCodec, member: str, value: object) -> None:
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", member: value}), member)


def test_min_tokens_is_at_most_max_tokens(codec: TextCodec) -> None:
    assert completion(codec).min_tokens == 0
    assert completion(codec, max_tokens=8, min_tokens=8).min_tokens == 8
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", "max_tokens": 8, "min_tokens": 9}), "min_tokens")


def test_output_options_and_their_defaults(codec: TextCodec) -> None:
    default = completion(codec)
    assert (default.skip_special_tokens, default.include_stop_str, default.echo) == (True, False, False)
    assert (default.user, default.request_id, default.stream) == (None, None, False)
    chosen = completion(
        codec, skip_special_tokens=False, include_stop_str_in_output=True, echo=True, user="ann", request_id="r1"
    )
    assert (chosen.skip_special_tokens, chosen.include_stop_str, chosen.echo) == (False, True, True)
    assert (chosen.user, chosen.request_id) == ("ann", "r1")
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", "user": 5}), "user")
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", "request_id": ["r"]}), "request_id")
    assert_bad_parameter(
        refusal(codec, {"messages": CHAT, "parallel_tool_calls": "yes"}, chat=True), "parallel_tool_calls"
    )


# -- streaming and logprobs -------------------------------------------------------------------------------------


def test_stream_options(codec: TextCodec) -> None:
    assert (completion(codec, stream=True).include_usage, completion(codec, stream=True).continuous_usage) == (
        False,
        False,
    )
    usage = completion(codec, stream=True, stream_options={"include_usage": True})
    assert (usage.stream, usage.include_usage, usage.continuous_usage) == (True, True, False)
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert completion(codec, stream=True, stream_options=both).continuous_usage
    # Continuous usage is a kind of usage: without include_usage there is none.
    assert not completion(codec, stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": "usage"}, "stream_options"),
        ({"stream": True, "stream_options": {"everything": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        (
            {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_malformed_stream_options_are_a_400_naming_them(codec: TextCodec, body: dict[str, Any], param: str) -> None:
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", **body}), param)


def test_completions_logprobs_is_the_number_of_alternatives(codec: TextCodec) -> None:
    assert completion(codec).logprobs is None
    assert completion(codec, logprobs=0).logprobs == 0
    assert completion(codec, logprobs=20).logprobs == 20
    for value in (21, -1, True):
        assert_bad_parameter(refusal(codec, {"prompt": "Hello", "logprobs": value}), "logprobs")
    assert_bad_parameter(refusal(codec, {"prompt": "Hello", "logprobs": 1, "echo": True}), "echo")


def test_chat_logprobs_is_a_switch_with_top_logprobs(codec: TextCodec) -> None:
    assert chat(codec).logprobs is None
    assert chat(codec, logprobs=False).logprobs is None
    assert chat(codec, logprobs=True).logprobs == 0
    assert chat(codec, logprobs=True, top_logprobs=3).logprobs == 3
    assert_bad_parameter(refusal(codec, {"messages": CHAT, "top_logprobs": 3}, chat=True), "top_logprobs")
    assert_bad_parameter(refusal(codec, {"messages": CHAT, "logprobs": 2}, chat=True), "logprobs")
    assert_bad_parameter(
        refusal(codec, {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, chat=True), "top_logprobs"
    )


def _token_text(token: int) -> str:
    return {1: "a", 2: "bc", 3: "é"}[token]


ENTRIES: list[tuple[int, TokenLogprob | None]] = [
    (
        1,
        TokenLogprob(
            logprob=-500_000, top=(Alternative(token=1, logprob=-500_000), Alternative(token=3, logprob=-2_000_000))
        ),
    ),
    # A token the verifier did not decide (committed before a failover) has no log-probability.
    (2, None),
    (3, TokenLogprob(logprob=-1_250_000)),
]


def test_completion_logprobs_have_openais_shape() -> None:
    assert completion_logprobs(ENTRIES, _token_text, 10) == {
        "tokens": ["a", "bc", "é"],
        "token_logprobs": [-0.5, None, -1.25],
        "top_logprobs": [{"a": -0.5, "é": -2.0}, None, {}],
        "text_offset": [10, 11, 13],
    }
    assert completion_logprobs([], _token_text, 0) == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }


def test_chat_logprobs_have_openais_shape() -> None:
    assert chat_logprobs(ENTRIES, _token_text) == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [
                    {"token": "a", "logprob": -0.5, "bytes": [97]},
                    {"token": "é", "logprob": -2.0, "bytes": [0xC3, 0xA9]},
                ],
            },
            {"token": "bc", "logprob": None, "bytes": [98, 99], "top_logprobs": []},
            {"token": "é", "logprob": -1.25, "bytes": [0xC3, 0xA9], "top_logprobs": []},
        ]
    }


# -- errors ---------------------------------------------------------------------------------------------------


def test_errors_take_openais_shape() -> None:
    assert error_body("no", "server_error") == {
        "error": {"message": "no", "type": "server_error", "param": None, "code": None}
    }
    unauthorized = OpenAIError("Incorrect API key provided", status=401, kind="authentication_error")
    assert unauthorized.body()["error"] == {
        "message": "Incorrect API key provided",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert OpenAIError("too big", status=413).body()["error"]["code"] is None


# -- /tokenize and /detokenize ----------------------------------------------------------------------------------


def test_tokenize_reads_a_prompt_or_messages(codec: TextCodec) -> None:
    assert parse_tokenize({"prompt": "Hello"}, codec, served=SERVED) == codec.encode("Hello")
    assert parse_tokenize({"model": "smollm2", "messages": CHAT}, codec, served=SERVED) == codec.encode_chat(CHAT)
    without = parse_tokenize({"messages": CHAT, "add_generation_prompt": False}, codec, served=SERVED)
    assert without == codec.encode_chat(CHAT, add_generation_prompt=False)
    assert parse_tokenize({"prompt": "Hello", "add_special_tokens": False}, codec, served=SERVED) == codec.encode(
        "Hello", add_special_tokens=False
    )


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"prompt": "x", "n": 1}, "n", 400),
        ({"prompt": 5}, "prompt", 400),
        ({}, "prompt", 400),
        ({"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens", 400),
        ({"messages": []}, "messages", 400),
        ({"prompt": "x", "model": "gpt-4"}, "model", 404),
    ],
)
def test_tokenize_refusals_name_the_parameter(codec: TextCodec, body: dict[str, Any], param: str, status: int) -> None:
    with pytest.raises(OpenAIError) as refused:
        parse_tokenize(body, codec, served=SERVED)
    assert (refused.value.status, refused.value.param) == (status, param)


def test_detokenize_gives_the_text_of_tokens(codec: TextCodec) -> None:
    tokens = codec.encode("Café ☕")
    assert parse_detokenize({"tokens": tokens}, codec, served=SERVED) == "Café ☕"
    for body, param in (
        ({"tokens": [codec.vocab_size]}, "tokens"),
        ({"tokens": "x"}, "tokens"),
        ({"text": "x"}, "text"),
    ):
        with pytest.raises(OpenAIError) as refused:
            parse_detokenize(body, codec, served=SERVED)
        assert (refused.value.status, refused.value.param) == (400, param)
    with pytest.raises(OpenAIError, match="JSON object"):
        parse_detokenize([1], codec, served=SERVED)


# -- a choice's text and stop strings -------------------------------------------------------------------------


def run_text(
    codec: TextCodec, generation: Generation, tokens: Sequence[int], sizes: Sequence[int]
) -> list[tuple[str, bool]]:
    """The (text, stopped) of each chunk, the chunk sizes as given; the last chunk ends the session."""
    text, out, start = choice_text(codec, generation), [], 0
    for number, size in enumerate(sizes):
        out.append(text.add(tokens[start : start + size], last=number == len(sizes) - 1))
        start += size
        if out[-1][1]:
            break
    return out


def test_without_stop_strings_text_comes_out_as_it_is_decoded(codec: TextCodec) -> None:
    tokens = codec.encode("Hello world. Café ☕ here", add_special_tokens=False)
    pieces = run_text(codec, completion(codec), tokens, [1] * len(tokens))
    assert "".join(text for text, _ in pieces) == codec.decode(tokens)
    assert not any(stopped for _, stopped in pieces)
    # Each token's text comes out with it, but for a character whose bytes are not all there yet.
    assert [text for text, _ in pieces[:3]] == ["Hello", " world", "."]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_chunks_ends_the_text(codec: TextCodec, include: bool) -> None:
    tokens = codec.encode("Hello world. STOP here and on", add_special_tokens=False)
    assert [codec.token_text(t) for t in tokens[3:5]] == [" ST", "OP"]
    generation = completion(codec, stop=[" STOP"], include_stop_str_in_output=include)
    pieces = run_text(codec, generation, tokens, [1] * len(tokens))
    # The stop string's last token is the fifth: the choice ends there, cut before the stop string.
    assert len(pieces) == 5 and pieces[-1][1] and not any(stopped for _, stopped in pieces[:-1])
    assert "".join(text for text, _ in pieces) == ("Hello world. STOP" if include else "Hello world.")
    # Its start was held back until the next token decided it.
    assert "S" not in "".join(text for text, _ in pieces[:-1])


def test_held_back_text_comes_out_when_no_stop_string_follows(codec: TextCodec) -> None:
    tokens = codec.encode("Hello world. STAR here", add_special_tokens=False)
    pieces = run_text(codec, completion(codec, stop=[" STOP"]), tokens, [1] * len(tokens))
    assert "".join(text for text, _ in pieces) == "Hello world. STAR here" and not any(s for _, s in pieces)
    # What could start " STOP" stays back: as many characters as the stop string has but one.
    given = ""
    for count, (text, _) in enumerate(pieces[:-1], start=1):
        given += text
        decoded = codec.decode(tokens[:count])
        assert given == decoded[: max(0, len(decoded) - 4)]


def test_the_earliest_stop_string_wins(codec: TextCodec) -> None:
    tokens = codec.encode("one two three four", add_special_tokens=False)
    generation = completion(codec, stop=[" four", " two", "three"])
    pieces = run_text(codec, generation, tokens, [len(tokens)])
    assert pieces == [("one", True)]


def test_a_multi_byte_stop_string_split_over_tokens(codec: TextCodec) -> None:
    tokens = codec.encode("Tea: ☕ and more", add_special_tokens=False)
    pieces = run_text(codec, completion(codec, stop=["☕"], include_stop_str_in_output=True), tokens, [1] * len(tokens))
    assert pieces[-1][1] and "".join(text for text, _ in pieces) == "Tea: ☕"


def test_stop_strings_count_from_min_tokens_on(codec: TextCodec) -> None:
    tokens = codec.encode("a STOP b c d e STOP f", add_special_tokens=False)
    before = tokens.index(codec.encode(" b", add_special_tokens=False)[0])
    # The first stop string comes before min_tokens and is output; the second ends the text.
    generation = completion(codec, stop=[" STOP"], max_tokens=20, min_tokens=before + 1)
    pieces = run_text(codec, generation, tokens, [1] * len(tokens))
    assert pieces[-1][1] and "".join(text for text, _ in pieces) == "a STOP b c d e"
    # With every token at once, min_tokens is reached and the first one ends it.
    assert run_text(codec, generation, tokens, [len(tokens)]) == [("a", True)]


def test_a_stop_string_held_back_before_min_tokens_does_not_stop(codec: TextCodec) -> None:
    tokens = codec.encode("Hi! one two three! end", add_special_tokens=False)
    # "!" is the second token; min_tokens is reached with the third, while the longer stop string
    # still holds "!" back: it ended in text from before min_tokens, the second "!" ends the choice.
    generation = completion(codec, stop=["!", "never here"], max_tokens=20, min_tokens=3)
    pieces = run_text(codec, generation, tokens, [1] * len(tokens))
    assert pieces[-1][1] and "".join(text for text, _ in pieces) == "Hi! one two three"


def test_a_stop_string_decided_only_by_the_last_tokens(codec: TextCodec) -> None:
    tokens = codec.encode("Hello world. ST", add_special_tokens=False)
    pieces = run_text(codec, completion(codec, stop=[" STOP"]), tokens, [1] * len(tokens))
    # The session ended: the held text, " ST" included, is no stop string and comes out.
    assert pieces[-1] == ("rld. ST", False) and "".join(text for text, _ in pieces) == "Hello world. ST"


def test_special_tokens_are_skipped_unless_asked_for(codec: TextCodec) -> None:
    tokens = [*codec.encode("Hi", add_special_tokens=False), *codec.end_of_text_tokens()]
    assert "".join(t for t, _ in run_text(codec, completion(codec), tokens, [len(tokens)])) == "Hi"
    kept = completion(codec, skip_special_tokens=False)
    assert "".join(t for t, _ in run_text(codec, kept, tokens, [len(tokens)])) == "Hi<|im_end|>"
