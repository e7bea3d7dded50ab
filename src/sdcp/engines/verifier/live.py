"""A session as the verifier holds it: its state machine and commit log, and what the engine keeps
about it between rounds (rounds in flight, readers to wake, the self-decoding task, timings)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sdcp.cache import CommitLog
from sdcp.engines.verifier.observe import TRACE_ROUNDS, RoundTimings, RoundTrace
from sdcp.models.lookup.suffix import SuffixIndex
from sdcp.protocol.drafter import AcceptanceEstimate
from sdcp.protocol.messages import Verdict
from sdcp.protocol.verifier import VerifierSession

__all__ = ["LiveSession", "RunningSessions"]


@dataclass
class LiveSession:
    machine: VerifierSession
    log: CommitLog
    etag: str
    # What decides the session's tokens beyond contract and prompt (sdcp.protocol.records.session_terms):
    # every commit record names them, so that it is valid in this session's log only.
    terms: bytes
    # The front end that opened the session at the router (session-open's owner extension), and
    # the user it named (tenant): together they scope the session's history.
    owner: str | None = None
    tenant: str | None = None
    # The most time apart the front end takes its self-decoded rounds (session-open's extension).
    self_decode_group_ms: int | None = None
    rounds: dict[int, asyncio.Future[Verdict]] = field(default_factory=dict)
    committed: asyncio.Event = field(default_factory=asyncio.Event)
    # The events of reads of several sessions (POST outputs) that wait on this one among others.
    watchers: set[asyncio.Event] = field(default_factory=set)
    self_decoder: asyncio.Task[None] | None = None
    timings: RoundTimings = field(default_factory=RoundTimings)
    # The per-token acceptance of its drafters' proposals: with the pass costs, how long a proposal
    # the next verdict's m_cap allows (Rounds.verify).
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    # When a proposal, a commit or a router message last concerned the session (time.monotonic).
    driven_at: float = field(default_factory=time.monotonic)
    # When the router was last told that no drafter drives the session (a switch event), and the
    # delivery of that event while it is retried.
    nudged_at: float = 0.0
    nudge: asyncio.Task[None] | None = None
    # A cancel is waiting for the self-decoding period to stop at its next round boundary.
    cancelling: bool = False
    # While self-decoding awaits a greedy run's step: ends the run there, so that a cancel is
    # decided at the scorer's next pass, not a group of steps later.
    cut_run: Callable[[], None] | None = None
    # The session's recent rounds (GET sessions/{id}/trace), and the proposal round being timed.
    trace: deque[tuple[object, ...]] = field(default_factory=lambda: deque(maxlen=TRACE_ROUNDS))
    timing: RoundTrace | None = None
    # How long the last commit-log append took (s).
    append_s: float = 0.0
    # Whether a record of this epoch carrying the verifier's certificate is in the log (signed
    # records, docs/interpretations.md): until one is, every record carries it.
    cert_logged: bool = False
    # The records of the last append, unsigned and signed: a retry of their rounds sends them again.
    signed: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    # The session's target KV in the MLC (kvpublish.py): where this epoch publishes it (None: no
    # name the router would find), the committed length of the latest publication tried and of the
    # latest that landed, the one in flight, and whether the store refused the KV as too large or
    # the session's end retired it. ``kv_imported``: tokens whose KV the open imported from the
    # resume's blob (0: prefilled).
    kv_uri: str | None = None
    kv_tried_at: int = 0
    kv_published: int = 0
    kv_publishing: asyncio.Task[None] | None = None
    kv_too_large: bool = False
    kv_retired: bool = False
    kv_imported: int = 0
    # Whether no scoring request of the session has gone to the scorer since its prefill, whose last
    # row the target may keep for the first (Target.keeps_prefill_row).
    prefill_row_kept: bool = True
    # The session's own tokens as the lookahead indexes them (VerifierLookahead), built at its first guess.
    suffix_index: SuffixIndex | None = None
    # When the open answered (time.perf_counter): the first_round part of the first token's latency
    # runs from here to the first committed token (sdcp.latency).
    opened_at: float = field(default_factory=time.perf_counter)
    # The verifier's parts of the first token's latency (s), by part: stats' first_token_us.
    first_token_parts: dict[str, float] = field(default_factory=dict)
    # (tokens committed, time.monotonic()) at each release of tokens, after the tokens committed
    # before this verifier held the session (released at no known time): when a reader's first new
    # token became output (released_at).
    releases: list[tuple[int, float]] = field(default_factory=list)

    # The engine no longer holds the session (SessionSweeps.forget): its waiting readers answer.
    forgotten: bool = False

    def __post_init__(self) -> None:
        self.releases.append((self.machine.committed, -math.inf))

    def released(self) -> None:
        """The session's committed tokens became output now."""
        committed = self.machine.committed
        if committed > self.releases[-1][0]:
            self.releases.append((committed, time.monotonic()))

    def released_at(self, index: int) -> float:
        """When output token ``index`` (committed) was released (time.monotonic), -inf for a
        token committed before this verifier held the session."""
        entry = bisect.bisect_right(self.releases, index, key=lambda release: release[0])
        return self.releases[min(entry, len(self.releases) - 1)][1]

    def driven(self) -> None:
        self.driven_at = time.monotonic()

    def wake_readers(self) -> None:
        # Readers wait on the current event; replacing it after setting wakes each exactly once.
        self.committed.set()
        self.committed = asyncio.Event()
        for watcher in self.watchers:
            watcher.set()


class RunningSessions:
    """How many of a verifier's sessions run (open, not ended, not forgotten), counted on the event
    loop where that can change: a pass and the scorer's thread read an int, rather than walk every
    session kept for its readers after its end (``ended_retention_s``, hundreds on a busy verifier)."""

    def __init__(self, sessions: dict[bytes, LiveSession]) -> None:
        self._sessions = sessions
        self._running: dict[bytes, LiveSession] = {}
        self.count = 0
        # Sessions whose open is under way (their prefill): they do not count as running yet,
        # but the verifier is not idle.
        self.opening = 0
        # Set while no session runs or opens: work that can wait for it (PrefixSharing) waits on it.
        self.idle = asyncio.Event()
        self.idle.set()

    @contextlib.contextmanager
    def open_under_way(self) -> Iterator[None]:
        """While a session opens (its prefill): the verifier is not idle."""
        self.opening += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.opening -= 1
            self._idle_if_so()

    def add(self, live: LiveSession) -> None:
        self._running[live.machine.session] = live
        self.recount()

    def recount(self) -> None:
        """After a round that ended a session, and before the count decides an admission: a
        session forgotten meanwhile (idle, replaced by a later epoch) is dropped here."""
        self._running = {
            session: live
            for session, live in self._running.items()
            if not live.machine.ended and self._sessions.get(session) is live
        }
        self.count = len(self._running)
        self._idle_if_so()

    def _idle_if_so(self) -> None:
        if self.count or self.opening:
            self.idle.clear()
        else:
            self.idle.set()
