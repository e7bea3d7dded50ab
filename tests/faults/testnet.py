"""Test hosts on this machine: one network namespace per host, joined by veth pairs to a bridge in
a switch namespace of their own, with addresses in 10.213.0.0/24 that exist nowhere else.

Nothing touches the root namespace's interfaces or routes: the bridge lives in the switch
namespace, and deleting the namespaces deletes every link. A link is cut at the switch (`cut`),
which drops packets without a FIN or RST, as a host that disappears does; `loss` drops a share of a
host's packets with iptables' statistic match. Needs root, `ip` (iproute2) and `iptables`.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults.delay import LISTENING
from tests.faults.delay import MARK as RELAY_MARK

__all__ = ["SUBNET", "Testnet", "remove_orphaned_namespaces"]

SUBNET = "10.213.0"
_FIRST_HOST = 10
_RELAY_PORT = 15001
# A bound for a relay that hangs before it listens, not how long it takes.
_RELAY_START_S = 120.0


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


# Namespaces are named sdcp-OWNER-NONCE-HOST: OWNER is the process id of the test run that made
# them, or HAND_OWNER for scripts/testnet's, which only `scripts/testnet down` removes.
_PREFIX = "sdcp-"
HAND_OWNER = "hand"


@dataclass
class Testnet:
    hosts: Sequence[str]
    owner: str = field(default_factory=lambda: str(os.getpid()))
    nonce: str = field(default_factory=lambda: os.urandom(3).hex())
    _up: bool = False

    @property
    def tag(self) -> str:
        return f"{self.owner}-{self.nonce}"

    @property
    def switch(self) -> str:
        return f"sdcp-{self.tag}-sw"

    def namespace(self, host: str) -> str:
        return f"sdcp-{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{_FIRST_HOST + list(self.hosts).index(host)}"

    def _port(self, host: str) -> str:
        return f"p{list(self.hosts).index(host)}"

    def exec_prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program on `host`."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def up(self) -> None:
        self._up = True
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            namespace, port = self.namespace(host), self._port(host)
            _run("ip", "netns", "add", namespace)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            _run(
                "ip", "-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch
            )
            _run("ip", "-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")

    def cut(self, host: str) -> None:
        """Take the host off the network: its packets go nowhere, no connection is closed."""
        _run("ip", "-n", self.switch, "link", "set", self._port(host), "down")

    def restore(self, host: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self._port(host), "up")

    def loss(self, host: str, percent: int) -> None:
        """Drop `percent` % of the host's incoming and outgoing packets, at random."""
        for chain in ("INPUT", "OUTPUT"):
            _run(
                *self.exec_prefix(host),
                "iptables", "-A", chain, "-i" if chain == "INPUT" else "-o", "eth0",
                "-m", "statistic", "--mode", "random", "--probability", f"{percent / 100:.2f}", "-j", "DROP",
            )  # fmt: skip

    def clear_loss(self, host: str) -> None:
        for chain in ("INPUT", "OUTPUT"):
            _run(*self.exec_prefix(host), "iptables", "-F", chain)

    def delay(self, host: str, delay_ms: int) -> subprocess.Popen[str]:
        """Delay every TCP connection the host opens by `delay_ms` each way (tests/faults/delay.py,
        since this kernel has no netem); stop the returned relay and call `clear_delay` to undo."""
        relay = subprocess.Popen(
            [*self.exec_prefix(host), sys.executable, "-m", "tests.faults.delay", "--port", str(_RELAY_PORT)]
            + ["--delay-ms", str(delay_ms)],
            cwd=Path(__file__).resolve().parents[2],
            stdout=subprocess.PIPE,
            text=True,
        )
        # Connections are sent to the relay only once it listens.
        assert relay.stdout is not None
        announced, _, _ = select.select([relay.stdout], [], [], _RELAY_START_S)
        if not announced or relay.stdout.readline().strip() != LISTENING:
            relay.kill()
            relay.wait(timeout=10)
            raise RuntimeError(f"the delay relay on {host} did not start listening")
        _run(
            *self.exec_prefix(host),
            "iptables", "-t", "nat", "-A", "OUTPUT", "-o", "eth0", "-p", "tcp",
            "-m", "mark", "!", "--mark", str(RELAY_MARK), "-j", "REDIRECT", "--to-ports", str(_RELAY_PORT),
        )  # fmt: skip
        return relay

    def clear_delay(self, host: str, relay: subprocess.Popen[str]) -> None:
        _run(*self.exec_prefix(host), "iptables", "-t", "nat", "-F", "OUTPUT")
        relay.terminate()
        relay.wait(timeout=10)

    def down(self) -> None:
        if not self._up:
            return
        for namespace in [self.namespace(host) for host in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        self._up = False


def our_namespaces() -> list[str]:
    """Every namespace a test or scripts/testnet made, whoever made it."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(_PREFIX)]


def _owner_alive(namespace: str) -> bool:
    owner = namespace.removeprefix(_PREFIX).split("-", 1)[0]
    if owner == HAND_OWNER:
        return True
    if not owner.isdigit():
        return False
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphaned_namespaces() -> list[str]:
    """Deletes the namespaces of test runs that were killed before their cleanup, and says which.

    A run still going keeps its own: two runs on one machine never meet, each has its own switch.
    """
    orphans = [namespace for namespace in our_namespaces() if not _owner_alive(namespace)]
    for namespace in orphans:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
    return orphans
