"""What the drafter measures of itself: its metrics (docs/observability.md), one ``DrafterMetrics``
per engine holding its instance's series; the time from a proposal to its verdict (t_v of SDCP 6.2);
and its acceptance by class of session, which its status reports once measured."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from sdcp.models.lookup.suffix import SharesHistory
from sdcp.protocol.drafter import PLAIN, SESSION_CLASSES, AcceptanceEstimate

__all__ = ["MEASURED_AFTER_VERDICTS", "Acceptance", "DrafterMetrics", "RoundTrip"]

# The families are the process's (prometheus_client registers each name once); each engine's
# DrafterMetrics holds the series of its instance.
_PROPOSALS = Counter("sdcp_drafter_proposals_total", "Proposals sent", ["instance"])
_TOKENS_PROPOSED = Counter("sdcp_drafter_tokens_proposed_total", "Tokens proposed", ["instance"])
_TOKENS_ACCEPTED = Counter("sdcp_drafter_tokens_accepted_total", "Proposed tokens the verifier accepted", ["instance"])
_RESYNCS = Counter("sdcp_drafter_resyncs_total", "Resynchronisations after sdcp-stale-base", ["instance"])
_PREDRAFTS = Counter("sdcp_drafter_predrafts_total", "Pre-drafted rounds by outcome", ["instance", "outcome"])
_ROUND_SECONDS = Histogram("sdcp_drafter_round_seconds", "Time from sending a proposal to its verdict", ["instance"])
# From microseconds (a pre-draft sent at once, an inline drafter) to a model drafter's pass.
_GAP_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_VERDICT_TO_PROPOSAL_SECONDS = Histogram(
    "sdcp_drafter_verdict_to_proposal_seconds",
    "Time from a verdict's arrival to the session's next proposal leaving",
    ["instance"],
    buckets=_GAP_BUCKETS,
)
_SECONDS_PER_TOKEN = Gauge(
    "sdcp_drafter_seconds_per_token", "What drafting one token costs here (measured)", ["instance"]
)
_ACCEPTANCE = Gauge("sdcp_drafter_acceptance", "Measured acceptance alpha of this drafter's proposals", ["instance"])
_HISTORY_SESSIONS = Gauge(
    "sdcp_drafter_history_sessions", "Finished sessions' outputs the shared history holds", ["instance"]
)
_HISTORY_TOKENS = Gauge("sdcp_drafter_history_tokens", "Tokens the shared history holds", ["instance"])
_HISTORY_BYTES = Gauge("sdcp_drafter_history_bytes", "Estimated memory of the shared history", ["instance"])
_HISTORY_MAX_TOKENS = Gauge("sdcp_drafter_history_max_tokens", "Tokens the shared history may hold", ["instance"])
_HISTORY_LEARNED = Counter(
    "sdcp_drafter_history_learned_total", "Finished sessions' outputs read from the MLC into the history", ["instance"]
)

# Verification time assumed before the first verdict has been timed.
_INITIAL_ROUND_TRIP_S = 0.05
_ROUND_TRIP_WEIGHT = 0.25
# Verdicts this instance takes in before its status reports an acceptance measurement; the report
# goes out at once then, which bounds how long a router explores an unmeasured drafter.
MEASURED_AFTER_VERDICTS = 4


class RoundTrip:
    """Exponentially weighted time from sending a proposal to its verdict (t_v of SDCP 6.2)."""

    def __init__(self) -> None:
        self.seconds = _INITIAL_ROUND_TRIP_S
        self.measured = False

    def record(self, seconds: float) -> None:
        self.seconds = seconds if not self.measured else self.seconds + _ROUND_TRIP_WEIGHT * (seconds - self.seconds)
        self.measured = True


class Acceptance:
    """Acceptance across the sessions this instance drafted, by session class (constrained or not,
    ``session_class``): the alphas of its status reports, which the router compares with
    self-decoding for a session of that class. ``on_measured`` is called when a class is first
    measured: a router may be exploring this drafter on it, and the measurement ends that at once."""

    def __init__(self, on_measured: Callable[[], None] | None = None) -> None:
        self.estimates = {klass: AcceptanceEstimate() for klass in SESSION_CLASSES}
        self._verdicts = dict.fromkeys(SESSION_CLASSES, 0)
        self._on_measured = on_measured

    def record(self, klass: str, accepted: int, proposed: int) -> None:
        self.estimates[klass].update(accepted, proposed)
        self._verdicts[klass] += 1
        if self._verdicts[klass] == MEASURED_AFTER_VERDICTS and self._on_measured is not None:
            self._on_measured()

    def alpha_milli(self, klass: str) -> int | None:
        """The status report's acceptance on sessions of ``klass``, once measured."""
        if self._verdicts[klass] < MEASURED_AFTER_VERDICTS:
            return None
        return round(1000 * self.estimates[klass].alpha)


class DrafterMetrics:
    """The drafter instance ``uri``'s series, started at zero; its gauges read ``seconds_per_token``,
    the plain sessions' acceptance and, for a drafter that drafts from earlier sessions, its
    shared history's size."""

    def __init__(
        self,
        uri: str,
        *,
        seconds_per_token: Callable[[], float],
        acceptance: Acceptance,
        history: SharesHistory | None,
    ) -> None:
        self.uri = uri
        self._proposals = _PROPOSALS.labels(uri)
        self._tokens_proposed = _TOKENS_PROPOSED.labels(uri)
        self._tokens_accepted = _TOKENS_ACCEPTED.labels(uri)
        self._resyncs = _RESYNCS.labels(uri)
        self._round_seconds = _ROUND_SECONDS.labels(uri)
        self._verdict_to_proposal = _VERDICT_TO_PROPOSAL_SECONDS.labels(uri)
        self._predrafts = {outcome: _PREDRAFTS.labels(uri, outcome) for outcome in ("used", "discarded")}
        _SECONDS_PER_TOKEN.labels(uri).set_function(seconds_per_token)
        _ACCEPTANCE.labels(uri).set_function(lambda: acceptance.estimates[PLAIN].alpha)
        self._history_learned = _HISTORY_LEARNED.labels(uri) if history is not None else None
        if history is not None:
            _HISTORY_SESSIONS.labels(uri).set_function(lambda: history.history_size.sessions)
            _HISTORY_TOKENS.labels(uri).set_function(lambda: history.history_size.tokens)
            _HISTORY_BYTES.labels(uri).set_function(lambda: history.history_size.approx_bytes)
            _HISTORY_MAX_TOKENS.labels(uri).set_function(lambda: history.history_size.max_tokens)

    def proposed(self, tokens: int, seconds: float) -> None:
        """A proposal of ``tokens`` tokens got its verdict ``seconds`` after it left."""
        self._round_seconds.observe(seconds)
        self._proposals.inc()
        self._tokens_proposed.inc(tokens)

    def before_proposal(self, seconds: float) -> None:
        """What a verdict left to do before the session's next proposal (docs/performance.md)."""
        self._verdict_to_proposal.observe(seconds)

    def accepted(self, tokens: int) -> None:
        self._tokens_accepted.inc(tokens)

    def resynced(self) -> None:
        self._resyncs.inc()

    def predraft(self, *, used: bool) -> None:
        self._predrafts["used" if used else "discarded"].inc()

    def history_learned(self) -> None:
        if self._history_learned is not None:
            self._history_learned.inc()
