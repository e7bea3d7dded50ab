"""A test run killed before its cleanup leaves namespaces; the next run removes them, and only them."""

from __future__ import annotations

import subprocess
import sys

from tests.faults import testnet
from tests.faults.testnet import HAND_OWNER, our_namespaces, remove_orphaned_namespaces


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def test_only_the_namespaces_of_runs_that_are_gone_are_removed() -> None:
    orphaned = testnet.Testnet(["host"], owner=str(_dead_pid()))
    running = testnet.Testnet(["host"])
    by_hand = testnet.Testnet(["host"], owner=HAND_OWNER)
    nets = (orphaned, running, by_hand)
    try:
        for net in nets:
            net.up()
        removed = remove_orphaned_namespaces()
        left = our_namespaces()
        assert set(removed) >= {orphaned.switch, orphaned.namespace("host")}
        assert not set(removed) & set(left)
        for net in (running, by_hand):
            assert {net.switch, net.namespace("host")} <= set(left)
    finally:
        for net in nets:
            net.down()
    assert not {net.namespace("host") for net in nets} & set(our_namespaces())
