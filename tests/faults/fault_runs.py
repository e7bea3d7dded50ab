"""The fault tests' runs of sessions on a deployment of test hosts (tests/faults/deployment.py), shared
by tests/faults/test_faults.py and tests/faults/test_routers.py: SESSIONS sessions started and under
way before a fault begins, the checks that the fault began while every one was running and that each
ended with exactly the reference output (none lost, none repeated), and the figures each test records
in `measurements.json` of its deployment's directory, from which the rows of docs/reliability.md
come."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from tests.faults.deployment import Deployment, Run

# A bound for a hung run, not how long a run takes: on a slow or busy machine the deployment takes
# minutes to start and a run minutes to end.
HUNG_S = 600.0

SESSIONS = 4


def record_figures(deployment: Deployment, name: str, **figures: Any) -> None:
    path = deployment.tmp / "measurements.json"
    measured = json.loads(path.read_text()) if path.exists() else {}
    measured[name] = figures
    path.write_text(json.dumps(measured, indent=1))
    print(name, figures)


def check_outputs(run: Run, reference: list[int]) -> dict[str, int]:
    """Every session complete, token for token the reference: none lost, none repeated."""
    lost = repeated = 0
    for session in range(SESSIONS):
        done = run.done[session]
        assert done["error"] is None, done["error"]
        tokens = done["tokens"]
        assert tokens == reference, f"session {session}: {len(tokens)} tokens, first difference at " + str(
            next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
        )
        assert done["finish"] == 4
        lost += max(0, len(reference) - len(tokens))
        repeated += max(0, len(tokens) - len(reference))
        epochs = done["epochs"]
        assert epochs == sorted(epochs), "output of a lower epoch after a higher one"
    return {"lost": lost, "repeated": repeated}


def start_sessions(deployment: Deployment, max_new: int) -> Run:
    """Sessions under way: each has its first tokens and hundreds to go, so that a fault that
    begins now finds every one of them running."""
    run = deployment.run(SESSIONS, max_new)
    run.wait(lambda r: len(r.progress) == SESSIONS and min(r.progress.values()) >= 10, HUNG_S)
    return run


def check_running(run: Run) -> None:
    """The fault began while every session was running."""
    assert not run.done, f"sessions ended before the fault: {sorted(run.done)}"


def wait_all_done(run: Run) -> None:
    run.wait(lambda r: len(r.done) == SESSIONS, HUNG_S)


def fail_over_verifier(
    deployment: Deployment, run: Run, session: int = 0, *, while_cut: Callable[[str], None] | None = None
) -> tuple[list[int], float]:
    """The failover of a verifier, as each test that needs one does it: the host of ``session``'s
    verifier is cut off (while every session still runs) until each session it served runs at a
    later epoch elsewhere, then its link is back; ``while_cut`` (given the cut host) runs once the
    cut has begun. The sessions it served, and when the cut began."""
    uri = run.opened[session]["verifier"]
    host = deployment.host_of(uri)
    affected = [s for s, opened in run.opened.items() if opened["verifier"] == uri]
    cut_at = time.monotonic()
    deployment.net.cut(host)
    try:
        check_running(run)
        if while_cut is not None:
            while_cut(host)
        run.wait(lambda r: all(r.epoch.get(s, 1) >= 2 for s in affected), HUNG_S)
    finally:
        deployment.net.restore(host)
    return affected, cut_at


def check_moved(run: Run, affected: list[int], epoch: int = 2) -> None:
    for session in affected:
        assert run.done[session]["epochs"][-1] == epoch, "the session did not move to a new epoch"
