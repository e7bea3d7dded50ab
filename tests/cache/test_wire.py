"""The MLC node's error contract read in both directions (sdcp.cache.wire)."""

from __future__ import annotations

import pytest

from sdcp.cache.errors import (
    CacheError,
    CacheFull,
    CorruptRecord,
    Fenced,
    InvalidArgument,
    InvalidRecord,
    InvalidURI,
    LeaseNotHeld,
    ObjectNotFound,
    ObjectTooLarge,
    PreconditionFailed,
)
from sdcp.cache.wire import LEASE_ERRORS, LOG_ERRORS, OBJECT_ERRORS, ErrorMap, status_of


@pytest.mark.parametrize(
    ("error", "errors", "read_back_as"),
    [
        (InvalidURI("u"), OBJECT_ERRORS, InvalidArgument),
        (InvalidArgument("a"), LEASE_ERRORS, InvalidArgument),
        (InvalidRecord("r"), LOG_ERRORS, InvalidRecord),
        (ObjectNotFound("n"), OBJECT_ERRORS, ObjectNotFound),
        (Fenced("f"), LOG_ERRORS, Fenced),
        (LeaseNotHeld("l"), LEASE_ERRORS, LeaseNotHeld),
        (PreconditionFailed("p"), LOG_ERRORS, PreconditionFailed),
        (ObjectTooLarge("t"), OBJECT_ERRORS, ObjectTooLarge),
        (CacheFull("c"), OBJECT_ERRORS, CacheFull),
    ],
)
def test_what_the_node_answers_the_client_reads_back(
    error: CacheError, errors: ErrorMap, read_back_as: type[CacheError]
) -> None:
    assert errors[status_of(error)] is read_back_as


def test_a_corrupt_record_is_a_server_failure_and_409_is_only_fenced_or_not_held() -> None:
    assert status_of(CorruptRecord("c")) == 500
    assert status_of(CacheFull("full")) == 507
    assert {OBJECT_ERRORS.get(409), LEASE_ERRORS[409], LOG_ERRORS[409]} == {None, LeaseNotHeld, Fenced}
