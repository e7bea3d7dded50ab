"""Certificates per test session (the `pki` fixture); tests/transport/tls_harness.py holds the identities
and the helpers that run servers on 127.0.0.1 ephemeral ports with them."""

from __future__ import annotations

import pytest

from sdcp.transport import make_certs

from .tls_harness import DRAFTER_A, DRAFTER_B, PKI, ROGUE_URI, SERVER_URI, Identity


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    directory = tmp_path_factory.mktemp("pki")
    issued = make_certs(directory, [SERVER_URI, DRAFTER_A, DRAFTER_B])
    other_directory = tmp_path_factory.mktemp("other-pki")
    rogue = make_certs(other_directory, [ROGUE_URI])[ROGUE_URI]
    ca = directory / "ca.pem"

    def identity(uri: str) -> Identity:
        return Identity(uri, issued[uri].cert_path, issued[uri].key_path)

    return PKI(
        directory,
        ca,
        identity(SERVER_URI),
        identity(DRAFTER_A),
        identity(DRAFTER_B),
        Identity(ROGUE_URI, rogue.cert_path, rogue.key_path),
        other_directory / "ca.pem",
    )
