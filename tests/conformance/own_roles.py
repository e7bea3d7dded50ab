"""The project's roles started from their CLI (`python -m sdcp ROLE --config`), and the identities
the conformance kit plays, with certificates from one dev CA."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sdcp.localhost import free_port
from sdcp.transport.certs import make_certs

# Identities of the kit: one per role it plays.
PLAYED = ("kit-router", "kit-verifier", "kit-drafter", "kit-drafter2", "kit-front-end")
STARTUP_S = 120.0


@dataclass
class OwnRoles:
    tmp: Path
    uris: dict[str, str] = field(default_factory=dict)
    certs: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def ca(self) -> Path:
        return self.tmp / "certs" / "ca.pem"

    def issue(self, names: list[str]) -> None:
        self.uris.update({name: f"https://127.0.0.1:{free_port()}" for name in names})
        issued = make_certs(self.tmp / "certs", [self.uris[name] for name in names])
        self.certs.update(
            {name: (issued[self.uris[name]].cert_path, issued[self.uris[name]].key_path) for name in names}
        )

    def played(self, name: str, flag: str) -> list[str]:
        cert, key = self.certs[name]
        return [f"--{flag}-cert", str(cert), f"--{flag}-key", str(key)]

    def instance(self, name: str, router: str | None = None) -> str:
        cert, key = self.certs[name]
        lines = [
            f'uri = "{self.uris[name]}"',
            f'cert = "{cert}"',
            f'key = "{key}"',
            f'ca = "{self.ca}"',
            "ttl_ms = 1500",
        ]
        if router is not None:
            lines.append(f'router = "{self.uris[router]}"')
        return "[instance]\n" + "\n".join(lines) + "\n"

    def start(self, name: str, role: str, config: str) -> None:
        path = self.tmp / f"{name}.toml"
        path.write_text(config, encoding="utf-8")
        log = (self.tmp / f"{name}.log").open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "sdcp", role, "--config", str(path)], stdout=log, stderr=subprocess.STDOUT, env=env
        )

    def wait_listening(self, names: list[str]) -> None:
        deadline = time.monotonic() + STARTUP_S
        for name in names:
            port = int(self.uris[name].rsplit(":", 1)[1])
            while True:
                if self.processes[name].poll() is not None:
                    raise RuntimeError(f"{name} exited: {self.log(name)[-2000:]}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} is not listening: {self.log(name)[-2000:]}") from None
                    time.sleep(0.2)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
