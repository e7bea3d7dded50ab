"""docs/deploy.md's two-host example, run from the document itself: its TOML files and commands.

Every port is replaced by a free one (the documented 9100, 9101, 9201, 9202, 6390 and 8000), so that
a cluster or Redis a developer left running cannot disturb the test; nothing else is changed.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.e2e.support import PROMPTS, sdcp

from sdcp.localhost import free_port
from sdcp.models.registry import load_tokenizer
from sdcp.transport import SDCPClient

pytestmark = pytest.mark.timeout(600)

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


def documented_files() -> dict[str, str]:
    """Each ```toml block of the document, named by the `file` mentioned just before it."""
    text = DOC.read_text(encoding="utf-8")
    files = {name: body for name, body in re.findall(r"`([\w-]+\.toml)`[^\n]*:\n\n```toml\n(.*?)```", text, re.S)}
    files["drafter-2.toml"] = files["drafter-1.toml"].replace("9201", "9202").replace('"ngram"', '"hf:smollm2"')
    return files


def wait_for(host: str, port: int, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{log.name} exited: {log.read_text()[-2000:]}")
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"{log.name} did not listen on {host}:{port} in {timeout_s} s")


async def wait_for_target(root: Path, router: str, timeout_s: float = 60) -> None:
    """Ask the router (as the gateway, whose certificate the example issues) for its targets."""
    certs = root / "certs"
    async with (
        SDCPClient(
            router, certs / "localhost_443_gateway.pem", certs / "localhost_443_gateway.key", certs / "ca.pem"
        ) as client,
        asyncio.timeout(timeout_s),
    ):
        while not (await client.get_cbor("targets"))[1]:
            await asyncio.sleep(0.1)


@pytest.fixture
def deployment(empty_home: Path) -> Iterator[tuple[Path, int]]:
    root = empty_home / "deploy"
    root.mkdir()
    files = documented_files()
    assert {"router.toml", "verifier.toml", "drafter-1.toml", "gateway.toml"} <= set(files)
    ports = {
        documented: free_port(host)
        for documented, host in [(9100, "127.0.0.2"), (9101, "127.0.0.2"), (9201, "127.0.0.3"), (9202, "127.0.0.3")]
    }
    ports[6390] = free_port("127.0.0.2")
    ports[8000] = gateway_port = free_port()
    for name, body in files.items():
        for documented, port in ports.items():
            body = re.sub(rf"(?<=[:_]){documented}\b", str(port), body)
        files[name] = body
    for name, body in files.items():
        (root / name).write_text(body, encoding="utf-8")
    uris = sorted(set(re.findall(r'uri = "(https://[^"]+)"', "".join(files.values()))))
    certs = sdcp(empty_home, "certs", str(root / "certs"), *[arg for uri in uris for arg in ("--instance", uri)])
    assert certs.returncode == 0, certs.stderr
    # As documented: a Redis user per role, the default user off (docs/security.md).
    users = sdcp(empty_home, "redis-acl", "--secrets", str(root / "redis"), "--acl-file", str(root / "users.acl"))
    assert users.returncode == 0, users.stderr
    pidfile = root / "redis.pid"
    subprocess.run(
        [
            "redis-server",
            "--port",
            str(ports[6390]),
            "--bind",
            "127.0.0.2",
            "--daemonize",
            "yes",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(root),
            "--pidfile",
            str(pidfile),
            "--aclfile",
            str(root / "users.acl"),
        ],
        check=True,
        capture_output=True,
    )
    processes: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "SDCP_HOME": str(empty_home)}
    try:
        for name, host, port in [
            ("router", "127.0.0.2", ports[9100]),
            ("verifier", "127.0.0.2", ports[9101]),
            ("drafter-1", "127.0.0.3", ports[9201]),
            ("drafter-2", "127.0.0.3", ports[9202]),
            ("gateway", "127.0.0.1", gateway_port),
        ]:
            role = name.split("-")[0]
            log = root / f"{name}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "sdcp", role, "--config", f"{name}.toml"],
                    cwd=root,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            processes.append(process)
            wait_for(host, port, process, log)
        # Every instance reports its status within ttl_ms / 3: wait until the router lists the verifier.
        asyncio.run(wait_for_target(root, router=f"https://127.0.0.2:{ports[9100]}"))
        yield root, gateway_port
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGTERM)


def test_two_host_example_serves_greedy_completions(
    deployment: tuple[Path, int], reference: dict[str, list[int]]
) -> None:
    _, port = deployment
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    expected = load_tokenizer("smollm2").decode(reference[PROMPTS[0]][:16], skip_special_tokens=True)
    assert response.json()["choices"][0]["text"] == expected
