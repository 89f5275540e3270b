"""The ``InferenceService`` registry: registration, heartbeats, load counters and least-loaded selection.

Load counters are owned. ``running_requests`` is the total of the in-flight requests of every owner (a sampler's
inference pool); ``running_by.<owner key>`` holds each owner's share ``n`` and when it was last ``seen`` (epoch
seconds, refreshed by the owner while it has requests in flight). Every update moves an owner's ``n`` and the total
together in one atomic update, so the total is always the sum of the shares. An owner that dies (SIGKILL) leaves its
share behind; any live owner reclaims it once it has not been seen for the owner TTL (:meth:`reclaim`), with one
update fenced on the share and ``seen`` it read, so a share that moved meanwhile is never taken.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from pymongo import ReturnDocument
from pymongo.asynchronous.database import AsyncDatabase

from agentrl.store.clock import ServerClock
from agentrl.store.models import InferenceService, PolicyProbe, ServiceStatus
from agentrl.store.outage import retry_on_reconnect

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TTL_S = 30.0


def owner_key(owner: str) -> str:
    """``owner`` as a field name: ``%``, ``.`` and ``$`` percent-encoded (a dot would split the field path)."""
    return owner.replace("%", "%25").replace(".", "%2E").replace("$", "%24")


class ServiceRegistry:
    """A service is *live* while its status is UP and its last heartbeat is younger than ``ttl_s``."""

    def __init__(self, db: AsyncDatabase, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S, *,
                 clock: ServerClock | None = None):
        self.collection = db[InferenceService.collection]
        self.ttl_s = ttl_s
        self.clock = clock or ServerClock(db.client)  # heartbeats are judged on the database server's clock

    async def register(self, base_url: str, *, kind: str = "sglang", models: list[str] | None = None,
                       weight_version: int | None = None, fresh_start: bool = False,
                       status: ServiceStatus = ServiceStatus.UP) -> InferenceService:
        """Register (or re-register) a service as UP (or ``status``: STARTING while it loads the run's weights).

        The descriptive fields are set (``models`` and ``weight_version`` only when given). The load counters are
        created at zero and otherwise kept: other samplers' in-flight requests stay counted until they release
        them. ``fresh_start`` (the engine registering itself as it starts: nothing is in flight on it) resets
        the total and every share together, so the owners' later releases of old requests find no share and
        change nothing; it also forgets the last policy probe (a new process serves what it loaded itself).
        """
        service_id = base_url.rstrip("/")
        now = self.clock.now()
        fields: dict[str, Any] = {"base_url": service_id, "kind": kind, "status": str(status),
                                  "heartbeat_at": now, "started_at": now}
        counters: dict[str, Any] = {"running_requests": 0, "running_by": {}, "policy_probe": None,
                                    "probe_failed": False}
        on_insert: dict[str, Any] = {"total_requests": 0, "engine_load": {}}
        (fields if fresh_start else on_insert).update(counters)
        for name, value, default in (("models", models, []), ("weight_version", weight_version, 0)):
            if value is not None:
                fields[name] = value
            else:
                on_insert[name] = default
        await self.collection.update_one({"_id": service_id}, {"$set": fields, "$setOnInsert": on_insert},
                                         upsert=True)
        return InferenceService.from_mongo(await self.collection.find_one({"_id": service_id}))

    async def heartbeat(self, base_url: str, *, weight_version: int | None = None,
                        engine_load: dict[str, Any] | None = None, status: ServiceStatus = ServiceStatus.UP) -> bool:
        """Refresh the heartbeat (and report version/load); ``False`` if the service is not registered."""
        fields: dict[str, Any] = {"heartbeat_at": self.clock.now(), "status": str(status)}
        if weight_version is not None:
            fields["weight_version"] = weight_version
        if engine_load is not None:
            fields["engine_load"] = engine_load
        result = await self.collection.update_one({"_id": base_url.rstrip("/")}, {"$set": fields})
        return result.matched_count == 1

    async def mark_down(self, base_url: str) -> None:
        """Mark the service DOWN (not picked until its next heartbeat); in-flight requests stay counted until their
        owners release them."""
        await self.collection.update_one({"_id": base_url.rstrip("/")},
                                         {"$set": {"status": str(ServiceStatus.DOWN)}})

    def _epoch_s(self) -> float:
        """Seconds since the epoch on the database server's clock (owner shares' ``seen``)."""
        return self.clock.now().timestamp()

    def _live_query(self) -> dict[str, Any]:
        return {"status": str(ServiceStatus.UP), "probe_failed": {"$ne": True},
                "heartbeat_at": {"$gt": self.clock.now() - timedelta(seconds=self.ttl_s)}}

    @retry_on_reconnect
    async def live(self) -> list[InferenceService]:
        cursor = self.collection.find(self._live_query(), sort=[("running_requests", 1)])
        return [InferenceService.from_mongo(doc) async for doc in cursor]

    @retry_on_reconnect
    async def serving(self) -> list[InferenceService]:
        """The services a weight publish must reach: heartbeat fresh and UP or STARTING, whatever their last policy
        probe said (a later publish may fix them)."""
        query = {"$or": [{"status": str(ServiceStatus.UP)}, {"status": str(ServiceStatus.STARTING)}],
                 "heartbeat_at": {"$gt": self.clock.now() - timedelta(seconds=self.ttl_s)}}
        return [InferenceService.from_mongo(doc) async for doc in self.collection.find(query, sort=[("_id", 1)])]

    @retry_on_reconnect
    async def record_probe(self, base_url: str, probe: PolicyProbe) -> None:
        """Store the trainer's check of the policy the service serves; a failed one keeps it out of :meth:`live`
        (and :meth:`acquire`) until a later check passes or the service registers afresh."""
        await self.collection.update_one({"_id": base_url.rstrip("/")}, {"$set": {
            "policy_probe": probe.model_dump(mode="python"), "probe_failed": not probe.ok}})

    async def acquire(self, owner: str, exclude: list[str] | None = None, max_running: int | None = None
                      ) -> InferenceService | None:
        """Pick the least-loaded live service and count one more request of ``owner`` on it (``release`` it
        afterwards).

        ``exclude`` skips services (e.g. ones that just failed); with ``max_running``, services already running
        that many requests are not picked (``None`` when all are that busy).
        """
        query = self._live_query()
        if exclude:
            query["_id"] = {"$nin": list(exclude)}
        if max_running is not None:
            query["running_requests"] = {"$lt": max_running}
        key = owner_key(owner)
        doc = await self.collection.find_one_and_update(
            query, {"$inc": {"running_requests": 1, "total_requests": 1, f"running_by.{key}.n": 1},
                    "$set": {f"running_by.{key}.seen": self._epoch_s()}},
            sort=[("running_requests", 1)], return_document=ReturnDocument.AFTER)
        return InferenceService.from_mongo(doc)

    async def release(self, service_id: str, owner: str) -> None:
        """Count one request of ``owner`` less (a no-op when its share was reclaimed meanwhile)."""
        key = owner_key(owner)
        await self.collection.update_one(
            {"_id": service_id, f"running_by.{key}.n": {"$gt": 0}},
            {"$inc": {"running_requests": -1, f"running_by.{key}.n": -1},
             "$set": {f"running_by.{key}.seen": self._epoch_s()}})

    async def keep_alive(self, service_ids: list[str], owner: str) -> None:
        """Refresh ``owner``'s ``seen`` on the services where it has requests in flight."""
        key = owner_key(owner)
        await self.collection.update_many({"_id": {"$in": service_ids}, f"running_by.{key}.n": {"$gt": 0}},
                                          {"$set": {f"running_by.{key}.seen": self._epoch_s()}})

    async def reclaim(self, owner_ttl_s: float, keep: str | None = None) -> int:
        """Take back the shares of owners not seen for ``owner_ttl_s`` (dead samplers), except ``keep``'s (the
        caller's own); returns how many requests.

        Each share goes with one update fenced on the ``n`` and ``seen`` read: the total drops by ``n`` and the
        share is removed, unless its owner moved it meanwhile. Empty shares of gone owners are removed too.
        """
        cutoff = self._epoch_s() - owner_ttl_s
        kept = owner_key(keep) if keep is not None else None
        reclaimed = 0
        async for doc in self.collection.find({}, {"running_by": 1}):
            for key, share in (doc.get("running_by") or {}).items():
                n, seen = share.get("n", 0), share.get("seen")
                if key == kept or (seen is not None and seen >= cutoff):
                    continue
                fence = {"_id": doc["_id"], f"running_by.{key}.n": n, f"running_by.{key}.seen": seen}
                update: dict[str, Any] = {"$unset": {f"running_by.{key}": ""}}
                if n:
                    update["$inc"] = {"running_requests": -n}
                result = await self.collection.update_one(fence, update)
                if result.modified_count and n:
                    reclaimed += n
                    logger.warning("reclaimed %d in-flight request(s) on %s of owner %s, not seen for %.0fs "
                                   "(dead sampler)", n, doc["_id"], key, self._epoch_s() - (seen or 0))
        return reclaimed

    async def forget(self, owner: str) -> None:
        """Remove ``owner``'s empty shares (when its pool closes)."""
        key = owner_key(owner)
        await self.collection.update_many({f"running_by.{key}.n": 0}, {"$unset": {f"running_by.{key}": ""}})
