"""Where a run stands: counts per collection and state, leases, inference services, policy version."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

from pymongo.collection import Collection
from pymongo.database import Database

from agentrl.store.models import (
    NOT_TRAINED_STATES,
    CallStatus,
    DBRecordData,
    DispatchedSamplingTask,
    FailureClass,
    InferenceService,
    Metric,
    Record,
    RecordStatus,
    Run,
    SampleStatus,
    ServiceStatus,
    Task,
    TaskStatus,
    utcnow,
)
from agentrl.store.runs import RUN_ID
from agentrl.store.services import DEFAULT_HEARTBEAT_TTL_S

STATES: dict[str, list[str]] = {
    Task.collection: [str(s) for s in TaskStatus],
    Record.collection: [str(s) for s in RecordStatus],
    DispatchedSamplingTask.collection: [str(s) for s in CallStatus],
    DBRecordData.collection: [str(s) for s in SampleStatus],
}


def count(collection: Collection, query: dict[str, Any]) -> int:
    """How many documents match ``query``: a ``$match`` + ``$count`` pipeline. PyMongo's ``count_documents`` groups
    on a constant key, which NX-27017 does slowly (340 ms for 12,000 records, against 1 ms with ``$count``)."""
    found = list(collection.aggregate([{"$match": query}, {"$count": "n"}]))
    return int(found[0]["n"]) if found else 0


def reward_by_version(records: Collection, split: str | None = None) -> list[dict[str, Any]]:
    """Mean score of the scored trajectories (of ``split``, or all) per policy version that sampled them
    (ascending versions; trajectories without a version count as version 0)."""
    query: dict[str, Any] = {"score": {"$ne": None}} | ({"split": split} if split else {})
    sums: dict[int, tuple[int, float]] = {}
    for row in records.aggregate([{"$match": query}, {"$group": {
            "_id": "$policy_version", "n": {"$sum": 1}, "total": {"$sum": "$score"}}}]):
        n, total = sums.get(row["_id"] or 0, (0, 0.0))  # no version and version 0 are one row
        sums[row["_id"] or 0] = (n + row["n"], total + float(row["total"]))
    return [{"policy_version": v, "records": n, "mean_score": total / n} for v, (n, total) in sorted(sums.items())]


def trained_tokens(db: Database, split: str = "train") -> dict[str, Any]:
    """How much of what ``split`` sampled trained, in tokens: ``sampled`` (the output tokens of every LLM call of
    its tasks), ``trained`` (the loss tokens of its trained samples) and ``nonzero_advantage`` (those of them
    with an advantage other than 0: with ``grpo`` a trajectory's tokens share one advantage, a per-turn estimator
    may credit a turn 0 beside others that are not); ``share`` is ``nonzero_advantage / sampled`` (None before
    anything was sampled)."""
    calls = db[DispatchedSamplingTask.collection].aggregate([
        {"$match": {"task_id": {"$regex": f"^{re.escape(split)}:"}}},
        {"$group": {"_id": None, "n": {"$sum": {"$size": "$output_ids"}}}}])
    sampled = next((int(row["n"]) for row in calls), 0)
    trained = nonzero = 0
    for doc in db[DBRecordData.collection].find({"status": str(SampleStatus.TRAINED), "split": split},
                                                 {"loss_mask": 1, "advantages": 1, "_id": 0}):
        for mask, advantage in zip(doc["loss_mask"], doc["advantages"]):
            if mask:
                trained += 1
                nonzero += advantage != 0
    return {"sampled": sampled, "trained": trained, "nonzero_advantage": nonzero,
            "share": nonzero / sampled if sampled else None}


def failure_counts(records: Collection, split: str | None = None) -> dict[str, int]:
    """Records that did not train (``failed``, ``abandoned``; of ``split``, or all) per failure class, most first
    (Records stored before failure classes existed count as ``unknown``)."""
    query: dict[str, Any] = {"status": {"$in": list(NOT_TRAINED_STATES)}} | ({"split": split} if split else {})
    counts: dict[str, int] = {}
    for row in records.aggregate([{"$match": query}, {"$group": {"_id": "$failure_class", "n": {"$sum": 1}}}]):
        name = str(row["_id"] or FailureClass.UNKNOWN)
        counts[name] = counts.get(name, 0) + int(row["n"])
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def state_counts(db: Database) -> dict[str, dict[str, int]]:
    """Documents per state of the Task, Record, DispatchedSamplingTask and DBRecordData collections (every known
    state listed, 0 included)."""
    counts = {}
    for name, states in STATES.items():
        rows = db[name].aggregate([{"$group": {"_id": "$status", "n": {"$sum": 1}}}])
        found = {row["_id"]: row["n"] for row in rows}
        counts[name] = {state: int(found.get(state, 0)) for state in states}
    return counts


def service_state(service: InferenceService, heartbeat_age_s: float) -> str:
    """What a service's row shows: DOWN, stale (no recent heartbeat), probe-failed (kept off the samplers by the
    trainer's policy probe), else its status (UP, STARTING)."""
    if str(service.status) == str(ServiceStatus.DOWN):
        return str(ServiceStatus.DOWN)
    if heartbeat_age_s >= DEFAULT_HEARTBEAT_TTL_S:
        return "stale"
    if service.probe_failed:
        return "probe-failed"
    return str(service.status)


def run_summary(db: Database, now: datetime | None = None) -> dict[str, Any]:
    """A JSON-able summary of the run stored in ``db``."""
    now = now or utcnow()
    counts = state_counts(db)
    records = db[Record.collection]
    leases = {
        "live": count(records, {"leased": True, "lease_expires_at": {"$gt": now}}),
        "expired": count(records, {"leased": True, "lease_expires_at": {"$lte": now}}),
    }
    services = []
    for doc in db[InferenceService.collection].find({}, sort=[("_id", 1)]):
        service = InferenceService.from_mongo(doc)
        age = (now - service.heartbeat_at).total_seconds()
        probe = service.policy_probe
        live = str(service.status) == "UP" and age < DEFAULT_HEARTBEAT_TTL_S and not service.probe_failed
        services.append({"id": service.id, "kind": service.kind, "status": str(service.status), "live": live,
                         "state": service_state(service, age),
                         "heartbeat_age_s": round(age, 1), "weight_version": service.weight_version,
                         "running_requests": service.running_requests, "total_requests": service.total_requests,
                         "policy_probe": None if probe is None else probe.model_dump(mode="json")})
    run = Run.from_mongo(db[Run.collection].find_one({"_id": RUN_ID}))
    last_metric = db[Metric.collection].find_one({}, sort=[("step", -1)])
    pending_groups = count(db[Task.collection], {"remaining": 0, "group_stage_done": False})
    return {
        "database": db.name,
        "run": None if run is None else {"name": run.name, "status": str(run.status),
                                         "policy_version": run.policy_version, "weights_path": run.weights_path},
        "counts": counts,
        "leases": leases,
        "pending_group_stages": pending_groups,
        "services": services,
        "last_metric": None if last_metric is None else {"step": last_metric["step"],
                                                         "values": last_metric.get("values", {})},
        "reward_by_version": reward_by_version(records, (run.config.get("split") if run else None) or "train"),
        "failures": failure_counts(records),
        "recent_records_per_min": count(records, {"finished_at": {"$gt": now - timedelta(minutes=1)}}),
    }
