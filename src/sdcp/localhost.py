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


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range where it leaves room (a random one, so
    that two picks at once rarely meet), else the kernel's pick for port 0."""
    below = _ephemeral_start() - LOWEST_PICKED_PORT
    for _ in range(PICK_ATTEMPTS if below > 0 else 0):
        port = LOWEST_PICKED_PORT + secrets.randbelow(below)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue  # held, or closing (TIME_WAIT)
            return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on host:port now."""
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex((host, port)) == 0
