"""Records (trajectories) and DispatchedSamplingTasks (LLM calls): creation and atomic state transitions."""

from __future__ import annotations

from typing import Any

from pymongo.asynchronous.database import AsyncDatabase

from agentrl.store.models import (
    CALL_TRANSITIONS,
    RECORD_TRANSITIONS,
    CallStatus,
    DispatchedSamplingTask,
    Record,
    RecordStatus,
    utcnow,
)
from agentrl.store.transitions import transition


class Records:
    """State changes of ``Record`` documents (creation happens through slot claims)."""

    def __init__(self, db: AsyncDatabase):
        self.collection = db[Record.collection]

    async def get(self, record_id: str) -> Record | None:
        return Record.from_mongo(await self.collection.find_one({"_id": record_id}))

    async def transition(self, record_id: str, target: RecordStatus, *, lease_id: str | None = None,
                         **fields: Any) -> Record:
        """Move a Record to ``target`` (DESIGN §3 state machine); with ``lease_id``, only while that lease holds."""
        extra = {"lease_id": lease_id, "leased": True} if lease_id is not None else None
        doc = await transition(self.collection, RECORD_TRANSITIONS, record_id, target, extra_filter=extra,
                               set_fields=fields)
        return Record.from_mongo(doc)

    async def for_task(self, task_id: str) -> list[Record]:
        """All attempts of all slots of a Task, by slot then attempt."""
        cursor = self.collection.find({"task_id": task_id}, sort=[("slot", 1), ("attempt", 1)])
        return [Record.from_mongo(doc) async for doc in cursor]


class Calls:
    """``DispatchedSamplingTask`` documents: one per LLM call."""

    def __init__(self, db: AsyncDatabase):
        self.collection = db[DispatchedSamplingTask.collection]

    async def start(self, call: DispatchedSamplingTask) -> DispatchedSamplingTask:
        """Store a call about to be sent (status ``running``)."""
        await self.collection.insert_one(call.to_mongo())
        return call

    async def finish(self, call_id: str, target: CallStatus, **fields: Any) -> DispatchedSamplingTask:
        """``running → completed | failed`` with the response fields (output ids, logprobs, ...)."""
        fields.setdefault("finished_at", utcnow())
        return DispatchedSamplingTask.from_mongo(
            await transition(self.collection, CALL_TRANSITIONS, call_id, target, set_fields=fields))

    async def relabel(self, call_id: str, target: CallStatus, **fields: Any) -> DispatchedSamplingTask:
        """``completed → formaterror | toolfailed | repeaterror`` after the tool stage looked at the output."""
        return DispatchedSamplingTask.from_mongo(
            await transition(self.collection, CALL_TRANSITIONS, call_id, target, set_fields=fields))

    async def annotate(self, call_id: str, **fields: Any) -> None:
        """Add non-state fields (e.g. tool calls and results) to a call; its status is left as it is."""
        if "status" in fields:
            raise ValueError("annotate does not change a call's status; use finish or relabel")
        await self.collection.update_one({"_id": call_id}, {"$set": fields})

    async def for_record(self, record_id: str) -> list[DispatchedSamplingTask]:
        cursor = self.collection.find({"record_id": record_id}, sort=[("turn", 1)])
        return [DispatchedSamplingTask.from_mongo(doc) async for doc in cursor]
