"""A front end's view of an SDCP deployment: open sessions through a router, stream their output.

A front end may know several routers (docs/reliability.md, "Routers"): it opens a session at the
first that answers and asks the one that answered it about the session, another where that one
does not answer; any of them can load the session from the shared tier.

Output follows SDCP 6.7: indices are stable, every message carries the session epoch, and output of
a lower epoch than one already seen is discarded, so a reader that retries or follows a failover
never duplicates or loses tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sdcp.engines.tasks import BackgroundTasks
from sdcp.protocol.messages import (
    MAX_OUTPUT_READS,
    Action,
    CancelRequest,
    Constraint,
    Contract,
    Output,
    OutputBatch,
    OutputRead,
    OutputReads,
    Sampling,
    SessionRequest,
    TokenLogprob,
    session_path_id,
)
from sdcp.protocol.problems import BadMessage, ProblemType, ProtocolError
from sdcp.protocol.router import open_deadline_s
from sdcp.transport.client import PeerClients, SDCPClient
from sdcp.transport.errors import ConnectionLost, StatusError, TransportError

__all__ = [
    "BatchedReads",
    "ClusterClient",
    "OutputChunk",
    "OutputReader",
    "ReadAlone",
    "SessionHandle",
    "build_contract",
]

log = logging.getLogger(__name__)

# GET sessions/{id}/output?from=n at a verifier of this process: (session, from) -> its Output.
OutputReader = Callable[[bytes, int], Awaitable[Output]]

# Self-decoding periods keep a session going where drafts keep failing; each entry of the ladder is
# used once until R good rounds reset it, so the ladder holds enough of them for max_new tokens. A
# period ends with an event the router answers before the verifier decodes on: one stream on 2 cores
# stood 9-11 ms at each end, a fiftieth of a 48-token period (docs/performance.md, session 32), so a
# period holds a usual chat answer whole, and a drafter whose drafts kept failing is tried again
# after that many tokens decoded alone.
DEFAULT_SELF_MAX = 128
# How long a session-open may wait for the router's answer, besides its prompt's prefill: a queue
# of long prompts at the verifier makes the router wait longer than a prompt of its own asks.
_OPEN_PATIENCE_S = 600.0
# The most tokens a proposal holds (m_max) unless the front end asks for another bound.
DEFAULT_M_MAX = 16
# While an output read is outstanding, how often the router is asked whether the session moved.
LOCATE_EVERY_S = 3.0
# How long a stream waits for its session's next tokens before it ends with SessionStalled: long
# enough for a prefill of a whole context on a loaded CPU, a failover and a Redis restart.
STALL_S = 300.0


class SessionStalled(TransportError):
    """No token came for ``stall_s``: the session's verifier answers but commits nothing (its store
    out of reach, say) and no router moved it. The stream ends with this instead of waiting forever."""


def build_contract(
    *,
    target: bytes,
    tokenizer: bytes,
    rule: int = 1,
    max_new: int = 128,
    stop: Sequence[int] = (),
    sampling: Sampling | None = None,
    m_max: int = DEFAULT_M_MAX,
    low_rounds: int = 2,
    self_load: int = 100,
    self_max: int = DEFAULT_SELF_MAX,
    drafters: Sequence[bytes] | None = None,
) -> Contract:
    """A contract for generation: reduce, then self-decoding periods, so persistent rejection costs
    little time and never fails a session before max_new (SDCP 6.5.2)."""
    periods = math.ceil(max_new / self_max) + 1
    obj: dict[str, object] = {
        "target": target,
        "tokenizer": tokenizer,
        "rule": rule,
        "m_max": m_max,
        "max_new": max_new,
        "stop": list(stop),
        "low_rounds": low_rounds,
        "fallback": [int(Action.REDUCE), *([int(Action.SELF_DECODE)] * periods), int(Action.FAIL)],
        "self_load": self_load,
        "self_max": self_max,
    }
    if sampling is not None:
        obj["sampling"] = sampling.to_obj()
    if drafters is not None:
        obj["drafters"] = list(drafters)
    return Contract.from_obj(obj)


@dataclass(frozen=True)
class SessionHandle:
    session: bytes
    epoch: int
    verifier: str
    drafter: str | None
    # The router that last answered about the session: it is asked first.
    router: str | None = None

    @property
    def path_id(self) -> str:
        return session_path_id(self.session)


@dataclass(frozen=True)
class OutputChunk:
    """Newly committed tokens at output index ``start``; ``finish`` is set on the final chunk."""

    start: int
    tokens: tuple[int, ...]
    epoch: int
    finish: Action | None
    # One per token when the session was opened with ``logprobs``.
    logprobs: tuple[TokenLogprob, ...] | None = None
    # The verifier the tokens came from: after a failover, the one to ask for the session's stats.
    verifier: str | None = None


class ClusterClient:
    """An authenticated client of one router, or of several (``router`` a list, the first
    preferred), and of the verifiers they name."""

    def __init__(
        self,
        router: str | Sequence[str],
        *,
        cert: Path,
        key: Path,
        ca: Path,
        follow_attempts: int = 20,
        stall_s: float = STALL_S,
    ) -> None:
        self.routers = (router,) if isinstance(router, str) else tuple(router)
        if not self.routers:
            raise ValueError("a cluster client needs a router")
        self.peers = PeerClients(cert, key, ca)
        self.follow_attempts = follow_attempts
        self.stall_s = stall_s
        # Verifiers of this very process (`sdcp together`): their output is read by a call, not
        # over HTTP, with the errors their service would answer (sdcp.together).
        self.local_outputs: dict[str, OutputReader] = {}
        # Each verifier's output reads, sent together (BatchedReads).
        self._batched: dict[str, BatchedReads] = {}

    async def aclose(self) -> None:
        for batched in list(self._batched.values()):
            await batched.aclose()
        await self.peers.aclose()

    async def __aenter__(self) -> ClusterClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def _at_router(
        self, call: Callable[[str], Awaitable[tuple[int, object | None]]], first: str | None = None
    ) -> tuple[str, object | None]:
        """``call`` at ``first`` (else the first router), then at each other router while the last
        one did not answer; the router that answered, and its body."""
        order = ([first] if first is not None else []) + [router for router in self.routers if router != first]
        for router in order[:-1]:
            try:
                return router, (await call(router))[1]
            except TransportError:
                continue
        return order[-1], (await call(order[-1]))[1]

    async def targets(self) -> list[dict[str, object]]:
        _, body = await self._at_router(lambda router: self.peers.get(router).get_cbor("targets"))
        if not isinstance(body, list):
            raise BadMessage("the router's target list is not an array")
        return body

    async def open(
        self,
        prompt: Sequence[int],
        contract: Contract,
        sampling: Sampling | None = None,
        *,
        logprobs: int | None = None,
        min_new: int | None = None,
        request: str | None = None,
        constraint: Constraint | None = None,
        self_decode_only: bool = False,
        tenant: str | None = None,
        self_decode_group_ms: int | None = None,
    ) -> SessionHandle:
        """Open a session; ``logprobs`` asks for log-probabilities with that many alternatives per
        output token, ``min_new`` holds the contract's stop tokens back until that many tokens are
        out, ``request`` names the front end's request in every role's log, ``constraint`` is the
        output's language, ``self_decode_only`` has the verifier decode it without drafters,
        ``tenant`` names the front end's user, whose history alone its drafts draw on,
        ``self_decode_group_ms`` bounds how far apart its self-decoded rounds are released
        (extensions, docs/interpretations.md)."""
        wanted = SessionRequest(
            prompt=tuple(prompt),
            contract=contract,
            sampling=sampling,
            logprobs=logprobs,
            min_new=min_new,
            request=request,
            constraint=constraint,
            self_decode_only=self_decode_only or None,
            tenant=tenant,
            self_decode_group_ms=self_decode_group_ms,
        )
        # A router that opened the session but whose answer was lost leaves it unread; the next
        # router opens another (docs/reliability.md, "Routers").
        # The router waits for the verifier's prefill as long as the prompt and the verifier's queue
        # of prefills ask (open_deadline_s) and answers then: this bound only guards against a
        # router that never answers.
        deadline = open_deadline_s(_OPEN_PATIENCE_S, len(wanted.prompt))
        router, body = await self._at_router(
            lambda r: self.peers.get(r).post_cbor("sessions", wanted.to_obj(), timeout=deadline)
        )
        return _handle(body, router)

    async def locate(self, handle: SessionHandle) -> SessionHandle:
        """Where the session runs now (after a failover, another verifier and a higher epoch)."""
        router, body = await self._describe(handle)
        return _handle(body, router)

    async def describe(self, handle: SessionHandle) -> dict[str, object]:
        """The router's description of the session: where it runs, whether it ended, who served it."""
        return (await self._describe(handle))[1]

    async def _describe(self, handle: SessionHandle) -> tuple[str, dict[str, object]]:
        path = f"sessions/{handle.path_id}"
        router, body = await self._at_router(lambda r: self.peers.get(r).get_cbor(path), handle.router)
        if not isinstance(body, dict):
            raise BadMessage("the router's session description is not a map")
        return router, body

    async def stats(self, handle: SessionHandle) -> dict[str, object]:
        _, body = await self.peers.get(handle.verifier).get_cbor(f"sessions/{handle.path_id}/stats")
        if not isinstance(body, dict):
            raise BadMessage("session stats are not a map")
        return body

    async def cancel(self, handle: SessionHandle) -> None:
        """End the session early (POST sessions/{id}/cancel at the router, docs/interpretations.md)."""
        request = CancelRequest(session=handle.session, epoch=handle.epoch)
        path = f"sessions/{handle.path_id}/cancel"
        await self._at_router(lambda r: self.peers.get(r).post_cbor(path, request.to_obj()), handle.router)

    async def stream(self, handle: SessionHandle, start: int = 0) -> AsyncIterator[OutputChunk]:
        """Committed tokens from output index ``start`` on, until the final output (SDCP 6.7)."""
        position = start
        highest_epoch = handle.epoch
        failures = 0
        progressed_at = time.monotonic()
        while True:
            deadline = progressed_at + self.stall_s
            if time.monotonic() > deadline:
                raise self._stalled(handle, position)
            try:
                read = await self._read_or_move(handle, position, deadline)
                if isinstance(read, SessionHandle):
                    handle = read  # the session moved while its old verifier kept us waiting
                    continue
                output = read
            except (TransportError, ProtocolError) as exc:
                if isinstance(exc, SessionStalled) or (
                    isinstance(exc, ProtocolError) and exc.problem not in (ProblemType.STALE_EPOCH, None)
                ):
                    raise
                failures += 1
                if failures > self.follow_attempts:
                    raise
                # The verifier failed or was fenced: ask the router where the session went. A router
                # that cannot answer now (its store out of reach) counts as one more failure.
                await asyncio.sleep(min(2.0, 0.1 * failures))
                with contextlib.suppress(TransportError, ProtocolError):
                    handle = await self.locate(handle)
                continue
            failures = 0
            # SDCP 6.7: output with a lower epoch than one already seen is discarded.
            if output.epoch < highest_epoch or output.from_ != position:
                continue
            highest_epoch = output.epoch
            if output.tokens or output.final:
                progressed_at = time.monotonic()
                finish = output.finish if output.final else None
                yield OutputChunk(position, output.tokens, output.epoch, finish, output.logprobs, handle.verifier)
                position += len(output.tokens)
            if output.final:
                return
            if not output.tokens:
                # A verifier that lost the session without learning it (its status expired, the
                # router fenced the log) still answers, with nothing new: ask where it went. No
                # answer now leaves the session where it was: the next read asks again.
                with contextlib.suppress(TransportError, ProtocolError):
                    moved = await self.locate(handle)
                    if moved.epoch > handle.epoch:
                        handle = moved

    def _stalled(self, handle: SessionHandle, position: int) -> SessionStalled:
        return SessionStalled(
            f"session {handle.session.hex()}: no output for {self.stall_s:.0f} s at {handle.verifier} "
            f"(output index {position}): its verifier commits nothing and no router moved it"
        )

    async def _read_or_move(self, handle: SessionHandle, position: int, deadline: float) -> Output | SessionHandle:
        """GET output at the session's verifier; while the answer is outstanding, the router is
        asked every ``LOCATE_EVERY_S`` where the session runs, and a higher epoch elsewhere wins
        (a paused or cut-off verifier answers nothing, not even its fencing, SDCP 6.9)."""
        read = asyncio.ensure_future(self._output(handle, position))
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._stalled(handle, position)
                done, _ = await asyncio.wait({read}, timeout=min(LOCATE_EVERY_S, left))
                if done:
                    return read.result()
                with contextlib.suppress(TransportError, ProtocolError):
                    moved = await self.locate(handle)
                    if moved.epoch > handle.epoch:
                        return moved
        finally:
            read.cancel()

    async def _output(self, handle: SessionHandle, position: int) -> Output:
        local = self.local_outputs.get(handle.verifier)
        if local is not None:
            return await local(handle.session, position)
        batched = self._batched.get(handle.verifier)
        if batched is None:
            batched = self._batched[handle.verifier] = BatchedReads(self.peers.get(handle.verifier))
        if batched.supported:
            with contextlib.suppress(ReadAlone):
                return await batched.read(handle.session, position)
        answer = await self.peers.get(handle.verifier).get_cbor(
            f"sessions/{handle.path_id}/output", {"from": str(position)}
        )
        return Output.from_obj(answer[1])


# How long a read of a stream past its first token waits for the reads of the other streams that
# the same pass answers (BatchedReads): a pass's rounds of 16 sessions are released over about 9 ms
# on 2 cores. 16-stream levels gave 4-9 % more tokens/s with 2.4 times fewer requests.
KEEP_PACE_S = 0.005


class ReadAlone(Exception):
    """This read goes as a GET of its own: the verifier does not serve POST outputs, or another
    read of the same session waits there already."""


class BatchedReads:
    """The output reads of one verifier's sessions, sent together as POST outputs (extension,
    docs/interpretations.md, "Output reads of many sessions"): each request answers every session
    that has news, where a GET a session would take a request a session a round. A read that comes
    while a request waits goes in a request of its own (a first token never waits behind the
    others' wait); the reads a request leaves unanswered go again together. Reads of streams past
    their first token wait ``keep_pace_s`` for the others that the same pass answers, since a
    pass's rounds are released one session after another: at 16 streams a request went for every
    two or three sessions of a pass, and the verifier's event loop spent a quarter of its work
    answering them (docs/performance.md, session 27). A first read goes at once, with those
    waiting."""

    def __init__(self, peer: SDCPClient, keep_pace_s: float = KEEP_PACE_S) -> None:
        self._peer = peer
        self._keep_pace_s = keep_pace_s
        # Session -> the output index its reader waits at, and its answer.
        self._waiting: dict[bytes, tuple[int, asyncio.Future[Output]]] = {}
        # The sessions whose read is in a request in flight.
        self._asked: set[bytes] = set()
        # The send to come, and whether it goes at the loop's next turn (else after keep_pace_s).
        self._scheduled: asyncio.Handle | None = None
        self._scheduled_at_once = False
        self._requests = BackgroundTasks(peer.base_uri, log)
        self._closed = False
        self.supported = True

    async def read(self, session: bytes, position: int) -> Output:
        """The session's output from ``position``, once the verifier has news of it (SDCP 6.7)."""
        if self._closed:
            raise ConnectionLost(f"the client of {self._peer.base_uri} is closed")
        if session in self._waiting:
            raise ReadAlone("another read of the session waits already")
        future: asyncio.Future[Output] = asyncio.get_running_loop().create_future()
        self._waiting[session] = (position, future)
        future.add_done_callback(lambda done: self._forget(session, done))
        self._schedule()
        return await future

    def _forget(self, session: bytes, future: asyncio.Future[Output]) -> None:
        waiting = self._waiting.get(session)
        if waiting is not None and waiting[1] is future:
            del self._waiting[session]

    def _schedule(self) -> None:
        # Reads asked before the send (every stream the rounds of a pass answered) go together.
        at_once = any(position == 0 for position, _ in self._waiting.values())
        if self._scheduled is not None:
            if self._scheduled_at_once or not at_once:
                return
            self._scheduled.cancel()
        loop = asyncio.get_running_loop()
        self._scheduled_at_once = at_once
        self._scheduled = loop.call_soon(self._send) if at_once else loop.call_later(self._keep_pace_s, self._send)

    def _send(self) -> None:
        self._scheduled = None
        if self._closed:
            return
        unasked = [
            (session, position) for session, (position, _) in self._waiting.items() if session not in self._asked
        ]
        for at in range(0, len(unasked), MAX_OUTPUT_READS):
            reads = dict(unasked[at : at + MAX_OUTPUT_READS])
            self._asked |= reads.keys()
            self._requests.spawn(self._request(reads))

    async def _request(self, reads: dict[bytes, int]) -> None:
        try:
            asked = OutputReads(reads=tuple(OutputRead(session=s, from_=n) for s, n in reads.items()))
            _, body = await self._peer.post_cbor("outputs", asked.to_obj(), idempotent=True)
            answer = OutputBatch.from_obj(body)
        except Exception as exc:  # noqa: BLE001 - every reader of the request must learn why it failed
            failed: Exception = exc
            if _not_served(exc):
                self.supported = False
                failed = ReadAlone(f"the verifier does not serve POST outputs: {exc}")
            for session, position in reads.items():
                self._answer(session, position, failed)
        else:
            for output in answer.outputs:
                self._answer(output.session, output.from_, output)
            for refusal in answer.refused:
                problem = {"type": refusal.type, "status": refusal.status, "detail": refusal.detail}
                self._answer(refusal.session, reads.get(refusal.session), ProtocolError.from_problem(problem))
        finally:
            self._asked -= reads.keys()
            if self._waiting and not self._closed:
                self._schedule()

    def _answer(self, session: bytes, position: int | None, answer: Output | Exception) -> None:
        waiting = self._waiting.get(session)
        if waiting is None or waiting[0] != position or waiting[1].done():
            return  # its reader went, or reads from elsewhere now: it asks again
        if isinstance(answer, Output):
            waiting[1].set_result(answer)
        else:
            waiting[1].set_exception(answer)

    async def aclose(self) -> None:
        """Stop asking; a reader still waiting learns that the client closed."""
        self._closed = True
        if self._scheduled is not None:
            self._scheduled.cancel()
        await self._requests.cancel_all()
        closed = ConnectionLost(f"the client of {self._peer.base_uri} is closed")
        for _, future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(closed)


def _not_served(error: Exception) -> bool:
    """A verifier without POST outputs answers 404 or 405 to it (another implementation)."""
    status = error.status if isinstance(error, (ProtocolError, StatusError)) else None
    problem = error.problem if isinstance(error, ProtocolError) else None
    return status in (404, 405) and problem is None


def _handle(body: object, router: str) -> SessionHandle:
    if not isinstance(body, dict):
        raise BadMessage("the router's session description is not a map")
    session, epoch, verifier = body.get("session"), body.get("epoch"), body.get("verifier")
    drafter = body.get("drafter")
    if not isinstance(session, bytes) or not isinstance(epoch, int) or not isinstance(verifier, str):
        raise BadMessage("the router's session description lacks session, epoch or verifier")
    return SessionHandle(session, epoch, verifier, drafter if isinstance(drafter, str) else None, router)
