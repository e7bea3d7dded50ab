"""Loopback helpers for local clusters, benchmarks and tests: free ports, readiness probes."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

__all__ = ["accepts", "free_port"]

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Ports are picked below the kernel's ephemeral range, from which every outgoing connection takes its
# local port: a port picked there (the kernel's pick for port 0 is) can be taken by a connection
# before its server binds it, which on a busy host happened (the server then fails to listen, and
# its clients reach whatever else holds the port).
LOWEST_PICKED_PORT = 10000
PICK_ATTEMPTS = 64


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts there


# Never the same port twice in one process: the ports picked in a row for a cluster's instances
# (or a test's identities) are bound only later, and each must be its own.
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and not handed out before by this process: below the kernel's ephemeral
    range where it leaves room (a random one, so that two processes' picks rarely meet), else the
    kernel's pick for port 0."""
    below = _ephemeral_start() - LOWEST_PICKED_PORT
    for attempt in range(2 * PICK_ATTEMPTS):
        with socket.socket() as probe:
            port = LOWEST_PICKED_PORT + secrets.randbelow(below) if below > 0 and attempt < PICK_ATTEMPTS else 0
            try:
                probe.bind((host, port))
            except OSError:
                continue  # held, or closing (TIME_WAIT)
            port = int(probe.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {host} in {2 * PICK_ATTEMPTS} tries")


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on host:port now."""
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex((host, port)) == 0
