"""Faults on real hosts (issue #18): each role in its own network namespace, links cut without a
FIN, packets lost, verifiers failed over; every session ends with exactly the greedy output.

Each test records what it measured in `measurements.json` of its deployment's directory; the rows
of docs/reliability.md come from these figures.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from tests.faults.deployment import ADMIN_PORT, INSTANCES, REPO, Deployment, Run
from tests.faults.fault_runs import (
    HUNG_S,
    SESSIONS,
    check_moved,
    check_outputs,
    check_running,
    fail_over_verifier,
    record_figures,
    start_sessions,
    wait_all_done,
)

from sdcp.cache.redis_acl import ADMIN

# Bounds for a hung run, not how long a run takes: on a slow or busy machine the deployment takes
# minutes to start and a run minutes to end.
pytestmark = pytest.mark.timeout(1800)

VERIFIERS = ("verifier-a", "verifier-b")


def test_a_drafter_host_cut_off_mid_session(deployment: Deployment, reference: dict[int, list[int]]) -> None:
    run = start_sessions(deployment, 300)
    drafters = Counter(opened["drafter"] for opened in run.opened.values())
    victim_uri = drafters.most_common(1)[0][0]
    victim = deployment.host_of(victim_uri)
    affected = [s for s, opened in run.opened.items() if opened["drafter"] == victim_uri]
    cut_at = time.monotonic()
    deployment.net.cut(victim)
    try:
        check_running(run)
        wait_all_done(run)
    finally:
        deployment.net.restore(victim)
    recovery = run.longest_stall(affected, cut_at)
    figures = check_outputs(run, reference[300])
    record_figures(deployment, "drafter host cut", recovery_s=round(recovery, 2), sessions=len(affected), **figures)


def test_the_verifier_host_cut_off_fails_over_and_its_return_changes_nothing(
    deployment: Deployment, reference: dict[int, list[int]]
) -> None:
    run = start_sessions(deployment, 300)
    # The old verifier comes back while its sessions run elsewhere, its proposals in flight.
    affected, cut_at = fail_over_verifier(deployment, run)
    wait_all_done(run)
    recovery = run.longest_stall(affected, cut_at)
    figures = check_outputs(run, reference[300])
    check_moved(run, affected)
    for session in affected:
        # SDCP 6.8, 6.9: the fence, then the new epoch only; the old verifier committed nothing after it.
        records = deployment.commit_log(run.opened[session]["id"])
        fence = records.index({"epoch": 2})
        assert {r["epoch"] for r in records[:fence]} == {1} and {r["epoch"] for r in records[fence + 1 :]} == {2}
        assert records[-1]["committed"] == len(reference[300])
    recovery_s = round(recovery, 2)
    record_figures(deployment, "verifier host cut, then back", recovery_s=recovery_s, sessions=len(affected), **figures)


def test_loss_and_delay_on_the_drafters_links_slow_and_change_nothing(
    deployment: Deployment, reference: dict[int, list[int]]
) -> None:
    deployment.wait_registered(INSTANCES)
    drafters = ("drafter-1", "drafter-2")
    relays = [deployment.net.delay(host, 50) for host in drafters]
    for host in drafters:
        deployment.net.loss(host, 30)
    try:
        started = time.monotonic()
        run = deployment.run(SESSIONS, 40)
        wait_all_done(run)
        elapsed = time.monotonic() - started
    finally:
        for host, relay in zip(drafters, relays, strict=True):
            deployment.net.clear_loss(host)
            deployment.net.clear_delay(host, relay)
    figures = check_outputs(run, reference[40])
    record_figures(deployment, "30% loss and 50 ms delay on both drafters' links", seconds=round(elapsed, 1), **figures)


def test_a_link_cut_right_after_commits_repeats_no_round(
    deployment: Deployment, reference: dict[int, list[int]]
) -> None:
    run = start_sessions(deployment, 300)
    # Verdicts in flight are lost both ways; the drafters ask again for the same rounds.
    for host in ("drafter-1", "drafter-2"):
        deployment.net.cut(host)
    try:
        check_running(run)
        time.sleep(0.5)  # the outage
    finally:
        for host in ("drafter-1", "drafter-2"):
            deployment.net.restore(host)
    wait_all_done(run)
    figures = check_outputs(run, reference[300])
    for session in range(SESSIONS):
        # Each round once: rounds strictly increase and the last record holds every token.
        rounds = [r["round"] for r in deployment.commit_log(run.opened[session]["id"]) if "round" in r]
        assert rounds == sorted(set(rounds))
    record_figures(deployment, "drafter links cut for 0.5 s with verdicts in flight", **figures)


@pytest.mark.parametrize(
    ("host", "name"), [("redis", "Redis killed and restarted (AOF)"), ("router", "router killed -9 and restarted")]
)
def test_a_killed_and_restarted_process_loses_nothing(
    deployment: Deployment, reference: dict[int, list[int]], host: str, name: str
) -> None:
    """Redis restarts from its append-only file; the router restarts knowing no session, which the
    sessions in flight do not need until a failover (docs/reliability.md)."""
    run = start_sessions(deployment, 300)
    killed_at = time.monotonic()
    deployment.kill(host)
    check_running(run)
    time.sleep(1.0)  # the outage
    deployment.restart(host)
    wait_all_done(run)
    figures = check_outputs(run, reference[300])
    stall = run.longest_stall(list(range(SESSIONS)), killed_at)
    record_figures(deployment, name, recovery_s=round(stall, 2), **figures)


def test_a_restarted_router_fails_over_the_sessions_it_opened_before(
    deployment: Deployment, reference: dict[int, list[int]]
) -> None:
    """The router is killed -9; while it is down the verifier of the sessions is cut off, so that
    they are still running whenever the router comes back; the router restarts knowing no session
    in memory, loads each one from the shared tier when its front end asks where it went, fences
    it and resumes it at the other verifier (#29)."""
    run = start_sessions(deployment, 400)
    deployment.kill("router")
    check_running(run)

    def restart_router(cut_host: str) -> None:
        time.sleep(1.0)  # the outage
        deployment.restart("router")
        deployment.wait_registered(tuple(host for host in INSTANCES if host != cut_host))

    affected, cut_at = fail_over_verifier(deployment, run, while_cut=restart_router)
    wait_all_done(run)
    figures = check_outputs(run, reference[400])
    check_moved(run, affected)
    recovery = run.longest_stall(affected, cut_at)
    record_figures(
        deployment,
        "router killed -9, the verifier cut while it is down, then the router restarted",
        recovery_s=round(recovery, 2),
        sessions=len(affected),
        **figures,
    )


def test_redis_unreachable_for_ten_seconds(deployment: Deployment, reference: dict[int, list[int]]) -> None:
    run = start_sessions(deployment, 300)
    cut_at = time.monotonic()
    deployment.net.cut("redis")
    try:
        check_running(run)
        time.sleep(10.0)  # the outage
    finally:
        deployment.net.restore("redis")
    wait_all_done(run)
    figures = check_outputs(run, reference[300])
    stall = run.longest_stall(list(range(SESSIONS)), cut_at)
    record_figures(deployment, "Redis unreachable for 10 s", recovery_s=round(stall, 2), **figures)


def _has_received(tokens: int) -> Callable[[Run], bool]:
    return lambda run: run.tokens_received() >= tokens


def test_kill_9_of_every_role_at_seeded_random_points(deployment: Deployment, reference: dict[int, list[int]]) -> None:
    """Each role killed -9 once, in a seeded order, each at a seeded point of the sessions'
    progress: once they have received a seeded number of tokens since the previous victim was
    back. The run replaces every session that ends until the last victim is back, so that every
    kill finds sessions running however fast the machine is."""
    rng = random.Random(18)
    sessions, max_new = 16, 100
    victims = ["router", "verifier-a", "verifier-b", "drafter-1", "drafter-2", "redis"]
    rng.shuffle(victims)
    tokens_before_kill = {victim: rng.randint(100, 1000) for victim in victims}
    run = deployment.run(sessions, max_new, until_stopped=True)
    killed = []
    try:
        run.wait(lambda r: len(r.progress) >= sessions, HUNG_S)
        for victim in victims:
            run.wait(_has_received(run.tokens_received() + tokens_before_kill[victim]), HUNG_S)
            deployment.kill(victim)
            killed.append(f"{victim} at {run.tokens_received()} tokens")
            if victim in INSTANCES:
                # Restarted as by a supervisor slower than the status TTL: once the router has
                # dropped it, so that its sessions move on rather than wait for a process that
                # never had them.
                deployment.wait_registered(tuple(host for host in INSTANCES if host != victim))
            deployment.restart(victim)
            deployment.wait_registered(INSTANCES)
    finally:
        run.stop_opening()
    run.wait(lambda r: r.finished, HUNG_S)
    completed = failed = 0
    for session, done in sorted(run.done.items()):
        tokens = done["tokens"]
        # Never a wrong or repeated token: what arrived is the reference's beginning, in order.
        assert tokens == reference[max_new][: len(tokens)], f"session {session} diverged: {done}"
        assert done["epochs"] == sorted(done["epochs"])
        if done["error"] is None:
            assert tokens == reference[max_new] and done["finish"] == 4
            completed += 1
        else:
            failed += 1
    assert set(run.opened) <= set(run.done), "a session opened and never ended"
    name = "kill -9 of each role, seeded order"
    record_figures(deployment, name, sessions=len(run.done), completed=completed, failed_clearly=failed, kills=killed)


def _check_fenced_after(records: list[dict[str, Any]], at: int, length: int) -> None:
    """After the record at ``at`` (one that must not count), the router's fence comes first, at a
    higher epoch, and every later commit record is the one of its epoch's named verifier, up to
    the whole reference (SDCP 6.8, 6.9; signed records)."""
    fence = records[at + 1]
    assert fence.keys() == {"epoch", "verifier"} and fence["epoch"] > records[at]["epoch"], fence
    named = fence
    for record in records[at + 2 :]:
        if record.keys() == {"epoch", "verifier"}:
            assert record["epoch"] > named["epoch"], record
            named = record
        else:
            assert record["epoch"] == named["epoch"] and record["writer"] == named["verifier"], record
    assert records[-1]["committed"] == length


def _forge(deployment: Deployment, host: str, action: str, role: str, session: str, **options: Any) -> Any:
    """tests/faults/forge.py run on `host` with `role`'s Redis user: what it wrote or was refused."""
    user, password_file = deployment.redis_user(role)
    command = [sys.executable, "-m", "tests.faults.forge", action, "--redis", deployment.redis_url]
    command += ["--user", user, "--password-file", str(password_file), "--session", session]
    for name, value in options.items():
        command += [f"--{name.replace('_', '-')}", json.dumps(value) if isinstance(value, list) else str(value)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        deployment.net.exec_prefix(host) + command, capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _untrusted_records(deployment: Deployment) -> float:
    """The router's count of commit records a replay left out (its admin /metrics, on its host)."""
    url = f"http://127.0.0.1:{ADMIN_PORT}/metrics"
    script = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=30).read().decode())"
    command = deployment.net.exec_prefix("router") + [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    name = "sdcp_router_untrusted_records_total"
    return sum(
        float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith((name + "{", name + " "))
    )


def _other_verifier(deployment: Deployment, uri: str) -> tuple[str, str]:
    """The verifier host whose URI is `uri`, and the other one."""
    first = deployment.host_of(uri)
    return first, next(host for host in VERIFIERS if host != first)


def test_a_record_forged_into_redis_is_refused_by_acl_and_without_acls_never_replayed(
    deployment: Deployment, reference: dict[int, list[int]]
) -> None:
    """Issue #29: from a drafter host, the drafter's Redis user may neither append a commit record
    nor fence (NOPERM from Redis itself). With the admin's credentials instead (as with ACLs off),
    the attacker appends a record in the verifier's name to a live session's log, signed with the
    drafter's own key; the verifier is cut off; the failover replays only the verifier's signed
    records: 0 forged tokens reach the client."""
    run = start_sessions(deployment, 400)
    verifier_uri = run.opened[0]["verifier"]
    target = run.opened[0]["id"]
    refusals = _forge(deployment, "drafter-1", "try", "drafter", target, writer=verifier_uri)
    assert all(refusals.values()), f"the drafter's user wrote to the commit log: {refusals}"
    assert all("noperm" in why.lower() or "no permissions" in why.lower() for why in refusals.values()), refusals
    untrusted_before = _untrusted_records(deployment)
    cert, key = deployment.cert("drafter-1")
    forged = _forge(
        deployment,
        "drafter-1",
        "append",
        ADMIN,
        target,
        writer=verifier_uri,
        reference=reference[400],
        cert=cert,
        key=key,
    )
    affected, cut_at = fail_over_verifier(deployment, run)
    wait_all_done(run)
    recovery = run.longest_stall(affected, cut_at)
    figures = check_outputs(run, reference[400])
    n = forged["committed"] - len(forged["emitted"])
    assert run.done[0]["tokens"][n : forged["committed"]] != forged["emitted"]
    untrusted = _untrusted_records(deployment) - untrusted_before
    assert untrusted >= 1, "the router's replay did not count the forged record"
    # The forged record is in the log (the admin may write anything), right after a record of the
    # verifier's; the new epoch follows it.
    records = deployment.commit_log(target, ("epoch", "round", "committed", "writer", "verifier"))
    at = records.index({**{k: forged[k] for k in ("epoch", "round", "committed")}, "writer": verifier_uri})
    _check_fenced_after(records, at, len(reference[400]))
    record_figures(
        deployment,
        "record forged into Redis: drafter's user refused, admin's not replayed",
        refused_writes=len(refusals),
        forged_tokens=0,
        untrusted_records=int(untrusted),
        recovery_s=round(recovery, 2),
        sessions=len(affected),
        **figures,
    )


def test_a_second_verifier_appending_at_the_next_epoch_is_not_replayed(
    deployment: Deployment, reference: dict[int, list[int]]
) -> None:
    """Issue #29: the second verifier, with its own Redis user and its own key, appends a validly
    signed record at epoch + 1 to a session of the first, whose log no fence names it in. The first
    verifier is cut off; the failover fences above that epoch, naming the second verifier, and
    replays none of the intruding record: the output is the reference."""
    run = start_sessions(deployment, 400)
    _, second = _other_verifier(deployment, run.opened[0]["verifier"])
    target = run.opened[0]["id"]
    untrusted_before = _untrusted_records(deployment)
    cert, key = deployment.cert(second)
    options = {
        "writer": deployment.uri(second),
        "reference": reference[400],
        "epoch_ahead": 1,
        "cert": cert,
        "key": key,
    }
    forged = _forge(deployment, second, "append", "verifier", target, **options)
    assert forged["epoch"] == 2
    affected, cut_at = fail_over_verifier(deployment, run)
    wait_all_done(run)
    recovery = run.longest_stall(affected, cut_at)
    figures = check_outputs(run, reference[400])
    untrusted = _untrusted_records(deployment) - untrusted_before
    assert untrusted >= 1, "the router's replay did not count the intruding record"
    # The log: the first verifier's records at epoch 1, the intruder's at 2, then the router's fence
    # above it (at the first verifier, which stopped at the intrusion and reopened there while
    # still reachable, or at the second once the first was cut), and only fenced verifiers' records.
    records = deployment.commit_log(target, ("epoch", "round", "committed", "writer", "verifier"))
    at = records.index({**{k: forged[k] for k in ("epoch", "round", "committed")}, "writer": deployment.uri(second)})
    assert {r["epoch"] for r in records[:at]} == {1}
    _check_fenced_after(records, at, len(reference[400]))
    fences = [r for r in records[at + 1 :] if r.keys() == {"epoch", "verifier"}]
    assert fences[-1]["verifier"] == deployment.uri(second)
    assert run.done[0]["epochs"][-1] >= 3
    record_figures(
        deployment,
        "a second verifier appends at epoch + 1, then the verifier cut",
        forged_tokens=0,
        untrusted_records=int(untrusted),
        fence_epoch=3,
        recovery_s=round(recovery, 2),
        sessions=len(affected),
        **figures,
    )
