"""What the verifier measures: what its passes cost, its metrics (docs/observability.md maps them to
vLLM's), and each session's stats and trace of committed rounds (GET sessions/{id}/stats, /trace)."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from sdcp.latency import VERIFIER_PARTS, start_parts
from sdcp.protocol.messages import Action
from sdcp.protocol.problems import ProblemType
from sdcp.protocol.verifier import PendingCommit

if TYPE_CHECKING:
    from sdcp.engines.verifier.live import LiveSession

__all__ = [
    "FIRST_CURVE_MS",
    "TRACE_FIELDS",
    "TRACE_ROUNDS",
    "PASS_ROWS",
    "PassCurve",
    "RoundTimings",
    "RoundTrace",
    "init_metrics",
    "record_round",
    "session_stats",
    "session_trace",
]

# What a pass of SmolLM2 cost on this 2-core CPU by its rows (llama.cpp, Q4_1, 2 threads; issue 38,
# docs/performance.md): the start of PassCurve, which measures the curve on this machine before the
# verifier serves and keeps it current from its passes. A second row costs about half a one-row pass.
PASS_ROWS = (1, 2, 4, 8, 16, 32)
FIRST_CURVE_MS = (9.3, 14.2, 21.0, 36.0, 67.0, 130.0)
_COST_WEIGHT = 0.2


@dataclass
class PassCurve:
    """What a pass costs here (ms) by the rows it scores, whoever's they are: measured at PASS_ROWS,
    linear between them and past the last. A pass's rows, not its sessions, set its cost on both
    backends (a packed sequence costs its rows, sdcp.models.hf.ragged; llama.cpp a row each)."""

    points_ms: list[float] = field(default_factory=lambda: list(FIRST_CURVE_MS))

    def ms(self, rows: int) -> float:
        """The cost of a pass of ``rows`` rows."""
        rows = max(1, rows)
        for index in range(1, len(PASS_ROWS)):
            if rows <= PASS_ROWS[index]:
                low, high = PASS_ROWS[index - 1], PASS_ROWS[index]
                share = (rows - low) / (high - low)
                return self.points_ms[index - 1] + share * (self.points_ms[index] - self.points_ms[index - 1])
        slope = (self.points_ms[-1] - self.points_ms[-2]) / (PASS_ROWS[-1] - PASS_ROWS[-2])
        return self.points_ms[-1] + slope * (rows - PASS_ROWS[-1])

    def measured(self, rows: int, seconds: float) -> None:
        """A probe's pass of exactly ``rows`` (one of PASS_ROWS): that point is the measurement."""
        self.points_ms[PASS_ROWS.index(rows)] = 1000 * seconds

    def record(self, seconds: float, rows: int) -> None:
        """A served pass of ``rows`` rows: the nearest measured point moves towards what it implies,
        in proportion, so that the curve keeps its shape between the points."""
        if rows < 1 or seconds <= 0:
            return
        nearest = min(range(len(PASS_ROWS)), key=lambda index: abs(math.log(rows / PASS_ROWS[index])))
        implied = 1000 * seconds * self.points_ms[nearest] / self.ms(rows)
        self.points_ms[nearest] += _COST_WEIGHT * (implied - self.points_ms[nearest])


# Metrics; every labelled series starts at zero.
ROUND_KINDS = ("proposal", "self", "cancel")
ROUNDS = Counter(
    "sdcp_verifier_rounds_total",
    "Rounds committed, by kind and by the action of the verdict",
    ["instance", "kind", "outcome"],
)
COMMITTED = Counter("sdcp_verifier_tokens_committed_total", "Tokens committed", ["instance"])
ROUND_SECONDS = Histogram("sdcp_verifier_round_seconds", "Time from admission to verdict", ["instance"])
PROBLEMS = Counter("sdcp_verifier_problems_total", "Proposals answered with a problem, by type", ["instance", "type"])
ESCALATIONS = Counter("sdcp_verifier_escalations_total", "Verdicts that escalated, by action", ["instance", "action"])
SELF_DECODED = Counter("sdcp_verifier_self_decoded_tokens_total", "Tokens the verifier decoded itself", ["instance"])
M_CAP = Histogram("sdcp_verifier_m_cap", "m_cap of each verdict", ["instance"], buckets=(1, 2, 4, 8, 16, 32, 64))
APPEND_SECONDS = Histogram("sdcp_verifier_commit_append_seconds", "Commit-log append latency", ["instance"])
APPEND_CONFLICTS = Counter(
    "sdcp_verifier_commit_conflicts_total", "Commit-log appends refused by their precondition", ["instance"]
)
FENCED = Counter("sdcp_verifier_fenced_sessions_total", "Sessions this verifier stopped serving, fenced", ["instance"])
DRAFTS = Counter("sdcp:spec_decode_num_drafts", "Proposals verified", ["instance"])
# vLLM's names: prompt tokens looked up in the prefix cache, and those whose KV it held.
PREFIX_QUERIES = Counter("sdcp:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", ["instance"])
PREFIX_HITS = Counter("sdcp:prefix_cache_hits", "Prompt tokens whose KV the prefix cache held", ["instance"])
DRAFT_TOKENS = Counter("sdcp:spec_decode_num_draft_tokens", "Tokens proposed in verified proposals", ["instance"])
ACCEPTED_TOKENS = Counter("sdcp:spec_decode_num_accepted_tokens", "Proposed tokens accepted", ["instance"])
ACCEPTED_BY_POSITION = Counter(
    "sdcp:spec_decode_num_accepted_tokens_per_pos",
    "Proposed tokens accepted, by position (0: first)",
    ["instance", "position"],
)
RUNNING = Gauge("sdcp:num_requests_running", "Sessions this verifier decodes", ["instance"])
WAITING = Gauge("sdcp:num_requests_waiting", "Rounds waiting for a scoring pass", ["instance"])
PREFIX_BYTES = Gauge("sdcp:prefix_cache_bytes", "Bytes of KV the prefix cache holds", ["instance"])
KV_USAGE = Gauge("sdcp:kv_cache_usage_perc", "Share of the KV slot pool's positions in use (1 = full)", ["instance"])
PASS_SECONDS = Gauge(
    "sdcp_verifier_pass_seconds", "What a pass of this many rows costs, measured (PassCurve)", ["instance", "rows"]
)
# The longest proposal a contract allows (SDCP 4.1 m_max): positions of ACCEPTED_BY_POSITION.
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


def init_metrics(
    uri: str,
    *,
    running: Callable[[], float],
    waiting: Callable[[], float],
    kv_usage: Callable[[], float],
    prefix_bytes: Callable[[], float],
    pass_curve: PassCurve,
) -> None:
    """Start every series of the instance ``uri`` at zero; the gauges read the given functions."""
    for kind in ROUND_KINDS:
        for action in Action:
            ROUNDS.labels(uri, kind, action.name.lower())
    for problem in ProblemType:
        PROBLEMS.labels(uri, problem.suffix)
    for action in (Action.REDUCE, Action.SWITCH, Action.SELF_DECODE, Action.FAIL):
        ESCALATIONS.labels(uri, action.name.lower())
    for position in range(_MAX_POSITIONS):
        ACCEPTED_BY_POSITION.labels(uri, str(position))
    for family in (COMMITTED, SELF_DECODED, APPEND_CONFLICTS, FENCED, DRAFTS, DRAFT_TOKENS, ACCEPTED_TOKENS):
        family.labels(uri)
    for histogram in (ROUND_SECONDS, M_CAP, APPEND_SECONDS):
        histogram.labels(uri)
    RUNNING.labels(uri).set_function(running)
    WAITING.labels(uri).set_function(waiting)
    KV_USAGE.labels(uri).set_function(kv_usage)
    PREFIX_BYTES.labels(uri).set_function(prefix_bytes)
    start_parts(uri, VERIFIER_PARTS)
    for rows in PASS_ROWS:
        PASS_SECONDS.labels(uri, str(rows)).set_function(functools.partial(_pass_seconds, pass_curve, rows))


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


def record_round(uri: str, live: LiveSession, pending: PendingCommit) -> None:
    """Metrics and the session's trace entry of a committed round."""
    verdict, proposal, emitted = pending.verdict, pending.ticket.proposal, len(pending.record.emitted)
    if proposal is not None:
        kind = "proposal"
    else:
        kind = "cancel" if live.cancelling and not emitted and verdict.action == Action.FAIL else "self"
    action = verdict.action.name.lower()
    ROUNDS.labels(uri, kind, action).inc()
    COMMITTED.labels(uri).inc(emitted)
    M_CAP.labels(uri).observe(verdict.m_cap)
    # An escalation is what a proposal round's outcome decides (SDCP 6.5.2), as in session stats.
    if kind == "proposal" and verdict.action in (Action.REDUCE, Action.SWITCH, Action.SELF_DECODE, Action.FAIL):
        ESCALATIONS.labels(uri, action).inc()
    timings = live.timings
    entry: dict[str, object] = {
        "round": verdict.round,
        "kind": kind,
        "accepted": verdict.accepted,
        "emitted": emitted,
        "committed": verdict.committed,
        "action": action,
        "m_cap": verdict.m_cap,
        "batch": timings.batch_sizes[-1],
        "gap_us": timings.gap_us[-1],
        "model_us": timings.model_us[-1],
        "append_us": round(1e6 * live.append_s),
    }
    if proposal is None:
        if kind == "self":
            SELF_DECODED.labels(uri).inc(emitted)
    else:
        proposed = len(proposal.tokens)
        DRAFTS.labels(uri).inc()
        DRAFT_TOKENS.labels(uri).inc(proposed)
        ACCEPTED_TOKENS.labels(uri).inc(verdict.accepted)
        for position in range(min(verdict.accepted, _MAX_POSITIONS)):
            ACCEPTED_BY_POSITION.labels(uri, str(position)).inc()
        entry |= {"drafter": proposal.drafter, "proposed": proposed, **_time_split(live, timings.gap_us[-1])}
    live.trace.append(tuple(entry.get(name) for name in TRACE_FIELDS))


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
