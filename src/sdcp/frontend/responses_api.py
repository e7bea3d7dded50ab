"""OpenAI's Responses API (``POST /v1/responses``) on the chat completions' machinery.

A request is read into a chat completions request (``ResponsesRequest.chat``: messages from its
``instructions``, ``input`` items and the conversation of ``previous_response_id``; its function
tools, ``tool_choice`` and ``text.format``), which the gateway serves as any chat request: the same
sessions, constraints and tool calls. Its answer is written back as a response object
(``response_object``) or, streamed, as the Responses API's events (``ResponseEvents``, from the chat
stream's chunks). Conversations are kept in the gateway's memory (``Conversations``), bounded.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sdcp.frontend.openai_api import OpenAIError

__all__ = ["Conversations", "ResponseEvents", "ResponsesRequest", "parse_responses_request", "response_object"]

# Responses kept for previous_response_id, at most, and their items' JSON size in all; the oldest
# goes first. A conversation grows with each turn, and every turn keeps it whole.
MAX_CONVERSATIONS = 1024
MAX_CONVERSATION_BYTES = 64 * 1024 * 1024
# Items of one conversation, at most: a longer one would not fit a context anyway.
MAX_CONVERSATION_ITEMS = 1024

# Members of a Responses request that the chat request does not read: accepted, named as ignored.
_IGNORED = ("include", "truncation", "reasoning", "prompt_cache_key", "safety_identifier", "service_tier", "metadata")
# Members read here (the rest go to the chat request as they are, to be read or ignored there).
_READ = frozenset(
    {"model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "text"}
    | {"max_output_tokens", "temperature", "top_p", "stream", "user", "parallel_tool_calls", "store", "background"}
    | set(_IGNORED)
)
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass
class ResponsesRequest:
    """A Responses request read: the chat request to serve, the items it adds to the conversation
    (its input), the members its response repeats, and those it ignores."""

    chat: dict[str, Any]
    # The conversation's items before the output: the previous response's, then this input.
    input_items: list[dict[str, Any]]
    echo: dict[str, Any]
    ignored: tuple[str, ...]
    store: bool
    # Who may continue it (previous_response_id): the API credential it came with, as a digest.
    scope: str | None = None
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))


class Conversations:
    """The items of each stored response's conversation (its input, earlier turns included, and its
    output), by response id, for ``previous_response_id``: the newest ``most``, and no more than
    ``most_bytes`` of their items' JSON in all (one larger alone is not kept). A conversation is
    found only with the API credential that stored it (its scope): to any other it is unknown, as
    one that never was."""

    def __init__(self, most: int = MAX_CONVERSATIONS, most_bytes: int = MAX_CONVERSATION_BYTES) -> None:
        self._most = most
        self._most_bytes = most_bytes
        self._bytes = 0
        self._items: OrderedDict[str, tuple[str | None, list[dict[str, Any]], int]] = OrderedDict()

    def get(self, response_id: str, scope: str | None) -> list[dict[str, Any]] | None:
        kept = self._items.get(response_id)
        return kept[1] if kept is not None and kept[0] == scope else None

    def keep(self, request: ResponsesRequest, output: list[dict[str, Any]]) -> None:
        if not request.store:
            return
        items = [*request.input_items, *output][-MAX_CONVERSATION_ITEMS:]
        size = len(json.dumps(items))
        if size > self._most_bytes:
            return
        self._items[request.id] = (request.scope, items, size)
        self._bytes += size
        while len(self._items) > self._most or self._bytes > self._most_bytes:
            self._bytes -= self._items.popitem(last=False)[1][2]


def parse_responses_request(
    body: object, conversations: Conversations, *, scope: str | None = None, strict: bool = False
) -> ResponsesRequest:
    """A Responses request as a chat completions request; OpenAIError (400, or 404 for a
    ``previous_response_id`` unknown in ``scope``) where it cannot be one. A member the Responses
    API does not define is ignored and named, or with ``strict`` refused, as on the other endpoints."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    unknown = [key for key, value in body.items() if key not in _READ and value is not None]
    if unknown and strict:
        raise OpenAIError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    earlier: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        found = conversations.get(previous, scope) if isinstance(previous, str) else None
        if found is None:
            raise OpenAIError(
                f"Previous response with id '{str(previous)[:64]}' not found.", status=404, param="previous_response_id"
            )
        earlier = list(found)
    if body.get("background") not in (None, False):
        raise OpenAIError("'background' is not supported by this server: only false is accepted", param="background")
    items = _input_items(body.get("input"))
    chat: dict[str, Any] = {}
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise OpenAIError("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    messages.extend(_messages([*earlier, *items]))
    chat["messages"] = messages
    for member, chat_member in (
        ("model", "model"),
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("user", "user"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ):
        if body.get(member) is not None:
            chat[chat_member] = body[member]
    stream = body.get("stream")
    if stream is not None:
        chat["stream"] = stream
        if stream is True:
            chat["stream_options"] = {"include_usage": True}
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        chat["tool_choice"] = _tool_choice(tool_choice)
    response_format = _format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise OpenAIError("'store' must be a boolean", param="store")
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": previous,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": body["text"]["format"]}
        if isinstance(body.get("text"), dict) and isinstance(body["text"].get("format"), dict)
        else {"format": {"type": "text"}},
        "tool_choice": tool_choice if tool_choice is not None else "auto",
        "tools": tools if isinstance(tools, list) else [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"),
        "user": body.get("user"),
        "store": store,
    }
    ignored = (*(member for member in _IGNORED if body.get(member) is not None), *unknown)
    return ResponsesRequest(chat, [*earlier, *items], echo, ignored, store, scope)


def _input_items(given: object) -> list[dict[str, Any]]:
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise OpenAIError("'input' must be a string or a non-empty list of items", param="input")
    items = []
    for index, item in enumerate(given):
        if not isinstance(item, dict):
            raise OpenAIError(f"'input[{index}]' must be an object", param="input")
        items.append(item)
    return items


def _text(content: object, where: str) -> str:
    """The text of an item's content: a string, or text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise OpenAIError(f"'{where}': only text content (a string or text parts) is supported", param="input")


def _messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of Responses items: messages, function calls (an assistant message's
    ``tool_calls``, consecutive ones together) and their outputs (tool messages)."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise OpenAIError(f"'{where}.role' must be one of {', '.join(_ROLES)}", param="input")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(value, str) for value in (call_id, name, arguments)):
                raise OpenAIError(f"'{where}': a function_call has a call_id, a name and arguments", param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise OpenAIError(f"'{where}.call_id' must be a string", param="input")
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}
            )
        elif kind == "reasoning":
            # A reasoning model's summary: this model does not reason, there is nothing to render.
            continue
        else:
            raise OpenAIError(
                f"'{where}.type' must be message, function_call, function_call_output or reasoning", param="input"
            )
    return messages


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise OpenAIError("'tools' must be a list", param="tools")
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise OpenAIError(f"'tools[{index}]': only function tools are supported", param="tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: object) -> dict[str, Any] | None:
    """``text.format`` as a chat request's ``response_format``."""
    if text is None:
        return None
    described = text.get("format") if isinstance(text, dict) else None
    if described is None:
        return None
    if not isinstance(described, dict):
        raise OpenAIError("'text.format' must be an object", param="text")
    kind = described.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {key: described[key] for key in ("name", "schema", "strict", "description") if key in described}
        return {"type": "json_schema", "json_schema": schema}
    raise OpenAIError("'text.format.type' must be one of 'text', 'json_object', 'json_schema'", param="text")


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or _new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call: dict[str, Any], item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or _new_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _status(finish: str | None) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """A response's status, incomplete_details and error for its choice's finish reason."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish == "abort":
        error = {"code": "server_error", "message": "the output's language allows no continuation"}
        return "failed", None, error
    return "completed", None, None


def _response(
    request: ResponsesRequest,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
    incomplete: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": request.id,
        "object": "response",
        "created_at": request.created_at,
        "model": model,
        "status": status,
        "output": output,
        "usage": usage,
        "incomplete_details": incomplete,
        "error": error,
        **request.echo,
    }


def response_object(
    request: ResponsesRequest, chat_answer: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The response object of a chat completion's answer (one choice), and its output items."""
    (choice,) = chat_answer["choices"]
    message = choice["message"]
    status, incomplete, error = _status(choice["finish_reason"])
    item_status = "incomplete" if status == "incomplete" else "completed"
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(_message_item(message["content"], item_status))
    output.extend(_call_item(call) for call in message.get("tool_calls") or [])
    if not output:
        output.append(_message_item("", item_status))
    response = _response(
        request, chat_answer["model"], output, status, _usage(chat_answer.get("usage")), incomplete, error
    )
    return response, output


class ResponseEvents:
    """The Responses API's stream events of a chat stream's chunks (one choice): the text as
    ``response.output_text.delta`` events of one message item as it comes, each function call as an
    item of its own once its arguments are whole, and ``response.completed`` with the usage."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self._request = request
        self._model = model
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._message_id: str | None = None
        self._text = ""
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    @property
    def output(self) -> list[dict[str, Any]]:
        return self._output

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def start(self) -> bytes:
        response = _response(self._request, self._model, [], "in_progress", None)
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def chunk(self, data: dict[str, Any]) -> bytes:
        """The events of one chat chunk."""
        if data.get("usage") is not None and not data["choices"]:
            self._usage = _usage(data["usage"])
            return b""
        events = b""
        for choice in data["choices"]:
            delta = choice.get("delta", {})
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return events

    def _text_delta(self, text: str) -> bytes:
        events = b""
        if self._message_id is None:
            self._message_id = _new_id("msg")
            item = {**_message_item("", "in_progress", self._message_id), "content": []}
            events += self._event("response.output_item.added", output_index=len(self._output), item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._event(
                "response.content_part.added",
                item_id=self._message_id,
                output_index=len(self._output),
                content_index=0,
                part=part,
            )
        self._text += text
        return events + self._event(
            "response.output_text.delta",
            item_id=self._message_id,
            output_index=len(self._output),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _call_delta(self, call: dict[str, Any]) -> None:
        index = call["index"]
        if index not in self._calls:
            self._calls[index] = {"id": call["id"], "function": {"name": call["function"]["name"], "arguments": ""}}
        self._calls[index]["function"]["arguments"] += call["function"].get("arguments", "")

    def failed(self, message: str) -> bytes:
        return self._event("error", code="server_error", message=message, param=None)

    def done(self) -> bytes:
        """The events that close the message and the calls, and ``response.completed``."""
        status, incomplete, error = _status(self._finish)
        item_status = "incomplete" if status == "incomplete" else "completed"
        events = b""
        if self._message_id is not None:
            index = len(self._output)
            item = _message_item(self._text, item_status, self._message_id)
            part = item["content"][0]
            events += self._event(
                "response.output_text.done",
                item_id=self._message_id,
                output_index=index,
                content_index=0,
                text=self._text,
                logprobs=[],
            )
            events += self._event(
                "response.content_part.done", item_id=self._message_id, output_index=index, content_index=0, part=part
            )
            events += self._event("response.output_item.done", output_index=index, item=item)
            self._output.append(item)
        for call in self._calls.values():
            index = len(self._output)
            item = _call_item(call)
            added = {**item, "arguments": "", "status": "in_progress"}
            events += self._event("response.output_item.added", output_index=index, item=added)
            arguments = item["arguments"]
            events += self._event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments
            )
            events += self._event(
                "response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=arguments
            )
            events += self._event("response.output_item.done", output_index=index, item=item)
            self._output.append(item)
        response = _response(self._request, self._model, self._output, status, self._usage, incomplete, error)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return events + self._event(kind, response=response)
