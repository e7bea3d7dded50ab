"""Loopback helpers for local clusters, benchmarks and tests: free ports, readiness probes."""

from __future__ import annotations

import socket

__all__ = ["accepts", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on host:port now."""
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex((host, port)) == 0
