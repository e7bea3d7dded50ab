"""OpenAI's Responses API read into chat requests and written back (sdcp.frontend.responses_api,
#39); tests/frontend/test_gateway_service.py serves it through the openai package, and
tests/e2e/test_client_libraries.py runs the OpenAI Agents SDK's loop on it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdcp.frontend.openai_api import OpenAIError
from sdcp.frontend.responses_api import (
    Conversations,
    ResponseEvents,
    parse_responses_request,
    response_object,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


def test_instructions_and_input_items_become_the_chat_messages() -> None:
    turn = parse_responses_request(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Weather in "},
                        {"type": "input_text", "text": "Paris?"},
                    ],
                },
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "reasoning", "summary": []},
            ],
            "max_output_tokens": 20,
            "temperature": 0,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        },
        Conversations(),
    )
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}},
    ]
    assert turn.chat == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "model": "m",
        "max_tokens": 20,
        "temperature": 0,
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
        },
    }
    assert turn.echo["tool_choice"] == {"type": "function", "name": "get_weather"} and turn.echo["tools"] == [WEATHER]
    assert turn.id.startswith("resp_") and turn.store


def test_a_previous_responses_conversation_comes_before_the_input_unless_it_is_unknown() -> None:
    conversations = Conversations(most=2)
    first = parse_responses_request({"input": "Hi", "instructions": "Old."}, conversations)
    conversations.keep(
        first, [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]}]
    )
    second = parse_responses_request({"input": "Again", "previous_response_id": first.id}, conversations)
    # The earlier instructions are not carried over, as OpenAI's.
    assert second.chat["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"},
    ]
    # A third turn continues the whole conversation, not only the second turn.
    conversations.keep(second, [{"type": "message", "role": "assistant", "content": "Hello again"}])
    third = parse_responses_request({"input": "Bye", "previous_response_id": second.id}, conversations)
    assert [message["content"] for message in third.chat["messages"]] == ["Hi", "Hello", "Again", "Hello again", "Bye"]
    with pytest.raises(OpenAIError) as unknown:
        parse_responses_request({"input": "x", "previous_response_id": "resp_nope"}, conversations)
    assert (unknown.value.status, unknown.value.param) == (404, "previous_response_id")
    # Not stored: not found later; the oldest stored goes first past the bound.
    unstored = parse_responses_request({"input": "x", "store": False}, conversations)
    conversations.keep(unstored, [])
    assert conversations.get(unstored.id, None) is None
    # Another API credential does not find it.
    with pytest.raises(OpenAIError) as elsewhere:
        parse_responses_request({"input": "x", "previous_response_id": first.id}, conversations, scope="other")
    assert elsewhere.value.status == 404
    for _ in range(2):
        conversations.keep(parse_responses_request({"input": "x"}, conversations), [])
    assert conversations.get(first.id, None) is None


def test_the_conversations_kept_are_bounded_in_bytes_too() -> None:
    conversations = Conversations(most=100, most_bytes=10_000)
    turns = [parse_responses_request({"input": "x" * 4_000}, conversations) for _ in range(3)]
    for turn in turns:
        conversations.keep(turn, [])
    assert [conversations.get(turn.id, None) is not None for turn in turns] == [False, True, True]
    # One larger than the bound alone is not kept, and the others stay.
    huge = parse_responses_request({"input": "x" * 20_000}, conversations)
    conversations.keep(huge, [])
    assert conversations.get(huge.id, None) is None
    assert [conversations.get(turn.id, None) is not None for turn in turns] == [False, True, True]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "instructions": 3}, "instructions"),
    ],
)
def test_what_cannot_be_a_chat_request_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        parse_responses_request(body, Conversations())
    assert (refused.value.status, refused.value.param) == (400, param)


def test_members_are_named_as_ignored_or_refused_when_strict() -> None:
    turn = parse_responses_request({"input": "x", "reasoning": {"effort": "low"}, "no_such": 1}, Conversations())
    assert turn.ignored == ("reasoning", "no_such")
    with pytest.raises(OpenAIError) as refused:
        parse_responses_request({"input": "x", "no_such": 1}, Conversations(), strict=True)
    assert refused.value.param == "no_such"


def _answer(message: dict[str, Any], finish: str) -> dict[str, Any]:
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    return {"model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}


def test_a_chat_answer_becomes_a_response_of_output_items() -> None:
    turn = parse_responses_request({"input": "x"}, Conversations())
    response, output = response_object(turn, _answer({"role": "assistant", "content": "Hi."}, "stop"))
    assert response["status"] == "completed" and response["object"] == "response" and response["id"] == turn.id
    assert [item["type"] for item in output] == ["message"] and output[0]["content"][0]["text"] == "Hi."
    assert response["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }
    call = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    response, output = response_object(
        turn, _answer({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls")
    )
    assert [(item["type"], item["call_id"], item["name"], item["arguments"]) for item in output] == [
        ("function_call", "call_9", "f", "{}")
    ]
    cut, _ = response_object(turn, _answer({"role": "assistant", "content": "Hel"}, "length"))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def _events(stream: bytes) -> list[dict[str, Any]]:
    events = []
    for block in stream.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            events.append(event)
    return events


def test_a_chat_stream_becomes_the_responses_events() -> None:
    turn = parse_responses_request({"input": "x", "stream": True}, Conversations())
    assert turn.chat["stream_options"] == {"include_usage": True}
    events = ResponseEvents(turn, "m")
    stream = events.start()
    for text in ("Hel", "lo"):
        stream += events.chunk({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    stream += events.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]})
    more = {"index": 0, "function": {"arguments": ": 1}"}}
    stream += events.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [more]}, "finish_reason": "tool_calls"}]})
    stream += events.chunk({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})
    stream += events.done()
    parsed = _events(stream)
    assert [event["sequence_number"] for event in parsed] == list(range(len(parsed)))
    assert [event["type"] for event in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    completed = parsed[-1]["response"]
    assert [item["type"] for item in completed["output"]] == ["message", "function_call"]
    assert completed["output"][0]["content"][0]["text"] == "Hello"
    assert completed["output"][1]["arguments"] == '{"a": 1}'
    assert completed["usage"]["output_tokens"] == 2 and events.output == completed["output"]
