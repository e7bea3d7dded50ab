"""An OpenAI-compatible front end for an SDCP deployment (not an SDCP role).

`POST /v1/completions`, `POST /v1/chat/completions` (with and without `stream`), `GET /v1/models`.
Requests are read and checked by ``sdcp.frontend.openai_api``; each choice of a request is one SDCP
session, opened through the router with the gateway's own client certificate, whose committed
output is read with the epoch rule of SDCP 6.7 (``sdcp.frontend.client.ClusterClient.stream``), so retries
and failovers never duplicate or lose tokens. Its listener takes no client certificates (browsers
and the `openai` package carry none): plain HTTP on loopback, or TLS when configured. It needs no
torch: text goes through ``sdcp.frontend.text`` (the `tokenizers` library).

The outermost layer (``_Admission``) admits at most ``[gateway] max_requests_in_flight`` requests
at once (429 with Retry-After past it) and writes one access-log line per request, when it has
been answered whole, refused, or abandoned by its client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from prometheus_client import Counter, Gauge, Histogram
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sdcp import __version__
from sdcp.config import ConfigError, ServiceConfig
from sdcp.engines.tasks import cancelled_if
from sdcp.frontend.client import DEFAULT_M_MAX, ClusterClient, SessionHandle, build_contract
from sdcp.frontend.openai_api import (
    Choice,
    Generation,
    OpenAIError,
    chat_logprobs,
    check_nesting,
    check_unicode,
    choice_text,
    completion_logprobs,
    error_body,
    parse_detokenize,
    parse_generation,
    parse_tokenize,
    token_stop_reason,
)
from sdcp.frontend.responses_api import (
    Conversations,
    ResponseEvents,
    ResponsesRequest,
    parse_responses_request,
    response_object,
)
from sdcp.frontend.text import load_text_codec
from sdcp.frontend.tool_calls import ToolCallReader, message_tool_calls, read_tool_calls, stream_tool_calls
from sdcp.latency import GATEWAY_PARTS, observe_part, start_parts
from sdcp.protocol.messages import Action, TokenLogprob
from sdcp.protocol.problems import BadContract, ProtocolError
from sdcp.services.admin import AdminServer, Readiness
from sdcp.transport.errors import StatusError, TransportError
from sdcp.transport.server import FrontEndServer, Listener, Server

__all__ = ["GatewayNode"]

log = logging.getLogger("sdcp.gateway")

# How long a stopping gateway lets the cancellations of abandoned sessions finish.
_CANCEL_WAIT_S = 5.0

# What a client of the API sees, in vLLM's names (docs/observability.md); every series starts at zero.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
FINISH_REASONS = ("stop", "length", "abort")
TIME_TO_FIRST_TOKEN = Histogram(
    "sdcp:time_to_first_token_seconds", "From the request to its first token", ["instance"], buckets=_LATENCY_BUCKETS
)
INTER_TOKEN_LATENCY = Histogram(
    "sdcp:inter_token_latency_seconds", "Between two tokens of a choice", ["instance"], buckets=_TOKEN_BUCKETS
)
E2E_LATENCY = Histogram(
    "sdcp:e2e_request_latency_seconds", "From the request to its last token", ["instance"], buckets=_LATENCY_BUCKETS
)
PROMPT_TOKENS = Counter("sdcp:prompt_tokens", "Prompt tokens of the requests served", ["instance"])
GENERATION_TOKENS = Counter("sdcp:generation_tokens", "Tokens generated for the requests' choices", ["instance"])
REQUEST_SUCCESS = Counter(
    "sdcp:request_success",
    "Choices that ended, by finish reason (abort: the client left)",
    ["instance", "finished_reason"],
)
REQUESTS_IN_PROGRESS = Gauge("sdcp_gateway_requests_in_progress", "Requests being answered", ["instance"])
REQUESTS_OPENING = Gauge("sdcp_gateway_requests_opening", "Requests whose sessions are being opened", ["instance"])
REQUESTS_IN_FLIGHT = Gauge(
    "sdcp_gateway_requests_in_flight",
    "Requests admitted and not yet answered, at most [gateway] max_requests_in_flight",
    ["instance"],
)
REQUESTS_REFUSED = Counter(
    "sdcp_gateway_requests_refused",
    "Requests refused with 429 because max_requests_in_flight were in flight",
    ["instance"],
)
# The routes whose requests count towards the cap: those that read a body and may tokenize it.
_CAPPED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"})
# A body this large is parsed off the event loop.
_PARSE_INLINE_BYTES = 64 * 1024
# The status an access line gives a request whose client went away before its answer began (nginx's).
_CLIENT_GONE = 499


# The verifier's session stats (GET sessions/{id}/stats) that a request's usage reports.
_ACCEPTANCE = ("rounds", "proposed", "accepted", "self_decoded")


@dataclass
class _Piece:
    """Text newly decided for one choice, the tokens it came with, and the finish reason on the last."""

    index: int
    text: str
    finish: str | None
    tokens: int
    logprobs: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    # On the last piece, where the request asked for it: the session's acceptance figures, as its
    # verifier counted them (sdcp.protocol.verifier.SessionStats), None where they could not be read.
    acceptance: dict[str, int] | None = None
    # On the last piece: vLLM's stop_reason, the stop string or stop token id that ended the choice.
    stop_reason: str | int | None = None


@dataclass
class _AccessRecord:
    """What a request's access-log line says besides its status and time; the handler fills it in."""

    request_id: str
    note: str = ""
    # "answered" (the whole answer was sent), "aborted" (the client went away first), "failed"
    # (the cluster failed a stream after its 200); None: decided from what was sent.
    outcome: str | None = None


_RECORD_KEY = "sdcp.access"
_TENANT_LABEL = b"sdcp-tenant-1\x00"


def api_tenant(authorization: str | None, user: str | None) -> str | None:
    """Whose history a request's sessions share (session-open's ``tenant``): the API credential it
    presented and OpenAI's ``user`` member, as a digest (never the key itself); None for a request
    with neither, which shares with the other anonymous ones. Two API users never draft from each
    other's outputs, so ``usage.speculative`` cannot confirm another user's output (docs/security.md)."""
    if not authorization and not user:
        return None
    digest = hashlib.sha256(_TENANT_LABEL)
    for part in ((authorization or "").encode(), (user or "").encode()):
        digest.update(len(part).to_bytes(4, "big") + part)
    return digest.hexdigest()[:32]


def _record(request: Request) -> _AccessRecord:
    record = request.scope.get(_RECORD_KEY)
    if not isinstance(record, _AccessRecord):
        # The routes' app used without _Admission (tests of the routes alone).
        record = request.scope[_RECORD_KEY] = _AccessRecord(_request_id(request.headers.get("x-request-id")))
    return record


class _Admission:
    """Caps the requests in flight and writes one access-log line per request, whatever its end: a
    stream whose client goes away ends here as an abandoned call, never reaching the routes' code
    again."""

    def __init__(self, app: ASGIApp, *, limit: int, uri: str) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0
        self._gauge = REQUESTS_IN_FLIGHT.labels(uri)
        self._refused = REQUESTS_REFUSED.labels(uri)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        record = _AccessRecord(_request_id(headers.get("x-request-id")))
        scope[_RECORD_KEY] = record
        status: int | None = None
        whole = False

        async def tracked(message: Message) -> None:
            nonlocal status, whole
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                whole = True
            await send(message)

        capped = scope["path"] in _CAPPED_PATHS
        try:
            if capped and self.in_flight >= self.limit:
                self._refused.inc()
                record.note = f"{self.in_flight} requests in flight, the most [gateway] max_requests_in_flight admits"
                message = f"too many requests in flight ({self.limit}); retry later"
                refusal = JSONResponse(
                    error_body(message, "rate_limit_error"), status_code=429, headers={"Retry-After": "1"}
                )
                await refusal(scope, receive, tracked)
                return
            if capped:
                self.in_flight += 1
                self._gauge.inc()
            try:
                await self.app(scope, receive, tracked)
            finally:
                if capped:
                    self.in_flight -= 1
                    self._gauge.dec()
        finally:
            outcome = record.outcome or ("answered" if whole else "aborted")
            if outcome == "aborted" and not record.note:
                record.note = "the client went away"
            client = scope.get("client")
            log.info(
                "%s %s %s %d %s request %s %.3f s: %s",
                client[0] if client else "-",
                scope["method"],
                scope["path"],
                _CLIENT_GONE if status is None else status,
                outcome,
                record.request_id,
                time.perf_counter() - started,
                record.note or "-",
            )


class _ClusterFailed(Exception):
    """The cluster could not open or finish a session; the client gets 503 and may retry."""


class _TargetLost(_ClusterFailed):
    """No verifier of the contract's target opened the session: none is live, or none answered."""


class GatewayNode:
    """Serves the OpenAI-compatible API on its own listener and speaks SDCP to the router."""

    def __init__(self, config: ServiceConfig) -> None:
        instance = config.instance
        if instance.router is None:
            raise ConfigError("the gateway needs instance.router")
        self.config = config
        self.settings = config.gateway
        # The name clients send and see; the tokenizer comes from `model` (a name or a directory).
        self.model_name = config.gateway.served_model_name or config.gateway.model
        self.codec = load_text_codec(config.gateway.model)
        self.api_key = config.gateway.resolved_api_key()
        self.client = ClusterClient(instance.router, cert=instance.cert, key=instance.key, ca=instance.ca)
        host, _, port = config.gateway.listen.rpartition(":")
        try:
            self.listener = Listener.front_end(
                host.strip("[]"), int(port), cert=config.gateway.cert, key=config.gateway.key
            )
        except ValueError as exc:
            raise ConfigError(f"gateway.listen: {exc}; give gateway.cert and gateway.key for TLS") from exc
        self._server: Server | None = None
        self._admin: AdminServer | None = None
        self._connecting: asyncio.Task[None] | None = None
        # The metrics' instance label: the gateway's SDCP identity.
        self.uri = instance.uri
        for family in (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_LATENCY, PROMPT_TOKENS, GENERATION_TOKENS):
            family.labels(self.uri)
        for reason in FINISH_REASONS:
            REQUEST_SUCCESS.labels(self.uri, reason)
        start_parts(self.uri, GATEWAY_PARTS)
        for gauge in (REQUESTS_IN_PROGRESS, REQUESTS_OPENING, REQUESTS_IN_FLIGHT):
            gauge.labels(self.uri)
        # The target digest that contracts name, until no verifier of it opens a session.
        self._target: bytes | None = None
        # The positions per session that each listed target's verifier holds, where it says.
        self._target_contexts: dict[bytes, int] = {}
        # The Responses API's conversations, for previous_response_id (in this gateway's memory).
        self._conversations = Conversations()
        REQUESTS_REFUSED.labels(self.uri)
        # Cancellations under way, kept referenced until they are done.
        self._cancelling: set[asyncio.Future[None]] = set()

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return self._server.base_url

    def app(self) -> ASGIApp:
        routes = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                # A served name may hold slashes (a directory's path, an organisation's model).
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                # As vLLM's API server: liveness and version on the API's own port too.
                Route("/health", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
            ],
            exception_handlers={404: _not_found, 405: _method_not_allowed},
        )
        return _Admission(routes, limit=self.settings.max_requests_in_flight, uri=self.uri)

    async def start(self) -> None:
        await asyncio.to_thread(self.codec.warm)
        # Starlette's streamed answers run in an anyio task group, whose event-loop backend is
        # imported at its first use: now, rather than in the first request's time to first token.
        async with anyio.create_task_group():
            pass
        self._server = FrontEndServer(self.app(), self.listener)
        await self._server.start()
        self._connecting = asyncio.create_task(self._connect_ahead())
        if self.config.admin.listen is not None:
            self._admin = AdminServer("gateway", self.config.admin.listen, self.readiness)
            await self._admin.start()
        log.info("OpenAI-compatible API on %s", self._server.base_url)

    async def _connect_ahead(self) -> None:
        """The router and the verifiers it lists, connected before the first request needs them
        (each TLS handshake out of its time to first token); where one does not answer yet, the
        first request connects."""
        with contextlib.suppress(ProtocolError, TransportError):
            targets = await self.client.targets()
            await asyncio.gather(
                *(
                    self.client.peers.get(str(t["instance"])).connect()
                    for t in targets
                    if isinstance(t.get("instance"), str)
                )
            )

    async def stop(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._admin is not None:
            await self._admin.stop()
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

    async def readiness(self) -> Readiness:
        """Ready while the router answers and lists a verifier that reads this gateway's tokens."""
        try:
            served = await self._served_targets()
        except _ClusterFailed as exc:
            return Readiness(False, str(exc))
        if not served:
            return Readiness(False, f"the router lists no verifier of {self.model_name}'s tokenizer")
        return Readiness(True, f"the router lists {len(served)} verifier(s) of {self.model_name}'s tokenizer")

    # -- routes ----------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except OpenAIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse({"object": "list", "data": [await self._model()]})

    async def model(self, request: Request) -> Response:
        """OpenAI's GET /v1/models/{model}: the served model, or a 404 as OpenAI gives it."""
        try:
            self._check_key(request)
            if request.path_params["model"] != self.model_name:
                raise OpenAIError(
                    f"The model '{request.path_params['model'][:256]}' does not exist",
                    status=404,
                    param="model",
                )
        except OpenAIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse(await self._model())

    async def _model(self) -> dict[str, Any]:
        model: dict[str, Any] = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "sdcp"}
        context = await self._context_length()
        if context is not None:
            model["max_model_len"] = context
        return model

    async def health(self, _request: Request) -> Response:
        return Response(status_code=200)

    async def version(self, _request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's POST /tokenize: the tokens a prompt or chat messages become, and the context."""

        context = await self._context_length()

        def answer(body: object) -> dict[str, Any]:
            tokens = parse_tokenize(body, self.codec, served=(self.model_name,), context=context)
            return {"tokens": tokens, "count": len(tokens), "max_model_len": context}

        return await self._answer_small(request, answer)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's POST /detokenize: the text of a list of tokens."""
        return await self._answer_small(
            request, lambda body: {"prompt": parse_detokenize(body, self.codec, served=(self.model_name,))}
        )

    async def _answer_small(self, request: Request, answer: Callable[[object], dict[str, Any]]) -> Response:
        """A request answered from the tokenizer alone (CPU work, off the event loop)."""
        try:
            self._check_key(request)
            body = await self._read_json(request)
            return JSONResponse(await asyncio.to_thread(answer, body))
        except OpenAIError as exc:
            _record(request).note = exc.message
            return JSONResponse(exc.body(), status_code=exc.status)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    def _check_key(self, request: Request) -> None:
        """With an API key configured, the request must carry it (OpenAI's 401 otherwise)."""
        expected = self.api_key
        if expected is None:
            return
        offered = request.headers.get("authorization", "")
        if not hmac.compare_digest(offered.encode(), f"Bearer {expected}".encode()):
            raise OpenAIError("Incorrect API key provided", status=401, kind="authentication_error")

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, served as a chat request (sdcp.frontend.responses_api)."""
        return await self._serve(request, chat=True, responses=True)

    async def _serve(self, request: Request, *, chat: bool, responses: bool = False) -> Response:
        record = _record(request)
        started = time.perf_counter()
        turn: ResponsesRequest | None = None
        try:
            self._check_key(request)
            body = await self._read_json(request)
            if responses:
                # A stored conversation is continued only with the credential that stored it.
                scope = api_tenant(request.headers.get("authorization"), None)
                # Its items are read off the loop too: a body of many small items is CPU work.
                turn = await asyncio.to_thread(
                    parse_responses_request, body, self._conversations, scope=scope, strict=self.settings.strict
                )
                body = turn.chat
            context = await self._context_length()
            # Tokenizing and rendering a chat template are CPU work: off the event loop.
            generation = await asyncio.to_thread(
                parse_generation,
                body,
                self.codec,
                served=(self.model_name,),
                chat=chat,
                context=context,
                strict=self.settings.strict,
                close_json_objects=self.settings.close_json_objects,
            )
            if generation.request_id:
                record.request_id = _request_id(generation.request_id)
            if turn is not None:
                generation = dataclasses.replace(generation, ignored=(*turn.ignored, *generation.ignored))
            if generation.ignored:
                log.warning(
                    "gateway: request %s: ignored members that no parameter reads: %s",
                    record.request_id,
                    ", ".join(generation.ignored),
                )
            tenant = api_tenant(request.headers.get("authorization"), generation.user)
            parsed = time.perf_counter()
            observe_part(self.uri, "parse", parsed - started)
            with REQUESTS_OPENING.labels(self.uri).track_inprogress():
                # A client that goes away first cancels the opening, and with it each session-open
                # in flight (a long prompt's prefill stops).
                opened = await cancelled_if(
                    self._open_all(generation, record.request_id, tenant), _disconnected(request)
                )
            if opened is None:
                record.outcome, record.note = "aborted", "the client went away while its sessions opened"
                return Response(status_code=_CLIENT_GONE)
            (handles,) = opened
            opened_at = time.perf_counter()
            observe_part(self.uri, "open", opened_at - parsed)
        except OpenAIError as exc:
            record.note = exc.message
            return JSONResponse(exc.body(), status_code=exc.status)
        except _ClusterFailed as exc:
            record.note = str(exc)
            return _unavailable(str(exc))
        except ClientDisconnect:
            record.outcome, record.note = "aborted", "the client went away while sending"
            return Response(status_code=_CLIENT_GONE)
        request_id = record.request_id
        sessions = ",".join(h.session.hex() for h in handles)
        log.info("gateway: request %s (user %s) opened sessions %s", request_id, generation.user or "-", sessions)
        PROMPT_TOKENS.labels(self.uri).inc(generation.prompt_tokens)
        completion_id = turn.id if turn is not None else ("chatcmpl-" if chat else "cmpl-") + request_id
        # The sessions of the choices, in choice order, so that an operator can follow them.
        headers = {"X-Request-Id": request_id, "X-SDCP-Sessions": sessions}
        if generation.ignored:
            headers["X-SDCP-Ignored-Members"] = ",".join(_header_safe(name) for name in generation.ignored)
        streams = [
            self._texts(handle, generation, choice, started, opened_at)
            for handle, choice in zip(handles, generation.choices, strict=True)
        ]
        if generation.stream:
            record.note = f"sessions {sessions}, streamed"
            return StreamingResponse(
                self._sse(_merged(streams), generation, completion_id, record, started, turn),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **headers},
            )
        collecting = [asyncio.ensure_future(_collected(stream)) for stream in streams]
        # The body has been read: the next message is the client's going away, if it goes before
        # the answer (the sessions are then cancelled, rather than decoded to their end for nobody).
        gone = asyncio.ensure_future(_disconnected(request))
        all_collected = asyncio.gather(*collecting)
        try:
            with REQUESTS_IN_PROGRESS.labels(self.uri).track_inprogress():
                racing: set[asyncio.Future[Any]] = {all_collected, gone}
                await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
                if not all_collected.done():
                    record.outcome = "aborted"
                    record.note = f"the client went away; sessions {sessions} cancelled"
                    return Response(status_code=_CLIENT_GONE)
                answers = all_collected.result()
        except _ClusterFailed as exc:
            record.note = str(exc)
            return _unavailable(str(exc))
        finally:
            gone.cancel()
            # A choice not collected (the client left, another choice failed, the gateway stops):
            # cancelling its task closes its stream, which cancels its session.
            for task in collecting:
                task.cancel()
            await asyncio.gather(gone, all_collected, *collecting, return_exceptions=True)
        E2E_LATENCY.labels(self.uri).observe(time.perf_counter() - started)
        record.note = f"sessions {sessions}"
        answer = self._answer(generation, answers, completion_id)
        if turn is not None:
            answer, output = response_object(turn, answer)
            self._conversations.keep(turn, output)
        return JSONResponse(answer, headers=headers)

    async def _read_json(self, request: Request) -> object:
        """The body, read with the configured limit enforced while reading; then JSON, refused
        where it holds a string that is no Unicode text."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise OpenAIError(f"the request body exceeds {limit} bytes", status=413)
        received = bytearray()
        async for chunk in request.stream():
            received += chunk
            if len(received) > limit:
                raise OpenAIError(f"the request body exceeds {limit} bytes", status=413)
        if len(received) > _PARSE_INLINE_BYTES:
            return await asyncio.to_thread(_parsed, received)
        return _parsed(received)

    async def _open_all(self, generation: Generation, request_id: str, tenant: str | None) -> list[SessionHandle]:
        """One session per choice; if one cannot be opened, those that were are cancelled. When no
        verifier of the target opens them, the router's list gives another target, tried once."""
        target = self._target or await self._choose_target()
        try:
            return await self._open_each(target, generation, request_id, tenant)
        except _TargetLost as lost:
            try:
                replacement = await self._choose_target(instead_of=target)
            except _ClusterFailed as exc:
                raise _ClusterFailed(f"{lost}; {exc}") from lost
            log.info("gateway: target %s failed (%s); contracts name %s now", target.hex(), lost, replacement.hex())
            return await self._open_each(replacement, generation, request_id, tenant)

    async def _open_each(
        self, target: bytes, generation: Generation, request_id: str, tenant: str | None
    ) -> list[SessionHandle]:
        contract = build_contract(
            target=target,
            tokenizer=self.codec.tokenizer_digest,
            rule=generation.rule,
            max_new=generation.max_tokens,
            stop=generation.stop_ids,
            sampling=generation.sampling,
            m_max=generation.speculation.max_tokens or DEFAULT_M_MAX,
            drafters=generation.speculation.drafters,
        )
        opened = await asyncio.gather(
            *(
                self.client.open(
                    choice.prompt.ids,
                    contract,
                    logprobs=generation.logprobs,
                    min_new=generation.min_tokens or None,
                    request=request_id,
                    constraint=generation.constraint,
                    self_decode_only=not generation.speculation.enabled,
                    tenant=tenant,
                    # Every stop string is matched in the text, a one-token one inside a longer
                    # token too (ChoiceText): the verifier's shortest groups let it be seen soon.
                    self_decode_group_ms=0 if generation.stop_texts else None,
                )
                for choice in generation.choices
            ),
            return_exceptions=True,
        )
        handles = [h for h in opened if isinstance(h, SessionHandle)]
        failure = next((e for e in opened if isinstance(e, BaseException)), None)
        if failure is None:
            return handles
        for handle in handles:
            self._cancel_soon(handle)
        # The router refuses a target that no live verifier serves (422), and answers 503 when
        # none of those it lists answers.
        if isinstance(failure, BadContract) or (isinstance(failure, StatusError) and failure.status == 503):
            raise _TargetLost(f"the SDCP cluster did not open a session: {failure}")
        if isinstance(failure, (ProtocolError, TransportError)):
            if isinstance(failure, ProtocolError) and failure.status == 429:
                raise OpenAIError(f"too many open sessions: {failure}", status=429, kind="rate_limit_error")
            raise _ClusterFailed(f"the SDCP cluster did not open a session: {failure}")
        raise failure

    async def _choose_target(self, *, instead_of: bytes | None = None) -> bytes:
        """The first target that the router lists with a verifier of this gateway's tokenizer (other
        than ``instead_of``, which failed); contracts name it from now on."""
        served = [model for model in await self._served_targets() if model != instead_of]
        if not served:
            other = "" if instead_of is None else " other"
            raise _ClusterFailed(f"the router lists no{other} target with a verifier of {self.model_name}'s tokenizer")
        self._target = served[0]
        return self._target

    async def _context_length(self) -> int | None:
        """The model's context, or less where the target's verifier holds fewer positions per
        session (a llama.cpp verifier's kv_capacity): what a request may fill."""
        target = self._target
        if target is None:
            with contextlib.suppress(_ClusterFailed):
                target = await self._choose_target()
        held = self._target_contexts.get(target) if target is not None else None
        contexts = [context for context in (self.codec.context_length, held) if context is not None]
        return min(contexts, default=None)

    async def _served_targets(self) -> list[bytes]:
        """The target digests of the live verifiers that read this gateway's tokens, in the router's
        order. One that reports no tokenizer digest checks the contract's itself at session-open."""
        try:
            targets = await self.client.targets()
        except (ProtocolError, TransportError) as exc:
            raise _ClusterFailed(f"the router did not answer: {exc}") from exc
        own = self.codec.tokenizer_digest
        served = []
        for target in targets:
            model = target.get("model")
            if isinstance(model, bytes) and target.get("tokenizer", own) == own:
                served.append(model)
                context = target.get("context")
                if isinstance(context, int) and context > 0:
                    self._target_contexts[model] = context
        return served

    # -- output ----------------------------------------------------------------------------------

    async def _texts(
        self, handle: SessionHandle, generation: Generation, choice: Choice, started: float, opened_at: float
    ) -> AsyncIterator[_Piece]:
        """The choice's pieces, timed (``started``: the request's arrival; ``opened_at``: its
        sessions' open). A session left before its last piece (the client went away, another choice
        failed) is cancelled, as is one a stop string ends."""
        ended = False
        tokens, last = 0, started
        try:
            async for piece in self._decoded(handle, generation, choice):
                ended = piece.finish is not None
                now, new = time.perf_counter(), piece.tokens - tokens
                if new > 0:
                    # A piece's tokens share the time since the previous piece (a round commits several).
                    if tokens == 0:
                        TIME_TO_FIRST_TOKEN.labels(self.uri).observe(now - started)
                        observe_part(self.uri, "first_read", now - opened_at)
                    else:
                        for _ in range(new):
                            INTER_TOKEN_LATENCY.labels(self.uri).observe((now - last) / new)
                    tokens, last = piece.tokens, now
                if piece.finish is not None:
                    REQUEST_SUCCESS.labels(self.uri, piece.finish).inc()
                yield piece
        except (ProtocolError, TransportError) as exc:
            raise _ClusterFailed(f"session {handle.session.hex()} failed: {exc}") from exc
        finally:
            GENERATION_TOKENS.labels(self.uri).inc(tokens)
            if not ended:
                REQUEST_SUCCESS.labels(self.uri, "abort").inc()
                self._cancel_soon(handle)

    async def _decoded(self, handle: SessionHandle, generation: Generation, choice: Choice) -> AsyncIterator[_Piece]:
        text = choice_text(self.codec, generation)
        echo = choice.prompt.text if generation.echo else ""
        tokens = 0
        final_token: int | None = None
        logprobs: list[tuple[int, TokenLogprob | None]] = []

        def piece(
            decided: str,
            finish: str | None,
            acceptance: dict[str, int] | None = None,
            stop_reason: str | int | None = None,
        ) -> _Piece:
            nonlocal echo, logprobs
            out = _Piece(choice.index, echo + decided, finish, tokens, logprobs, acceptance, stop_reason)
            echo, logprobs = "", []
            return out

        async for chunk in self.client.stream(handle):
            tokens += len(chunk.tokens)
            final_token = chunk.tokens[-1] if chunk.tokens else final_token
            chosen: Sequence[TokenLogprob | None] = chunk.logprobs or [None] * len(chunk.tokens)
            logprobs.extend(zip(chunk.tokens, chosen, strict=True))
            decided, stopped = text.add(chunk.tokens, last=chunk.finish is not None)
            if stopped:
                # A stop string of several tokens: the verifier would decode on to max_tokens.
                self._cancel_soon(handle)
                acceptance = await self._acceptance(handle, chunk.epoch, generation)
                yield piece(decided, "stop", acceptance, text.stopped_by)
                return
            if chunk.finish is not None:
                stop_token = final_token is not None and final_token in generation.stop_ids
                # A session its verifier ended with fail (a constraint that no output continues,
                # docs/interpretations.md) is "abort", as vLLM names an output that did not finish.
                finish = "abort" if chunk.finish == Action.FAIL else "stop" if stop_token else "length"
                reason = None
                if finish == "stop" and final_token is not None:
                    reason = token_stop_reason(self.codec, generation, final_token)
                yield piece(decided, finish, await self._acceptance(handle, chunk.epoch, generation), reason)
                return
            if decided:
                yield piece(decided, None)

    async def _acceptance(self, handle: SessionHandle, epoch: int, generation: Generation) -> dict[str, int] | None:
        """The session's acceptance figures from the verifier that committed its last tokens (at
        ``epoch``), where the request asked for them; None where they cannot be read (the answer
        goes out without them)."""
        if not generation.speculation.report:
            return None
        try:
            where = handle if handle.epoch == epoch else await self.client.locate(handle)
            stats = await self.client.stats(where)
        except (ProtocolError, TransportError) as exc:
            log.warning("gateway: acceptance of session %s not read: %s", handle.session.hex(), exc)
            return None
        figures = {name: stats.get(name) for name in _ACCEPTANCE}
        if not all(isinstance(value, int) for value in figures.values()):
            log.warning("gateway: session %s: its stats lack acceptance figures", handle.session.hex())
            return None
        return {name: int(value) for name, value in figures.items() if isinstance(value, int)}

    def _cancel_soon(self, handle: SessionHandle) -> None:
        # In a task of its own: the request's task may be being cancelled (a client that went away).
        task = asyncio.ensure_future(self._cancel(handle))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def _cancel(self, handle: SessionHandle) -> None:
        try:
            await self.client.cancel(handle)
        except (ProtocolError, TransportError) as exc:
            log.warning("gateway: session %s not cancelled: %s", handle.session.hex(), exc)

    # -- answers ---------------------------------------------------------------------------------

    def _logprobs(self, generation: Generation, entries: list[tuple[int, TokenLogprob | None]], offset: int) -> Any:
        if generation.logprobs is None:
            return None
        if generation.chat:
            return chat_logprobs(entries, self.codec.token_text)
        return completion_logprobs(entries, self.codec.token_text, offset)

    def _answer(self, generation: Generation, answers: list[list[_Piece]], completion_id: str) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        for choice, pieces in zip(generation.choices, answers, strict=True):
            text = "".join(p.text for p in pieces)
            entries = [entry for p in pieces for entry in p.logprobs]
            finish = next((p.finish for p in reversed(pieces) if p.finish), "length")
            completion_tokens += pieces[-1].tokens if pieces else 0
            answer: dict[str, Any] = {
                "index": choice.index,
                "finish_reason": finish,
                "stop_reason": pieces[-1].stop_reason if pieces else None,
                # Offsets start at 0: echo comes without logprobs (openai_api refuses the pair).
                "logprobs": self._logprobs(generation, entries, 0),
            }
            if generation.chat and generation.tool_parser is not None:
                content, calls = read_tool_calls(text, generation.tool_parser)
                message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
                if calls:
                    message["tool_calls"] = message_tool_calls(calls)
                    answer["finish_reason"] = "tool_calls" if finish == "stop" else finish
                answer["message"] = message
            elif generation.chat:
                answer["message"] = {"role": "assistant", "content": text}
            else:
                answer["text"] = text
            choices.append(answer)
        return {
            "id": completion_id,
            "object": "chat.completion" if generation.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(
                generation.prompt_tokens, completion_tokens, generation, [pieces[-1] for pieces in answers if pieces]
            ),
        }

    async def _sse(
        self,
        pieces: AsyncIterator[_Piece],
        generation: Generation,
        completion_id: str,
        record: _AccessRecord,
        started: float,
        turn: ResponsesRequest | None = None,
    ) -> AsyncIterator[bytes]:
        """Chat completion chunks (or completions'), or for a Responses request its events."""
        created = int(time.time())
        events = ResponseEvents(turn, self.model_name) if turn is not None else None
        chat = generation.chat
        kind = "chat.completion.chunk" if chat else "text_completion"
        greeted: set[int] = set()
        # Each chat choice's tool calls, read as its text comes.
        readers = {
            c.index: ToolCallReader(generation.tool_parser) for c in generation.choices if generation.tool_parser
        }
        counts: dict[int, int] = {}
        # Each choice's last piece, with its acceptance figures.
        last: dict[int, _Piece] = {}
        offsets: dict[int, int] = {}
        prompt_tokens = {c.index: len(c.prompt.ids) for c in generation.choices}

        def event(choices: list[dict[str, Any]], usage: dict[str, int] | None) -> bytes:
            data: dict[str, Any] = {
                "id": completion_id,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if generation.include_usage:
                data["usage"] = usage
            if events is not None:
                return events.chunk(data)
            return f"data: {json.dumps(data)}\n\n".encode()

        in_progress = REQUESTS_IN_PROGRESS.labels(self.uri)
        in_progress.inc()
        if events is not None:
            yield events.start()
        try:
            async for piece in pieces:
                counts[piece.index] = piece.tokens
                if piece.finish is not None:
                    last[piece.index] = piece
                logprobs = self._logprobs(generation, piece.logprobs, offsets.get(piece.index, 0))
                offsets[piece.index] = offsets.get(piece.index, 0) + len(piece.text)
                finish = piece.finish
                if chat:
                    delta: dict[str, Any] = {"content": piece.text}
                    calls: list[dict[str, Any]] = []
                    reader = readers.get(piece.index)
                    if reader is not None:
                        read = reader.feed(piece.text, last=finish is not None)
                        delta["content"] = read.content or (None if read.calls else "")
                        calls = stream_tool_calls(read.calls)
                        if reader.calls and finish == "stop":
                            finish = "tool_calls"
                    if piece.index not in greeted:
                        greeted.add(piece.index)
                        delta["role"] = "assistant"
                    # Each tool call item goes in a chunk of its own, the piece's other members on the first.
                    deltas = [delta | {"tool_calls": calls[:1]}] if calls else [delta]
                    deltas += [{"content": None, "tool_calls": [call]} for call in calls[1:]]
                    choices: list[dict[str, Any]] = [
                        {"index": piece.index, "delta": each, "logprobs": None} for each in deltas
                    ]
                    choices[0]["logprobs"] = logprobs
                else:
                    choices = [{"index": piece.index, "text": piece.text, "logprobs": logprobs}]
                usage = _usage(prompt_tokens[piece.index], piece.tokens) if generation.continuous_usage else None
                for choice in choices:
                    ended = choice is choices[-1]
                    choice |= {"finish_reason": None, "stop_reason": None}
                    if ended:
                        choice |= {"finish_reason": finish, "stop_reason": piece.stop_reason}
                    yield event([choice], usage)
        except _ClusterFailed as exc:
            log.warning("gateway: request %s failed while streaming: %s", record.request_id, exc)
            record.outcome, record.note = "failed", f"{record.note}: {exc}"
            if events is not None:
                yield events.failed(str(exc))
                return
            yield f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n".encode()
        else:
            if generation.include_usage:
                yield event([], _usage(generation.prompt_tokens, sum(counts.values()), generation, list(last.values())))
            E2E_LATENCY.labels(self.uri).observe(time.perf_counter() - started)
            if events is not None and turn is not None:
                yield events.done()
                self._conversations.keep(turn, events.output)
                return
        finally:
            in_progress.dec()
            record.note += f", {sum(counts.values())} tokens"
        yield b"data: [DONE]\n\n"


async def _collected(stream: AsyncIterator[_Piece]) -> list[_Piece]:
    return [piece async for piece in stream]


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (to be called once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _parsed(body: bytearray) -> object:
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as exc:
        # ValueError: not UTF-8, not JSON, or an integer past Python's 4300 digits.
        raise OpenAIError(f"the request body is not valid JSON: {exc}") from exc
    check_nesting(parsed)
    check_unicode(parsed)
    return parsed


def _header_safe(name: str) -> str:
    # A member's name goes into a header as printable ASCII (others escaped, as JSON writes them).
    return json.dumps(name)[1:-1] if name.isascii() and name.isprintable() and "," not in name else json.dumps(name)


async def _merged(streams: list[AsyncIterator[_Piece]]) -> AsyncIterator[_Piece]:
    """The pieces of every choice as they come; all streams are closed when this one is."""
    if len(streams) == 1:
        async for piece in streams[0]:
            yield piece
        return
    queue: asyncio.Queue[_Piece | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[_Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put(piece)
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put(exc)

    pumps = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        remaining = len(pumps)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]


def _request_id(offered: str | None) -> str:
    """The client's request id when it is one we can log safely, else a new one."""
    if offered and len(offered) <= 128 and offered.isascii() and offered.isprintable():
        return offered
    return uuid.uuid4().hex


def _usage(
    prompt_tokens: int, completion_tokens: int, generation: Generation | None = None, finals: Sequence[_Piece] = ()
) -> dict[str, Any]:
    """OpenAI's usage; where ``generation`` asked for it, with ``speculative``: the acceptance
    figures of its choices' sessions (their ``finals``) summed, null where one could not be read."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if generation is not None and generation.speculation.report:
        figures = [piece.acceptance for piece in finals]
        if len(figures) != len(generation.choices) or any(f is None for f in figures):
            usage["speculative"] = None
        else:
            total = {name: sum(f[name] for f in figures if f is not None) for name in _ACCEPTANCE}
            rounds = total["rounds"]
            usage["speculative"] = {
                "rounds": rounds,
                "drafted_tokens": total["proposed"],
                "accepted_tokens": total["accepted"],
                # Draft tokens accepted per verified proposal (vLLM's mean acceptance length is 1 more).
                "mean_accepted_length": round(total["accepted"] / rounds, 3) if rounds else 0.0,
                "self_decoded_tokens": total["self_decoded"],
            }
    return usage


def _unavailable(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "server_error"), status_code=503, headers={"Retry-After": "1"})


async def _not_found(request: Request, _exc: Exception) -> Response:
    return JSONResponse(error_body(f"no route {request.url.path}", "invalid_request_error"), status_code=404)


async def _method_not_allowed(request: Request, _exc: Exception) -> Response:
    message = f"{request.method} is not allowed on {request.url.path}"
    return JSONResponse(error_body(message, "invalid_request_error"), status_code=405)
