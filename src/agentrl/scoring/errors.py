"""Errors a scorer raises to say that no verdict could be had (as opposed to a verdict of 0)."""

from __future__ import annotations

DEFAULT_UNAVAILABLE_RETRY_S = 600.0


class ScorerUnavailable(RuntimeError):
    """The scorer's backend cannot be reached (not a verdict): retry later, for up to ``retry_for_s`` seconds."""

    def __init__(self, message: str, retry_for_s: float = DEFAULT_UNAVAILABLE_RETRY_S):
        super().__init__(message)
        self.retry_for_s = retry_for_s
