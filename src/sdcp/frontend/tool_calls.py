"""Tools in chat requests: OpenAI's ``tools`` and ``tool_choice``, assistant messages with
``tool_calls`` and ``role: "tool"`` messages into the prompt, and the model's tool calls out of its
text, whole or as a stream's deltas (docs/services.md, "Tools").

A chat template that renders tools (one that reads a ``tools`` variable) is given them as
transformers' ``apply_chat_template(tools=...)`` gives them, with each call's arguments as an object.
One that does not, as SmolLM2's, would drop them: they are written into the messages instead, in the
Hermes format that the ChatML templates of Qwen2.5 and Hermes write: the definitions at the end of the
system message, between ``<tools>`` tags, one JSON object a line; each call of an assistant message as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` in its content; the answers of
consecutive ``tool`` messages in one user message, each between ``<tool_response>`` tags. The calls are
read back from the output in that format (vLLM's ``hermes`` tool parser reads the same).

``tool_choice`` ``auto`` (the default with tools) leaves the output free and reads the calls in it;
``none`` reads none; ``required`` and a named function make the output one call, the JSON object
``{"name": ..., "arguments": ...}`` with arguments that validate against the function's parameters:
the session's constraint (structured output, ``sdcp.grammar``), so the call is valid under rule 1 and
rule 2 whatever the drafters propose.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sdcp.frontend.schemas import SchemaError, closed_schema, hoisted_parameters
from sdcp.grammar import ConstraintError, check
from sdcp.protocol.messages import MAX_CONSTRAINT_TEXT, Constraint

__all__ = [
    "CallDelta",
    "ToolCallReader",
    "ToolUse",
    "ToolsError",
    "hermes_messages",
    "message_tool_calls",
    "nested_deeper",
    "parse_tools",
    "read_tool_calls",
    "stream_tool_calls",
    "tool_message_fields",
]

# OpenAI's limit on the tools of one request.
MAX_TOOLS = 128
# The deepest nesting of JSON arrays and objects read from a request (its body, a call's arguments):
# llguidance reads schemas to 128 levels, and deeper values would reach Python's recursion limit
# where they are written out again (json.dumps, a chat template's tojson).
MAX_NESTING = 256
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_START, _END = "<tool_call>", "</tool_call>"
# The start of a call in the Hermes format as models write it: the name first, then the arguments,
# an object. A call that starts otherwise is read when its block is complete.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_HERMES_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_HERMES_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


class ToolsError(ValueError):
    """A request's tools, tool choice or tool messages that are malformed; ``param`` names the member."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools make of it: the definitions its prompt shows, how its output is
    read (``"hermes"``: calls among text; ``"json"``: the whole output is one call; None: no calls)
    and the constraint that makes the output a call."""

    tools: tuple[dict[str, Any], ...]
    parser: str | None
    constraint: Constraint | None


def parse_tools(body: dict[str, Any], *, close_objects: bool = True) -> ToolUse | None:
    """``tools`` and ``tool_choice`` of a chat request; None where it gives no tools (then only
    ``tool_choice`` ``none`` is accepted, as OpenAI's). Every function's parameters must be a
    schema this server can apply, whether or not a call is forced; a forced call's arguments
    follow them with their objects closed where ``close_objects`` or the function is ``strict``
    (sdcp.frontend.schemas), their ``$defs`` hoisted to the call's root."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ToolsError("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolsError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    functions: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for index, tool in enumerate(tools):
        name, parameters, strict = _function(tool, f"tools[{index}]")
        if name in functions:
            raise ToolsError(f"'tools[{index}]': a second function named {name!r}", "tools")
        try:
            closed = closed_schema(parameters, close=close_objects, strict=strict)
        except SchemaError as exc:
            raise ToolsError(f"'tools[{index}].function.parameters': {exc}", "tools") from exc
        assert isinstance(closed, dict)  # a dict stays one
        functions[name] = hoisted_parameters(name, closed)
    if choice is None or choice == "auto" or choice == "none":
        # No call is forced, but each function's parameters are checked as if one were.
        for name, (reference, defs) in functions.items():
            _constraint(_call_schema(name, reference, defs))
        return ToolUse(tuple(tools), None if choice == "none" else "hermes", None)
    if choice == "required":
        calls = [_call_schema(name, reference, {}) for name, (reference, _) in functions.items()]
        defs = {key: schema for _, hoisted in functions.values() for key, schema in hoisted.items()}
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return ToolUse(tuple(tools), "json", _constraint({**schema, "$defs": defs}))
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    chosen = named.get("name") if isinstance(named, dict) else None
    if not isinstance(chosen, str):
        raise ToolsError(
            "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
            '{"name": ...}}',
            "tool_choice",
        )
    if chosen not in functions:
        raise ToolsError(f"'tool_choice' names {chosen!r}, which is not one of the tools", "tool_choice")
    return ToolUse(tuple(tools), "json", _constraint(_call_schema(chosen, *functions[chosen])))


def _function(tool: object, where: str) -> tuple[str, dict[str, Any], bool]:
    """A tool's function name, parameters (a JSON schema; an object without properties if none)
    and whether it is ``strict``."""
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise ToolsError(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolsError(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolsError(f"'{where}.function.description' must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolsError(f"'{where}.function.parameters' must be a JSON schema (an object)", "tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolsError(f"'{where}.function.strict' must be a boolean", "tools")
    return name, parameters, bool(strict)


def _call_schema(name: str, arguments: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of a function, in the order the Hermes format writes a call;
    ``defs``: the definitions its ``arguments`` refer to (sdcp.frontend.schemas.hoisted_parameters)."""
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    if defs:
        schema["$defs"] = defs
    return schema


def _constraint(schema: dict[str, Any]) -> Constraint:
    constraint = Constraint(kind="json_schema", text=json.dumps(schema))
    if len(constraint.text) > MAX_CONSTRAINT_TEXT:
        raise ToolsError(f"the tools' parameters are longer than {MAX_CONSTRAINT_TEXT} characters", "tools")
    try:
        check(constraint)
    except ConstraintError as exc:
        raise ToolsError(f"the tools' parameters are no JSON schema this server can apply: {exc}", "tools") from exc
    return constraint


def tool_message_fields(message: dict[str, Any], where: str) -> dict[str, Any]:
    """The tool members of a chat message, checked: an assistant's ``tool_calls`` (each arguments
    text read as JSON where it is, as the templates that render calls expect an object) and a tool
    message's ``tool_call_id``."""
    role = message["role"]
    fields: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise ToolsError(f"'{where}.tool_calls' must be a list, on an assistant message", f"{where}.tool_calls")
        fields["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if role != "tool" or not isinstance(call_id, str):
            raise ToolsError(f"'{where}.tool_call_id' must be a string, on a tool message", f"{where}.tool_call_id")
        fields["tool_call_id"] = call_id
    return fields


def _tool_call(call: object, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    if not isinstance(call, dict) or not isinstance(name, str) or not isinstance(arguments, str):
        raise ToolsError(f"'{where}' must be a call with a function's name and arguments (a string)", where)
    if not isinstance(call.get("id", ""), str | None):
        raise ToolsError(f"'{where}.id' must be a string", where)
    try:
        read: Any = json.loads(arguments)
    except (ValueError, RecursionError):
        # OpenAI keeps arguments that are no JSON (a model may write them): rendered as the string.
        read = arguments
    if nested_deeper(read, MAX_NESTING):
        read = arguments
    return {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": read}}


def nested_deeper(value: object, limit: int) -> bool:
    """Whether ``value`` (as JSON reads it) nests arrays and objects more than ``limit`` levels deep."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth == limit:
                return True
            pending.extend((inner, depth + 1) for inner in (item.values() if isinstance(item, dict) else item))
    return False


def hermes_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with the tools, calls and tool answers written into their text in the Hermes
    format, for a chat template that renders no tools (module docstring)."""
    written: list[dict[str, Any]] = []
    if tools:
        listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        section = _HERMES_INSTRUCTIONS + listed + _HERMES_FORMAT
        if messages and messages[0]["role"] == "system":
            written.append({**messages[0], "content": f"{messages[0]['content']}\n\n{section}"})
            messages = messages[1:]
        else:
            written.append({"role": "system", "content": section})
    for message in messages:
        if message["role"] == "tool":
            answer = f"<tool_response>\n{message['content']}\n</tool_response>"
            if written and written[-1].get("answers"):
                written[-1]["content"] += "\n" + answer
            else:
                # Marked while consecutive tool answers are joined into it; the mark is removed below.
                written.append({"role": "user", "content": answer, "answers": True})
            continue
        if message.get("tool_calls"):
            parts = [message["content"]] if message.get("content") else []
            for call in message["tool_calls"]:
                function = call["function"]
                arguments = json.dumps(function["arguments"], ensure_ascii=False)
                parts.append(f'{_START}\n{{"name": {json.dumps(function["name"])}, "arguments": {arguments}}}\n{_END}')
            message = {"role": "assistant", "content": "\n".join(parts)}
        written.append({key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id")})
    return [{key: value for key, value in message.items() if key != "answers"} for message in written]


# -- reading calls ----------------------------------------------------------------------------------------


@dataclass
class CallDelta:
    """Part of the ``index``-th call of a choice: its first part has its id and name, every part
    the arguments text that came with it."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class ToolCallPiece:
    """What a piece of output text holds: text of the answer's content and parts of calls."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    """Reads a choice's output as its text comes, for ``parser`` ``hermes`` (calls between
    ``<tool_call>`` tags among text) or ``json`` (the whole output is one call). A call's id and
    name go out as soon as its start is read, its arguments text as it comes; a call that starts
    otherwise than name first goes out whole at its end tag; a block that holds no call is content.
    Whitespace around calls is not content; without calls, the content is the text exactly."""

    def __init__(self, parser: str, new_id: Callable[[], str] = _new_call_id) -> None:
        self._tagged = parser == "hermes"
        self._new_id = new_id
        self._state = "text" if self._tagged else "header"
        # Text read and not yet given out.
        self._buffer = ""
        self.calls = 0
        # Whitespace at the end of the content so far: content only if more content follows it.
        self._pending = ""
        # After a call, whitespace before the next content is dropped.
        self._strip = False
        # The whitespace before a block: content again if the block holds no call.
        self._gap = ""
        # Where the arguments' JSON text stands: nesting, within a string, after a backslash.
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str, *, last: bool) -> ToolCallPiece:
        """What ``text`` (the next of the output) decides; ``last``: the output ends with it."""
        piece = ToolCallPiece()
        self._buffer += text
        while self._step(piece):
            pass
        if last:
            if self._state == "text":
                self._content(piece, self._buffer, before_block=False)
            elif self._state == "header":
                self._whole(piece, self._buffer, _START + self._buffer if self._tagged else self._buffer)
            self._buffer = ""
            if not self.calls:
                piece.content += self._pending
            self._pending = ""
        return piece

    def _step(self, piece: ToolCallPiece) -> bool:
        """One move of the state machine over the buffer; False when it needs more text."""
        if self._state == "text":
            at = self._buffer.find(_START)
            if at < 0:
                kept = _partial(self._buffer, _START)
                self._content(piece, self._buffer[: len(self._buffer) - kept], before_block=False)
                self._buffer = self._buffer[len(self._buffer) - kept :]
                return False
            self._content(piece, self._buffer[:at], before_block=True)
            self._buffer, self._state = self._buffer[at + len(_START) :], "header"
            return True
        if self._state == "header":
            return self._header(piece)
        if self._state == "arguments":
            return self._arguments(piece)
        # "after": the call's arguments are out; the rest of its block is not content.
        if not self._tagged:
            self._buffer = ""
            return False
        at = self._buffer.find(_END)
        if at < 0:
            self._buffer = self._buffer[len(self._buffer) - _partial(self._buffer, _END) :]
            return False
        self._buffer, self._state, self._strip = self._buffer[at + len(_END) :], "text", True
        return True

    def _header(self, piece: ToolCallPiece) -> bool:
        started = _HEADER.match(self._buffer)
        name = _json_string(started.group(1)) if started else None
        if started and name is not None:
            _add(piece, CallDelta(self.calls, self._new_id(), name, ""))
            self.calls += 1
            self._buffer, self._state = self._buffer[started.end() :], "arguments"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        at = self._buffer.find(_END) if self._tagged else -1
        if at < 0:
            return False
        block = self._buffer[:at]
        self._buffer, self._state = self._buffer[at + len(_END) :], "text"
        self._whole(piece, block, _START + block + _END)
        return True

    def _arguments(self, piece: ToolCallPiece) -> bool:
        """The arguments object's text up to its closing brace (or up to a '<' outside its strings,
        which JSON has no place for: the model left the object unclosed)."""
        end = None
        for at, char in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = at + 1
                    break
            elif char == "<":
                end = at
                break
        taken = len(self._buffer) if end is None else end
        _add(piece, CallDelta(self.calls - 1, None, None, self._buffer[:taken]))
        self._buffer = self._buffer[taken:]
        if end is not None:
            self._state = "after"
        return end is not None

    def _whole(self, piece: ToolCallPiece, block: str, raw: str) -> None:
        """A block read whole: its calls (a call object or a list of them), else content."""
        calls = _calls_in(block)
        if calls is None:
            self._content(piece, self._gap + raw, before_block=False)
            return
        for name, arguments in calls:
            _add(piece, CallDelta(self.calls, self._new_id(), name, arguments))
            self.calls += 1
        self._strip = True

    def _content(self, piece: ToolCallPiece, text: str, *, before_block: bool) -> None:
        if before_block:
            self._gap = ""
        if self._strip:
            text = text.lstrip()
            if not text:
                return
            self._strip = False
        text = self._pending + text
        kept = text.rstrip()
        if before_block:
            self._pending, self._gap = "", text[len(kept) :]
        else:
            self._pending = text[len(kept) :]
        piece.content += kept


def _add(piece: ToolCallPiece, delta: CallDelta) -> None:
    """A call's parts within one piece are joined into one."""
    if piece.calls and piece.calls[-1].index == delta.index:
        piece.calls[-1].arguments += delta.arguments
    elif delta.id is not None or delta.arguments:
        piece.calls.append(delta)


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag`` (it may be completed later)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _json_string(quoted: str) -> str | None:
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _calls_in(block: str) -> list[tuple[str, str]] | None:
    """The calls a complete block holds: a call object or a list of them (SmolLM2's larger models
    write a list), each with a string name and arguments (an object, or its JSON text)."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    items = value if isinstance(value, list) and value else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):
            calls.append((item["name"], arguments))
        elif isinstance(arguments, dict):
            calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
        else:
            return None
    return calls


def read_tool_calls(text: str, parser: str) -> tuple[str, list[CallDelta]]:
    """A whole output's content and calls (each call whole: one delta with its id and name)."""
    piece = ToolCallReader(parser).feed(text, last=True)
    return piece.content, piece.calls


def message_tool_calls(calls: Sequence[CallDelta]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` of a message."""
    return [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]


def stream_tool_calls(deltas: Sequence[CallDelta]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` items of a stream, each for a chunk of its own: a call's first part
    alone (index, id, type, name, empty arguments), then every part's arguments text. OpenAI streams a
    call so, and clients read its first part as the header, whatever one read of the output held."""
    items: list[dict[str, Any]] = []
    for delta in deltas:
        if delta.id is not None:
            header = {"name": delta.name, "arguments": ""}
            items.append({"index": delta.index, "id": delta.id, "type": "function", "function": header})
        if delta.arguments:
            items.append({"index": delta.index, "function": {"arguments": delta.arguments}})
    return items
