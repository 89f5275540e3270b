"""Errors raised by store operations."""

from __future__ import annotations

DUPLICATE_KEY = 11000
"""The server's error code of a write refused for a duplicate ``_id`` (or unique key)."""


class StoreError(RuntimeError):
    """Base class of the store's errors."""


class DatabaseUnreachable(StoreError):
    """The database did not answer within the time a process waits for it when it opens its store."""


class NotFound(StoreError):
    """The document an operation targets does not exist."""


class InvalidTransition(StoreError):
    """A state change was requested from a state that does not allow it; nothing was written."""

    def __init__(self, collection: str, doc_id: object, current: str, target: str, allowed_from: list[str]):
        self.collection, self.doc_id, self.current, self.target = collection, doc_id, current, target
        super().__init__(
            f"{collection} {doc_id!s}: cannot change state {current!r} -> {target!r} "
            f"(allowed only from {', '.join(repr(s) for s in allowed_from) or 'nowhere'})"
        )


class LeaseLost(StoreError):
    """The caller's lease expired and was taken over (or released); its work on that slot must stop."""


class VersionConflict(StoreError):
    """``Run.policy_version`` is not the version the caller expected; nothing was written."""
