"""Development CA and per-instance certificates (SDCP 5.1 mutual authentication).

An instance is identified by its base URI: its certificate carries that URI as a URI subjectAltName,
so a verifier can compare the authenticated client with the drafter named in an assignment
(SDCP 6.3). The same certificate serves both directions of mutual TLS (serverAuth + clientAuth).

File layout in the certificate directory::

    ca.pem, ca.key            the development CA (created once, reused afterwards)
    <name>.pem, <name>.key    one pair per instance, <name> = instance_name(base_uri)

Private keys are written unencrypted with mode 0600: this is a development CA, not a production PKI.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, urlsplit

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "CertificateAuthority",
    "InstanceCertificate",
    "InvalidInstanceURI",
    "create_ca",
    "instance_name",
    "issue",
    "load_ca",
    "make_certs",
    "uri_sans",
]

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
DEFAULT_VALIDITY = datetime.timedelta(days=365)
# Certificates become valid slightly in the past so that peers with a skewed clock accept them.
_CLOCK_SKEW = datetime.timedelta(minutes=5)
# Instance certificates this close to expiry are re-issued by make_certs instead of reused.
_RENEW_BEFORE = datetime.timedelta(days=7)
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9.-]+")


class InvalidInstanceURI(ValueError):
    """An instance base URI that cannot name a TLS endpoint (not https, or without a host)."""


@dataclass(frozen=True)
class CertificateAuthority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path
    key_path: Path


@dataclass(frozen=True)
class InstanceCertificate:
    uri: str
    cert_path: Path
    key_path: Path


def instance_name(uri: str) -> str:
    """File-name stem for an instance: ``host_port``, plus the path when the base URI has one.

    Two instances on one host:port differ by path, so the path takes part in the name.
    """
    parts = _split_instance_uri(uri)
    port = parts.port if parts.port is not None else 443
    stem = f"{parts.hostname}_{port}"
    path = parts.path.strip("/")
    if path:
        stem = f"{stem}_{path}"
    return _UNSAFE_NAME_CHARS.sub("_", stem)


def create_ca(directory: Path | str, *, validity: datetime.timedelta = DEFAULT_VALIDITY) -> CertificateAuthority:
    """Create a new development CA in ``directory`` (overwriting an existing one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sdcp development CA")])
    now = _now()
    public_key = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    _write_pair(cert, key, cert_path, key_path)
    return CertificateAuthority(cert, key, cert_path, key_path)


def load_ca(directory: Path | str) -> CertificateAuthority:
    """Load the CA that ``create_ca`` wrote in ``directory``."""
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{key_path} is not an EC private key")
    return CertificateAuthority(cert, key, cert_path, key_path)


def issue(directory: Path | str, uri: str, *, validity: datetime.timedelta = DEFAULT_VALIDITY) -> tuple[Path, Path]:
    """Issue a certificate for the instance with base URI ``uri``, signed by the CA in ``directory``.

    Returns ``(cert_path, key_path)``.
    """
    directory = Path(directory)
    parts = _split_instance_uri(uri)
    ca = load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    public_key = key.public_key()
    ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    # CN is limited to 64 characters; the identity lives in the URI SAN, the CN is only a label.
    label = instance_name(uri)[:64]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)]))
        .issuer_name(ca.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(min(now + validity, ca.cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(_subject_alt_names(uri, parts.hostname or "")), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    name = instance_name(uri)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    _write_pair(cert, key, cert_path, key_path)
    return cert_path, key_path


def make_certs(directory: Path | str, instance_uris: list[str]) -> dict[str, InstanceCertificate]:
    """Ensure a CA and one certificate per instance URI exist in ``directory``.

    An existing CA is reused. An existing instance certificate is reused when it was issued by that
    CA for the same URI and is not about to expire; otherwise it is re-issued. Returns the
    certificates keyed by URI.
    """
    directory = Path(directory)
    for uri in instance_uris:
        _split_instance_uri(uri)
    names = [instance_name(uri) for uri in instance_uris]
    if len(set(names)) != len(set(instance_uris)):
        raise InvalidInstanceURI(f"instance URIs map to clashing file names: {sorted(names)}")
    ca = load_ca(directory) if (directory / CA_CERT_FILE).exists() else create_ca(directory)
    issued: dict[str, InstanceCertificate] = {}
    for uri in instance_uris:
        name = instance_name(uri)
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
        if not _reusable(cert_path, key_path, uri, ca):
            cert_path, key_path = issue(directory, uri)
        issued[uri] = InstanceCertificate(uri, cert_path, key_path)
    return issued


def uri_sans(cert: x509.Certificate) -> list[str]:
    """The URI subjectAltNames of ``cert`` (empty when it has none)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def _split_instance_uri(uri: str) -> SplitResult:
    parts = urlsplit(uri)
    if parts.scheme != "https" or not parts.hostname:
        raise InvalidInstanceURI(f"instance base URI must be https://host[:port][/path], got {uri!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise InvalidInstanceURI(f"instance base URI must not carry userinfo, query or fragment: {uri!r}")
    try:
        _ = parts.port
    except ValueError as error:
        raise InvalidInstanceURI(f"invalid port in {uri!r}") from error
    return parts


def _subject_alt_names(uri: str, host: str) -> list[x509.GeneralName]:
    """The instance's URI and the host of that URI, nothing else: a certificate names one instance,
    so that no other instance on the same host can pass for it (docs/security.md)."""
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    return names


def _reusable(cert_path: Path, key_path: Path, uri: str, ca: CertificateAuthority) -> bool:
    if not (cert_path.exists() and key_path.exists()):
        return False
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    expected = _subject_alt_names(uri, _split_instance_uri(uri).hostname or "")
    return list(names) == expected and cert.not_valid_after_utc - _now() > _RENEW_BEFORE


def _write_pair(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert_path: Path, key_path: Path) -> None:
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # Create the key file with owner-only permissions from the start, not chmod after writing.
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as key_file:
        key_file.write(key_bytes)
    os.chmod(key_path, 0o600)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
