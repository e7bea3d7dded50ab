"""Each role's metrics as one observer object per engine (docs/observability.md): its instance's
series start at zero when the engine is made, and two engines in one process (`sdcp together`)
count apart."""

from __future__ import annotations

from prometheus_client import REGISTRY

from sdcp.engines.drafter.observe import Acceptance, DrafterMetrics
from sdcp.engines.router.observe import RouterMetrics
from sdcp.engines.verifier.observe import VerifierMetrics
from sdcp.protocol.messages import Action
from sdcp.protocol.passcost import PassCurve
from sdcp.protocol.problems import ProblemType


def sample(name: str, instance: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"instance": instance, **labels})


def test_two_routers_in_one_process_count_apart() -> None:
    first, second = RouterMetrics("https://router-a.observers.test"), RouterMetrics("https://router-b.observers.test")
    for kind in ("drafter", "explore", "self"):
        assert sample("sdcp_router_decoding_choices_total", first.uri, choice=kind) == 0
    assert sample("sdcp_router_events_total", first.uri, kind="switch") == 0
    first.chose("explore")
    first.event(Action.SWITCH)
    first.opened()
    first.opened(loaded=True)
    first.let_go()
    assert sample("sdcp_router_decoding_choices_total", first.uri, choice="explore") == 1
    assert sample("sdcp_router_decoding_choices_total", second.uri, choice="explore") == 0
    assert sample("sdcp_router_events_total", first.uri, kind="switch") == 1
    assert sample("sdcp_router_sessions_open", first.uri) == 1
    assert sample("sdcp_router_sessions_loaded_total", first.uri) == 1
    assert sample("sdcp_router_sessions_let_go_total", first.uri) == 1
    assert sample("sdcp_router_sessions_open", second.uri) == 0


def test_two_verifiers_in_one_process_count_apart() -> None:
    def made(uri: str) -> VerifierMetrics:
        return VerifierMetrics(
            uri,
            running=lambda: 3.0,
            waiting=lambda: 1.0,
            kv_usage=lambda: 0.5,
            prefix_bytes=lambda: 0.0,
            pass_curve=PassCurve(),
        )

    first, second = made("https://verifier-a.observers.test"), made("https://verifier-b.observers.test")
    assert sample("sdcp_verifier_rounds_total", first.uri, kind="proposal", outcome="continue") == 0
    assert sample("sdcp:num_requests_running", first.uri) == 3.0
    first.problem(ProblemType.STALE_BASE)
    first.fenced()
    first.prefix_shared("used")
    first.history_published(ok=False)
    assert sample("sdcp_verifier_problems_total", first.uri, type=ProblemType.STALE_BASE.suffix) == 1
    assert sample("sdcp_verifier_problems_total", second.uri, type=ProblemType.STALE_BASE.suffix) == 0
    assert sample("sdcp_verifier_fenced_sessions_total", first.uri) == 1
    assert sample("sdcp:prefix_cache_shared_objects_total", first.uri, outcome="used") == 1
    assert sample("sdcp_verifier_history_published_total", first.uri, outcome="failed") == 1
    assert sample("sdcp_verifier_history_published_total", second.uri, outcome="failed") == 0


def test_two_drafters_in_one_process_count_apart() -> None:
    first = DrafterMetrics(
        "https://drafter-a.observers.test", seconds_per_token=lambda: 0.01, acceptance=Acceptance(), history=None
    )
    second = DrafterMetrics(
        "https://drafter-b.observers.test", seconds_per_token=lambda: 0.02, acceptance=Acceptance(), history=None
    )
    assert sample("sdcp_drafter_predrafts_total", first.uri, outcome="used") == 0
    first.proposed(4, 0.01)
    first.predraft(used=True)
    assert sample("sdcp_drafter_tokens_proposed_total", first.uri) == 4
    assert sample("sdcp_drafter_tokens_proposed_total", second.uri) == 0
    assert sample("sdcp_drafter_predrafts_total", first.uri, outcome="used") == 1
    assert sample("sdcp_drafter_seconds_per_token", second.uri) == 0.02
