"""The DBRecordData queue between conversion and trainer ranks: ``queued → claimed(rank, step) → trained``
(or ``→ skipped``, with a reason, when a trainer decides not to train a claimed sample).

A rank claims the samples of a step one atomic ``find_one_and_update`` at a time (oldest policy version first,
then enqueue order), so concurrent ranks never get the same sample, and a group that finished after a younger
one is still trained before it goes stale. Claims are keyed by (rank, step): asking again for the same step returns the
samples already claimed for it, which is what makes a resumed trainer see exactly the data it saw before.
"""

from __future__ import annotations

import time
from typing import Any

from pymongo import ReturnDocument, UpdateOne
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import BulkWriteError

from agentrl.failpoints import failpoint
from agentrl.store.errors import DUPLICATE_KEY, StoreError
from agentrl.store.models import DBRecordData, SampleStatus, utcnow
from agentrl.store.outage import retry_on_reconnect


class SampleQueue:
    def __init__(self, db: AsyncDatabase):
        self.collection = db[DBRecordData.collection]

    @retry_on_reconnect
    async def enqueue(self, samples: list[DBRecordData]) -> int:
        """Insert samples (``seq`` is assigned in enqueue order when left at 0). Returns how many were queued.

        One command. Idempotent: samples whose ``_id`` is already stored are skipped (a group stage redone after a
        crash enqueues nothing twice), also when two runs of the same group stage (one that outlived its lease and
        the one that took it over) queue them at the same time: the duplicate keys are ignored.
        """
        if not samples:
            return 0
        base = time.time_ns()
        docs = []
        for i, sample in enumerate(samples):
            doc = sample.to_mongo()
            doc["status"] = str(SampleStatus.QUEUED)
            doc["first_version"] = sample.oldest_version()
            if not doc.get("seq"):
                doc["seq"] = base + i
            docs.append(doc)
        try:
            await self.collection.insert_many(docs, ordered=False)
        except BulkWriteError as error:  # only samples another writer queued first may fail, by their _id
            errors = error.details.get("writeErrors", [])
            taken = [docs[e["index"]]["_id"] for e in errors if e.get("code") == DUPLICATE_KEY]
            if (len(taken) != len(errors)
                    or await self.collection.count_documents({"_id": {"$in": taken}}) != len(taken)):
                raise
            return len(docs) - len(taken)
        return len(docs)

    @retry_on_reconnect
    async def claim_batch(self, rank: int, step: int, size: int, split: str = "train") -> list[DBRecordData]:
        """Samples for ``rank``'s ``step``: those it already claimed for that step, topped up to ``size``."""
        claimed = [DBRecordData.from_mongo(doc) async for doc in self.collection.find(
            {"status": str(SampleStatus.CLAIMED), "claimed_rank": rank, "claimed_step": step}, sort=[("seq", 1)])]
        while len(claimed) < size:
            doc = await self.collection.find_one_and_update(
                {"split": split, "status": str(SampleStatus.QUEUED)},
                {"$set": {"status": str(SampleStatus.CLAIMED), "claimed_rank": rank, "claimed_step": step,
                          "claimed_at": utcnow()}},
                sort=[("first_version", 1), ("seq", 1)],
                return_document=ReturnDocument.AFTER,
            )
            if doc is None:
                break
            claimed.append(DBRecordData.from_mongo(doc))
            failpoint("samples.claim.after_one")
        return claimed

    @retry_on_reconnect
    async def mark_trained(self, rank: int, step: int, sample_ids: list[Any]) -> None:
        """``claimed(rank, step) → trained`` for exactly these samples; raises if any was neither so claimed nor
        already trained by this (rank, step) (idempotent: a retry after a broken connection succeeds)."""
        mine = {"_id": {"$in": list(sample_ids)}, "claimed_rank": rank, "claimed_step": step}
        result = await self.collection.update_many(
            {**mine, "status": str(SampleStatus.CLAIMED)},
            {"$set": {"status": str(SampleStatus.TRAINED), "trained_at": utcnow()}},
        )
        if (result.modified_count != len(sample_ids) and await self.collection.count_documents(
                {**mine, "status": str(SampleStatus.TRAINED)}) != len(sample_ids)):
            raise StoreError(f"rank {rank} step {step}: {len(sample_ids) - result.modified_count} of "
                             f"{len(sample_ids)} samples were not claimed by it (already trained or requeued)")

    @retry_on_reconnect
    async def others_in_play(self, record_id: str, sample_ids: list[Any]) -> int:
        """How many samples of Record ``record_id`` besides ``sample_ids`` are not skipped (queued, claimed or
        trained: the Record may still be, or is, trained through them)."""
        return await self.collection.count_documents({"record_id": record_id, "_id": {"$nin": list(sample_ids)},
                                                      "status": {"$ne": str(SampleStatus.SKIPPED)}})

    @retry_on_reconnect
    async def claimed_steps(self) -> list[int]:
        """The steps that hold claims (of any rank)."""
        return sorted(await self.collection.distinct("claimed_step", {"status": str(SampleStatus.CLAIMED)}))

    @retry_on_reconnect
    async def mark_logged_trained(self, step: int, sample_ids: list[Any]) -> int:
        """``claimed(any rank, step) → trained`` for those of ``sample_ids`` (a step whose ledger lists them);
        returns how many."""
        result = await self.collection.update_many(
            {"_id": {"$in": list(sample_ids)}, "claimed_step": step, "status": str(SampleStatus.CLAIMED)},
            {"$set": {"status": str(SampleStatus.TRAINED), "trained_at": utcnow()}})
        return result.modified_count

    @retry_on_reconnect
    async def record_trainer_logprobs(self, rank: int, step: int, version: int | None,
                                      logprobs: dict[Any, list[float]]) -> None:
        """Keep the logprobs the trainer computed for its claimed samples (``trainer_logprobs``, aligned with
        ``logprobs``; the policy ``trainer_version``, None when the weights had updates not yet published), so
        audits can compare them token by token with the engine's.
        An annotation, not part of the claim protocol: a sample trained again after a resume is overwritten."""
        if not logprobs:
            return
        await self.collection.bulk_write([
            UpdateOne({"_id": sample_id, "claimed_rank": rank, "claimed_step": step},
                      {"$set": {"trainer_logprobs": values, "trainer_version": version}})
            for sample_id, values in logprobs.items()], ordered=False)

    @retry_on_reconnect
    async def mark_trained_through(self, rank: int, step: int) -> int:
        """``claimed(rank, s) → trained`` for every step ``s <= step`` (e.g. once a checkpoint of ``step`` holds
        their updates). Returns how many samples changed."""
        result = await self.collection.update_many(
            {"status": str(SampleStatus.CLAIMED), "claimed_rank": rank, "claimed_step": {"$lte": step}},
            {"$set": {"status": str(SampleStatus.TRAINED), "trained_at": utcnow()}},
        )
        return result.modified_count

    @retry_on_reconnect
    async def skip(self, rank: int, step: int, sample_ids: list[Any], reason: str) -> int:
        """``claimed(rank, step) → skipped`` with ``reason``: claimed samples the trainer decided not to train.
        Returns how many changed."""
        if not sample_ids:
            return 0
        result = await self.collection.update_many(
            {"_id": {"$in": list(sample_ids)}, "status": str(SampleStatus.CLAIMED), "claimed_rank": rank,
             "claimed_step": step},
            {"$set": {"status": str(SampleStatus.SKIPPED), "skip_reason": reason}},
        )
        return result.modified_count

    @retry_on_reconnect
    async def start_epoch(self, split: str, epoch: int) -> int:
        """Queue the trained samples of ``split`` from earlier epochs again, for pass ``epoch`` (offline training
        over a fixed data set). Idempotent; returns how many were queued."""
        result = await self.collection.update_many(
            {"split": split, "status": str(SampleStatus.TRAINED), "epoch": {"$lt": epoch}},
            {"$set": {"status": str(SampleStatus.QUEUED), "epoch": epoch, "claimed_rank": None,
                      "claimed_step": None, "claimed_at": None, "trained_at": None}},
        )
        return result.modified_count

    @retry_on_reconnect
    async def requeue(self, *, rank: int | None = None, from_step: int = 0) -> int:
        """Return claims of steps ``>= from_step`` (of ``rank``, or all ranks) to the queue, e.g. when resuming a
        trainer from the checkpoint of step ``from_step - 1``. Returns how many were requeued."""
        query: dict[str, Any] = {"status": str(SampleStatus.CLAIMED), "claimed_step": {"$gte": from_step}}
        if rank is not None:
            query["claimed_rank"] = rank
        result = await self.collection.update_many(
            query, {"$set": {"status": str(SampleStatus.QUEUED), "claimed_rank": None, "claimed_step": None,
                             "claimed_at": None}})
        return result.modified_count

    @retry_on_reconnect
    async def counts(self, split: str | None = None) -> dict[str, int]:
        """Samples per status (``skipped`` is listed only when there are some)."""
        query = {"split": split} if split else {}
        counts = {str(status): await self.collection.count_documents({**query, "status": str(status)})
                  for status in SampleStatus}
        if not counts[str(SampleStatus.SKIPPED)]:
            del counts[str(SampleStatus.SKIPPED)]
        return counts
