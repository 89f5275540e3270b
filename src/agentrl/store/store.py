"""``Store``: the async facade over one run's database (PyMongo ``AsyncMongoClient``)."""

from __future__ import annotations

from typing import Any

from pymongo import AsyncMongoClient
from pymongo.asynchronous.database import AsyncDatabase

from agentrl.store.connection import database_name
from agentrl.store.evals import Evals
from agentrl.store.indexes import ensure_indexes
from agentrl.store.records import Calls, Records
from agentrl.store.runs import Runs
from agentrl.store.samples import SampleQueue
from agentrl.store.services import ServiceRegistry
from agentrl.store.slots import DEFAULT_LEASE_S, SlotLeases


class Store:
    """All store operations of one run (the database named by the connection string's path).

    ``slots`` hands out Task sample slots as leases, ``records``/``calls`` move trajectories and LLM calls
    through their states, ``samples`` is the trainer's DBRecordData queue, ``services`` the inference-service
    registry, ``runs`` the Run document and metrics. Use as ``async with Store(uri) as store:`` or call
    ``close()``. Create it inside the event loop that will use it.
    """

    def __init__(self, uri: str, *, lease_s: float = DEFAULT_LEASE_S, client: AsyncMongoClient | None = None,
                 **client_kwargs: Any):
        self.uri = uri
        self._owns_client = client is None
        self.client: AsyncMongoClient = client or AsyncMongoClient(uri, tz_aware=True, **client_kwargs)
        self.db: AsyncDatabase = self.client[database_name(uri)]
        self.slots = SlotLeases(self.db, lease_s=lease_s)
        self.records = Records(self.db)
        self.calls = Calls(self.db)
        self.samples = SampleQueue(self.db)
        self.services = ServiceRegistry(self.db)
        self.runs = Runs(self.db)
        self.evals = Evals(self.db)

    async def ensure_indexes(self) -> None:
        await ensure_indexes(self.db)

    async def close(self) -> None:
        if self._owns_client:
            await self.client.close()

    async def __aenter__(self) -> Store:
        await self.ensure_indexes()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
