"""The first token's latency budget (issue 38 item 1): where the time from a request to its first
token goes, one histogram whose parts the roles that spend them observe (docs/observability.md).

Parts, in the order a request meets them: ``parse`` (the gateway reads the request, renders the chat
template and tokenizes), ``open`` (the gateway's session open, the router's and the verifier's work
in it included), ``route`` (the router's own share of ``open``: choosing the verifier, reading the
log, assigning), ``prefill_wait`` (the verifier's queue of prefills before this one's turn),
``prefill`` (computing the prompt's KV, or taking it from the prefix cache), ``first_round`` (from
the open's answer to the first committed token: the first pass, its decision and its record) and
``first_read`` (the gateway, from the open's answer to the first token in hand). A part a request
does not pass through (a resume's KV, no gateway) is not observed.
"""

from __future__ import annotations

from prometheus_client import Histogram

__all__ = [
    "FIRST_TOKEN_PARTS",
    "GATEWAY_PARTS",
    "PARTS",
    "ROUTER_PARTS",
    "VERIFIER_PARTS",
    "observe_part",
    "start_parts",
]

GATEWAY_PARTS = ("parse", "open", "first_read")
ROUTER_PARTS = ("route",)
VERIFIER_PARTS = ("prefill_wait", "prefill", "first_round")
PARTS = ("parse", "open", "route", "prefill_wait", "prefill", "first_round", "first_read")
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FIRST_TOKEN_PARTS = Histogram(
    "sdcp_first_token_part_seconds",
    "Where the time to a request's first token goes, by part (sdcp.latency)",
    ["instance", "part"],
    buckets=_BUCKETS,
)


def observe_part(instance: str, part: str, seconds: float) -> None:
    FIRST_TOKEN_PARTS.labels(instance, part).observe(seconds)


def start_parts(instance: str, parts: tuple[str, ...]) -> None:
    """The parts an instance observes, at zero before its first request (as every series here)."""
    for part in parts:
        FIRST_TOKEN_PARTS.labels(instance, part)
