"""Development CA and instance certificates: identity in the URI SAN, reuse, file layout."""

from __future__ import annotations

import datetime
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from sdcp.transport.certs import InvalidInstanceURI, create_ca, instance_name, issue, make_certs, uri_sans

pytestmark = pytest.mark.timeout(30)


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_instance_certificate_names_only_its_instance_and_has_both_usages(tmp_path: Path) -> None:
    uri = "https://node-7.example:8443/drafter/"
    issued = make_certs(tmp_path, [uri])[uri]
    cert = load(issued.cert_path)
    ca = load(tmp_path / "ca.pem")

    cert.verify_directly_issued_by(ca)
    assert uri_sans(cert) == [uri]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-7.example"]
    assert san.get_values_for_type(x509.IPAddress) == []
    loopback = make_certs(tmp_path, ["https://127.0.0.1:9001/"])["https://127.0.0.1:9001/"]
    names = load(loopback.cert_path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == []
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    assert cert.signature_hash_algorithm is not None and cert.signature_hash_algorithm.name == "sha256"
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert datetime.timedelta(days=364) < lifetime <= datetime.timedelta(days=366)


def test_ca_is_a_ca_and_keys_are_private(tmp_path: Path) -> None:
    make_certs(tmp_path, ["https://127.0.0.1:9000/"])
    ca = load(tmp_path / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign is True
    for key_file in tmp_path.glob("*.key"):
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_file_layout_names_instances_by_host_port_and_path(tmp_path: Path) -> None:
    uris = ["https://127.0.0.1:9000/", "https://127.0.0.1:9000/verifier", "https://host.example/"]
    issued = make_certs(tmp_path, uris)
    assert [issued[uri].cert_path.name for uri in uris] == [
        "127.0.0.1_9000.pem",
        "127.0.0.1_9000_verifier.pem",
        "host.example_443.pem",
    ]
    assert instance_name("https://[::1]:7000/a/b/") == "_1_7000_a_b"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ca.pem", "ca.key"] + [f"{instance_name(u)}.{ext}" for u in uris for ext in ("pem", "key")]
    )


def test_make_certs_reuses_the_ca_and_valid_instance_certificates(tmp_path: Path) -> None:
    uri = "https://127.0.0.1:9001/"
    first = make_certs(tmp_path, [uri])[uri]
    ca_before = (tmp_path / "ca.pem").read_bytes()
    cert_before = first.cert_path.read_bytes()
    second = make_certs(tmp_path, [uri, "https://127.0.0.1:9002/"])
    assert (tmp_path / "ca.pem").read_bytes() == ca_before
    assert second[uri].cert_path.read_bytes() == cert_before
    load(second["https://127.0.0.1:9002/"].cert_path).verify_directly_issued_by(load(tmp_path / "ca.pem"))


def test_instance_certificates_are_reissued_after_the_ca_changes(tmp_path: Path) -> None:
    uri = "https://127.0.0.1:9003/"
    before = make_certs(tmp_path, [uri])[uri].cert_path.read_bytes()
    create_ca(tmp_path)
    after = make_certs(tmp_path, [uri])[uri]
    assert after.cert_path.read_bytes() != before
    load(after.cert_path).verify_directly_issued_by(load(tmp_path / "ca.pem"))


def test_issue_returns_the_pair_it_wrote(tmp_path: Path) -> None:
    create_ca(tmp_path)
    cert_path, key_path = issue(tmp_path, "https://127.0.0.1:9004/x/")
    assert (cert_path.name, key_path.name) == ("127.0.0.1_9004_x.pem", "127.0.0.1_9004_x.key")
    assert uri_sans(load(cert_path)) == ["https://127.0.0.1:9004/x/"]


@pytest.mark.parametrize(
    "uri",
    [
        "http://127.0.0.1:9000/",
        "https:///path",
        "127.0.0.1:9000",
        "https://u:p@host/",
        "https://h/?q=1",
        "https://h:99999/",
    ],
)
def test_unusable_instance_uris_are_refused(tmp_path: Path, uri: str) -> None:
    with pytest.raises(InvalidInstanceURI):
        make_certs(tmp_path, [uri])
    assert not (tmp_path / "ca.pem").exists()


def test_clashing_file_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInstanceURI, match="clashing"):
        make_certs(tmp_path, ["https://h:1/a/b", "https://h:1/a_b"])
