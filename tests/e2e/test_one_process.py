"""`sdcp up --one-process` (sdcp.together; the default on the CPU): the whole local cluster in one
process, its output rule 1's through the real `openai` client, streamed and not, with no connection
from the process to its own listeners (its instances ask each other by calls); a process killed -9
and started again by `sdcp up`; and the gateway's direct output read answering as the verifier's
HTTP does."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tests.e2e.homes import fresh_home
from tests.e2e.support import MAX_NEW, PROMPTS, cluster_up, sdcp
from tests.waiting import wait_until

from sdcp.cluster import LocalCluster
from sdcp.frontend.text import load_text_codec

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def one_process_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = fresh_home(tmp_path_factory.mktemp("sdcp-one-process"))
    with cluster_up(root, "--gateway-port", "0", "--one-process") as started:
        assert started.returncode == 0, started.stderr
        yield root


def client_of(home: Path) -> openai.OpenAI:
    gateway = LocalCluster(home).gateway
    assert gateway is not None
    return openai.OpenAI(base_url=gateway, api_key="unused", timeout=120, max_retries=0)


def test_every_instance_runs_in_one_process(one_process_home: Path) -> None:
    instances = LocalCluster(one_process_home).instances()
    assert {instance.role for instance in instances} == {"router", "verifier", "drafter", "gateway"}
    assert len({instance.pid for instance in instances}) == 1
    assert all(instance.alive() for instance in instances)
    logs = one_process_home / "cluster" / "logs"
    assert all((logs / f"{instance.name}.log").resolve() == logs / "together.log" for instance in instances)


def test_output_is_rule_1s_streamed_and_not(one_process_home: Path, reference: dict[str, list[int]]) -> None:
    codec = load_text_codec("smollm2")
    client = client_of(one_process_home)
    for prompt in PROMPTS:
        expected = codec.decode(reference[prompt])
        reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert reply.choices[0].text == expected
        pieces = [
            chunk.choices[0].text
            for chunk in client.completions.create(
                model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True
            )
            if chunk.choices
        ]
        assert "".join(pieces) == expected


def test_the_instances_ask_each_other_by_calls_not_connections(one_process_home: Path) -> None:
    instances = LocalCluster(one_process_home).instances()
    client_of(one_process_home).completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    listeners = {instance.port for instance in instances if instance.role != "gateway"}
    assert not _connected_ports(instances[0].pid) & listeners


def _connected_ports(pid: int) -> set[int]:
    """The remote ports of the established TCP connections of the process ``pid``."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                sockets.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            established = fields[3] == "01"
            if established and fields[9] in sockets:
                ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def test_a_killed_process_is_started_again_by_sdcp_up(one_process_home: Path, reference: dict[str, list[int]]) -> None:
    before = LocalCluster(one_process_home).instances()
    os.kill(before[0].pid, signal.SIGKILL)
    wait_until(lambda: not any(instance.alive() for instance in before), what="the killed process to be gone")
    again = sdcp(one_process_home, "up", "--gateway-port", "0")
    assert again.returncode == 0, again.stderr
    after = LocalCluster(one_process_home).instances()
    assert [i.uri for i in after] == [i.uri for i in before]
    assert len({i.pid for i in after}) == 1 and after[0].pid != before[0].pid
    prompt = PROMPTS[0]
    reply = client_of(one_process_home).completions.create(
        model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=0
    )
    assert reply.choices[0].text == load_text_codec("smollm2").decode(reference[prompt])
