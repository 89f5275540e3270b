"""Every stored timestamp is a BSON date (type 9), whoever wrote it and however: a short real run, the store paths
it does not take, and each update form on its own. Dates stored as strings look right in Python (pydantic parses
them) but other clients (Compass, the Node.js driver) see strings, their date filters match nothing, and a sort
puts every string before every date (the oldest expired lease was then not the first taken over)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from bson.codec_options import CodecOptions, DatetimeConversion
from bson.datetime_ms import DatetimeMS
from bson.raw_bson import RawBSONDocument
from pymongo import MongoClient, UpdateOne

from agentrl.store import RecordStatus, Store
from agentrl.store.models import DBRecordData, RunStatus, utcnow
from rollout_fixtures import sample_args, upload, write_mcp_config, write_script_tasks
from store_helpers import insert_tasks
from test_rollout_sampler import run_sampler

pytestmark = pytest.mark.slow

# Decoded so, a value is a DatetimeMS exactly when its BSON type is 9 (date); a string stays a str.
RAW = CodecOptions(document_class=RawBSONDocument, datetime_conversion=DatetimeConversion.DATETIME_MS)
SLACK_S = 1.1  # NX-27017 compares query dates at one-second resolution (see test_store_slots.py)


def timestamp_fields(doc: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of every field whose name ends in ``_at``, in nested documents and arrays too."""
    if isinstance(doc, RawBSONDocument):
        for key in doc:
            value = doc[key]
            if key.endswith("_at"):
                yield f"{path}{key}", value
            yield from timestamp_fields(value, f"{path}{key}.")
    elif isinstance(doc, list):
        for i, item in enumerate(doc):
            yield from timestamp_fields(item, f"{path}{i}.")


def kind_of(value: Any) -> str:
    return "date" if isinstance(value, DatetimeMS) else "null" if value is None else type(value).__name__


def stored_timestamps(db_uri: str) -> dict[str, dict[str, set[str]]]:
    """Per collection, per ``*_at`` field (documents' ids dropped), the kinds of value stored: ``date`` (BSON
    type 9), ``null``, or the Python type another BSON type decodes to (``str``...)."""
    client: MongoClient = MongoClient(db_uri)
    try:
        db = client.get_default_database()
        found: dict[str, dict[str, set[str]]] = {}
        for name in db.list_collection_names():
            fields = found.setdefault(name, {})
            for doc in db.get_collection(name, codec_options=RAW).find():
                for path, value in timestamp_fields(doc):
                    fields.setdefault(path, set()).add(kind_of(value))
        return found
    finally:
        client.close()


def assert_all_dates(db_uri: str, expected: dict[str, set[str]]) -> None:
    """Every ``*_at`` value of every document is a date (or null), and each ``expected`` field was written as a
    date at least once (so the check cannot pass on an empty database)."""
    found = stored_timestamps(db_uri)
    not_dates = {f"{name}.{field}": kinds - {"date", "null"} for name, fields in found.items()
                 for field, kinds in fields.items() if kinds - {"date", "null"}}
    assert not not_dates, f"timestamps stored as something else than a BSON date: {not_dates}"
    missing = {f"{name}.{field}" for name, fields in expected.items() for field in fields
               if "date" not in found.get(name, {}).get(field, set())}
    assert not missing, f"never written (the test no longer covers them): {sorted(missing)}"


def test_a_short_run_stores_every_timestamp_as_a_date(db_uri: str, tmp_path: Path, scripted_model_dir: Path,
                                                      scripted_engine_url: str) -> None:
    """A real sampler rolls out, scores and runs the group stage; then a trainer's claims and a step's metrics."""
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add", "mul")), "--num_generations", "2")
    run_sampler(sample_args(db_uri, scripted_model_dir, scripted_engine_url, write_mcp_config(tmp_path / "m.json"),
                            "--temperature", "0", "--zero_variance_threshold", "0", "--drop_zero_advantage", "false"))

    async def train_one_step() -> None:
        async with Store(db_uri) as store:
            await store.runs.get_or_create("dates")
            samples = await store.samples.claim_batch(rank=0, step=1, size=4)
            assert len(samples) == 4
            await store.samples.mark_trained(0, 1, [s.id for s in samples])
            await store.runs.bump_policy_version(expected=0)
            await store.runs.log_metrics(1, {"loss": 0.5}, sample_ids=[s.id for s in samples])

    asyncio.run(train_one_step())
    assert_all_dates(db_uri, {
        "Task": {"created_at", "updated_at", "group_lease_expires_at", "claimed_at"},
        "Record": {"created_at", "updated_at", "lease_expires_at", "finished_at"},
        "DispatchedSamplingTask": {"created_at", "updated_at", "finished_at"},
        "DBRecordData": {"created_at", "claimed_at", "trained_at"},
        "Run": {"created_at", "updated_at"},
        "Metric": {"created_at"},
    })


async def test_the_paths_a_clean_run_skips_store_dates_too(db_uri: str) -> None:
    """Release, abandonment, expiry and take-over, a slot given up, group-stage heartbeats, re-queued samples,
    services and evaluations."""
    async with Store(db_uri, lease_s=1) as store:
        await insert_tasks(store, 1, num_generations=2, max_attempts=2)
        released, abandoned = await store.slots.claim("train", "s1"), await store.slots.claim("train", "s1")
        await store.slots.heartbeat(released)
        await store.slots.release(released)
        await store.slots.abandon(abandoned, "tool server died")
        assert None not in (await store.slots.recover("train", "s2"), await store.slots.recover("train", "s2"))
        await asyncio.sleep(1 + SLACK_S)  # both retaken leases expire: one slot is retaken, the other given up
        (last,) = [lease for lease in (await store.slots.recover("train", "s3"),
                                       await store.slots.recover("train", "s3")) if lease is not None]
        group = await store.slots.finish(last, RecordStatus.SCORED, score=1.0)
        assert group is not None
        await store.slots.heartbeat_group(group)
        await store.slots.complete_group(group)

        await store.samples.enqueue([DBRecordData(id="s0", record_id="r0", task_id="t0", seq=1, input_ids=[1],
                                                  loss_mask=[1], logprobs=[0.0], versions=[0], advantages=[1.0],
                                                  num_tokens=1)])
        await store.samples.claim_batch(rank=0, step=1, size=1)
        assert await store.samples.requeue(rank=0) == 1  # a trainer resumed before step 1
        assert len(await store.samples.claim_batch(rank=0, step=1, size=1)) == 1
        assert await store.samples.mark_trained_through(0, 1) == 1

        await store.services.register("http://127.0.0.1:1", models=["m"])
        await store.services.heartbeat("http://127.0.0.1:1", weight_version=1)
        await store.services.register("http://127.0.0.1:1", fresh_start=True)
        await store.evals.start("gsm8k", {"name": "gsm8k", "tasks_source": "x.jsonl"})
        job = await store.evals.start("gsm8k", {"name": "gsm8k", "tasks_source": "x.jsonl"}, force=True)
        await store.evals.finish(job, metrics={"accuracy": 1.0})
        await store.runs.get_or_create("dates")
        await store.runs.set_status(RunStatus.FINISHED)
    assert_all_dates(db_uri, {
        "Task": {"updated_at", "group_lease_expires_at"},
        "Record": {"created_at", "updated_at", "lease_expires_at", "finished_at"},
        "DBRecordData": {"claimed_at", "trained_at"},
        "InferenceService": {"heartbeat_at", "started_at"},
        "Eval": {"created_at", "started_at", "finished_at"},
        "Run": {"updated_at"},
    })


async def test_the_oldest_expired_lease_is_taken_over_first(db_uri: str) -> None:
    """Take-over sorts expired leases by ``lease_expires_at``: a lease extended by a heartbeat (an update) and one
    never extended (as inserted) are ordered by time, not by how they were written."""
    async with Store(db_uri, lease_s=1) as store:
        await insert_tasks(store, 1, num_generations=2)
        older = await store.slots.claim("train", "s1")
        newer = await store.slots.claim("train", "s1")
        await asyncio.sleep(0.2)
        await store.slots.heartbeat(newer)  # expires 0.2 s after ``older``
        await asyncio.sleep(1.2 + SLACK_S)
        taken = await store.slots.recover("train", "s2")
        assert taken is not None and (taken.slot, taken.attempt) == (older.slot, 2)


T = datetime(2024, 5, 6, 7, 8, 9, 123000, tzinfo=UTC)
LATER = T + timedelta(hours=1)

# (name, the document before (None: none), (how it is written, the update), the date stored after (None: the
# server's now))
UPDATE_FORMS: list[tuple[str, dict[str, Any] | None, tuple[str, dict[str, Any]], datetime | None]] = [
    ("update_one $set", {"seen_at": T}, ("update_one", {"$set": {"seen_at": LATER}}), LATER),
    ("update_one $set new field", {}, ("update_one", {"$set": {"seen_at": LATER}}), LATER),
    ("update_one $set nested", {"n": {"seen_at": T}}, ("update_one", {"$set": {"n.seen_at": LATER}}), LATER),
    ("update_one $set with $inc", {"seen_at": T, "k": 1},
     ("update_one", {"$set": {"seen_at": LATER}, "$inc": {"k": 1}}), LATER),
    ("update_many $set", {"seen_at": T}, ("update_many", {"$set": {"seen_at": LATER}}), LATER),
    ("find_one_and_update $set", {"seen_at": T}, ("find_one_and_update", {"$set": {"seen_at": LATER}}), LATER),
    ("bulk_write UpdateOne $set", {"seen_at": T}, ("bulk_write", {"$set": {"seen_at": LATER}}), LATER),
    ("upsert (existing) $set", {"seen_at": T},
     ("upsert", {"$set": {"seen_at": LATER}, "$setOnInsert": {"k": 1}}), LATER),
    ("upsert (new) $set", None, ("upsert", {"$set": {"seen_at": LATER}}), LATER),
    ("upsert (new) $setOnInsert", None,
     ("upsert", {"$setOnInsert": {"seen_at": LATER}, "$set": {"k": 1}}), LATER),
    ("$max", {"seen_at": T}, ("update_one", {"$max": {"seen_at": LATER}}), LATER),
    ("$min", {"seen_at": LATER}, ("update_one", {"$min": {"seen_at": T}}), T),
    ("$currentDate", {"seen_at": T}, ("update_one", {"$currentDate": {"seen_at": True}}), None),
    ("$addToSet", {"l": []}, ("update_one", {"$addToSet": {"l": {"seen_at": LATER}}}), LATER),
]


@pytest.mark.parametrize("before, update, after", [form[1:] for form in UPDATE_FORMS],
                         ids=[form[0] for form in UPDATE_FORMS])
def test_each_update_form_keeps_dates(db_uri: str, before: dict[str, Any] | None,
                                      update: tuple[str, dict[str, Any]],
                                      after: datetime | None) -> None:
    client: MongoClient = MongoClient(db_uri, tz_aware=True)
    try:
        collection = client.get_default_database()["forms"]
        if before is not None:
            collection.insert_one({"_id": 1, **before})
        method, spec = update
        started = utcnow()
        if method == "bulk_write":
            collection.bulk_write([UpdateOne({"_id": 1}, spec)])
        elif method == "upsert":
            collection.update_one({"_id": 1}, spec, upsert=True)
        else:
            getattr(collection, method)({"_id": 1}, spec)
        (path, value), = [(p, v) for p, v in timestamp_fields(collection.with_options(codec_options=RAW).find_one())
                          if v is not None]
        assert isinstance(value, DatetimeMS), f"{path} is stored as {type(value).__name__}: {value!r}"
        stored = value.as_datetime(CodecOptions(tz_aware=True))
        if after is None:  # $currentDate: the server's now
            assert abs(stored - started) < timedelta(seconds=5)
        else:
            assert stored == after
    finally:
        client.close()

