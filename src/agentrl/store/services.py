"""The ``InferenceService`` registry: registration, heartbeats, load counters and least-loaded selection."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pymongo import ReturnDocument
from pymongo.asynchronous.database import AsyncDatabase

from agentrl.store.models import InferenceService, ServiceStatus, utcnow

DEFAULT_HEARTBEAT_TTL_S = 30.0


class ServiceRegistry:
    """A service is *live* while its status is UP and its last heartbeat is younger than ``ttl_s``."""

    def __init__(self, db: AsyncDatabase, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S):
        self.collection = db[InferenceService.collection]
        self.ttl_s = ttl_s

    async def register(self, base_url: str, *, kind: str = "sglang", models: list[str] | None = None,
                       weight_version: int = 0) -> InferenceService:
        """Register (or re-register) a service as UP; its load counters start from zero."""
        now = utcnow()
        service = InferenceService(id=base_url.rstrip("/"), base_url=base_url.rstrip("/"), kind=kind,
                                   models=models or [], weight_version=weight_version, heartbeat_at=now,
                                   started_at=now)
        await self.collection.replace_one({"_id": service.id}, service.to_mongo(), upsert=True)
        return service

    async def heartbeat(self, base_url: str, *, weight_version: int | None = None,
                        engine_load: dict[str, Any] | None = None) -> bool:
        """Refresh the heartbeat (and report version/load); ``False`` if the service is not registered."""
        fields: dict[str, Any] = {"heartbeat_at": utcnow(), "status": str(ServiceStatus.UP)}
        if weight_version is not None:
            fields["weight_version"] = weight_version
        if engine_load is not None:
            fields["engine_load"] = engine_load
        result = await self.collection.update_one({"_id": base_url.rstrip("/")}, {"$set": fields})
        return result.matched_count == 1

    async def mark_down(self, base_url: str) -> None:
        await self.collection.update_one({"_id": base_url.rstrip("/")},
                                         {"$set": {"status": str(ServiceStatus.DOWN), "running_requests": 0}})

    def _live_query(self) -> dict[str, Any]:
        return {"status": str(ServiceStatus.UP),
                "heartbeat_at": {"$gt": utcnow() - timedelta(seconds=self.ttl_s)}}

    async def live(self) -> list[InferenceService]:
        cursor = self.collection.find(self._live_query(), sort=[("running_requests", 1)])
        return [InferenceService.from_mongo(doc) async for doc in cursor]

    async def acquire(self, exclude: list[str] | None = None, max_running: int | None = None
                      ) -> InferenceService | None:
        """Pick the least-loaded live service and count one more request on it (release it afterwards).

        ``exclude`` skips services (e.g. ones that just failed); with ``max_running``, services already running
        that many requests are not picked (``None`` when all are that busy).
        """
        query = self._live_query()
        if exclude:
            query["_id"] = {"$nin": list(exclude)}
        if max_running is not None:
            query["running_requests"] = {"$lt": max_running}
        doc = await self.collection.find_one_and_update(
            query, {"$inc": {"running_requests": 1, "total_requests": 1}},
            sort=[("running_requests", 1)], return_document=ReturnDocument.AFTER)
        return InferenceService.from_mongo(doc)

    async def release(self, service_id: str) -> None:
        await self.collection.update_one({"_id": service_id, "running_requests": {"$gt": 0}},
                                         {"$inc": {"running_requests": -1}})
