"""What the verifier measures: what its passes cost, its metrics (docs/observability.md maps them to
vLLM's), and each session's stats and trace of committed rounds (GET sessions/{id}/stats, /trace)."""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from sdcp.latency import VERIFIER_PARTS, start_parts
from sdcp.protocol.messages import Action
from sdcp.protocol.passcost import PASS_ROWS, PassCurve
from sdcp.protocol.problems import ProblemType
from sdcp.protocol.verifier import PendingCommit

if TYPE_CHECKING:
    from sdcp.engines.verifier.live import LiveSession

__all__ = [
    "CONTEXT_BANDS",
    "TRACE_FIELDS",
    "TRACE_ROUNDS",
    "PassCurves",
    "RoundTimings",
    "RoundTrace",
    "VerifierMetrics",
    "session_stats",
    "session_trace",
]

# Where a pass's cost by its rows changes with the positions its rows attend: a band of context
# starts at each (the attention's share grows with them; on llama.cpp a one-token pass runs on one
# thread from 256 positions on, docs/models.md, and at 2,400 positions a second row adds a sixth to
# a one-row pass where at 100 it adds half).
CONTEXT_BANDS = (256, 512, 1024, 2048)


class PassCurves:
    """What a pass costs by its rows, a PassCurve per band of context (CONTEXT_BANDS), so that
    long-context passes neither teach the short-context curve their cost nor take it. ``base``, the
    band of the shortest contexts, is the one the verifier measures at start: its passes keep its
    level current and its measured shape (PassCurve.follow_level). A band that has served no pass
    yet answers with the nearest shorter band's curve; its first pass scales that curve's shape to
    its own cost, and its passes keep it current from then on, shape included (PassCurve.record:
    at long contexts a second row costs less against the first than at short ones)."""

    def __init__(self, base: PassCurve | None = None) -> None:
        self.base = base if base is not None else PassCurve()
        self._bands: list[PassCurve | None] = [self.base] + [None] * len(CONTEXT_BANDS)

    def curve(self, context: int) -> PassCurve:
        """The curve of passes whose rows attend ``context`` positions at most."""
        band = bisect.bisect_right(CONTEXT_BANDS, context)
        # The base band is never empty: the search always ends there at the latest.
        return next(learned for learned in reversed(self._bands[: band + 1]) if learned is not None)

    def record(self, seconds: float, rows: int, context: int) -> None:
        """A served pass of ``rows`` rows, the longest attending ``context`` positions."""
        if rows < 1 or seconds <= 0:
            return
        band = bisect.bisect_right(CONTEXT_BANDS, context)
        if band == 0:
            self.base.follow_level(seconds, rows)
            return
        learned = self._bands[band]
        if learned is None:
            shape = self.curve(context)
            scale = 1000 * seconds / shape.ms(rows)
            self._bands[band] = PassCurve([point * scale for point in shape.points_ms], shape.rows)
            return
        learned.record(seconds, rows)


# Metrics; every labelled series starts at zero.
ROUND_KINDS = ("proposal", "self", "cancel")
_ROUNDS = Counter(
    "sdcp_verifier_rounds_total",
    "Rounds committed, by kind and by the action of the verdict",
    ["instance", "kind", "outcome"],
)
_COMMITTED = Counter("sdcp_verifier_tokens_committed_total", "Tokens committed", ["instance"])
_ROUND_SECONDS = Histogram("sdcp_verifier_round_seconds", "Time from admission to verdict", ["instance"])
_PROBLEMS = Counter("sdcp_verifier_problems_total", "Proposals answered with a problem, by type", ["instance", "type"])
_ESCALATIONS = Counter("sdcp_verifier_escalations_total", "Verdicts that escalated, by action", ["instance", "action"])
_SELF_DECODED = Counter("sdcp_verifier_self_decoded_tokens_total", "Tokens the verifier decoded itself", ["instance"])
_M_CAP = Histogram("sdcp_verifier_m_cap", "m_cap of each verdict", ["instance"], buckets=(1, 2, 4, 8, 16, 32, 64))
_APPEND_SECONDS = Histogram("sdcp_verifier_commit_append_seconds", "Commit-log append latency", ["instance"])
_APPEND_CONFLICTS = Counter(
    "sdcp_verifier_commit_conflicts_total", "Commit-log appends refused by their precondition", ["instance"]
)
_FENCED = Counter("sdcp_verifier_fenced_sessions_total", "Sessions this verifier stopped serving, fenced", ["instance"])
_DRAFTS = Counter("sdcp:spec_decode_num_drafts", "Proposals verified", ["instance"])
# vLLM's names: prompt tokens looked up in the prefix cache, and those whose KV it held.
_PREFIX_QUERIES = Counter("sdcp:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", ["instance"])
_PREFIX_HITS = Counter("sdcp:prefix_cache_hits", "Prompt tokens whose KV the prefix cache held", ["instance"])
_DRAFT_TOKENS = Counter("sdcp:spec_decode_num_draft_tokens", "Tokens proposed in verified proposals", ["instance"])
_ACCEPTED_TOKENS = Counter("sdcp:spec_decode_num_accepted_tokens", "Proposed tokens accepted", ["instance"])
_ACCEPTED_BY_POSITION = Counter(
    "sdcp:spec_decode_num_accepted_tokens_per_pos",
    "Proposed tokens accepted, by position (0: first)",
    ["instance", "position"],
)
_RUNNING = Gauge("sdcp:num_requests_running", "Sessions this verifier decodes", ["instance"])
_WAITING = Gauge("sdcp:num_requests_waiting", "Rounds waiting for a scoring pass", ["instance"])
_PREFIX_BYTES = Gauge("sdcp:prefix_cache_bytes", "Bytes of KV the prefix cache holds", ["instance"])
_KV_USAGE = Gauge("sdcp:kv_cache_usage_perc", "Share of the KV slot pool's positions in use (1 = full)", ["instance"])
_PASS_SECONDS = Gauge(
    "sdcp_verifier_pass_seconds", "What a pass of this many rows costs, measured (PassCurve)", ["instance", "rows"]
)
_HISTORY_PUBLISHED = Counter(
    "sdcp_verifier_history_published_total",
    "Finished sessions' outputs published for the drafters' shared history, by outcome",
    ["instance", "outcome"],
)
_PREFIX_SHARED = Counter(
    "sdcp:prefix_cache_shared_objects",
    "Prefix KV objects of the MLC: published here, used here, or refused (untrusted or unusable)",
    ["instance", "outcome"],
)
# The longest proposal a contract allows (SDCP 4.1 m_max): positions of _ACCEPTED_BY_POSITION.
_MAX_POSITIONS = 64
# Rounds each session's trace keeps (GET sessions/{id}/trace), the most recent; each a tuple of
# TRACE_FIELDS (None: not measured), about 200 bytes, so 256 sessions hold at most about 50 MB.
TRACE_ROUNDS = 1024
TRACE_FIELDS = (
    "round",
    "kind",
    "drafter",
    "proposed",
    "accepted",
    "emitted",
    "committed",
    "action",
    "m_cap",
    "batch",
    "gap_us",
    "model_us",
    "queue_us",
    "fetch_us",
    "append_us",
    "verify_us",
    "other_us",
)


def _pass_seconds(curve: PassCurve, rows: int) -> float:
    return curve.ms(rows) / 1000


class VerifierMetrics:
    """The verifier instance ``uri``'s series (docs/observability.md maps them to vLLM's), each
    started at zero; its gauges read the given functions and ``pass_curve``. Bound once, so that a
    round's metrics cost no label lookups."""

    def __init__(
        self,
        uri: str,
        *,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        prefix_bytes: Callable[[], float],
        pass_curve: PassCurve,
    ) -> None:
        self.uri = uri
        self._rounds = {
            (kind, action): _ROUNDS.labels(uri, kind, action.name.lower()) for kind in ROUND_KINDS for action in Action
        }
        self._problems = {problem: _PROBLEMS.labels(uri, problem.suffix) for problem in ProblemType}
        self._escalations = {
            action: _ESCALATIONS.labels(uri, action.name.lower())
            for action in (Action.REDUCE, Action.SWITCH, Action.SELF_DECODE, Action.FAIL)
        }
        self._accepted_by_position = [_ACCEPTED_BY_POSITION.labels(uri, str(p)) for p in range(_MAX_POSITIONS)]
        self._committed = _COMMITTED.labels(uri)
        self._self_decoded = _SELF_DECODED.labels(uri)
        self._append_conflicts = _APPEND_CONFLICTS.labels(uri)
        self._fenced = _FENCED.labels(uri)
        self._drafts = _DRAFTS.labels(uri)
        self._draft_tokens = _DRAFT_TOKENS.labels(uri)
        self._accepted_tokens = _ACCEPTED_TOKENS.labels(uri)
        self._prefix_queries = _PREFIX_QUERIES.labels(uri)
        self._prefix_hits = _PREFIX_HITS.labels(uri)
        self.round_seconds = _ROUND_SECONDS.labels(uri)
        self._m_cap = _M_CAP.labels(uri)
        self._append_seconds = _APPEND_SECONDS.labels(uri)
        self._history = {ok: _HISTORY_PUBLISHED.labels(uri, "published" if ok else "failed") for ok in (True, False)}
        self._shared = {outcome: _PREFIX_SHARED.labels(uri, outcome) for outcome in ("published", "used", "refused")}
        _RUNNING.labels(uri).set_function(running)
        _WAITING.labels(uri).set_function(waiting)
        _KV_USAGE.labels(uri).set_function(kv_usage)
        _PREFIX_BYTES.labels(uri).set_function(prefix_bytes)
        start_parts(uri, VERIFIER_PARTS)
        for rows in PASS_ROWS:
            _PASS_SECONDS.labels(uri, str(rows)).set_function(functools.partial(_pass_seconds, pass_curve, rows))

    def committed_round(self, live: LiveSession, pending: PendingCommit) -> None:
        """Metrics and the session's trace entry of a committed round."""
        verdict, proposal, emitted = pending.verdict, pending.ticket.proposal, len(pending.record.emitted)
        if proposal is not None:
            kind = "proposal"
        else:
            kind = "cancel" if live.cancelling and not emitted and verdict.action == Action.FAIL else "self"
        self._rounds[(kind, verdict.action)].inc()
        self._committed.inc(emitted)
        self._m_cap.observe(verdict.m_cap)
        # An escalation is what a proposal round's outcome decides (SDCP 6.5.2), as in session stats.
        escalation = self._escalations.get(verdict.action)
        if kind == "proposal" and escalation is not None:
            escalation.inc()
        timings = live.timings
        entry: dict[str, object] = {
            "round": verdict.round,
            "kind": kind,
            "accepted": verdict.accepted,
            "emitted": emitted,
            "committed": verdict.committed,
            "action": verdict.action.name.lower(),
            "m_cap": verdict.m_cap,
            "batch": timings.batch_sizes[-1],
            "gap_us": timings.gap_us[-1],
            "model_us": timings.model_us[-1],
            "append_us": round(1e6 * live.append_s),
        }
        if proposal is None:
            if kind == "self":
                self._self_decoded.inc(emitted)
        else:
            proposed = len(proposal.tokens)
            self._drafts.inc()
            self._draft_tokens.inc(proposed)
            self._accepted_tokens.inc(verdict.accepted)
            for position in range(min(verdict.accepted, _MAX_POSITIONS)):
                self._accepted_by_position[position].inc()
            entry |= {"drafter": proposal.drafter, "proposed": proposed, **_time_split(live, timings.gap_us[-1])}
        live.trace.append(tuple(entry.get(name) for name in TRACE_FIELDS))

    def problem(self, problem: ProblemType) -> None:
        """A proposal answered with a problem."""
        self._problems[problem].inc()

    def prefix_lookups(self, queries: int, hits: int) -> None:
        """Prompt tokens looked up in the prefix cache, and those whose KV it held."""
        self._prefix_queries.inc(queries)
        self._prefix_hits.inc(hits)

    def appended(self, seconds: float) -> None:
        self._append_seconds.observe(seconds)

    def append_conflict(self) -> None:
        self._append_conflicts.inc()

    def fenced(self) -> None:
        self._fenced.inc()

    def history_published(self, *, ok: bool) -> None:
        self._history[ok].inc()

    def prefix_shared(self, outcome: str) -> None:
        """A prefix KV object ``published``, ``used`` or ``refused``."""
        self._shared[outcome].inc()


@dataclass
class RoundTrace:
    """Where one proposal round's time went, for the session's timeline (microseconds)."""

    admitted_at: float = field(default_factory=time.perf_counter)
    scored_at: float | None = None
    fetch_s: float = 0.0


@dataclass
class RoundTimings:
    """Per committed round: time since the previous commit, model time in it, its pass's batch size.

    The gap minus the model time is what a round costs besides the model: drafting, serialisation,
    HTTP, queueing in the batching window, the commit-log append (docs/performance.md). Times are
    whole microseconds, since SDCP's CBOR carries no floats.
    """

    last_commit_at: float = field(default_factory=time.perf_counter)
    model_s: float = 0.0
    batch_size: int = 0
    gap_us: list[int] = field(default_factory=list)
    model_us: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)

    def committed(self) -> None:
        now = time.perf_counter()
        self.gap_us.append(round(1e6 * (now - self.last_commit_at)))
        self.model_us.append(round(1e6 * self.model_s))
        self.batch_sizes.append(self.batch_size)
        self.last_commit_at, self.model_s, self.batch_size = now, 0.0, 0

    def to_obj(self) -> dict[str, object]:
        return {"round_gap_us": self.gap_us, "round_model_us": self.model_us, "round_batch": self.batch_sizes}


def _time_split(live: LiveSession, gap_us: int) -> dict[str, int]:
    """A proposal round's time: waiting for a pass, the pass, fetching q rows, the append, and
    the rest of the time since the previous commit (drafting, the network, serialisation)."""
    timing, live.timing = live.timing, None
    if timing is None or timing.scored_at is None:
        return {}
    model_us = live.timings.model_us[-1]
    verify_us = round(1e6 * (time.perf_counter() - timing.admitted_at))
    return {
        "queue_us": max(0, round(1e6 * (timing.scored_at - timing.admitted_at)) - model_us),
        "fetch_us": round(1e6 * timing.fetch_s),
        "verify_us": verify_us,
        "other_us": max(0, gap_us - verify_us),
    }


def session_stats(live: LiveSession) -> dict[str, object]:
    """GET sessions/{id}/stats (not in Table 1): what the session's rounds did so far."""
    machine = live.machine
    return {
        **machine.stats.to_obj(),
        **live.timings.to_obj(),
        "epoch": machine.epoch,
        "committed": machine.committed,
        "m_cap": machine.control.m_cap,
        "state": int(machine.serving_state),
        # Where the verifier's share of the first token's latency went (sdcp.latency), in µs.
        "first_token_us": {part: round(1e6 * seconds) for part, seconds in live.first_token_parts.items()},
        **({"drafter": machine.drafter} if machine.drafter is not None else {}),
    }


def session_trace(live: LiveSession, last: int = TRACE_ROUNDS) -> list[dict[str, object]]:
    """The session's ``last`` rounds, oldest first (GET sessions/{id}/trace): who drafted, M,
    accepted, the verdict, and where the time went, in microseconds."""
    rounds = live.trace
    return [
        {name: value for name, value in zip(TRACE_FIELDS, entry, strict=True) if value is not None}
        for entry in islice(rounds, max(0, len(rounds) - last), None)
    ]
