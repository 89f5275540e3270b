"""The ``Run`` document (config snapshot, policy version, status) and per-step ``Metric`` documents."""

from __future__ import annotations

from typing import Any

from pymongo import ReturnDocument
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import DuplicateKeyError

from agentrl.store.errors import NotFound, VersionConflict
from agentrl.store.models import Metric, Run, RunStatus, RunValues, utcnow
from agentrl.store.outage import retry_on_reconnect

RUN_ID = "run"


class RunValuesConflict(ValueError):
    """A sampler's or trainer's flag differs from the value its run records (:class:`RunValues`)."""


class Runs:
    def __init__(self, db: AsyncDatabase):
        self.collection = db[Run.collection]
        self.metrics = db[Metric.collection]

    @retry_on_reconnect
    async def get_or_create(self, name: str, config: dict[str, Any] | None = None) -> Run:
        """The run's document, created on first use with ``config`` as its snapshot; a snapshot is never
        overwritten, but a document without one (a sampler created it, see :meth:`agree`) gets ``config``."""
        now = utcnow()
        fresh = Run(id=RUN_ID, name=name, config=config or {}, created_at=now, updated_at=now)
        try:
            await self.collection.insert_one(fresh.to_mongo())
            return fresh
        except DuplicateKeyError:
            run = Run.from_mongo(await self.collection.find_one({"_id": RUN_ID}))
        if not config or run.config:
            return run
        await self.collection.update_one({"_id": RUN_ID, "config": {}}, {"$set": {"config": config}})
        return Run.from_mongo(await self.collection.find_one({"_id": RUN_ID}))

    @retry_on_reconnect
    async def agree(self, name: str, given: dict[str, Any], sources: dict[str, str] | None = None) -> Run:
        """The run's document, created if needed, with ``given`` (the :class:`RunValues` this process was given;
        ``sources[key]`` says how, e.g. ``"trainer: --per_device_train_batch_size 2 x 1 rank"``) recorded where no
        process recorded one before.

        A value no process was given is never recorded: the caller uses the recorded value if there is one, else
        its own default. A ``given`` value that differs from a recorded one raises :class:`RunValuesConflict`
        naming both and how each was given, and nothing is written. One conditional update records every given
        value or none (its filter holds only while each is unrecorded or equal), so concurrent processes end with
        one value each, whoever came first, and a caller killed at any point and started again gets the same
        answer. (The trainer's configuration snapshot follows with :meth:`get_or_create`.)
        """
        values = RunValues(**given).model_dump(include=set(given))
        sources = {key: (sources or {}).get(key, f"--{key} {_shown(value)}") for key, value in values.items()}
        now = utcnow()
        fresh = Run(id=RUN_ID, name=name, values=values, value_sources=sources, created_at=now, updated_at=now)
        try:
            await self.collection.insert_one(fresh.to_mongo())
            return fresh
        except DuplicateKeyError:
            pass
        await self.collection.update_one({"_id": RUN_ID, "values": None}, {"$set": {"values": {}}})  # an old run
        run = Run.from_mongo(await self.collection.find_one({"_id": RUN_ID}))
        new = {key: value for key, value in values.items() if key not in run.values}
        if new and not any(run.values.get(key, value) != value for key, value in values.items()):
            agreeing = [{"$or": [{f"values.{key}": {"$exists": False}}, {f"values.{key}": value}]}
                        for key, value in values.items()]
            updates = {**{f"values.{key}": value for key, value in new.items()},
                       **{f"value_sources.{key}": sources[key] for key in new}, "updated_at": now}
            await self.collection.update_one({"_id": RUN_ID, "$and": agreeing}, {"$set": updates})
            run = Run.from_mongo(await self.collection.find_one({"_id": RUN_ID}))
        differing = [f"{sources[key]} differs from the run's {key} {_shown(run.values[key])} (from "
                     f"{run.value_sources.get(key, 'an earlier process')})"
                     for key, value in values.items() if key in run.values and run.values[key] != value]
        if differing:
            raise RunValuesConflict(f"run {run.name!r}: {'; '.join(differing)}: pass the same value or leave the "
                                    "flag out")
        return run

    @retry_on_reconnect
    async def get(self) -> Run | None:
        return Run.from_mongo(await self.collection.find_one({"_id": RUN_ID}))

    @retry_on_reconnect
    async def policy_version(self) -> int:
        run = await self.get()
        return run.policy_version if run else 0

    @retry_on_reconnect
    async def bump_policy_version(self, weights_path: str | None = None, *, expected: int,
                                  lora_name: str | None = None, publish_id: str | None = None) -> int:
        """Move ``policy_version`` from ``expected`` to ``expected + 1`` in one atomic update whose filter is the
        precondition ``policy_version == expected``; returns the new version. With ``weights_path`` the new
        version's weights are in those files (``weights_version``; ``lora_name``: the adapter that holds them);
        without it they were sent in memory and the files stay those of an older version. ``publish_id`` (unique per
        publish, made by the caller; else ``weights_path`` serves) lets a retried bump whose first answer was lost
        recognise it landed. If another writer moved the version, :class:`VersionConflict` is raised and the
        document is left unchanged."""
        fields: dict[str, Any] = {"updated_at": utcnow(), "publish_id": publish_id}
        if weights_path is not None:
            fields.update(weights_path=weights_path, weights_version=expected + 1, lora_name=lora_name)
        doc = await self.collection.find_one_and_update(
            {"_id": RUN_ID, "policy_version": expected}, {"$inc": {"policy_version": 1}, "$set": fields},
            return_document=ReturnDocument.AFTER)
        if doc is not None:
            return doc["policy_version"]
        current = await self.get()
        if current is None:
            raise NotFound("no Run document: create the run first (get_or_create)")
        landed = (current.publish_id == publish_id) if publish_id else (
            weights_path is not None and current.weights_path == weights_path)
        if current.policy_version == expected + 1 and landed:
            return current.policy_version  # this very bump landed before a broken connection hid its answer
        raise VersionConflict(f"Run {current.name!r}: expected policy_version {expected} but it is "
                              f"{current.policy_version}: is another trainer publishing weights to this run?")

    @retry_on_reconnect
    async def record_weights(self, weights_path: str, version: int) -> bool:
        """Record ``weights_path`` as the files of ``version`` if the Run is still at that version (a publish in
        memory wrote none; e.g. the trainer's final model); whether it was recorded."""
        result = await self.collection.update_one(
            {"_id": RUN_ID, "policy_version": version, "lora_name": None},
            {"$set": {"weights_path": weights_path, "weights_version": version, "updated_at": utcnow()}})
        return result.matched_count == 1

    @retry_on_reconnect
    async def set_status(self, status: RunStatus) -> None:
        await self.collection.update_one({"_id": RUN_ID}, {"$set": {"status": str(status), "updated_at": utcnow()}})

    @retry_on_reconnect
    async def log_metrics(self, step: int, values: dict[str, float], split: str = "train",
                          sample_ids: list[str] | None = None) -> None:
        """Store the metrics of ``step`` and the ids of the samples it trained (re-logging a step, e.g. after a
        resume, replaces it)."""
        metric = Metric(id=f"{split}/{step}", step=step, split=split, values=values, sample_ids=sample_ids or [])
        await self.metrics.replace_one({"_id": metric.id}, metric.to_mongo(), upsert=True)

    @retry_on_reconnect
    async def ledger(self, step: int, split: str = "train") -> list[str] | None:
        """The ids of the samples step ``step`` trained, as its ``Metric`` lists them (None: not logged)."""
        doc = await self.metrics.find_one({"_id": f"{split}/{step}"}, projection={"sample_ids": 1})
        return None if doc is None else list(doc.get("sample_ids") or [])

    @retry_on_reconnect
    async def last_step(self, split: str = "train") -> int:
        """The highest step with a ``Metric`` document (0: none)."""
        doc = await self.metrics.find_one({"split": split}, sort=[("step", -1)], projection={"step": 1})
        return int(doc["step"]) if doc else 0

    @retry_on_reconnect
    async def forget_metrics_after(self, step: int, split: str = "train") -> int:
        """Delete the ``Metric`` documents of the steps after ``step``: a trainer resumed from checkpoint ``step``
        lost their updates (their samples are trained again), so the ledger must not list them. Returns how many."""
        result = await self.metrics.delete_many({"split": split, "step": {"$gt": step}})
        return result.deleted_count


def _shown(value: Any) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
