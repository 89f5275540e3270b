"""Indexes: one compound index per claim or fetch predicate (equality fields first, then the range/sort key)."""

from __future__ import annotations

from pymongo import ASCENDING, DESCENDING, IndexModel
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.database import Database


def _index(*fields: str, name: str) -> IndexModel:
    return IndexModel([(f, ASCENDING) for f in fields], name=name)


INDEXES: dict[str, list[IndexModel]] = {
    "Task": [
        # free-slot claim: {split, status (one, or $in), unclaimed $gt} sorted by round, then order
        _index("split", "status", "unclaimed", "round", "order", name="claim_free_slot_by_round"),
        # group-stage (re)claim: {split, remaining 0, group_stage_done false, group_lease_expires_at $lt}
        _index("split", "remaining", "group_stage_done", "group_lease_expires_at", name="claim_group_stage"),
        # orphan sweep: {split, status running | interrupted (a query each), updated_at $lt} sorted by updated_at
        _index("split", "status", "updated_at", name="sweep_stale"),
    ],
    "Record": [
        # expired-lease reclaim: {split, leased true, lease_expires_at $lt}
        _index("split", "leased", "lease_expires_at", name="reclaim_expired_lease"),
        # a task's records (group stage, sweep; sweep's lease count {task_id $in, leased}): sorted by slot, attempt
        _index("task_id", "slot", "attempt", name="task_records"),
        # counts per state: {split, status} (admission control's ready Records, watch/status/report progress)
        _index("split", "status", "updated_at", name="records_by_state"),
        # the dashboard's record lists: newest first
        IndexModel([("created_at", DESCENDING)], name="records_newest"),
    ],
    "DispatchedSamplingTask": [
        _index("record_id", "turn", name="record_calls"),
        _index("task_id", "status", name="task_calls"),
    ],
    "DBRecordData": [
        # trainer claim: {split, status queued} sorted by policy version, then seq
        _index("split", "status", "first_version", "seq", name="claim_sample_by_version"),
        # a rank's claims for a step (resume): {status, claimed_rank, claimed_step}
        _index("status", "claimed_rank", "claimed_step", name="rank_step_claims"),
        _index("record_id", name="record_samples"),
    ],
    "InferenceService": [
        # pick least-loaded live service: {status UP, heartbeat_at $gt} sorted by running_requests
        _index("status", "heartbeat_at", "running_requests", name="pick_service"),
    ],
    "Metric": [_index("split", "step", name="metrics_by_step")],
}


def ensure_indexes_sync(db: Database) -> None:
    """Create every index (idempotent)."""
    for collection, indexes in INDEXES.items():
        db[collection].create_indexes(indexes)


async def ensure_indexes(db: AsyncDatabase) -> None:
    """Create every index (idempotent)."""
    for collection, indexes in INDEXES.items():
        await db[collection].create_indexes(indexes)
