"""Loopback identities for a test's instances: a URI on a free 127.0.0.1 port and a certificate of a
fresh test CA for each name, and the configuration of one of them (its instance section, its trust,
an MLC on disk). Shared by the router harness's deployment and the gateway harness's cluster."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sdcp.config import InstanceConfig, MLCConfig, ServiceConfig, TrustConfig
from sdcp.localhost import free_port
from sdcp.transport.certs import make_certs


@dataclass(frozen=True)
class Identities:
    tmp: Path
    uris: dict[str, str]
    certs: dict[str, tuple[Path, Path]]
    ca: Path

    def config(self, name: str, *, trust: TrustConfig, ttl_ms: int, **sections: object) -> ServiceConfig:
        """``name``'s configuration: reporting to the instance named ``router`` (the router itself
        to none), trusting ``trust``, with an MLC in the test's directory."""
        cert, key = self.certs[name]
        router = None if name == "router" else self.uris["router"]
        instance = InstanceConfig(uri=self.uris[name], cert=cert, key=key, ca=self.ca, router=router, ttl_ms=ttl_ms)
        mlc = MLCConfig(disk_dir=self.tmp / "mlc")
        return ServiceConfig(instance=instance, mlc=mlc, trust=trust, **sections)  # type: ignore[arg-type]


def loopback_identities(tmp: Path, names: list[str]) -> Identities:
    uris = {name: f"https://127.0.0.1:{free_port()}" for name in names}
    issued = make_certs(tmp / "certs", list(uris.values()))
    certs = {name: (issued[uri].cert_path, issued[uri].key_path) for name, uri in uris.items()}
    return Identities(tmp, uris, certs, tmp / "certs" / "ca.pem")
