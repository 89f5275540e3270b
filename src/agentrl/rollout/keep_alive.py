"""Heartbeats that keep a lease (a trajectory's slot, a Task's group stage) alive while its work runs.

``KeepAlive`` extends the lease every ``lease_s / 3`` and cancels the work once a heartbeat finds the lease taken
over. Database errors do not stop it: they are logged and retried every 2 s (the lease is measured on the server, so an
outage shorter than the remaining lease costs nothing; after a longer one the first heartbeat that lands either extends
the lease or finds it taken over).

Stopping is a flag as well as a cancellation. Python 3.11's ``asyncio.wait_for`` (which pymongo's socket writes use)
drops a cancellation that arrives as the operation it waits on completes; a heartbeat loop stopped by ``cancel()``
alone would then beat on for ever, keeping a settled slot's lease alive and blocking whoever waits for it to end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pymongo.errors import PyMongoError

from agentrl.store import LeaseLost

logger = logging.getLogger(__name__)

OUTAGE_RETRY_S = 2.0


class KeepAlive:
    """Heartbeat with ``beat`` while ``work`` runs (started at once, on the running loop); ``what`` names the lease in
    the log."""

    def __init__(self, beat: Callable[[], Awaitable[None]], work: asyncio.Task, what: str, lease_s: float) -> None:
        self._beat, self._work, self._what, self._lease_s = beat, work, what, lease_s
        self._stopped = False
        self._task = asyncio.create_task(self._run(), name=f"keep-alive {what}")

    def cancel(self) -> None:
        """Stop heartbeating; one heartbeat already sent may still land (use ``stop`` to wait for it)."""
        self._stopped = True
        self._task.cancel()

    async def stop(self) -> None:
        """Stop heartbeating and return once no heartbeat is in flight: none lands after this returns."""
        self.cancel()
        await asyncio.wait([self._task])

    async def _run(self) -> None:
        interval = self._lease_s / 3
        while not self._stopped:
            await asyncio.sleep(interval)
            if self._stopped:
                return
            try:
                await self._beat()
                interval = self._lease_s / 3
            except LeaseLost:
                if not self._stopped:
                    logger.warning("lost the lease on %s (another sampler took it over); stopping it", self._what)
                    self._work.cancel()
                return
            except PyMongoError as error:
                logger.warning("could not extend the lease on %s (%s); retrying", self._what, error)
                interval = min(self._lease_s / 3, OUTAGE_RETRY_S)
