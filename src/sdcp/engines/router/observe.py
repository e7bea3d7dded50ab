"""What the router shows of itself: its metrics (docs/observability.md), one ``RouterMetrics`` per
engine holding its instance's series, and the views of the live instances that its admin API and
dashboard serve (targets, target digest splits, expected rates)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge

from sdcp.latency import ROUTER_PARTS, observe_part, start_parts
from sdcp.protocol.drafter import CONSTRAINED, PLAIN
from sdcp.protocol.messages import Action
from sdcp.protocol.passcost import self_decoded_rate
from sdcp.protocol.router import InstanceView, drafter_costs, drafter_rate, verifier_passes, verify_seconds

__all__ = [
    "CONSTRAINED_BY",
    "SELF_DECODING_AT",
    "RouterMetrics",
    "expected_rates",
    "target_splits",
    "targets",
]

# The option of self-decoding at a verifier, in ``expected_rates`` (the dashboard's key).
SELF_DECODING_AT = "self-decoding at "
# A drafter's option for a constrained session, measured apart (``session_class``).
CONSTRAINED_BY = "constrained sessions by "

# The families are the process's (prometheus_client registers each name once); each engine's
# RouterMetrics holds the series of its instance.
_SESSIONS_OPEN = Gauge("sdcp_router_sessions_open", "Sessions neither finished nor failed", ["instance"])
_ASSIGNMENTS = Counter("sdcp_router_assignments_total", "Assignments sent, by drafter", ["instance", "drafter"])
_SWITCHES = Counter(
    "sdcp_router_switches_total",
    "Sessions moved off a drafter (a switch event, or a faster option), by the drafter left",
    ["instance", "drafter"],
)
_EVENTS = Counter("sdcp_router_events_total", "Events from verifiers, by kind", ["instance", "kind"])
_EXPECTED_RATE = Gauge(
    "sdcp_router_expected_tokens_per_second",
    "The cost model's expected tokens per second of a session, by option (a drafter, or self-decoding at a verifier);"
    " per second of the verifier's time where it reports its pass costs",
    ["instance", "option"],
)
_FAILOVERS = Counter("sdcp_router_failovers_total", "Sessions moved to another verifier", ["instance"])
_REOPENED = Counter(
    "sdcp_router_sessions_reopened_total",
    "Sessions opened again above a record another party appended to their log, which stopped their verifier",
    ["instance"],
)
_UNTRUSTED_RECORDS = Counter(
    "sdcp_router_untrusted_records_total",
    "Commit records a replay left out: not signed by their epoch's verifier",
    ["instance"],
)
_TAKEN_OVER = Counter(
    "sdcp_router_sessions_loaded_total",
    "Sessions loaded from the shared tier on first contact (after a restart, or another router's)",
    ["instance"],
)
_TARGET_DIGESTS = Gauge(
    "sdcp_router_verifier_target_digests",
    "Distinct target digests among the live verifiers of one model: above 1, those verifiers cannot take "
    "over each other's sessions (pin their backend, docs/deploy.md)",
    ["instance", "model"],
)
_LET_GO = Counter(
    "sdcp_router_sessions_let_go_total", "Sessions another router changed since this one held them", ["instance"]
)
_CHOICES = Counter(
    "sdcp_router_decoding_choices_total",
    "Decisions on who drafts for a session: a drafter, an exploration of an unmeasured drafter, or the verifier alone",
    ["instance", "choice"],
)
_CHOICE_KINDS = ("drafter", "explore", "self")


class RouterMetrics:
    """The router instance ``uri``'s series, each started at zero when the engine starts."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._sessions_open = _SESSIONS_OPEN.labels(uri)
        self._failovers = _FAILOVERS.labels(uri)
        self._reopened = _REOPENED.labels(uri)
        self._untrusted = _UNTRUSTED_RECORDS.labels(uri)
        self._loaded = _TAKEN_OVER.labels(uri)
        self._let_go = _LET_GO.labels(uri)
        self._events = {kind: _EVENTS.labels(uri, kind.name.lower()) for kind in Action}
        self._choices = {kind: _CHOICES.labels(uri, kind) for kind in _CHOICE_KINDS}

    def start(self) -> None:
        start_parts(self.uri, ROUTER_PARTS)

    def routed(self, seconds: float) -> None:
        """The router's own part of a session-open's latency (its verifiers' excluded)."""
        observe_part(self.uri, "route", seconds)

    def drafter_reported(self, drafter: str) -> None:
        # A drafter's series start at zero when it first reports.
        _ASSIGNMENTS.labels(self.uri, drafter)
        _SWITCHES.labels(self.uri, drafter)

    def expected_rates(self, rates: dict[str, float]) -> None:
        for option, rate in rates.items():
            _EXPECTED_RATE.labels(self.uri, option).set(rate)

    def target_digests(self, model_name: str, count: int) -> None:
        _TARGET_DIGESTS.labels(self.uri, model_name).set(count)

    def opened(self, *, loaded: bool = False) -> None:
        """A session held from now on: opened here, or ``loaded`` from the shared tier."""
        self._sessions_open.inc()
        if loaded:
            self._loaded.inc()

    def ended(self) -> None:
        self._sessions_open.dec()

    def let_go(self) -> None:
        """Another router holds a session (one that had not ended here) now."""
        self._sessions_open.dec()
        self._let_go.inc()

    def event(self, kind: Action) -> None:
        self._events[kind].inc()

    def switched(self, drafter: str) -> None:
        _SWITCHES.labels(self.uri, drafter).inc()

    def chose(self, kind: str) -> None:
        """A decision on who drafts: ``drafter``, ``explore`` or ``self``."""
        self._choices[kind].inc()

    def assigned(self, drafter: str) -> None:
        _ASSIGNMENTS.labels(self.uri, drafter).inc()

    def moved(self, *, elsewhere: bool) -> None:
        """A failover: to another verifier (``elsewhere``), or at the same one above a foreign record."""
        (self._failovers if elsewhere else self._reopened).inc()

    def untrusted_record(self) -> None:
        self._untrusted.inc()


def targets(verifiers: Sequence[InstanceView]) -> list[dict[str, object]]:
    """The live verifiers and the digests a contract must name to use them."""
    found = []
    for view in verifiers:
        if view.status.model is None:
            continue
        target: dict[str, object] = {"instance": view.uri, "model": view.status.model}
        if view.status.tokenizer is not None:
            target["tokenizer"] = view.status.tokenizer
        if view.status.context is not None:
            target["context"] = view.status.context
        if view.status.model_name is not None:
            target["model_name"] = view.status.model_name
        if view.status.backend is not None:
            target["backend"] = view.status.backend
        found.append(target)
    return sorted(found, key=lambda t: str(t["instance"]))


def target_splits(verifiers: Sequence[InstanceView]) -> dict[str, dict[str, list[str]]]:
    """The models whose live verifiers advertise more than one target digest: by model name, the
    verifiers of each digest (hex) with their backend. A session opened at one of them cannot fail
    over to a verifier of another digest (SDCP 6.1: the contract names the digest)."""
    groups: dict[str, dict[str, list[str]]] = {}
    for view in verifiers:
        status = view.status
        if status.model_name is None or status.model is None:
            continue
        described = f"{view.uri} ({status.backend or 'backend unknown'})"
        groups.setdefault(status.model_name, {}).setdefault(status.model.hex(), []).append(described)
    return {name: digests for name, digests in groups.items() if len(digests) > 1}


def expected_rates(
    drafters: Sequence[InstanceView], verifiers: Sequence[InstanceView], *, m_init: int
) -> dict[str, float]:
    """The cost model's expected tokens per second of a session (SDCP 6.2), by live option: a
    drafter's URI, the same for a constrained session (``CONSTRAINED_BY``), or self-decoding at a
    verifier; per second of the verifier's time where it reports its pass costs (the router's
    choice, sdcp.protocol.router.drafter_rate)."""
    verify_s = verify_seconds(verifiers[0] if verifiers else None)
    passes = verifier_passes(verifiers[0] if verifiers else None)
    m_limit = max(1, m_init)
    rates = {}
    for view in drafters:
        for klass, prefix in ((PLAIN, ""), (CONSTRAINED, CONSTRAINED_BY)):
            costs = drafter_costs(view, klass)
            if costs.alpha is not None:
                rates[f"{prefix}{view.uri}"] = drafter_rate(costs, verify_s=verify_s, m_limit=m_limit, passes=passes)
    for view in verifiers:
        reported = verifier_passes(view)
        if reported is not None:
            rates[f"{SELF_DECODING_AT}{view.uri}"] = self_decoded_rate(reported.sessions, reported.curve)
        elif view.status.self_us:
            rates[f"{SELF_DECODING_AT}{view.uri}"] = 1e6 / view.status.self_us
    return rates
