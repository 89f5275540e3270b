"""Records (trajectories): atomic state transitions; DispatchedSamplingTasks (LLM calls): written per trajectory."""

from __future__ import annotations

from typing import Any

from pymongo import UpdateOne
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import BulkWriteError

from agentrl.store.errors import DUPLICATE_KEY, LeaseLost
from agentrl.store.models import RECORD_TRANSITIONS, DispatchedSamplingTask, Record, RecordStatus, utcnow
from agentrl.store.outage import retry_on_reconnect
from agentrl.store.transitions import sources_of, transition


class Records:
    """State changes of ``Record`` documents (creation happens through slot claims)."""

    def __init__(self, db: AsyncDatabase):
        self.collection = db[Record.collection]

    async def get(self, record_id: str) -> Record | None:
        return Record.from_mongo(await self.collection.find_one({"_id": record_id}))

    @retry_on_reconnect
    async def transition(self, record_id: str, target: RecordStatus, **fields: Any) -> Record:
        """Move a Record to ``target`` (the state machine ``RECORD_TRANSITIONS``; docs/data-model.md), setting
        ``fields``. (A lease holder's writes go through ``SlotLeases``, fenced on its lease.)"""
        return Record.from_mongo(await transition(self.collection, RECORD_TRANSITIONS, record_id, target,
                                                  set_fields=fields))

    @retry_on_reconnect
    async def transition_many(self, target: RecordStatus, updates: dict[str, dict[str, Any]]) -> dict[str, str]:
        """Move each Record of ``updates`` (id → its fields) to ``target`` in one command, each only from a state
        that leads there (as ``transition``). Returns ``{}`` when every one moved, else the current state of each
        Record that exists (those not moved stayed as they were). Idempotent: a re-run finds them at ``target``."""
        if not updates:
            return {}
        allowed = sources_of(RECORD_TRANSITIONS, target)
        now = utcnow()
        result = await self.collection.bulk_write([
            UpdateOne({"_id": rid, "status": {"$in": allowed}},
                      {"$set": {**fields, "status": str(target), "updated_at": now}})
            for rid, fields in updates.items()], ordered=False)
        if result.matched_count == len(updates):
            return {}
        return {doc["_id"]: doc["status"]
                async for doc in self.collection.find({"_id": {"$in": list(updates)}}, {"status": 1})}

    @retry_on_reconnect
    async def set_env_instance(self, record_id: str, lease_id: str, instance: dict[str, Any]) -> None:
        """Record the environment instance an attempt works on (while its lease holds: ``LeaseLost`` otherwise, and
        the caller closes the instance itself)."""
        result = await self.collection.update_one({"_id": record_id, "lease_id": lease_id, "leased": True},
                                                  {"$set": {"env_instance": instance, "env_open": True}})
        if result.matched_count != 1:
            raise LeaseLost(f"{record_id}: lease {lease_id} no longer holds; not recording its environment instance")

    @retry_on_reconnect
    async def mark_env_closed(self, record_id: str) -> None:
        await self.collection.update_one({"_id": record_id}, {"$unset": {"env_open": ""}})

    async def open_env_instances(self, task_id: str, slot: int, before_attempt: int) -> list[Record]:
        """Earlier attempts of a slot whose environment instance was never closed (their sampler died)."""
        cursor = self.collection.find({"task_id": task_id, "slot": slot, "attempt": {"$lt": before_attempt},
                                       "env_open": {"$exists": True}})
        return [Record.from_mongo(doc) async for doc in cursor]

    async def for_task(self, task_id: str) -> list[Record]:
        """All attempts of all slots of a Task, by slot then attempt."""
        cursor = self.collection.find({"task_id": task_id}, sort=[("slot", 1), ("attempt", 1)])
        return [Record.from_mongo(doc) async for doc in cursor]


class Calls:
    """``DispatchedSamplingTask`` documents: one per LLM call, written by ``insert`` when their trajectory ends
    (``agentrl.store.call_log``)."""

    def __init__(self, db: AsyncDatabase):
        self.collection = db[DispatchedSamplingTask.collection]

    @retry_on_reconnect
    async def insert(self, calls: list[DispatchedSamplingTask]) -> None:
        """Write the calls of one trajectory (a ``CallLog``) in one command. Idempotent: call ids are
        deterministic (Record id and turn) and each Record's calls are written once, by the attempt that made them,
        so a call already stored (a retry after a broken connection) is left as it is."""
        if not calls:
            return
        try:
            await self.collection.insert_many([call.to_mongo() for call in calls], ordered=False)
        except BulkWriteError as error:
            if any(e.get("code") != DUPLICATE_KEY for e in error.details.get("writeErrors", [])) or (
                    error.details.get("writeConcernErrors")):
                raise

    @retry_on_reconnect
    async def set_credits(self, credits: dict[str, dict[str, Any]]) -> None:
        """Write each call's credit fields (the group stage's, per-turn estimators: ``advantage``, ``step_return``,
        and ``step_reward`` / ``state_key`` where the stage derived them) in one command. Idempotent: a redo of the
        stage writes the same values."""
        if credits:
            await self.collection.bulk_write([UpdateOne({"_id": call_id}, {"$set": fields})
                                              for call_id, fields in credits.items()], ordered=False)

    async def for_records(self, record_ids: list[str]) -> dict[str, list[DispatchedSamplingTask]]:
        """The calls of several Records in one query, by Record, in turn order."""
        calls: dict[str, list[DispatchedSamplingTask]] = {rid: [] for rid in record_ids}
        if record_ids:
            async for doc in self.collection.find({"record_id": {"$in": record_ids}},
                                                  sort=[("record_id", 1), ("turn", 1)]):
                calls[doc["record_id"]].append(DispatchedSamplingTask.from_mongo(doc))
        return calls
