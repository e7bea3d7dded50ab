"""Requests that once made the gateway answer 500 or hang a session, on a real tiny cluster
(router, verifier, n-gram drafter, gateway on 127.0.0.1): schemas and grammars that llguidance
cannot read, bodies that JSON cannot hold or that nest too deep, languages that no output can start
(a 400 before any session opens) and languages whose outputs dead-end (the verifier ends the session
with fail: the choice's finish_reason is "abort", at once, instead of a session that never ends)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from tests.frontend.gateway_harness import Cluster, base, cluster

from sdcp.frontend.gateway import GatewayNode
from sdcp.frontend.text import TextCodec
from sdcp.grammar import ConstraintError, check, gbnf_to_lark
from sdcp.protocol.messages import Constraint
from sdcp.protocol.problems import BadContract
from sdcp.transport.client import SDCPClient

__all__ = ["cluster"]  # the fixture, from the gateway tests' harness

pytestmark = pytest.mark.timeout(180)

# The tiny tokenizer has no chat template: the chat requests get this one.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


async def chat_gateway(cluster: Cluster) -> GatewayNode:
    gateway = await cluster.gateway()
    codec = gateway.codec
    gateway.codec = TextCodec(codec.tokenizer, chat_template=TEMPLATE, context_length=codec.context_length)
    return gateway


async def post(http: httpx.AsyncClient, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await http.post(path, content=content, headers={"content-type": "application/json"})


def completion(**members: Any) -> dict[str, Any]:
    return {"prompt": "Hello", "max_tokens": 20, **members}


def chat(**members: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20, **members}


# Arguments with no finite value: "x" must hold an "x", which must hold an "x", ...
ENDLESS_ARGUMENTS = {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}, "required": ["x"]}


def tool(name: str = "f", parameters: object = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def test_what_llguidance_cannot_read_is_a_constraint_error() -> None:
    # llguidance's ValueError (a schema nested past its 128 levels, options on a boolean schema)
    # and the GBNF converter's bare Exception, IndexError and RecursionError were 500s.
    for text in ("false", json.dumps(nested(200))):
        with pytest.raises(ConstraintError):
            check(Constraint(kind="json_schema", text=text))
    check(Constraint(kind="json_schema", text="true"))
    for grammar in (" ", "i::=a", "root ::= " + "(" * 3000 + '"a"' + ")" * 3000):
        with pytest.raises(ConstraintError):
            gbnf_to_lark(grammar)


async def test_schemas_and_grammars_llguidance_cannot_read_are_a_400(cluster: Cluster) -> None:
    gateway = await chat_gateway(cluster)
    async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:
        for path, body, param in [
            ("/v1/completions", completion(guided_json=False), "guided_json"),
            ("/v1/completions", completion(guided_json=nested(200)), "guided_json"),
            (
                "/v1/completions",
                completion(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": False}}),
                "response_format",
            ),
            ("/v1/completions", completion(guided_grammar=" "), "guided_grammar"),
            ("/v1/completions", completion(guided_grammar="i::=a"), "guided_grammar"),
            (
                "/v1/completions",
                completion(guided_grammar="root ::= " + "(" * 3000 + '"a"' + ")" * 3000),
                "guided_grammar",
            ),
            ("/v1/chat/completions", chat(tools=[tool(parameters=nested(200))], tool_choice="required"), "tools"),
        ]:
            answer = await post(http, path, body)
            assert answer.status_code == 400, (param, answer.text)
            assert answer.json()["error"]["param"] == param
        # The schema true allows any JSON value, as {} does.
        anything = await post(http, "/v1/completions", completion(guided_json=True))
        assert anything.status_code == 200, anything.text


async def test_a_body_json_cannot_hold_or_that_nests_too_deep_is_a_400(cluster: Cluster) -> None:
    gateway = await chat_gateway(cluster)
    long_integer = b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}"
    # Nested within what json.loads reads, but past what writing a schema out again (json.dumps
    # of the tools on a worker thread) or llguidance takes.
    deep_tools = chat(tools=[tool(parameters=json.loads('{"a":' * 400 + "1" + "}" * 400))])
    async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:
        bodies: list[tuple[str, dict[str, Any] | bytes]] = [
            ("/v1/completions", long_integer),
            ("/v1/completions", completion(x=json.loads("[" * 300 + "]" * 300))),
            ("/v1/chat/completions", deep_tools),
        ]
        for path, body in bodies:
            answer = await post(http, path, body)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["type"] == "invalid_request_error"
        # Arguments nested past what JSON reads are kept as their text, as arguments that are no JSON.
        call = {"function": {"name": "f", "arguments": "[" * 2000}}
        history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]}]
        kept = await post(http, "/v1/chat/completions", chat(messages=history, max_tokens=1))
        assert kept.status_code == 200, kept.text
        # A call's id is a string.
        bad_id = [{"role": "assistant", "tool_calls": [{"id": {"x": 1}, **call}]}]
        refused = await post(http, "/v1/chat/completions", chat(messages=bad_id))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[0].tool_calls[0]"


async def test_a_language_that_no_output_can_start_is_a_400_before_a_session_opens(cluster: Cluster) -> None:
    gateway = await chat_gateway(cluster)
    every_token = list(range(gateway.codec.vocab_size))
    async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:
        for body, param in [
            (completion(guided_json={"$ref": "#"}), "guided_json"),
            (completion(guided_json={"$ref": "#"}, stream=True), "guided_json"),
            (completion(guided_regex="[a&&b]"), "guided_regex"),
            # Stop tokens are no text: with every token one, no output starts.
            (completion(guided_regex="a+", stop_token_ids=every_token), "guided_regex"),
        ]:
            answer = await post(http, "/v1/completions", body)
            assert answer.status_code == 400, (body, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param and "no output of the language can start" in error["message"]
    assert not cluster.verifier.engine.sessions


async def test_a_language_whose_output_dead_ends_ends_the_choice_as_abort(cluster: Cluster) -> None:
    gateway = await chat_gateway(cluster)
    (b,) = gateway.codec.encode("b", add_special_tokens=False)
    async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:
        for path, body in [
            # "b" is a stop token, so no text: after "a" nothing may follow.
            ("/v1/completions", completion(guided_regex="ab", stop_token_ids=[b], temperature=0)),
            ("/v1/completions", completion(guided_regex="ab", stop_token_ids=[b], temperature=1)),
            # No finite derivation: llguidance gives up after the first token (its item limit).
            ("/v1/completions", completion(guided_grammar='start: a\na: "x" a', temperature=0)),
            # A call's arguments that no finite value validates against (a property that is itself,
            # required): the call starts, then dead-ends. (Contradictions llguidance sees when it
            # compiles the schema, an empty enum or minimum above maximum, are a 400.) Sampled, the
            # call's start may come a character a token: room for all of it before the dead end.
            (
                "/v1/chat/completions",
                chat(tools=[tool(parameters=ENDLESS_ARGUMENTS)], tool_choice="required", max_tokens=64),
            ),
        ]:
            answer = await post(http, path, body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["finish_reason"] == "abort", (body, answer.text)
        streamed = completion(guided_regex="ab", stop_token_ids=[b], stream=True)
        async with http.stream("POST", "/v1/completions", json=streamed) as stream:
            assert stream.status_code == 200
            events = [line async for line in stream.aiter_lines() if line.startswith("data: {")]
        assert json.loads(events[-1][len("data: ") :])["choices"][0]["finish_reason"] == "abort"


# Issue #36: a 36 KB grammar of 2,000 alternatives killed the verifier's scorer thread (a parser
# limit at self-decoding); a 47 KB chain of 3,000 rules crashed the gateway, and through the router
# each verifier it tried (a segmentation fault in llguidance).
WIDE_GRAMMAR = "start: " + " | ".join(f'"alternative{i:05d}"' for i in range(2000))
CHAIN_GRAMMAR = "\n".join(["start: rule0", *(f"rule{i}: rule{i + 1}" for i in range(2999)), 'rule2999: "x"'])


async def test_the_grammars_that_stopped_the_cluster_are_refused_at_every_hop(cluster: Cluster) -> None:
    gateway = await chat_gateway(cluster)
    verifier = cluster.verifier
    target = verifier.engine.target
    contract = {
        "target": target.weights_digest,
        "tokenizer": target.tokenizer_digest,
        "rule": 1,
        "m_max": 4,
        "max_new": 8,
        "stop": [0],
        "low_rounds": 2,
        "fallback": [3, 5],
        "self_load": 100,
    }
    cert, key = cluster.identities.certs["gateway"]
    front_end = SDCPClient(cluster.uris["router"], cert, key, cluster.identities.ca)
    try:
        async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:
            for grammar in (WIDE_GRAMMAR, CHAIN_GRAMMAR):
                answer = await post(http, "/v1/completions", completion(guided_grammar=grammar))
                assert answer.status_code == 400, answer.text
                assert answer.json()["error"]["param"] == "guided_grammar"
                assert "exceeds a limit" in answer.json()["error"]["message"]
                # A trusted front end sends it to the router: the verifier refuses it too (a peer's
                # constraint is input), before llguidance reads it.
                with pytest.raises(BadContract, match="exceeds a limit"):
                    await front_end.post_cbor(
                        "sessions",
                        {"prompt": [5, 6, 7], "contract": contract, "constraint": {"kind": "lark", "text": grammar}},
                    )
            assert verifier.engine.scorer.alive and (await verifier.readiness()).ready
            after = await post(http, "/v1/completions", completion(temperature=0, max_tokens=4))
            assert after.status_code == 200, after.text
    finally:
        await front_end.aclose()
