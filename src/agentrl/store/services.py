"""The ``InferenceService`` registry: registration, heartbeats, load counters and least-loaded selection.

Load counters are owned. ``running_requests`` is the total of the in-flight requests of every owner (a sampler's
inference pool); ``running_by.<owner key>`` holds each owner's share ``n`` and when it was last ``seen`` (epoch
seconds, refreshed by the owner while it has requests in flight). An owner counts its requests itself and writes
its share when it changed (``sync_share``, at most every second or so: see ``agentrl.rollout.inference_pool``);
every update moves an owner's ``n`` and the total together in one atomic update, fenced on the share it replaces,
so the total is always the sum of the shares. An owner that dies (SIGKILL) leaves its
share behind; any live owner reclaims it once it has not been seen for the owner TTL (:meth:`reclaim`), with one
update fenced on the share and ``seen`` it read, so a share that moved meanwhile is never taken.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

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
        created at zero and otherwise kept: other samplers' in-flight requests stay counted until they write their
        shares again. ``fresh_start`` (the engine registering itself as it starts: nothing is in flight on it)
        resets the total and every share together; an owner's next ``sync_share`` finds its share gone and counts
        only what it has in flight then. It also forgets the last policy probe (a new process serves what it
        loaded itself).
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
        owners write their shares again."""
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
        (the samplers' choice) until a later check passes or the service registers afresh."""
        await self.collection.update_one({"_id": base_url.rstrip("/")}, {"$set": {
            "policy_probe": probe.model_dump(mode="python"), "probe_failed": not probe.ok}})

    async def sync_share(self, service_id: str, owner: str, n: int, *, started: int = 0,
                         expected: int | None = None) -> int | None:
        """Set ``owner``'s share on the service to ``n`` in-flight requests (the total moves with it) and count
        ``started`` more requests in ``total_requests``; returns ``n``, or ``None`` when the service is not
        registered.

        ``expected`` is the share the owner last wrote (``None``: none). The update is fenced on it; when the stored
        share differs (reclaimed as dead, reset by the service's fresh registration), it is read and the update
        fenced on what was read, so a share never moves by a change it did not see."""
        key = owner_key(owner)
        for _ in range(4):
            fence: dict[str, Any] = {"_id": service_id}
            if expected is None:
                fence[f"running_by.{key}"] = {"$exists": False}
            else:
                fence[f"running_by.{key}.n"] = expected
            result = await self.collection.update_one(fence, {
                "$inc": {"running_requests": n - (expected or 0), "total_requests": started},
                "$set": {f"running_by.{key}.n": n, f"running_by.{key}.seen": self._epoch_s()}})
            if result.matched_count == 1:
                return n
            doc = await self.collection.find_one({"_id": service_id}, {f"running_by.{key}": 1})
            if doc is None:
                return None
            expected = ((doc.get("running_by") or {}).get(key) or {}).get("n")
        logger.warning("the load share of %s on %s kept changing under it; trying again later", owner, service_id)
        return expected

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
        """Remove ``owner``'s empty shares (when its pool closes, after writing its last shares)."""
        key = owner_key(owner)
        await self.collection.update_many({f"running_by.{key}.n": 0}, {"$unset": {f"running_by.{key}": ""}})
