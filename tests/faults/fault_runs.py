"""The fault tests' runs of sessions on a deployment of test hosts (tests/faults/deployment.py), shared
by tests/faults/test_faults.py and tests/faults/test_routers.py: SESSIONS sessions started and under
way before a fault begins, the checks that the fault began while every one was running and that each
ended with exactly the reference output (none lost, none repeated), and the figures each test records
in `measurements.json` of its deployment's directory, from which the rows of docs/reliability.md
come."""

from __future__ import annotations

import json
from typing import Any

from tests.faults.deployment import Deployment, Run

# A bound for a hung run, not how long a run takes: on a slow or busy machine the deployment takes
# minutes to start and a run minutes to end.
HUNG_S = 600.0

SESSIONS = 4


def _record(deployment: Deployment, name: str, **figures: Any) -> None:
    path = deployment.tmp / "measurements.json"
    measured = json.loads(path.read_text()) if path.exists() else {}
    measured[name] = figures
    path.write_text(json.dumps(measured, indent=1))
    print(name, figures)


def _check_outputs(run: Run, reference: list[int]) -> dict[str, int]:
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


def _start(deployment: Deployment, max_new: int) -> Run:
    """Sessions under way: each has its first tokens and hundreds to go, so that a fault that
    begins now finds every one of them running."""
    run = deployment.run(SESSIONS, max_new)
    run.wait(lambda r: len(r.progress) == SESSIONS and min(r.progress.values()) >= 10, HUNG_S)
    return run


def _check_running(run: Run) -> None:
    """The fault began while every session was running."""
    assert not run.done, f"sessions ended before the fault: {sorted(run.done)}"
