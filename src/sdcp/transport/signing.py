"""Signed commit records (the format: ``sdcp.protocol.records``): a verifier signs each record it
appends, a router checks each before a failover replays it (SDCP 1.3 "the verifier is the sole
commit authority", 6.8, 6.9; extension, docs/interpretations.md "Signed commit records").

A commit record written by a verifier carries two extension members besides ``writer``:

- ``sig``: the signature, by the private key of the writer's TLS certificate, over the
  deterministic CBOR (SDCP 5.1) of the record without ``sig`` (so over epoch, round, emitted,
  committed, digest, writer and, where present, cert). ECDSA keys sign with SHA-256 (DER
  ``ECDSA-Sig-Value``), Ed25519 keys with Ed25519, RSA keys with RSASSA-PSS, SHA-256, MGF1-SHA-256
  and a 32-byte salt.
- ``cert``: the writer's certificate (DER), on the first record the verifier appends in its epoch
  (and on every later one until an append has succeeded). A reader checks it against the
  deployment's CA and that its URI subjectAltName is the record's ``writer``; the later records of
  the epoch are checked with its public key.

The log is thus self-contained: a router can check a dead verifier's records without ever having
seen that verifier.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from sdcp.protocol import codec
from sdcp.protocol.records import CERT_MEMBER, SIG_MEMBER, UntrustedRecord
from sdcp.transport.certs import uri_sans

__all__ = ["RecordCheck", "RecordSigner", "signed_bytes"]

PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | rsa.RSAPublicKey
PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)
# Made once: a verifier signs every commit record, and building the algorithm object each time was a
# fifth of a signature's cost on the event loop.
_ECDSA = ec.ECDSA(hashes.SHA256())


def signed_bytes(record: dict[str, Any]) -> bytes:
    """What ``sig`` covers: the record's deterministic CBOR without ``sig``."""
    return codec.encode({key: value for key, value in record.items() if key != SIG_MEMBER})


@dataclass(frozen=True)
class RecordSigner:
    """A verifier's signing key and certificate (its TLS pair: the identity is its URI SAN)."""

    key: PrivateKey
    cert_der: bytes

    @classmethod
    def load(cls, cert_path: Path | str, key_path: Path | str) -> RecordSigner:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey):
            raise ValueError(f"{key_path}: a record is signed with an EC, Ed25519 or RSA key")
        return cls(key, cert.public_bytes(serialization.Encoding.DER))

    def sign(self, record: dict[str, Any], with_cert: bool = False) -> dict[str, Any]:
        """``record`` with ``sig`` (and ``cert`` when asked) added, carrying its deterministic
        encoding (``codec.with_member``: the log stores it without encoding it again)."""
        body = {**record, CERT_MEMBER: self.cert_der} if with_cert else dict(record)
        body.pop(SIG_MEMBER, None)
        data = codec.encode(body)
        key = self.key
        if isinstance(key, ec.EllipticCurvePrivateKey):
            signature = key.sign(data, _ECDSA)
        elif isinstance(key, ed25519.Ed25519PrivateKey):
            signature = key.sign(data)
        else:
            signature = key.sign(data, _PSS, hashes.SHA256())
        return codec.with_member(body, data, SIG_MEMBER, signature)


class RecordCheck:
    """Checks records against the deployment's CA: whose they are and that they are unchanged."""

    def __init__(self, ca: x509.Certificate) -> None:
        self._ca = ca
        # DER -> (URI SANs, public key): a certificate is checked once, not once per record.
        self._known: dict[bytes, tuple[tuple[str, ...], PublicKey]] = {}

    @classmethod
    def load(cls, ca_path: Path | str) -> RecordCheck:
        return cls(x509.load_pem_x509_certificate(Path(ca_path).read_bytes()))

    def certificate(self, der: object, writer: str) -> PublicKey:
        """The public key of ``der`` if the CA issued it, it is valid now and names ``writer``."""
        if not isinstance(der, bytes):
            raise UntrustedRecord("the record carries no certificate (cert)")
        known = self._known.get(der)
        if known is None:
            try:
                cert = x509.load_der_x509_certificate(der)
                cert.verify_directly_issued_by(self._ca)
            except (ValueError, TypeError, InvalidSignature) as exc:
                raise UntrustedRecord(f"the record's certificate is not issued by the CA: {exc}") from exc
            now = datetime.datetime.now(datetime.UTC)
            if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
                raise UntrustedRecord("the record's certificate is not valid now")
            key = cert.public_key()
            if not isinstance(key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | rsa.RSAPublicKey):
                raise UntrustedRecord("the record's certificate has a key of no supported type")
            known = (tuple(uri_sans(cert)), key)
            self._known[der] = known
        if writer not in known[0]:
            raise UntrustedRecord(f"the record's certificate does not name its writer {writer}")
        return known[1]

    def signature(self, record: dict[str, Any], key: PublicKey) -> None:
        """Raises UntrustedRecord unless ``sig`` is ``key``'s signature over the record."""
        signature = record.get(SIG_MEMBER)
        if not isinstance(signature, bytes):
            raise UntrustedRecord("the record is not signed (sig)")
        data = signed_bytes(record)
        try:
            if isinstance(key, ec.EllipticCurvePublicKey):
                key.verify(signature, data, _ECDSA)
            elif isinstance(key, ed25519.Ed25519PublicKey):
                key.verify(signature, data)
            else:
                key.verify(signature, data, _PSS, hashes.SHA256())
        except InvalidSignature as exc:
            raise UntrustedRecord("the record's signature does not verify") from exc
