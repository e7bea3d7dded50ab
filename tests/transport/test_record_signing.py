"""Signed commit records (SDCP 1.3, 6.9; docs/interpretations.md "Signed commit records"): a
verifier's signature over each record, checked before a replay counts it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sdcp.protocol.digest import extend_digest, prefix_digest
from sdcp.protocol.messages import Constraint
from sdcp.protocol.records import (
    CommitRecord,
    FenceRecord,
    LogReplayer,
    UntrustedRecord,
    bind_record,
    replay_commit_log,
    session_terms,
)
from sdcp.transport.certs import CA_CERT_FILE, make_certs
from sdcp.transport.signing import RecordCheck, RecordSigner

V1 = "https://127.0.0.1:9301"
V2 = "https://127.0.0.1:9302"
ROGUE = "https://127.0.0.1:9303"
CONTRACT = b"\x07" * 32
PROMPT = (3, 4)
Pki = tuple[RecordCheck, dict[str, RecordSigner], RecordSigner]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    issued = make_certs(directory, [V1, V2])
    other = make_certs(tmp_path_factory.mktemp("other"), [V1])[V1]  # another CA's certificate for V1
    signers = {uri: RecordSigner.load(cert.cert_path, cert.key_path) for uri, cert in issued.items()}
    return RecordCheck.load(Path(directory) / CA_CERT_FILE), signers, RecordSigner.load(other.cert_path, other.key_path)


def chain(epoch_writers: list[tuple[int, str, RecordSigner | None]]) -> list[dict[str, object]]:
    """One signed record of one token per entry, each extending the last; a fence before each epoch > 1."""
    digest = prefix_digest(CONTRACT, PROMPT)
    records: list[dict[str, object]] = []
    epoch_seen: set[int] = set()
    for index, (epoch, writer, signer) in enumerate(epoch_writers):
        first = epoch not in epoch_seen
        if first and epoch > 1:
            records.append(FenceRecord(epoch, writer).to_obj())
        epoch_seen.add(epoch)
        digest = extend_digest(digest, (100 + index,))
        record = {**CommitRecord(epoch, index + 1, (100 + index,), index + 1, digest).to_obj(), "writer": writer}
        records.append(signer.sign(record, first) if signer is not None else record)
    return records


def replay(pki_check: RecordCheck, records: list[dict[str, object]]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    result = replay_commit_log(records, CONTRACT, PROMPT, authority=pki_check, first_verifier=V1)
    return result.tokens, result.faults


def test_signed_records_of_each_epochs_verifier_replay(pki: Pki) -> None:
    check, signers, _ = pki
    records = chain([(1, V1, signers[V1]), (1, V1, signers[V1]), (2, V2, signers[V2]), (2, V2, signers[V2])])
    assert "cert" in records[0] and "cert" not in records[1]
    assert replay(check, records) == ((100, 101, 102, 103), ())


def test_tampered_tokens_are_a_fault_and_the_epoch_counts_no_more(pki: Pki) -> None:
    check, signers, _ = pki
    records = chain([(1, V1, signers[V1]), (1, V1, signers[V1]), (1, V1, signers[V1])])
    records[1] = {**records[1], "emitted": [999]}
    tokens, faults = replay(check, records)
    assert tokens == (100,)
    assert len(faults) == 1 and "signature" in faults[0]


@pytest.mark.parametrize("case", ["missing", "wrong key", "other CA", "unsigned log"])
def test_a_record_not_signed_by_its_writer_is_a_fault(pki: Pki, case: str) -> None:
    check, signers, rogue = pki
    records = chain([(1, V1, signers[V1]), (1, V1, signers[V1])])
    unsigned = {k: v for k, v in records[1].items() if k not in ("sig", "cert")}
    if case == "missing":
        records[1] = unsigned
    elif case == "wrong key":
        records[1] = signers[V2].sign(unsigned)  # V2's key, V1's name and V1's certificate before it
    elif case == "other CA":
        records = [rogue.sign({k: v for k, v in records[0].items() if k not in ("sig", "cert")}, True), records[1]]
    else:
        records = [{k: v for k, v in r.items() if k not in ("sig", "cert")} for r in records]
    tokens, faults = replay(check, records)
    assert tokens == ((100,) if case in ("missing", "wrong key") else ())
    assert len(faults) == 1


def test_another_verifiers_valid_record_in_the_fenced_epoch_is_a_fault(pki: Pki) -> None:
    check, signers, _ = pki
    records = chain([(1, V1, signers[V1]), (2, V2, signers[V2])])
    # V1, trusted and validly signed, appends at epoch 2, which the router opened at V2.
    records.insert(1, FenceRecord(2, V2).to_obj())
    records = records[:2] + [signers[V1].sign({**records[3], "writer": V1}, True)]
    tokens, faults = replay(check, records)
    assert tokens == (100,) and "not by" in faults[0]


def test_the_next_epoch_resumes_from_the_last_good_record(pki: Pki) -> None:
    check, signers, _ = pki
    good = chain([(1, V1, signers[V1]), (2, V2, signers[V2])])
    first_digest = good[0]["digest"]
    assert isinstance(first_digest, bytes)
    forged = {k: v for k, v in good[0].items() if k not in ("sig", "cert")}
    forged.update(round=2, emitted=[666], committed=2, digest=extend_digest(first_digest, (666,)))
    # A drafter with write access appends a forged record after V1's; the router fences epoch 2 at V2.
    tokens, faults = replay(check, [good[0], forged, *good[1:]])
    assert tokens == (100, 101) and len(faults) == 1


def test_a_failover_fences_above_a_second_verifiers_record_at_the_next_epoch(pki: Pki) -> None:
    """V2, trusted, appends a validly signed record at epoch 2 to V1's session (no fence names it).
    A fence at 2 would follow that record and leave epoch 2 poisoned: V2's own records after the
    failover would never count. The router fences at 3, and V2's records there replay."""
    check, signers, _ = pki
    records = chain([(1, V1, signers[V1]), (1, V1, signers[V1])])
    intruder = chain([(1, V1, signers[V1]), (1, V1, signers[V1]), (2, V2, signers[V2])])[-1]
    replayer = LogReplayer(CONTRACT, PROMPT, authority=check, first_verifier=V1)
    assert replayer.feed([*records, intruder]) != []
    assert replayer.epoch_to_fence(1, V2) == 3
    after = chain([(1, V1, signers[V1]), (1, V1, signers[V1]), (3, V2, signers[V2])])[2:]
    assert replayer.feed(after) == []
    assert replayer.replay.tokens == (100, 101, 102) and replayer.replay.epoch == 3


def test_a_retried_failover_fences_its_own_epoch_again_and_a_clean_log_the_next(pki: Pki) -> None:
    check, signers, _ = pki
    replayer = LogReplayer(CONTRACT, PROMPT, authority=check, first_verifier=V1)
    replayer.feed(chain([(1, V1, signers[V1])]))
    assert replayer.epoch_to_fence(1, V2) == 2
    # The fence of the last try named V2 at epoch 2: the same failover fences it again (nothing is
    # appended); a failover to another verifier moves past it.
    replayer.feed([FenceRecord(2, V2).to_obj()])
    assert replayer.epoch_to_fence(1, V2) == 2
    assert replayer.epoch_to_fence(1, V1) == 3
    # A fence an intruder wrote far ahead is passed too.
    replayer.feed([FenceRecord(9).to_obj()])
    assert replayer.epoch_to_fence(1, V2) == 10


def test_a_certificate_must_name_the_writer(pki: Pki) -> None:
    check, signers, _ = pki
    with pytest.raises(UntrustedRecord):
        check.certificate(signers[V2].cert_der, V1)
    with pytest.raises(UntrustedRecord):
        check.certificate(b"not a certificate", V1)


def test_signing_costs_little(pki: Pki) -> None:
    """The verifier signs on its append path: an ECDSA P-256 signature is tens of microseconds."""
    _, signers, _ = pki
    record = chain([(1, V1, None)])[0]
    started = time.perf_counter()
    for _ in range(200):
        signers[V1].sign(record)
    per_sign = (time.perf_counter() - started) / 200
    print(f"sign: {per_sign * 1e6:.0f} us")
    assert per_sign < 0.005


SESSION = b"\x11" * 16
OTHER_SESSION = b"\x22" * 16


def bound_chain(signer: RecordSigner, session: bytes, terms: bytes, count: int) -> list[dict[str, object]]:
    """``count`` signed records of one token each, bound to ``session`` and ``terms`` as ours are."""
    digest = prefix_digest(CONTRACT, PROMPT)
    records: list[dict[str, object]] = []
    for index in range(count):
        digest = extend_digest(digest, (100 + index,))
        record = CommitRecord(1, index + 1, (100 + index,), index + 1, digest)
        records.append(signer.sign(bind_record(record, writer=V1, session=session, terms=terms), index == 0))
    return records


@pytest.mark.parametrize(
    "spliced",
    ["another session, same terms", "same session id, another constraint", "another session and constraint"],
)
def test_a_record_signed_for_another_place_is_a_fault(pki: Pki, spliced: str) -> None:
    """Issue #36: a verifier's genuinely signed records, of a session with the same contract and
    prompt (so the same digest chain), copied into another session's log are never replayed."""
    check, signers, _ = pki
    plain = session_terms(constraint=None, min_new=None)
    forcing = session_terms(constraint=Constraint(kind="regex", text="SPLICED.*"), min_new=None)
    session, terms = {
        "another session, same terms": (OTHER_SESSION, plain),
        "same session id, another constraint": (SESSION, forcing),
        "another session and constraint": (OTHER_SESSION, forcing),
    }[spliced]
    records = bound_chain(signers[V1], session, terms, 3)
    replayer = LogReplayer(CONTRACT, PROMPT, authority=check, first_verifier=V1, session=SESSION, terms=plain)
    faults = replayer.feed(records)
    assert replayer.replay.tokens == () and len(faults) == 1 and "another log" in faults[0]
    own = LogReplayer(CONTRACT, PROMPT, authority=check, first_verifier=V1, session=session, terms=terms)
    assert own.feed(records) == [] and own.replay.tokens == (100, 101, 102)


def test_terms_bind_the_constraint_and_min_new() -> None:
    json_schema = Constraint(kind="json_schema", text="{}")
    terms = {
        session_terms(constraint=None, min_new=None),
        session_terms(constraint=json_schema, min_new=None),
        session_terms(constraint=Constraint(kind="json_schema", text='{"type": "object"}'), min_new=None),
        session_terms(constraint=Constraint(kind="regex", text="{}"), min_new=None),
        session_terms(constraint=None, min_new=3),
    }
    assert len(terms) == 5
    assert session_terms(constraint=None, min_new=0) == session_terms(constraint=None, min_new=None)
