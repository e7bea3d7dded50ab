"""Faults on real hosts (issue #18): each role in its own network namespace, links cut without a
FIN, packets lost, verifiers failed over; every session ends with exactly the greedy output.

Each test records what it measured in `measurements.json` of its deployment's directory; the rows
of docs/reliability.md come from these figures.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest
from tests.faults.deployment import TTL_MS, Deployment, Run

pytestmark = pytest.mark.timeout(300)

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
    run = Run(deployment.drive(SESSIONS, max_new))
    run.wait(lambda r: len(r.progress) == SESSIONS and min(r.progress.values()) >= 10, 120)
    return run


def test_a_drafter_host_cut_off_mid_session(deployment: Deployment, reference: dict[int, list[int]]) -> None:
    run = _start(deployment, 300)
    drafters = Counter(opened["drafter"] for opened in run.opened.values())
    victim_uri = drafters.most_common(1)[0][0]
    victim = next(host for host in ("drafter-1", "drafter-2") if deployment.uri(host) == victim_uri)
    affected = [s for s, opened in run.opened.items() if opened["drafter"] == victim_uri]
    cut_at = time.monotonic()
    deployment.net.cut(victim)
    try:
        run.wait(lambda r: len(r.done) == SESSIONS, 180)
    finally:
        deployment.net.restore(victim)
    recovery = run.longest_stall(affected, cut_at)
    figures = _check_outputs(run, reference[300])
    _record(deployment, "drafter host cut", recovery_s=round(recovery, 2), sessions=len(affected), **figures)


def test_the_verifier_host_cut_off_fails_over_and_its_return_changes_nothing(
    deployment: Deployment, reference: dict[int, list[int]]
) -> None:
    time.sleep(2 * TTL_MS / 1000)  # every instance is live again after the previous test
    run = _start(deployment, 300)
    verifier_uri = run.opened[0]["verifier"]
    victim = next(host for host in ("verifier-a", "verifier-b") if deployment.uri(host) == verifier_uri)
    affected = [s for s, opened in run.opened.items() if opened["verifier"] == verifier_uri]
    cut_at = time.monotonic()
    deployment.net.cut(victim)
    try:
        # The old verifier comes back while its sessions run elsewhere, its proposals in flight.
        run.wait(lambda r: all(r.epoch.get(s) == 2 for s in affected), 120)
        deployment.net.restore(victim)
        run.wait(lambda r: len(r.done) == SESSIONS, 180)
    finally:
        deployment.net.restore(victim)
    recovery = run.longest_stall(affected, cut_at)
    figures = _check_outputs(run, reference[300])
    for session in affected:
        assert run.done[session]["epochs"][-1] == 2, "the session did not move to a new epoch"
        # SDCP 6.8, 6.9: the fence, then the new epoch only; the old verifier committed nothing after it.
        records = deployment.commit_log(run.opened[session]["id"])
        fence = records.index({"epoch": 2})
        assert {r["epoch"] for r in records[:fence]} == {1} and {r["epoch"] for r in records[fence + 1 :]} == {2}
        assert records[-1]["committed"] == len(reference[300])
    recovery_s = round(recovery, 2)
    _record(deployment, "verifier host cut, then back", recovery_s=recovery_s, sessions=len(affected), **figures)


def test_packet_loss_on_the_drafters_link_slows_and_changes_nothing(
    deployment: Deployment, reference: dict[int, list[int]]
) -> None:
    time.sleep(2 * TTL_MS / 1000)
    for host in ("drafter-1", "drafter-2"):
        deployment.net.loss(host, 30)
    try:
        started = time.monotonic()
        run = Run(deployment.drive(SESSIONS, 40))
        run.wait(lambda r: len(r.done) == SESSIONS, 240)
        elapsed = time.monotonic() - started
    finally:
        for host in ("drafter-1", "drafter-2"):
            deployment.net.clear_loss(host)
    figures = _check_outputs(run, reference[40])
    _record(deployment, "30% loss on both drafters' links", seconds=round(elapsed, 1), **figures)


def test_a_link_cut_right_after_commits_repeats_no_round(
    deployment: Deployment, reference: dict[int, list[int]]
) -> None:
    time.sleep(2 * TTL_MS / 1000)
    run = _start(deployment, 300)
    # Verdicts in flight are lost both ways; the drafters ask again for the same rounds.
    for host in ("drafter-1", "drafter-2"):
        deployment.net.cut(host)
    time.sleep(0.5)
    for host in ("drafter-1", "drafter-2"):
        deployment.net.restore(host)
    run.wait(lambda r: len(r.done) == SESSIONS, 180)
    figures = _check_outputs(run, reference[300])
    for session in range(SESSIONS):
        # Each round once: rounds strictly increase and the last record holds every token.
        rounds = [r["round"] for r in deployment.commit_log(run.opened[session]["id"]) if "round" in r]
        assert rounds == sorted(set(rounds))
    _record(deployment, "drafter links cut for 0.5 s with verdicts in flight", **figures)
