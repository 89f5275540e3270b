"""``Store``: the async facade over one run's database (PyMongo ``AsyncMongoClient``)."""

from __future__ import annotations

import time
from typing import Any

import pymongo
from pymongo import AsyncMongoClient
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import PyMongoError

from agentrl.log import redact
from agentrl.store.clock import ServerClock
from agentrl.store.command_count import CommandCounter
from agentrl.store.connection import database_name
from agentrl.store.errors import DatabaseUnreachable
from agentrl.store.evals import Evals
from agentrl.store.images import ImageStore
from agentrl.store.indexes import ensure_indexes
from agentrl.store.outage import OutageLog, outage_tolerance_s
from agentrl.store.records import Calls, Records
from agentrl.store.runs import Runs
from agentrl.store.samples import SampleQueue
from agentrl.store.services import ServiceRegistry
from agentrl.store.slots import DEFAULT_LEASE_S, SlotLeases

CONNECT_TIMEOUT_S = 30.0


class Store:
    """All store operations of one run (the database named by the connection string's path).

    ``slots`` hands out Task sample slots as leases, ``records``/``calls`` move trajectories and LLM calls
    through their states, ``samples`` is the trainer's DBRecordData queue, ``services`` the inference-service
    registry, ``runs`` the Run document and metrics, ``images`` the images calls refer to (GridFS). Use as
    ``async with Store(uri) as store:`` (which checks the database answers within ``connect_timeout_s`` and creates
    the indexes) or call ``close()``. Create it inside the
    event loop that will use it. Commands wait ``CONNECT_TIMEOUT_S`` for a database that does not answer; samplers
    and trainers wait as long as for an outage while running (``connect_timeout_s=outage_tolerance_s()``), so one
    started during an outage rides it out as a running one does.

    Once open, an unreachable database is waited for (``agentrl.store.outage``): operations block for up to
    ``$AGENTRL_DB_OUTAGE_S`` seconds instead of failing, and the outage is logged.
    """

    def __init__(self, uri: str, *, lease_s: float = DEFAULT_LEASE_S, client: AsyncMongoClient | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, **client_kwargs: Any):
        self.uri = uri
        self.connect_timeout_s = connect_timeout_s
        self._owns_client = client is None
        self.commands = CommandCounter()
        """The commands this store's own client sent, by name (nothing is counted on a ``client`` passed in)."""
        if client is None:
            tolerance_s = outage_tolerance_s()
            client_kwargs.setdefault("serverSelectionTimeoutMS", int(tolerance_s * 1000))
            client_kwargs.setdefault("event_listeners", [OutageLog(tolerance_s, on_back=self._database_back)])
            client_kwargs["event_listeners"] = [*client_kwargs["event_listeners"], self.commands]
            client = AsyncMongoClient(uri, tz_aware=True, **client_kwargs)
        self.client: AsyncMongoClient = client
        self.db: AsyncDatabase = self.client[database_name(uri)]
        self.clock = ServerClock(self.client)
        self.slots = SlotLeases(self.db, lease_s=lease_s, clock=self.clock)
        self.records = Records(self.db)
        self.calls = Calls(self.db)
        self.samples = SampleQueue(self.db)
        self.services = ServiceRegistry(self.db, clock=self.clock)
        self.runs = Runs(self.db)
        self.evals = Evals(self.db)
        self.images = ImageStore(self.db)

    def _database_back(self) -> None:
        """The outage log's word that the database is reachable again: its clock is measured again."""
        self.clock.remeasure()

    async def connect(self) -> None:
        """Check that the database answers (measuring its clock) and create the indexes, waiting for it up to
        ``connect_timeout_s`` (the outage log says why it waits); :class:`DatabaseUnreachable` naming the (redacted)
        connection string and how long it waited if it does not answer."""
        started = time.monotonic()
        try:
            with pymongo.timeout(self.connect_timeout_s):
                await self.clock.sync()
        except PyMongoError as error:
            raise DatabaseUnreachable(
                f"cannot reach the database at {redact(self.uri)}: waited {time.monotonic() - started:.0f} s "
                f"(limit {self.connect_timeout_s:.0f} s): {redact(str(error)).splitlines()[0][:200]}") from None
        await self.ensure_indexes()

    async def ensure_indexes(self) -> None:
        await ensure_indexes(self.db)

    async def close(self) -> None:
        await self.clock.close()
        if self._owns_client:
            await self.client.close()

    async def __aenter__(self) -> Store:
        try:
            await self.connect()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
