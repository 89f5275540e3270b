"""The ``Eval`` collection: one document per evaluation job and its result (docs/data-model.md).

``_id`` is the job's *reuse key*, a hash of everything that determines the result (model identity, task content,
sampling parameters, k, repeats, seed, tools, scorers; see :mod:`agentrl.eval.runner`). Evaluating the same
model on the same tasks again finds the ``completed`` document and reuses it; ``--force`` starts a new
*generation* of the same key on a fresh split (the old generation's Records stay for audits).

The samples themselves are ordinary Tasks and Records of the split named in ``split`` (``eval:<key12>`` or
``eval:<key12>-<generation>``), rolled out by the normal sampler code.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from pymongo import ReturnDocument
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import DuplicateKeyError

from agentrl.store.models import Document, UTCDatetime, utcnow


class EvalStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"


class Eval(Document):
    """An evaluation job: what was evaluated, where its samples are, and (once completed) its metrics."""

    collection: ClassVar[str] = "Eval"

    name: str
    status: EvalStatus = EvalStatus.RUNNING
    generation: int = 0
    split: str
    key_inputs: dict[str, Any] = {}
    model: dict[str, Any] = {}
    tasks_source: str = ""
    num_tasks: int = 0
    num_samples_per_task: int = 1
    repeats: int = 1
    seed: int | None = None
    sampling: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    by_type: dict[str, dict[str, Any]] = {}
    per_task: list[dict[str, Any]] = []
    stats: dict[str, Any] = {}
    created_at: UTCDatetime
    started_at: UTCDatetime
    finished_at: UTCDatetime | None = None
    duration_s: float | None = None


def eval_split(key: str, generation: int) -> str:
    """The split holding the Tasks and Records of generation ``generation`` of the job ``key``."""
    return f"eval:{key[:12]}" + (f"-{generation}" if generation else "")


class Evals:
    """Start, finish and look up ``Eval`` documents (every change is an atomic conditional update)."""

    def __init__(self, db: AsyncDatabase):
        self.collection = db[Eval.collection]

    async def get(self, key: str) -> Eval | None:
        return Eval.from_mongo(await self.collection.find_one({"_id": key}))

    async def start(self, key: str, fields: dict[str, Any], *, force: bool = False) -> Eval:
        """Open (or join) the job ``key`` and return its document, whose ``split`` is where to sample.

        No document yet: generation 0 is created. A ``completed`` job is returned as it is (its result is reused).
        A ``running`` or ``interrupted`` job is joined / resumed on its split (several processes may work on one
        job: the split's leases share the work). ``force`` starts the next generation on a fresh split.
        """
        while True:
            now = utcnow()
            current = await self.get(key)
            if current is None:
                doc = Eval(id=key, generation=0, split=eval_split(key, 0), created_at=now, started_at=now,
                           **fields)
                try:
                    await self.collection.insert_one(doc.to_mongo())
                    return doc
                except DuplicateKeyError:
                    continue  # another process created it meanwhile: look again
            if not force and current.status == EvalStatus.COMPLETED:
                return current  # the caller reuses its result
            if not force:
                doc = await self.collection.find_one_and_update(
                    {"_id": key, "generation": current.generation, "status": {"$ne": str(EvalStatus.COMPLETED)}},
                    {"$set": {"status": str(EvalStatus.RUNNING)}}, return_document=ReturnDocument.AFTER)
                if doc is not None:
                    return Eval.from_mongo(doc)
                continue
            generation = current.generation + 1
            reset = {**fields, "status": str(EvalStatus.RUNNING), "generation": generation,
                     "split": eval_split(key, generation), "metrics": {}, "by_type": {}, "per_task": [],
                     "stats": {}, "started_at": now, "finished_at": None, "duration_s": None}
            doc = await self.collection.find_one_and_update(
                {"_id": key, "generation": current.generation}, {"$set": reset},
                return_document=ReturnDocument.AFTER)
            if doc is not None:
                return Eval.from_mongo(doc)
            force = False  # another process started a new generation meanwhile: join that one

    async def finish(self, job: Eval, **fields: Any) -> Eval:
        """Store the result of ``job``'s generation and mark it ``completed``."""
        now = utcnow()
        doc = await self.collection.find_one_and_update(
            {"_id": job.id, "generation": job.generation},
            {"$set": {**fields, "status": str(EvalStatus.COMPLETED), "finished_at": now,
                      "duration_s": (now - job.started_at).total_seconds()}},
            return_document=ReturnDocument.AFTER)
        return Eval.from_mongo(doc) if doc is not None else job

    async def interrupt(self, job: Eval) -> None:
        """Mark ``job`` interrupted (a later run with the same key resumes its split)."""
        await self.collection.update_one(
            {"_id": job.id, "generation": job.generation, "status": str(EvalStatus.RUNNING)},
            {"$set": {"status": str(EvalStatus.INTERRUPTED)}})

    async def recent(self, limit: int = 50) -> list[Eval]:
        """The latest jobs first."""
        cursor = self.collection.find({}, sort=[("started_at", -1)], limit=limit)
        return [Eval.from_mongo(doc) async for doc in cursor]
