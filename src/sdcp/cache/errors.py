"""Typed errors of the multi-level cache; every one derives from `CacheError`."""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every error the MLC raises for bad input or a refused operation."""


class InvalidURI(CacheError):
    """The object name is not an absolute URI, or not of the shape a parser of our own names expects."""


class UnresolvableRef(InvalidURI):
    """No MLC is configured for the authority of the object's URI (SDCP 5.2 cache-ref)."""


class ObjectNotFound(CacheError):
    """No tier holds the object (or it was deleted)."""


class ObjectTooLarge(CacheError):
    """The object exceeds the configured maximum object size or the shared tier's capacity."""


class CacheFull(CacheError):
    """Capacity pressure could not be relieved because the remaining objects are leased."""


class PreconditionFailed(CacheError):
    """The If-Match entity tag does not name the current version (HTTP 412 semantics)."""


class Fenced(CacheError):
    """The commit log holds a fence record with a higher epoch than the appended record (SDCP 6.8)."""


class CorruptRecord(CacheError):
    """A stored record fails its checksum or does not decode as a CBOR map with an epoch."""


class InvalidRecord(CacheError):
    """A record given to append is not a CBOR-encodable map carrying a non-negative integer epoch."""


class LeaseNotHeld(CacheError):
    """The holder has no live lease on the object (never taken, released, or expired)."""


class AccessDenied(CacheError):
    """The store refused the caller: its role may not do this to the object (docs/security.md)."""


class StoreUnavailable(CacheError):
    """The shared store cannot be reached or did not answer (a Redis restart, a lost link): the
    operation may be repeated later; whether a write took effect is unknown."""


class InvalidArgument(CacheError):
    """An argument has the wrong type or range (object data not bytes, non-positive TTL, ...)."""
