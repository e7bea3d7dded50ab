"""The MLC node's wire contract for errors: which HTTP status carries which cache error, for the node
that answers (`sdcp.services.mlc`) and the client that reads the answer (`sdcp.services.mlc_client`).

| cache error | status | read back as |
|---|---|---|
| `InvalidURI`, `InvalidArgument` | 400 | `InvalidArgument` (objects, leases) |
| `InvalidRecord` | 400 | `InvalidRecord` (logs) |
| (a caller whose role may not do this, docs/security.md) | 403 | `AccessDenied` |
| `ObjectNotFound` | 404 | `ObjectNotFound` |
| `Fenced` | 409 | `Fenced` (logs) |
| `LeaseNotHeld` | 409 | `LeaseNotHeld` (leases) |
| `PreconditionFailed` | 412 | `PreconditionFailed` |
| `ObjectTooLarge` | 413 | `ObjectTooLarge` |
| `CorruptRecord` | 500, `cache_error: CorruptRecord` | `CorruptRecord` |
| `CacheFull` | 507 | `CacheFull` |
| `StoreUnavailable` | 503 | `StoreUnavailable` |

409 means Fenced on a log and LeaseNotHeld on a lease, and nothing else: a full store is 507, so
that a client reads 409 on a log as Fenced without parsing details (docs/interpretations.md).
"""

from __future__ import annotations

from sdcp.cache.errors import (
    AccessDenied,
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
    StoreUnavailable,
)

__all__ = ["LEASE_ERRORS", "LOG_ERRORS", "OBJECT_ERRORS", "ErrorMap", "status_of"]

ErrorMap = dict[int, type[CacheError]]

# The node's side: the first class an error is an instance of gives its status; any other is 500.
_STATUS_OF: dict[type[CacheError], int] = {
    InvalidURI: 400,
    InvalidArgument: 400,
    InvalidRecord: 400,
    ObjectNotFound: 404,
    Fenced: 409,
    LeaseNotHeld: 409,
    PreconditionFailed: 412,
    ObjectTooLarge: 413,
    CorruptRecord: 500,
    CacheFull: 507,
    StoreUnavailable: 503,
}

# The client's side, per kind of resource.
OBJECT_ERRORS: ErrorMap = {
    400: InvalidArgument,
    403: AccessDenied,
    404: ObjectNotFound,
    412: PreconditionFailed,
    413: ObjectTooLarge,
    503: StoreUnavailable,
    507: CacheFull,
}
LEASE_ERRORS: ErrorMap = {**OBJECT_ERRORS, 409: LeaseNotHeld}
LOG_ERRORS: ErrorMap = {**OBJECT_ERRORS, 400: InvalidRecord, 409: Fenced}


def status_of(error: CacheError) -> int:
    """The status with which the node answers ``error``."""
    return next((status for cls, status in _STATUS_OF.items() if isinstance(error, cls)), 500)
