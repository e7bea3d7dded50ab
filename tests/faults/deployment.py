"""An SDCP deployment on test hosts: Redis, a router (or two), two verifiers and two drafters, each
its own process on its own host, started with `ip netns exec HOST python -m sdcp ROLE --config FILE`
from the TOML a user writes, with certificates from `sdcp certs` naming each host's URI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.faults.testnet import Testnet, remove_orphaned_namespaces

from sdcp.cache.redis_acl import ADMIN, ROLE_USERS, acl_file_text, ensure_passwords
from sdcp.transport.certs import make_certs

# router-b last, so that the other hosts keep their addresses; it runs in two-router deployments only.
HOSTS = ("router", "verifier-a", "verifier-b", "drafter-1", "drafter-2", "redis", "client", "router-b")
ROLES = {
    "router": "router",
    "router-b": "router",
    "verifier-a": "verifier",
    "verifier-b": "verifier",
    "drafter-1": "drafter",
    "drafter-2": "drafter",
}
# The verifiers and drafters, which the router knows by their status reports.
INSTANCES = tuple(host for host, role in ROLES.items() if role != "router")
PORT = 8443
# The router's admin listener, on its host's loopback: its dashboard lists the live instances.
ADMIN_PORT = 9100
TTL_MS = 1500
# Bounds for a process that hangs, not how long starting one takes: on a busy machine a role
# that imports torch takes a minute to start.
STARTUP_S = 600.0
POLL_S = 0.2
REPO = Path(__file__).resolve().parents[2]
REDIS_PREFIX = "sdcp:mlc:"


@contextmanager
def deployed(tmp: Path, routers: tuple[str, ...] = ("router",)) -> Iterator[Deployment]:
    """A deployment up for the length of the block, on namespaces removed after it, whatever happens."""
    # Network namespaces need root and iproute2, loss iptables; CI has all three (.ci/run).
    missing = [tool for tool in ("ip", "iptables", "redis-server") if shutil.which(tool) is None]
    assert os.geteuid() == 0 and not missing, f"the fault tests need root and {missing or 'nothing else'}"
    remove_orphaned_namespaces()
    deployment = Deployment(tmp, routers=routers)
    try:
        deployment.up()
        yield deployment
    finally:
        deployment.down()


@dataclass
class Deployment:
    tmp: Path
    # The router hosts that run: the instances and the client know all of them.
    routers: tuple[str, ...] = ("router",)
    net: Testnet = field(default_factory=lambda: Testnet(HOSTS))
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def redis_url(self) -> str:
        return f"redis://{self.net.address('redis')}:6379/0"

    def uri(self, host: str) -> str:
        return f"https://{self.net.address(host)}:{PORT}"

    def host_of(self, uri: str) -> str:
        """The instance host whose URI ``uri`` is."""
        return next(host for host in INSTANCES if self.uri(host) == uri)

    @property
    def ca(self) -> Path:
        return self.tmp / "certs" / "ca.pem"

    def cert(self, host: str) -> tuple[Path, Path]:
        name = f"{self.net.address(host)}_{PORT}"
        return self.tmp / "certs" / f"{name}.pem", self.tmp / "certs" / f"{name}.key"

    def up(self) -> None:
        self.net.up()
        make_certs(self.tmp / "certs", [self.uri(host) for host in HOSTS if host != "redis"])
        self.start_redis()
        for host in self.roles:
            self.start(host)
        self.wait_ready(["redis", *self.roles])
        self.wait_registered(INSTANCES)

    @property
    def roles(self) -> dict[str, str]:
        """The hosts that run a role here, and the role."""
        return {host: role for host, role in ROLES.items() if role != "router" or host in self.routers}

    def start_redis(self) -> None:
        address = self.net.address("redis")
        # The commit log must survive a restart: every write is in the append-only file first.
        command = ["redis-server", "--bind", address, "--port", "6379", "--save", "", "--protected-mode", "no"]
        command += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.tmp)]
        # As shipped (`sdcp redis-acl`, docs/security.md): a Redis user per role, the default user off.
        passwords = ensure_passwords(self.tmp / "redis", ("router", "verifier", "drafter", ADMIN))
        aclfile = self.tmp / "redis" / "users.acl"
        aclfile.write_text(acl_file_text(passwords, REDIS_PREFIX), encoding="utf-8")
        command += ["--aclfile", str(aclfile)]
        self._spawn("redis", command)

    def redis_user(self, role: str) -> tuple[str, Path]:
        """The Redis user of `role` (router, verifier, drafter or admin) and its password file."""
        return ROLE_USERS[role], self.tmp / "redis" / f"{role}.password"

    def config(self, host: str) -> str:
        cert, key = self.cert(host)
        role = ROLES[host]
        lines = [
            "[instance]",
            f'uri = "{self.uri(host)}"',
            f'cert = "{cert}"',
            f'key = "{key}"',
            f'ca = "{self.ca}"',
            f"ttl_ms = {TTL_MS}",
        ]
        quoted = lambda hosts: "[" + ", ".join(f'"{self.uri(h)}"' for h in hosts) + "]"  # noqa: E731
        if role == "router":
            lines += ["[admin]", f'listen = "127.0.0.1:{ADMIN_PORT}"']
        elif len(self.routers) == 1:
            lines.append(f'router = "{self.uri(self.routers[0])}"')  # one router: a string, as before
        else:
            lines.append(f"router = {quoted(self.routers)}")
        lines += ["[mlc]", f'redis_url = "{self.redis_url}"', "memory_bytes = 0"]
        user, password_file = self.redis_user(role)
        lines += [f'redis_username = "{user}"', f'redis_password_file = "{password_file}"']
        lines += [
            "[trust]",
            f"routers = {quoted(self.routers)}",
            f"verifiers = {quoted(['verifier-a', 'verifier-b'])}",
            f"drafters = {quoted(['drafter-1', 'drafter-2'])}",
            f"front_ends = {quoted(['client'])}",
            f"operators = {quoted(['client'])}",
        ]
        if role == "verifier":
            lines += ["[verifier]", 'model = "tiny"', "output_wait_s = 1.0", "drafter_silence_s = 3.0"]
        elif role == "drafter":
            lines += ["[drafter]", 'model = "ngram"', 'target = "tiny"']
        return "\n".join(lines) + "\n"

    def start(self, host: str) -> None:
        path = self.tmp / f"{host}.toml"
        path.write_text(self.config(host), encoding="utf-8")
        self._spawn(host, [sys.executable, "-m", "sdcp", self.roles[host], "--config", str(path)])

    def _spawn(self, host: str, command: list[str]) -> None:
        log = (self.tmp / f"{host}.log").open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        self.processes[host] = subprocess.Popen(
            self.net.exec_prefix(host) + command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.tmp
        )

    def log(self, host: str) -> str:
        return (self.tmp / f"{host}.log").read_text(errors="replace")

    def wait_ready(self, hosts: list[str]) -> None:
        deadline = time.monotonic() + STARTUP_S
        marks = {"redis": "Ready to accept connections"}
        for host in hosts:
            while marks.get(host, "listening on") not in self.log(host):
                if self.processes[host].poll() is not None:
                    raise RuntimeError(f"{host} exited: {self.log(host)[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{host} did not start: {self.log(host)[-2000:]}")
                time.sleep(POLL_S)

    def registered(self, router: str = "router") -> dict[str, float] | None:
        """The hosts among INSTANCES whose status `router` holds unexpired, with the seconds each has
        left (its dashboard's state, read on the router's host), or None while the router does not
        answer."""
        state = f"http://127.0.0.1:{ADMIN_PORT}/dashboard/state"
        script = f"import urllib.request; print(urllib.request.urlopen({state!r}, timeout=30).read().decode())"
        command = self.net.exec_prefix(router) + [sys.executable, "-c", script]
        answered = subprocess.run(command, capture_output=True, text=True, timeout=STARTUP_S, check=False)
        if answered.returncode != 0:
            return None
        live = {instance["uri"]: float(instance["ttl_s"]) for instance in json.loads(answered.stdout)["instances"]}
        return {host: live[self.uri(host)] for host in INSTANCES if self.uri(host) in live}

    def wait_registered(self, hosts: tuple[str, ...]) -> None:
        """Wait until every running router holds a live status of exactly `hosts` among INSTANCES
        (all of them once a fault is over, or all but a killed one once its status has expired), each
        renewed since this call: an instance whose link to the router still waits behind a healed
        partition would otherwise look live until its status expires, in the next test."""
        deadline = time.monotonic() + STARTUP_S
        for router in self.routers:
            if self.processes[router].poll() is not None:
                continue  # killed and not restarted
            previous: dict[str, float] = {}
            renewed: set[str] = set()
            while True:
                registered = self.registered(router)
                if registered is not None and set(registered) == set(hosts):
                    # A status has more time left than at the reading before only if a report
                    # renewed it in between (they come every third of the TTL).
                    renewed |= {host for host, left in registered.items() if left > previous.get(host, left)}
                    if renewed == set(hosts):
                        break
                    previous = registered
                if time.monotonic() > deadline:
                    log = self.log(router)[-2000:]
                    raise RuntimeError(f"{router} holds {registered}, renewed {renewed}, not {sorted(hosts)}: {log}")
                time.sleep(POLL_S)

    def signal(self, host: str, signum: int) -> None:
        self.processes[host].send_signal(signum)

    def kill(self, host: str) -> None:
        self.processes[host].kill()
        self.processes[host].wait(timeout=30)

    def restart(self, host: str) -> None:
        """Start a killed host's process again, as its supervisor would."""
        mark = len(self.log(host))
        if host == "redis":
            self.start_redis()
        else:
            self.start(host)
        deadline = time.monotonic() + STARTUP_S
        ready = "Ready to accept connections" if host == "redis" else "listening on"
        while ready not in self.log(host)[mark:]:
            if time.monotonic() > deadline or self.processes[host].poll() is not None:
                raise RuntimeError(f"{host} did not restart: {self.log(host)[-2000:]}")
            time.sleep(POLL_S)

    def drive(self, sessions: int, max_new: int, *, until_stopped: bool) -> subprocess.Popen[str]:
        """The client host's program (tests/faults/drive.py); its stdout is JSON lines."""
        cert, key = self.cert("client")
        command = [sys.executable, "-m", "tests.faults.drive"]
        for router in self.routers:
            command += ["--router", self.uri(router)]
        command += ["--cert", str(cert), "--key", str(key), "--ca", str(self.ca)]
        command += ["--sessions", str(sessions), "--max-new", str(max_new)]
        if until_stopped:
            command.append("--until-stdin-closes")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        stderr = (self.tmp / "client.log").open("ab")
        stdin = subprocess.PIPE if until_stopped else subprocess.DEVNULL
        command = self.net.exec_prefix("client") + command
        return subprocess.Popen(
            command, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO
        )

    def run(self, sessions: int, max_new: int, *, until_stopped: bool = False) -> Run:
        """`sessions` sessions of `max_new` tokens, opened once every verifier and drafter is
        registered at the router (an earlier fault is over); `until_stopped`: each ended one is
        replaced by a new one until `Run.stop_opening`, so that the run outlasts any faults."""
        self.wait_registered(INSTANCES)
        return Run(self.drive(sessions, max_new, until_stopped=until_stopped), self.tmp / "client-output.jsonl")

    def commit_log(
        self, session_hex: str, members: tuple[str, ...] = ("epoch", "round", "committed")
    ) -> list[dict[str, Any]]:
        """The session's commit-log records, read from Redis on the client host as the admin user
        (epoch, round, committed of each, or the `members` asked for; a fence record has only its
        epoch and the verifier it names)."""
        user, password_file = self.redis_user(ADMIN)
        script = (
            "import asyncio, json\n"
            "from sdcp.cache import MLC\n"
            "from sdcp.cache.redis_acl import RedisAccess\n"
            "async def main():\n"
            f"    access = RedisAccess(username={user!r}, password=open({str(password_file)!r}).read().strip())\n"
            f"    async with MLC.from_config(redis_url={self.redis_url!r}, redis_access=access) as mlc:\n"
            f"        records = (await mlc.commit_log('mlc://local/-/log/{session_hex}').read()).records\n"
            f"    keep = {members!r}\n"
            "    print(json.dumps([{k: r[k] for k in keep if k in r} for r in records]))\n"
            "asyncio.run(main())\n"
        )
        command = self.net.exec_prefix("client") + [sys.executable, "-c", script]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True, cwd=REPO)
        return json.loads(done.stdout)

    def down(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.net.down()


class Run:
    """What the client host prints, read by a thread as it comes."""

    def __init__(self, process: subprocess.Popen[str], transcript: Path) -> None:
        self.process = process
        self.transcript = transcript
        self.progress: dict[int, int] = {}
        self.arrivals: dict[int, list[float]] = {}
        self.epoch: dict[int, int] = {}
        self.opened: dict[int, dict[str, Any]] = {}
        self.done: dict[int, dict[str, Any]] = {}
        # The client's output ended: every line it printed has been read.
        self.finished = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self.transcript.open("a") as kept:
                kept.write(line)
            message = json.loads(line)
            session = message["session"]
            with self._changed:
                if message["event"] == "opened":
                    self.opened[session] = message
                elif message["event"] == "progress":
                    self.progress[session] = message["tokens"]
                    self.arrivals.setdefault(session, []).append(time.monotonic())
                    self.epoch[session] = message["epoch"]
                else:
                    self.done[session] = message
                self._changed.notify_all()
        with self._changed:
            self.finished = True
            self._changed.notify_all()

    def tokens_received(self) -> int:
        """Tokens the client has received, over every session of the run."""
        with self._changed:
            return sum(self.progress.values())

    def stop_opening(self) -> None:
        """Open no more sessions (a run `until_stopped`); those running go on to their end."""
        assert self.process.stdin is not None
        self.process.stdin.close()

    def longest_stall(self, sessions: list[int], since: float) -> float:
        """The longest time any of `sessions` went without new tokens after `since`, in seconds."""
        stalls = [0.0]
        for session in sessions:
            times = [since] + [t for t in self.arrivals.get(session, []) if t > since]
            stalls += [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        return max(stalls)

    def wait(self, condition: Callable[[Run], bool], timeout: float) -> None:
        """Until `condition` holds; `timeout` bounds a hung run only."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self) or self.finished, timeout):
                raise TimeoutError(
                    f"the client did not get there in {timeout} s: {self.progress}, done {list(self.done)}"
                )
            if not condition(self):
                errors = {session: done["error"] for session, done in self.done.items() if done["error"]}
                status = self.process.wait(timeout=60)
                raise RuntimeError(f"the client ended ({status}) before: {self.progress} {errors}")
