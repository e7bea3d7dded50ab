"""The multi-level cache (MLC): objects named by URIs, leases and commit logs (SDCP 6.8)."""

from sdcp.cache.commitlog import CommitLog, FileCommitLog, LogSnapshot, MemoryCommitLog
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
    UnresolvableRef,
)
from sdcp.cache.etags import content_etag
from sdcp.cache.mlc import MLC, Lease, ObjectInfo
from sdcp.cache.uri import ObjectURI, build_uri, check_ref, parse_uri, target_kv_uri

__all__ = [
    "MLC",
    "AccessDenied",
    "CacheError",
    "CacheFull",
    "CommitLog",
    "CorruptRecord",
    "FileCommitLog",
    "Fenced",
    "InvalidArgument",
    "InvalidRecord",
    "InvalidURI",
    "Lease",
    "LeaseNotHeld",
    "LogSnapshot",
    "MemoryCommitLog",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectTooLarge",
    "ObjectURI",
    "PreconditionFailed",
    "StoreUnavailable",
    "UnresolvableRef",
    "build_uri",
    "check_ref",
    "content_etag",
    "parse_uri",
    "target_kv_uri",
]
