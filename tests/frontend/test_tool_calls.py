"""Tools in chat requests (sdcp.frontend.tool_calls, #30): tools, tool_choice and tool messages into
the bundled model's prompt (its template renders no tools: the Hermes format in the messages), the
constraint that a forcing tool_choice becomes, the calls read from an output whole and piece by
piece, and OpenAI's tool_calls in the gateway's answers and streams (over the scripted cluster of
tests/frontend/scripted_cluster.py). tests/e2e/test_structured_output.py runs a tool call round trip on SmolLM2."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from tests.frontend.scripted_cluster import MODEL_A, ROUTER, ScriptedCluster, chunked, streamed

from sdcp.config import GatewayConfig, InstanceConfig, ServiceConfig
from sdcp.frontend.gateway import GatewayNode
from sdcp.frontend.openai_api import OpenAIError, parse_generation, parse_tokenize
from sdcp.frontend.text import TextCodec, load_text_codec
from sdcp.frontend.tool_calls import ToolCallReader, read_tool_calls
from sdcp.grammar import GrammarConstraint, grammar_tokenizer

SERVED = ("smollm2",)
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLED = [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]
# An output in the Hermes format: text, a call with a '<' and braces in its strings, a call whose
# members come in the other order (read whole at its end tag), whitespace around them.
OUTPUT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris <3 {x}", "list": [1, {"a": "]"}]}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>\n'
)
OUTPUT_CALLS = [("get_weather", '{"city": "Paris <3 {x}", "list": [1, {"a": "]"}]}'), ("get_time", "{}")]


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_text_codec("smollm2")


def chat(codec: TextCodec, **body: Any) -> Any:
    return parse_generation({"messages": ASK, **body}, codec, served=SERVED, chat=True)


# -- requests ---------------------------------------------------------------------------------------------


def test_tools_and_calls_go_into_the_messages_in_the_hermes_format(codec: TextCodec) -> None:
    assert not codec.template_reads_tools
    generation = chat(codec, messages=[{"role": "system", "content": "Be brief."}, *ASK, *CALLED], tools=TOOLS)
    listed = "\n".join(json.dumps(tool) for tool in TOOLS)
    assert generation.choices[0].prompt.text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nnoon\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert generation.tool_parser == "hermes" and generation.constraint is None
    # Without a system message the tools make one; tool_choice none shows them and reads no calls.
    alone = chat(codec, tools=TOOLS, tool_choice="none")
    assert alone.choices[0].prompt.text.startswith("<|im_start|>system\n# Tools\n\n")
    assert alone.tool_parser is None
    # Without tools a conversation's calls and answers are still written in the same format.
    assert "<tool_response>\nnoon\n</tool_response>" in chat(codec, messages=[*ASK, *CALLED]).choices[0].prompt.text


def test_a_template_that_renders_tools_gets_them_with_the_calls_arguments_as_objects(codec: TextCodec) -> None:
    template = (
        "{% for tool in tools or [] %}[{{ tool.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for call in m.tool_calls or [] %}{{ call.function.name }}{{ call.function.arguments.city }}{% endfor %}"
        "{% endfor %}"
    )
    rendering = TextCodec(codec.tokenizer, chat_template=template, context_length=codec.context_length)
    assert rendering.template_reads_tools
    generation = chat(rendering, messages=[*ASK, *CALLED], tools=TOOLS)
    assert generation.choices[0].prompt.text == (
        "[get_weather][get_time]user:Weather in Paris?assistant:get_weatherParisget_timetool:sunny, 21 Ctool:noon"
    )


def test_tokenize_gives_the_tokens_of_the_chat_with_its_tools(codec: TextCodec) -> None:
    messages = [*ASK, *CALLED]
    tokens = parse_tokenize({"messages": messages, "tools": TOOLS}, codec, served=SERVED)
    assert tuple(tokens) == chat(codec, messages=messages, tools=TOOLS).choices[0].prompt.ids


@pytest.mark.parametrize(
    ("choice", "name"), [("required", None), ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")]
)
def test_a_forcing_tool_choice_is_a_json_schema_constraint_of_one_call(
    codec: TextCodec, choice: object, name: str | None
) -> None:
    generation = chat(codec, tools=TOOLS, tool_choice=choice)
    assert generation.tool_parser == "json" and generation.constraint is not None
    assert generation.constraint.kind == "json_schema"
    schema = json.loads(generation.constraint.text)
    valid = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    jsonschema.validate(valid, schema)
    other = {"name": "get_time", "arguments": {}}
    if name is None:
        jsonschema.validate(other, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(other, schema)
    # The verifier's grammar forces the call's start: a drafter's and the lookahead's free tokens.
    tokenizer = grammar_tokenizer(codec.tokenizer.to_str(), codec.vocab_size)
    grammar = GrammarConstraint(tokenizer, generation.constraint, codec.end_of_text_tokens(), codec.vocab_size)
    forced = codec.decode(grammar.forced([], 32))
    assert forced == ('{"name":"get_weather","arguments":{"city' if name else '{"name":"get_')
    grammar.commit(codec.encode(json.dumps(valid, separators=(",", ":")), add_special_tokens=False))


# What openai.pydantic_function_tool and instructor's TOOLS mode send for a nested Pydantic model.
NESTED_PARAMETERS = {
    "$defs": {
        "Address": {
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
            "title": "Address",
            "type": "object",
        }
    },
    "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"}},
    "required": ["name", "home"],
    "title": "Person",
    "type": "object",
}
NESTED_TOOLS = [{"type": "function", "function": {"name": "Person", "parameters": NESTED_PARAMETERS}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Person"}}])
def test_a_forced_call_of_parameters_with_defs_resolves_them_and_allows_no_other_arguments(
    codec: TextCodec, choice: object
) -> None:
    generation = chat(codec, tools=[*NESTED_TOOLS, TOOLS[1]], tool_choice=choice)
    assert generation.constraint is not None
    schema = json.loads(generation.constraint.text)
    call = {"name": "Person", "arguments": {"name": "Ada", "home": {"street": "1 Main St", "city": "London"}}}
    jsonschema.validate(call, schema)
    for extra in (
        {**call["arguments"], "age": 36},
        {**call["arguments"], "home": {**call["arguments"]["home"], "zip": "1"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**call, "arguments": extra}, schema)
    tokenizer = grammar_tokenizer(codec.tokenizer.to_str(), codec.vocab_size)
    grammar = GrammarConstraint(tokenizer, generation.constraint, codec.end_of_text_tokens(), codec.vocab_size)
    grammar.commit(codec.encode(json.dumps(call, separators=(",", ":")), add_special_tokens=False))


def test_a_forced_calls_arguments_stay_open_where_the_gateway_leaves_objects_open(codec: TextCodec) -> None:
    body = {"messages": ASK, "tools": NESTED_TOOLS, "tool_choice": "required"}
    generation = parse_generation(body, codec, served=SERVED, chat=True, close_json_objects=False)
    assert generation.constraint is not None
    arguments = {"name": "Ada", "home": {"street": "1 Main St", "city": "London"}, "age": 36}
    jsonschema.validate({"name": "Person", "arguments": arguments}, json.loads(generation.constraint.text))
    strict = [{"type": "function", "function": {"name": "Person", "parameters": NESTED_PARAMETERS, "strict": True}}]
    generation = parse_generation({**body, "tools": strict}, codec, served=SERVED, chat=True, close_json_objects=False)
    assert generation.constraint is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "Person", "arguments": arguments}, json.loads(generation.constraint.text))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        # Unreadable parameters are refused whether or not a call is forced.
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no such type"}}}]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {"type": "object", "properties": {}, "additionalProperties": True},
                        },
                    }
                ]
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": {"get_weather": {}}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no such type"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls[0]",
        ),
        ({"messages": [{"role": "tool", "content": None}]}, "messages"),
    ],
)
def test_malformed_tools_are_a_400_naming_the_member(codec: TextCodec, body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        chat(codec, **body)
    assert refused.value.status == 400 and refused.value.param == param


# -- reading calls ----------------------------------------------------------------------------------------


def test_calls_are_read_from_the_hermes_format_and_the_text_around_them_is_content() -> None:
    content, calls = read_tool_calls(OUTPUT, "hermes")
    assert content == "Let me look."
    assert [(call.name, call.arguments) for call in calls] == OUTPUT_CALLS
    assert [call.index for call in calls] == [0, 1]
    assert all(call.id and call.id.startswith("call_") for call in calls) and calls[0].id != calls[1].id
    # A list of calls in one block (SmolLM2's larger models write that), arguments as text or object.
    listed = '<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": "{}"}]</tool_call>'
    assert [(c.name, c.arguments) for c in read_tool_calls(listed, "hermes")[1]] == [("f", '{"a": 1}'), ("g", "{}")]


@pytest.mark.parametrize(
    "text",
    ["Plain text, spaces kept  \n", "A <tool_call> that is no call </tool_call> stays text", "<tool_call", "<"],
)
def test_an_output_without_calls_is_its_text_exactly(text: str) -> None:
    assert read_tool_calls(text, "hermes") == (text, [])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 1000])
def test_calls_read_piece_by_piece_are_the_calls_read_whole(size: int) -> None:
    reader = ToolCallReader("hermes")
    pieces = [reader.feed(OUTPUT[at : at + size], last=at + size >= len(OUTPUT)) for at in range(0, len(OUTPUT), size)]
    assert "".join(piece.content for piece in pieces) == "Let me look."
    deltas = [delta for piece in pieces for delta in piece.calls]
    # Each call's first part carries its id and name; then its arguments text comes as it is read.
    firsts = [delta for delta in deltas if delta.id is not None]
    assert [(delta.index, delta.name) for delta in firsts] == [(0, "get_weather"), (1, "get_time")]
    assert all(delta.id is None and delta.name is None for delta in deltas if delta not in firsts)
    arguments = ["".join(d.arguments for d in deltas if d.index == index) for index in (0, 1)]
    assert list(zip(["get_weather", "get_time"], arguments, strict=True)) == OUTPUT_CALLS
    if size <= 8:
        # The first call's arguments stream: they come in more than one part.
        assert len([delta for delta in deltas if delta.index == 0]) > 1


def test_a_forced_call_is_the_whole_output_and_a_cut_one_keeps_its_arguments_so_far() -> None:
    assert [(c.name, c.arguments) for c in read_tool_calls('{"name":"f","arguments":{"a":[1]}}', "json")[1]] == [
        ("f", '{"a":[1]}')
    ]
    # max_tokens ended it: OpenAI's arguments need not be JSON.
    content, calls = read_tool_calls('{"name":"f","arguments":{"a":', "json")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a":')]
    assert read_tool_calls('{"name":"f","argu', "json") == ('{"name":"f","argu', [])


# -- the gateway's answers ------------------------------------------------------------------------------------


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[GatewayNode, ScriptedCluster]]:
    # The client is replaced before any use: the credential files only need to exist.
    files = {name: tmp_path / f"gateway.{name}" for name in ("cert", "key", "ca")}
    for path in files.values():
        path.touch()
    instance = InstanceConfig(uri="https://127.0.0.1:9300", router=ROUTER, **files)  # type: ignore[arg-type]
    node = GatewayNode(ServiceConfig(instance=instance, gateway=GatewayConfig(model="smollm2")))
    cluster = ScriptedCluster([])
    cluster.register(("https://v1", MODEL_A, node.codec.tokenizer_digest))
    node.client = cluster  # type: ignore[assignment]
    yield node, cluster
    await node.stop()


async def ask(node: GatewayNode, **body: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=node.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        payload = {"messages": ASK, "max_tokens": 100, "temperature": 0, "tools": TOOLS, **body}
        return await client.post("/v1/chat/completions", json=payload)


@pytest.mark.parametrize("size", [2, 1000])
async def test_an_answers_calls_are_openais_tool_calls_whole_and_streamed(
    gateway: tuple[GatewayNode, ScriptedCluster], size: int
) -> None:
    """Whether the output comes two tokens at a time or in one read, each call streams as OpenAI's
    does: its index, id, type and name alone in a chunk, then its arguments in parts."""
    node, cluster = gateway
    end = node.codec.end_of_text_tokens()[0]
    cluster.chunks = [*chunked(node.codec.encode(OUTPUT, add_special_tokens=False), [size]), [end]]
    (choice,) = (await ask(node)).json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] == "Let me look."
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("function", name, arguments) for name, arguments in OUTPUT_CALLS
    ]
    events = [event["choices"][0] for event in streamed(await ask(node, stream=True))]
    assert events[0]["delta"]["role"] == "assistant"
    assert "".join(event["delta"]["content"] or "" for event in events) == "Let me look."
    parts = [part for event in events for part in event["delta"].get("tool_calls", [])]
    assert all(len(event["delta"].get("tool_calls", [])) <= 1 for event in events)
    firsts = [part for part in parts if "id" in part]
    assert [(p["index"], p["type"], p["function"]) for p in firsts] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""}),
    ]
    # A call's header comes before its arguments.
    assert [parts.index(first) for first in firsts] == [
        min(at for at, part in enumerate(parts) if part["index"] == index) for index in (0, 1)
    ]
    assert all(
        set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
        for part in parts[1:]
        if part not in firsts
    )
    streamed_arguments = ["".join(p["function"]["arguments"] for p in parts if p["index"] == i) for i in (0, 1)]
    assert streamed_arguments == [arguments for _, arguments in OUTPUT_CALLS]
    assert [event["finish_reason"] for event in events][-1] == "tool_calls"
    assert all(event["finish_reason"] is None for event in events[:-1])


async def test_an_answer_without_calls_or_cut_by_max_tokens_keeps_its_finish_reason(
    gateway: tuple[GatewayNode, ScriptedCluster],
) -> None:
    node, cluster = gateway
    end = node.codec.end_of_text_tokens()[0]
    cluster.chunks = [node.codec.encode("It is sunny.", add_special_tokens=False), [end]]
    (choice,) = (await ask(node)).json()["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"] == {"role": "assistant", "content": "It is sunny."}
    # A call cut by max_tokens: its arguments so far, finish_reason length.
    cluster.chunks = [
        node.codec.encode('<tool_call>\n{"name": "get_weather", "arguments": {"ci', add_special_tokens=False)
    ]
    (choice,) = (await ask(node)).json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
