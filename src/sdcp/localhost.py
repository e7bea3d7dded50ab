"""Loopback helpers for local clusters, benchmarks and tests: free ports, readiness probes."""

from __future__ import annotations

import itertools
import secrets
import socket
from collections.abc import Iterator
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


def _candidates() -> Iterator[int]:
    """Random ports below the kernel's ephemeral range where it leaves room (so that two processes'
    picks rarely meet), then the kernel's pick for port 0."""
    below = _ephemeral_start() - LOWEST_PICKED_PORT
    for _ in range(PICK_ATTEMPTS if below > 0 else 0):
        yield LOWEST_PICKED_PORT + secrets.randbelow(below)
    yield from itertools.repeat(0, PICK_ATTEMPTS)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and not handed out before by this process (`_candidates`)."""
    for candidate in _candidates():
        with socket.socket() as probe:
            try:
                probe.bind((host, candidate))
            except OSError:
                continue  # held, or closing (TIME_WAIT)
            port = int(probe.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {host} that this process has not handed out already")


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on host:port now."""
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex((host, port)) == 0
