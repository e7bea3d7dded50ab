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
from tests.faults.fault_runs import (
    SESSIONS,
    check_moved,
    check_outputs,
    check_running,
    fail_over_verifier,
    record_figures,
    start_sessions,
    wait_all_done,
)

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
    run = start_sessions(deployment, 400)
    mark = len(deployment.log(survivor))
    killed_at = time.monotonic()
    deployment.kill(victim)
    try:
        check_running(run)
        # The verifier of a session the victim opened (session i prefers router i modulo two).
        affected, _ = fail_over_verifier(deployment, run, deployment.routers.index(victim))
        wait_all_done(run)
    finally:
        deployment.restart(victim)
        deployment.wait_registered(INSTANCES)
    figures = check_outputs(run, reference[400])
    check_moved(run, affected)
    # The survivor took over sessions the victim had opened.
    assert "loaded from the shared tier" in deployment.log(survivor)[mark:]
    stall = run.longest_stall(list(range(SESSIONS)), killed_at)
    name = f"two routers, {victim} killed -9, then the verifier cut"
    record_figures(deployment, name, recovery_s=round(stall, 2), sessions=len(affected), **figures)
