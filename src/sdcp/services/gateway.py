"""An OpenAI-compatible front end for an SDCP deployment (not an SDCP role).

`POST /v1/completions`, `POST /v1/chat/completions` (with and without `stream`), `GET /v1/models`.
It tokenizes, opens a session through the router with its own client certificate, and reads the
committed output with the epoch rule of SDCP 6.7 (``sdcp.client.ClusterClient.stream``), so
retries and failovers never duplicate or lose tokens. Its listener takes no client certificates
(browsers and the `openai` package carry none): plain HTTP on loopback, or TLS when configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sdcp.client import ClusterClient, build_contract
from sdcp.config import ConfigError, ServiceConfig
from sdcp.models.registry import end_of_text_tokens, load_tokenizer
from sdcp.protocol.messages import Sampling
from sdcp.protocol.problems import ProtocolError
from sdcp.transport.errors import TransportError
from sdcp.transport.server import FrontEndServer, Listener, Server

__all__ = ["GatewayNode", "OpenAIRequestError"]

log = logging.getLogger("sdcp.gateway")

# How long a stopping gateway lets the cancellations of abandoned sessions finish.
_CANCEL_WAIT_S = 5.0

DEFAULT_MAX_TOKENS = 16


class OpenAIRequestError(ValueError):
    """A request the OpenAI API would refuse with 400 invalid_request_error."""


@dataclass(frozen=True)
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    rule: int
    sampling: Sampling | None
    stop_texts: tuple[str, ...]
    stop_ids: tuple[int, ...]
    stream: bool


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise OpenAIRequestError(f"'{key}' must be a number in [{low}, {high}]")
    return float(value)


class GatewayNode:
    """Serves the OpenAI-compatible API on its own listener and speaks SDCP to the router."""

    def __init__(self, config: ServiceConfig) -> None:
        instance = config.instance
        if instance.router is None:
            raise ConfigError("the gateway needs instance.router")
        self.config = config
        self.model_name = config.gateway.model
        self.tokenizer: Any = load_tokenizer(self.model_name)
        self.client = ClusterClient(instance.router, cert=instance.cert, key=instance.key, ca=instance.ca)
        host, _, port = config.gateway.listen.rpartition(":")
        self.listener = Listener.front_end(
            host.strip("[]"), int(port), cert=config.gateway.cert, key=config.gateway.key
        )
        self._server: Server | None = None
        self._target: dict[str, Any] | None = None
        # Cancellations under way, kept referenced until they are done.
        self._cancelling: set[asyncio.Future[None]] = set()

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return self._server.base_url

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ]
        )

    async def start(self) -> None:
        self._server = FrontEndServer(self.app(), self.listener)
        await self._server.start()
        log.info("OpenAI-compatible API on %s", self._server.base_url)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
        if self._cancelling:
            await asyncio.wait(self._cancelling, timeout=_CANCEL_WAIT_S)
        await self.client.aclose()

    async def run_until(self, shutdown: asyncio.Event) -> None:
        await self.start()
        try:
            await shutdown.wait()
        finally:
            await self.stop()

    # -- routes ----------------------------------------------------------------------------------

    async def models(self, _request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "sdcp"}]}
        )

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise OpenAIRequestError("the request body must be a JSON object")
            parsed = self._parse(body, chat=chat)
        except (OpenAIRequestError, ValueError) as exc:
            return _error(400, "invalid_request_error", str(exc))
        try:
            target = await self._target_digests()
            contract = build_contract(
                target=target["model"],
                tokenizer=target["tokenizer"],
                rule=parsed.rule,
                max_new=parsed.max_tokens,
                stop=parsed.stop_ids,
                sampling=parsed.sampling,
            )
            handle = await self.client.open(parsed.prompt_ids, contract)
        except (ProtocolError, TransportError) as exc:
            return _error(503, "server_error", f"the SDCP cluster did not open a session: {exc}")
        # The id names the SDCP session, so that an operator can follow a request into the cluster.
        completion_id = ("chatcmpl-" if chat else "cmpl-") + handle.session.hex()
        pieces = self._texts(handle, parsed)
        if parsed.stream:
            return StreamingResponse(
                self._sse(pieces, completion_id, chat),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        text, finish_reason, completion_tokens = "", "length", 0
        async for delta, finish, count in pieces:
            text += delta
            completion_tokens = count
            finish_reason = finish or finish_reason
        usage = {
            "prompt_tokens": len(parsed.prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(parsed.prompt_ids) + completion_tokens,
        }
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": usage,
            }
        )

    # -- request and output ----------------------------------------------------------------------

    def _parse(self, body: dict[str, Any], *, chat: bool) -> _Request:
        if chat:
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise OpenAIRequestError("'messages' must be a non-empty list of {role, content} strings")
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            prompt_ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise OpenAIRequestError("'prompt' must be a non-empty string")
            prompt_ids = list(self.tokenizer(prompt)["input_ids"])
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise OpenAIRequestError("'max_tokens' must be a positive integer")
        temperature = _number(body, "temperature", 0.0, 2.0)
        top_p = _number(body, "top_p", 0.0, 1.0)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise OpenAIRequestError("'seed' must be a non-negative integer")
        stop = body.get("stop")
        stop_texts = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stop_texts) or len(stop_texts) > 4:
            raise OpenAIRequestError("'stop' must be a string or a list of up to 4 strings")
        # OpenAI's default temperature is 1; temperature 0 is greedy decoding, i.e. rule 1.
        greedy = temperature == 0.0
        sampling = None
        if not greedy:
            sampling = Sampling(
                temperature_milli=None if temperature is None else round(temperature * 1000),
                top_p_milli=None if top_p is None else round(top_p * 1000),
                seed=seed,
            )
        return _Request(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            rule=1 if greedy else 2,
            sampling=sampling,
            stop_texts=stop_texts,
            stop_ids=self._stop_ids(stop_texts),
            stream=bool(body.get("stream", False)),
        )

    def _stop_ids(self, stop_texts: tuple[str, ...]) -> tuple[int, ...]:
        ids = set(end_of_text_tokens(self.tokenizer))
        # A stop string that is one token stops the session at the verifier itself (SDCP 6.3).
        for text in stop_texts:
            encoded = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(encoded) == 1:
                ids.add(encoded[0])
        return tuple(sorted(ids))

    async def _target_digests(self) -> dict[str, Any]:
        if self._target is None:
            targets = await self.client.targets()
            if not targets:
                raise TransportError("no live verifier is registered at the router")
            self._target = targets[0]
        return self._target

    async def _texts(self, handle: Any, parsed: _Request) -> AsyncIterator[tuple[str, str | None, int]]:
        """Text deltas, the finish reason on the last one, and the number of tokens so far. A session
        left before its last piece (the client went away) is cancelled, as is one a stop string ends."""
        ended = False
        try:
            async for piece in self._decoded(handle, parsed):
                ended = piece[1] is not None
                yield piece
        finally:
            if not ended:
                self._cancel_soon(handle)

    def _cancel_soon(self, handle: Any) -> None:
        # In a task of its own: the request's task may be being cancelled (a client that went away).
        task = asyncio.ensure_future(self._cancel(handle))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def _cancel(self, handle: Any) -> None:
        try:
            await self.client.cancel(handle)
        except (ProtocolError, TransportError) as exc:
            log.warning("gateway: session %s not cancelled: %s", handle.session.hex(), exc)

    async def _decoded(self, handle: Any, parsed: _Request) -> AsyncIterator[tuple[str, str | None, int]]:
        tokens: list[int] = []
        sent = ""
        async for chunk in self.client.stream(handle):
            tokens.extend(chunk.tokens)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            cut = min((i for i in (text.find(s) for s in parsed.stop_texts) if i >= 0), default=-1)
            if cut >= 0:
                # A stop string of several tokens: the verifier would decode on to max_tokens.
                self._cancel_soon(handle)
                yield text[len(sent) : cut], "stop", len(tokens)
                return
            if chunk.finish is not None:
                stopped = bool(tokens) and tokens[-1] in parsed.stop_ids
                yield text[len(sent) :], "stop" if stopped else "length", len(tokens)
                return
            # Hold back a possible start of a stop string until it is decided.
            hold = max((len(s) - 1 for s in parsed.stop_texts), default=0)
            ready = text[: max(len(sent), len(text) - hold)]
            # An incomplete multi-byte character decodes as U+FFFD until its last token arrives.
            ready = ready.rstrip("\ufffd")
            if len(ready) > len(sent):
                yield ready[len(sent) :], None, len(tokens)
                sent = ready

    async def _sse(
        self, pieces: AsyncIterator[tuple[str, str | None, int]], completion_id: str, chat: bool
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        first = True
        async for delta, finish, _count in pieces:
            if chat:
                content: dict[str, Any] = {"content": delta}
                if first:
                    content["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": content, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            first = False
            event = {
                "id": completion_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)
