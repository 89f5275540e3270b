"""The database server's clock, which every lease is measured against.

Leases are compared across machines (a sampler's heartbeat against another sampler's take-over), so they cannot
use each machine's own clock: a machine whose clock runs ahead would see live leases as expired and steal them.
``ServerClock.now()`` is the local clock corrected by the offset to the server's clock, measured from the
``localTime`` that ``hello`` returns (the midpoint of the round trip, so the error is at most half of it) when the
store opens and again every ``RESYNC_S``.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from pymongo import AsyncMongoClient

from agentrl.store.models import utcnow

logger = logging.getLogger(__name__)

RESYNC_S = 300.0
WARN_SKEW_S = 2.0


class ServerClock:
    """``now()`` in the database server's time (the local clock until ``sync`` has run)."""

    def __init__(self, client: AsyncMongoClient):
        self._client = client
        self.offset = timedelta(0)
        self._synced_at: float | None = None

    def now(self) -> datetime:
        return utcnow() + self.offset

    async def sync(self) -> timedelta:
        """Measure the offset to the server's clock; returns it."""
        sent = utcnow()
        reply = await self._client.admin.command("hello")
        received = utcnow()
        server = reply.get("localTime")
        if not isinstance(server, datetime):
            logger.warning("the database's hello reply has no localTime: leases use this machine's clock")
            return self.offset
        if server.tzinfo is None:
            server = server.replace(tzinfo=UTC)
        self.offset = server - (sent + (received - sent) / 2)
        if self._synced_at is None and abs(self.offset.total_seconds()) > WARN_SKEW_S:
            logger.warning("this machine's clock is %.1f s %s the database's: leases follow the database's clock",
                           abs(self.offset.total_seconds()), "behind" if self.offset > timedelta(0) else "ahead of")
        self._synced_at = time.monotonic()
        return self.offset

    async def maybe_sync(self) -> None:
        """Re-measure the offset when the last measurement is older than ``RESYNC_S``."""
        if self._synced_at is None or time.monotonic() - self._synced_at >= RESYNC_S:
            await self.sync()
