"""What the dashboard reads from MongoDB: runs, their metrics, pages of records, one record, one task's group.

Every run is a database with a ``Run`` collection. Reads only: lists use projections (no token arrays) and
``limit``/``offset`` pages, and every document comes back as plain JSON-able data with ``id`` for ``_id``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pymongo import MongoClient
from pymongo.database import Database
from pymongo.errors import OperationFailure

from agentrl.store.evals import Eval
from agentrl.store.images import read_image_sync
from agentrl.store.models import (
    EPOCH,
    NOT_TRAINED_STATES,
    DBRecordData,
    DispatchedSamplingTask,
    FailureClass,
    Metric,
    Record,
    RecordStatus,
    Run,
    Task,
)
from agentrl.store.runs import RUN_ID
from agentrl.store.summary import count, run_summary
from agentrl.vision.images import ImageError, LoadedImage

RECORD_FIELDS = ("task_id", "split", "slot", "attempt", "status", "outcome", "score", "score_error", "advantage",
                 "group_decision", "policy_version", "num_turns", "final_answer", "error", "failure_class",
                 "created_at", "finished_at")
"""The fields of a record in lists (no score details, meta or environment instance)."""
EVAL_FIELDS = ("name", "status", "split", "model", "num_tasks", "num_samples_per_task", "repeats", "metrics",
               "started_at", "finished_at", "duration_s")
PAGE_LIMIT_MAX = 500


class UnknownItem(LookupError):
    """An unknown run, record or task (HTTP 404)."""


class RecordFilters(BaseModel):
    """The filters and page of a records list (query parameters of ``/api/runs/{run}/records``)."""

    model_config = ConfigDict(extra="forbid")

    split: str | None = Field(None, description="train, or an evaluation's split (eval:...)")
    status: RecordStatus | None = None
    failure_class: FailureClass | None = Field(None, description="why a failed or abandoned Record did not train")
    outcome: str | None = Field(None, description="answer, turns_limit_error, ...")
    min_score: float | None = None
    max_score: float | None = None
    task_id: str | None = None
    policy_version: int | None = None
    group_decision: str | None = None
    limit: int = Field(50, ge=1, le=PAGE_LIMIT_MAX)
    offset: int = Field(0, ge=0)

    @field_validator("*", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    def query(self) -> dict[str, Any]:
        """The MongoDB filter of these filters."""
        query: dict[str, Any] = {}
        for name in ("split", "outcome", "task_id", "policy_version", "group_decision"):
            if getattr(self, name) is not None:
                query[name] = getattr(self, name)
        if self.status is not None:
            query["status"] = str(self.status)
        if self.failure_class == FailureClass.UNKNOWN:  # stored before failure classes existed
            query["status"] = query.get("status", {"$in": list(NOT_TRAINED_STATES)})
            query["failure_class"] = None
        elif self.failure_class is not None:
            query["failure_class"] = str(self.failure_class)
        score: dict[str, float] = {}
        if self.min_score is not None:
            score["$gte"] = self.min_score
        if self.max_score is not None:
            score["$lte"] = self.max_score
        if score:
            query["score"] = score
        return query

    def active(self) -> dict[str, Any]:
        """The filters that are set, without the page (for links and forms)."""
        return {k: (str(v) if k in ("status", "failure_class") else v)
                for k, v in self.model_dump(exclude={"limit", "offset"}).items() if v is not None}


def as_datetime(value: Any) -> datetime | None:
    """A stored date as an aware UTC datetime (drivers return naive UTC; databases written by NX-27017 without
    ``agentrl.store.nx_server`` hold dates set by updates as ISO strings)."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def plain(doc: dict[str, Any]) -> dict[str, Any]:
    """A stored document as JSON-able data: ``_id`` becomes ``id``, dates (``*_at``) aware UTC datetimes."""
    out = {"id": doc["_id"]} if "_id" in doc else {}
    out.update((k, as_datetime(v) if k.endswith("_at") else v) for k, v in doc.items() if k != "_id")
    return out


def _projection(fields: tuple[str, ...]) -> dict[str, int]:
    return dict.fromkeys(fields, 1)


class RunReader:
    """Read-only access to the runs on one MongoDB server."""

    def __init__(self, client: MongoClient, default_database: str | None = None):
        self.client = client
        self.default_database = default_database

    # ------------------------------------------------------------------------------------------------ runs

    def run_names(self) -> list[str]:
        """The databases holding a run (a ``Run`` collection), by name. A user who may not list databases sees the
        database of the connection string."""
        try:
            names = self.client.list_database_names()
        except OperationFailure:
            names = [self.default_database] if self.default_database else []
        return sorted(name for name in names if name not in ("admin", "local", "config")
                      and Run.collection in self.client[name].list_collection_names())

    def database(self, run: str) -> Database:
        """The database of ``run``; :class:`UnknownItem` when it holds no run."""
        db = self.client[run]
        if db[Run.collection].find_one({"_id": RUN_ID}, {"_id": 1}) is None:
            raise UnknownItem(f"no run named {run!r} on this server")
        return db

    def runs(self) -> list[dict[str, Any]]:
        """One row per run: status, policy version, steps, last reward and throughput, records, last activity."""
        rows = []
        for name in self.run_names():
            db = self.client[name]
            run = db[Run.collection].find_one({"_id": RUN_ID}, {"config": 0})
            if run is None:
                continue
            run = plain(run)
            last = plain(db[Metric.collection].find_one({"split": "train"}, {"sample_ids": 0},
                                                        sort=[("step", -1)]) or {})
            values = last.get("values", {})
            activity = max((d for d in (run.get("updated_at"), last.get("created_at")) if d is not None), default=None)
            rows.append({"run": name, "name": run.get("name"), "status": run.get("status"),
                         "policy_version": run.get("policy_version", 0), "lora_name": run.get("lora_name"),
                         "steps": last.get("step", 0), "reward_mean": values.get("reward_mean"),
                         "loss": values.get("loss"), "tokens_per_s": values.get("tokens_per_s"),
                         "records": db[Record.collection].estimated_document_count(),
                         "created_at": run.get("created_at"), "last_activity": activity})
        return sorted(rows, key=lambda r: r["created_at"] or EPOCH, reverse=True)

    def run(self, run: str) -> dict[str, Any]:
        """A run: its document (config included), states, leases, Records not trained per failure class, services,
        reward per version, evaluations."""
        db = self.database(run)
        doc = plain(db[Run.collection].find_one({"_id": RUN_ID}))
        summary = run_summary(db)
        evals = [plain(e) for e in db[Eval.collection].find({}, _projection(EVAL_FIELDS), sort=[("started_at", 1)])]
        return {"run": run, **doc, "counts": summary["counts"], "leases": summary["leases"],
                "pending_group_stages": summary["pending_group_stages"], "services": summary["services"],
                "reward_by_version": summary["reward_by_version"], "last_metric": summary["last_metric"],
                "failures": summary["failures"],
                "records_per_min": summary["recent_records_per_min"], "evals": evals,
                "splits": sorted(s for s in db[Record.collection].distinct("split") if s)}

    def run_config(self, run: str) -> dict[str, Any]:
        """The configuration snapshot of ``run`` (its trainer's flags)."""
        return (self.database(run)[Run.collection].find_one({"_id": RUN_ID}, {"config": 1}) or {}).get("config") or {}

    def metrics(self, run: str, split: str = "train") -> list[dict[str, Any]]:
        """The trainer's metrics of every step of ``split`` (ascending steps; the ledger as a count)."""
        db = self.database(run)
        rows = []
        for doc in db[Metric.collection].find({"split": split}, sort=[("step", 1)]):
            rows.append({"step": doc["step"], "values": doc.get("values", {}),
                         "created_at": as_datetime(doc.get("created_at")),
                         "samples_trained": len(doc.get("sample_ids", []))})
        return rows

    # --------------------------------------------------------------------------------------------- records

    def records(self, run: str, filters: RecordFilters) -> dict[str, Any]:
        """A page of records matching ``filters``, newest first, and how many match in all."""
        db = self.database(run)
        query = filters.query()
        records = db[Record.collection]
        docs = records.find(query, _projection(RECORD_FIELDS), sort=[("created_at", -1), ("_id", 1)],
                            skip=filters.offset, limit=filters.limit)
        return {"total": count(records, query), "limit": filters.limit, "offset": filters.offset,
                "filters": filters.active(), "records": [plain(doc) for doc in docs]}

    def filter_choices(self, run: str) -> dict[str, list[Any]]:
        """The values the record filters can take in this run (for the form's menus)."""
        records = self.database(run)[Record.collection]
        choices = {name: sorted((v for v in records.distinct(name) if v is not None), key=str)
                   for name in ("split", "outcome", "group_decision", "policy_version")}
        return {**choices, "failure_class": [str(failure) for failure in FailureClass]}

    def record(self, run: str, record_id: str) -> dict[str, Any]:
        """A record with its task, its LLM calls in turn order (token ids, logprobs, texts) and its training
        samples."""
        db = self.database(run)
        doc = db[Record.collection].find_one({"_id": record_id})
        if doc is None:
            raise UnknownItem(f"run {run!r} has no record {record_id!r}")
        task = db[Task.collection].find_one({"_id": doc["task_id"]}, {"query": 1, "system_prompt": 1, "images": 1,
                                                                       "answer": 1,
                                                                       "scorer": 1, "metadata": 1})
        calls = db[DispatchedSamplingTask.collection].find({"record_id": record_id}, sort=[("turn", 1)])
        samples = db[DBRecordData.collection].find({"record_id": record_id}, sort=[("branch", 1)])
        return {**plain(doc), "task": plain(task) if task else None,
                "calls": [plain(c) for c in calls],
                "samples": [plain(s) for s in samples]}

    def image(self, run: str, sha256: str) -> LoadedImage:
        """An image of the run (GridFS bucket ``images``), checked against its hash; :class:`UnknownItem` when the
        run has none by that id."""
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise UnknownItem(f"{sha256!r} is not an image id (64 hex digits: a sha256)")
        try:
            return read_image_sync(self.database(run), sha256)
        except ImageError as error:
            raise UnknownItem(str(error)) from None

    def task(self, run: str, task_id: str) -> dict[str, Any]:
        """A task and every record of its group (all slots and attempts), each with its turns' texts."""
        db = self.database(run)
        task = db[Task.collection].find_one({"_id": task_id}, {"claim_ids": 0})
        if task is None:
            raise UnknownItem(f"run {run!r} has no task {task_id!r}")
        records = [plain(r) for r in db[Record.collection].find(
            {"task_id": task_id}, _projection(RECORD_FIELDS), sort=[("task_id", 1), ("slot", 1), ("attempt", 1)])]
        turns: dict[str, list[dict[str, Any]]] = {}
        for call in db[DispatchedSamplingTask.collection].find(
                {"task_id": task_id}, {"record_id": 1, "turn": 1, "branch": 1, "status": 1, "output_text": 1,
                                       "prompt_delta_text": 1, "tool_calls": 1, "tool_results": 1}):
            turns.setdefault(call["record_id"], []).append(plain(call))
        for record in records:
            record["calls"] = sorted(turns.get(record["id"], []), key=lambda c: c["turn"])
        return {**plain(task), "records": records}
