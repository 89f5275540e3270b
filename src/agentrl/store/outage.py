"""Riding out database outages: every process waits for the database instead of dying, and says so.

How an outage reaches our code, and what handles it:

- **Operations issued while the database is down** wait for it in PyMongo's server selection, up to
  ``outage_tolerance_s()`` (``$AGENTRL_DB_OUTAGE_S``, default 300 s): the ``Store``'s client is created with that
  ``serverSelectionTimeoutMS``. They were never sent, so waiting is always safe. When the tolerance runs out they
  raise ``ServerSelectionTimeoutError`` and the process gives up with a clear message (work in flight is recovered
  by leases and checkpoints as after any crash).
- **Operations in flight when the connection broke** raise ``AutoReconnect``: the server may or may not have applied
  them. Store methods that are idempotent (re-running them after they were applied changes nothing and returns
  the same answer) are decorated with :func:`retry_on_reconnect`; the others (claims, counters) are left to their
  callers, whose protocol recovers an unknown outcome (an orphaned claim is an expiring lease).
- ``OutageLog`` (a PyMongo heartbeat listener) logs one line when the server becomes unreachable, one every
  ``LOG_EVERY_S`` while it stays so, and one when it is back, so an operator sees why a process stalls; when it is
  back it also calls ``on_back`` (the ``Store`` measures the server's clock again: ``agentrl.store.clock``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from pymongo import monitoring
from pymongo.errors import AutoReconnect, ServerSelectionTimeoutError

logger = logging.getLogger(__name__)

ENV = "AGENTRL_DB_OUTAGE_S"
DEFAULT_OUTAGE_S = 300.0
LOG_EVERY_S = 10.0
_MAX_BACKOFF_S = 5.0

P = ParamSpec("P")
T = TypeVar("T")


def outage_tolerance_s() -> float:
    """How long a process waits for an unreachable database before giving up (``$AGENTRL_DB_OUTAGE_S``)."""
    raw = os.environ.get(ENV)
    if raw is None:
        return DEFAULT_OUTAGE_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${ENV}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ValueError(f"${ENV}={raw!r}: expected a positive number of seconds")
    return value


def is_transient(error: BaseException) -> bool:
    """A broken connection during an operation (retry it if it is idempotent), not the end of our patience."""
    return isinstance(error, AutoReconnect) and not isinstance(error, ServerSelectionTimeoutError)


def retry_on_reconnect(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Re-run an **idempotent** store coroutine when its connection broke mid-operation (``AutoReconnect``),
    with exponential backoff, for up to ``outage_tolerance_s()``."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        deadline = time.monotonic() + outage_tolerance_s()
        delay = 0.25
        while True:
            try:
                return await method(*args, **kwargs)
            except AutoReconnect as error:
                if not is_transient(error) or time.monotonic() + delay > deadline:
                    raise
                logger.warning("database connection broke during %s (%s); retrying in %.1f s",
                               method.__qualname__, error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)

    return wrapper


class OutageLog(monitoring.ServerHeartbeatListener):
    """Logs when the database becomes unreachable, while it stays so, and when it is back, from the client's
    server heartbeats. (A heartbeat listener only: a ``ServerListener`` makes PyMongo re-open topologies in a forked
    child, which prints errors when an MCP server is spawned with a ``preexec_fn``.)"""

    def __init__(self, tolerance_s: float, on_back: Callable[[], None] | None = None):
        self.tolerance_s = tolerance_s
        self.on_back = on_back
        self.down_since: float | None = None
        self._last_line = 0.0

    def started(self, event: monitoring.ServerHeartbeatStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.ServerHeartbeatSucceededEvent) -> None:
        if self.down_since is not None:
            logger.warning("database %s:%s reachable again after %.1f s", *event.connection_id,
                           time.monotonic() - self.down_since)
            self.down_since = None
            if self.on_back is not None:
                self.on_back()

    def failed(self, event: monitoring.ServerHeartbeatFailedEvent) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = self._last_line = now
            logger.warning("database %s:%s unreachable (%s); waiting up to %.0f s for it (%s)", *event.connection_id,
                           event.reply, self.tolerance_s, ENV)
        elif now - self._last_line >= LOG_EVERY_S:
            self._last_line = now
            logger.warning("database %s:%s still unreachable after %.0f s (giving up after %.0f s)",
                           *event.connection_id, now - self.down_since, self.tolerance_s)
