"""free_port picks below the kernel's ephemeral range, where no outgoing connection takes a port
before its server binds it, never a port that is held, and never one it handed out before."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sdcp import localhost
from sdcp.localhost import LOWEST_PICKED_PORT, free_port


def test_a_picked_port_is_below_the_ephemeral_range_and_free() -> None:
    for _ in range(20):
        port = free_port()
        assert LOWEST_PICKED_PORT <= port < localhost._ephemeral_start()
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def _unpicked_free_port() -> int:
    """A port below the ephemeral range that is free and that free_port has not handed out."""
    for port in range(LOWEST_PICKED_PORT, localhost._ephemeral_start()):
        if port in localhost._handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port below the ephemeral range")


def test_a_held_port_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    held_port = _unpicked_free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", held_port))
        holder.listen()
        other = _unpicked_free_port()
        picks = iter([held_port - LOWEST_PICKED_PORT, other - LOWEST_PICKED_PORT])
        monkeypatch.setattr(localhost.secrets, "randbelow", lambda _below: next(picks))
        assert free_port() == other


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    low_range = tmp_path / "ip_local_port_range"
    low_range.write_text(f"{LOWEST_PICKED_PORT}\t60999\n")
    ephemeral_start = localhost._ephemeral_start()
    monkeypatch.setattr(localhost, "EPHEMERAL_RANGE", low_range)
    port = free_port()
    assert port >= ephemeral_start
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))


def test_no_port_is_handed_out_twice_in_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    picked = [free_port() for _ in range(200)]
    assert len(set(picked)) == 200
    first, second = picked[:2]
    fresh = _unpicked_free_port()
    picks = iter([first - LOWEST_PICKED_PORT, second - LOWEST_PICKED_PORT, fresh - LOWEST_PICKED_PORT])
    monkeypatch.setattr(localhost.secrets, "randbelow", lambda _below: next(picks))
    assert free_port() == fresh
