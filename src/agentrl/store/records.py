"""Records (trajectories) and DispatchedSamplingTasks (LLM calls): creation and atomic state transitions."""

from __future__ import annotations

from typing import Any

from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import DuplicateKeyError

from agentrl.store.errors import InvalidTransition, LeaseLost
from agentrl.store.models import (
    CALL_TRANSITIONS,
    RECORD_TRANSITIONS,
    CallStatus,
    DispatchedSamplingTask,
    Record,
    RecordStatus,
    utcnow,
)
from agentrl.store.outage import retry_on_reconnect
from agentrl.store.transitions import transition


class Records:
    """State changes of ``Record`` documents (creation happens through slot claims)."""

    def __init__(self, db: AsyncDatabase):
        self.collection = db[Record.collection]

    async def get(self, record_id: str) -> Record | None:
        return Record.from_mongo(await self.collection.find_one({"_id": record_id}))

    @retry_on_reconnect
    async def transition(self, record_id: str, target: RecordStatus, *, lease_id: str | None = None,
                         **fields: Any) -> Record:
        """Move a Record to ``target`` (the state machine RECORD_TRANSITIONS; docs/data-model.md); with ``lease_id``, only while that lease holds
        (and then idempotent: a Record this lease already moved to ``target`` is returned as it is)."""
        extra = {"lease_id": lease_id, "leased": True} if lease_id is not None else None
        try:
            doc = await transition(self.collection, RECORD_TRANSITIONS, record_id, target, extra_filter=extra,
                                   set_fields=fields)
        except InvalidTransition as error:
            if lease_id is None or error.current != str(target):
                raise
            doc = await self.collection.find_one({"_id": record_id, **extra})
            if doc is None:
                raise
        return Record.from_mongo(doc)

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
    """``DispatchedSamplingTask`` documents: one per LLM call."""

    def __init__(self, db: AsyncDatabase):
        self.collection = db[DispatchedSamplingTask.collection]

    @retry_on_reconnect
    async def start(self, call: DispatchedSamplingTask) -> DispatchedSamplingTask:
        """Store a call about to be sent (status ``running``). Idempotent: call ids are deterministic (Record id
        and turn) and only the attempt holding the Record's lease writes them."""
        try:
            await self.collection.insert_one(call.to_mongo())
        except DuplicateKeyError:
            if await self.collection.count_documents({"_id": call.id, "record_id": call.record_id,
                                                      "status": str(CallStatus.RUNNING)}) != 1:
                raise
        return call

    async def finish(self, call_id: str, target: CallStatus, **fields: Any) -> DispatchedSamplingTask:
        """``running → completed | failed`` with the response fields (output ids, logprobs, ...)."""
        fields.setdefault("finished_at", utcnow())
        return await self._move(call_id, target, fields)

    async def relabel(self, call_id: str, target: CallStatus, **fields: Any) -> DispatchedSamplingTask:
        """``completed → formaterror | toolfailed | repeaterror`` after the tool stage looked at the output."""
        return await self._move(call_id, target, fields)

    @retry_on_reconnect
    async def _move(self, call_id: str, target: CallStatus, fields: dict[str, Any]) -> DispatchedSamplingTask:
        """One call transition; a call already in ``target`` is returned as it is (a retry after a broken
        connection: a call has one writer, the attempt holding its Record's lease)."""
        try:
            doc = await transition(self.collection, CALL_TRANSITIONS, call_id, target, set_fields=fields)
        except InvalidTransition as error:
            if error.current != str(target):
                raise
            doc = await self.collection.find_one({"_id": call_id})
        return DispatchedSamplingTask.from_mongo(doc)

    @retry_on_reconnect
    async def annotate(self, call_id: str, **fields: Any) -> None:
        """Add non-state fields (e.g. tool calls and results) to a call; its status is left as it is."""
        if "status" in fields:
            raise ValueError("annotate does not change a call's status; use finish or relabel")
        await self.collection.update_one({"_id": call_id}, {"$set": fields})

    async def for_record(self, record_id: str) -> list[DispatchedSamplingTask]:
        cursor = self.collection.find({"record_id": record_id}, sort=[("turn", 1)])
        return [DispatchedSamplingTask.from_mongo(doc) async for doc in cursor]
