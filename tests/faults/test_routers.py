"""Two routers at once (#29): the instances report to both and the client knows both; each session
lane prefers one of them, so that each router holds sessions. One router is killed -9 mid-run and
stays down; then the verifier of the sessions is cut off, so that every session needs a router:
the surviving one loads the dead router's sessions from the shared tier (when their front end or
their verifier falls back to it) and fails them over. Every session ends with the greedy output."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from tests.faults.deployment import INSTANCES, Deployment, deployed
from tests.faults.fault_runs import HUNG_S, SESSIONS, _check_outputs, _check_running, _record, _start

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with deployed(tmp_path_factory.mktemp("faults-routers"), routers=("router", "router-b")) as deployment:
        yield deployment


@pytest.mark.parametrize("victim", ["router", "router-b"])
def test_either_of_two_routers_killed_mid_run(
    deployment: Deployment, reference: dict[int, list[int]], victim: str
) -> None:
    survivor = next(router for router in deployment.routers if router != victim)
    run = _start(deployment, 400)
    mark = len(deployment.log(survivor))
    killed_at = time.monotonic()
    deployment.kill(victim)
    try:
        _check_running(run)
        # The verifier of a session the victim opened (session i prefers router i modulo two).
        verifier_uri = run.opened[deployment.routers.index(victim)]["verifier"]
        cut = next(host for host in ("verifier-a", "verifier-b") if deployment.uri(host) == verifier_uri)
        affected = [s for s, opened in run.opened.items() if opened["verifier"] == verifier_uri]
        deployment.net.cut(cut)
        try:
            run.wait(lambda r: all(r.epoch.get(s) == 2 for s in affected), HUNG_S)
        finally:
            deployment.net.restore(cut)
        run.wait(lambda r: len(r.done) == SESSIONS, HUNG_S)
    finally:
        deployment.restart(victim)
        deployment.wait_registered(INSTANCES)
    figures = _check_outputs(run, reference[400])
    for session in affected:
        assert run.done[session]["epochs"][-1] == 2, "the session did not move to a new epoch"
    # The survivor took over sessions the victim had opened.
    assert "loaded from the shared tier" in deployment.log(survivor)[mark:]
    stall = run.longest_stall(list(range(SESSIONS)), killed_at)
    name = f"two routers, {victim} killed -9, then the verifier cut"
    _record(deployment, name, recovery_s=round(stall, 2), sessions=len(affected), **figures)
