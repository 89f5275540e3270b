"""The database server's clock, which every lease and every service's liveness is measured against.

Leases are compared across machines (a sampler's heartbeat against another sampler's take-over), so they cannot
use each machine's own clock: a machine whose clock runs ahead would see live leases as expired and steal them.
``ServerClock.now()`` is the local clock corrected by the offset to the server's clock.

How the offset is measured (``sync``): a reading is one ``hello`` round trip; the server's ``localTime`` is
taken to be the midpoint of the round trip, so a reading's error is at most half its round trip. Only readings
whose round trip is at most ``MAX_ROUND_TRIP_S`` count, and of ``READINGS`` such readings the one with the
shortest round trip sets the offset. A round trip that waited (for a database that was down, a server selection,
a stalled network) therefore never moves the offset: a process started during a 60 s outage would otherwise take
a clock 30 s wrong, and judge every live lease and heartbeat on it.

When it is measured: when the store opens (``Store.connect`` awaits it), again after every reconnect (the
outage log calls :meth:`ServerClock.remeasure` when the database is reachable again: it may be another server
now) and every ``RESYNC_S``. The later ones run in the background, started by ``now()`` from inside the event
loop, which keeps answering with the last good offset meanwhile; one that finds no short round trip keeps it and
is retried after ``RETRY_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from agentrl.store.models import utcnow
from agentrl.store.outage import retry_on_reconnect

logger = logging.getLogger(__name__)

RESYNC_S = 300.0
"""Seconds between two measurements while nothing reconnects."""
RETRY_S = 30.0
"""Seconds before a measurement that found no short round trip (or failed) is tried again."""
MAX_ROUND_TRIP_S = 1.0
"""A reading whose round trip took longer is not used (its error could be up to half of it)."""
READINGS = 3
"""Short readings per measurement; the shortest round trip's sets the offset."""
MAX_ATTEMPTS = 10
"""Readings tried per measurement before it gives up finding ``READINGS`` short ones."""
WARN_SKEW_S = 1.0
"""An offset larger than this is logged when first measured (NTP keeps machines within milliseconds)."""


@dataclass(frozen=True)
class ClockReading:
    """One ``hello``: the server's clock minus this machine's at the round trip's midpoint, and the round trip."""

    offset: timedelta
    round_trip_s: float


class ServerClock:
    """``now()`` in the database server's time (the local clock until ``sync`` has measured it)."""

    def __init__(self, client: AsyncMongoClient):
        self._client = client
        self.offset = timedelta(0)
        self.round_trip_s: float | None = None
        """The round trip of the reading that set ``offset`` (its error is at most half of it); None: unmeasured."""
        self._due_at = float("inf")  # monotonic time from which ``now()`` measures in the background (after sync)
        self._background: asyncio.Task | None = None

    def now(self) -> datetime:
        """The server's time; from inside the event loop, also starts a due re-measurement in the background."""
        if time.monotonic() >= self._due_at:
            self._start_background()
        return utcnow() + self.offset

    def remeasure(self) -> None:
        """Measure again at the next ``now()`` (called when the database is reachable again after an outage)."""
        self._due_at = 0.0

    async def sync(self) -> timedelta:
        """Measure the offset to the server's clock from short round trips; returns it (the last good one, or
        zero, when none of ``MAX_ATTEMPTS`` readings was short enough)."""
        self._due_at = time.monotonic() + RESYNC_S
        short: list[ClockReading] = []
        longest = 0.0
        for _ in range(MAX_ATTEMPTS):
            reading = await self._read()
            if reading is None:
                return self.offset
            longest = max(longest, reading.round_trip_s)
            if reading.round_trip_s <= MAX_ROUND_TRIP_S:
                short.append(reading)
                if len(short) == READINGS:
                    break
        if not short:
            self._due_at = time.monotonic() + RETRY_S
            logger.warning("could not measure the database's clock: %d round trips of up to %.1f s, none within "
                           "%.1f s; leases keep %s", MAX_ATTEMPTS, longest, MAX_ROUND_TRIP_S,
                           "this machine's clock" if self.round_trip_s is None else "the last measured offset")
            return self.offset
        best = min(short, key=lambda reading: reading.round_trip_s)
        first = self.round_trip_s is None
        self.offset, self.round_trip_s = best.offset, best.round_trip_s
        if first and abs(self.offset.total_seconds()) > WARN_SKEW_S:
            logger.warning("this machine's clock is %.1f s %s the database's: leases follow the database's clock",
                           abs(self.offset.total_seconds()), "behind" if self.offset > timedelta(0) else "ahead of")
        return self.offset

    @retry_on_reconnect
    async def _read(self) -> ClockReading | None:
        sent, started = utcnow(), time.monotonic()
        reply = await self._client.admin.command("hello")
        round_trip_s = time.monotonic() - started
        server = reply.get("localTime")
        if not isinstance(server, datetime):
            logger.warning("the database's hello reply has no localTime: leases use this machine's clock")
            self._due_at = float("inf")
            return None
        if server.tzinfo is None:
            server = server.replace(tzinfo=UTC)
        return ClockReading(offset=server - (sent + timedelta(seconds=round_trip_s / 2)), round_trip_s=round_trip_s)

    def _start_background(self) -> None:
        if self._background is not None and not self._background.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # called outside the event loop: the next call from inside it measures
        self._due_at = time.monotonic() + RETRY_S  # no second one while this runs, nor right after a failure
        self._background = loop.create_task(self._sync_in_background(), name="agentrl-server-clock")

    async def _sync_in_background(self) -> None:
        try:
            await self.sync()
        except PyMongoError as error:
            self._due_at = time.monotonic() + RETRY_S
            logger.debug("measuring the database's clock failed (%s); retrying in %.0f s", error, RETRY_S)

    async def close(self) -> None:
        """Stop a background measurement (before the client closes)."""
        if self._background is not None and not self._background.done():
            self._background.cancel()
            with contextlib.suppress(asyncio.CancelledError, PyMongoError):
                await self._background
        self._background = None
