"""Database errors injected at chosen commands (SecantusDB's ``failCommand`` failpoint) into the real store code.

Each test arms the failpoint for the connections of one client only (its ``appName``: the store under test), lets
a store operation hit it, then checks the invariants in the database with an unaffected client: every slot is
settled exactly once and keeps its score, no sample is claimed twice, retries change nothing.

Faults: ``errorCode`` (the command fails, nothing is written), ``closeConnection`` (the connection drops before the
command runs; ``times=2`` so that PyMongo's one retry of a retryable write fails too) and ``writeConcernError``
(the command is applied, yet the caller gets an error: the ambiguous outcome of a reply lost in transit).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from pymongo import AsyncMongoClient, monitoring
from pymongo.errors import AutoReconnect, OperationFailure, WriteConcernError

from agentrl.store import DBRecordData, RecordStatus, Store, Task, TaskStatus
from agentrl.store.connection import with_database
from secantus_fixtures import fail_command
from store_helpers import insert_tasks

LEASE_S = 1.0
SLACK_S = 0.3
FAILED = {"errorCode": 96}  # OperationFailed: not a retryable code, so the driver hands it straight to the store
DROPPED = {"closeConnection": True}
APPLIED_BUT_ERROR = {"writeConcernError": {"code": 64, "errmsg": "waiting for replication timed out"},
                     "errorLabels": []}  # no RetryableWriteError label: the driver does not retry it


@dataclass(frozen=True)
class Target:
    server: str  # the SecantusDB server, for failpoints
    app: str  # appName of the store under test: failpoints fire only on its connections
    uri: str  # the store under test's connection string
    checker_uri: str  # the same database through a client the failpoints never hit


@pytest.fixture
async def target(secantus_server_uri: str) -> AsyncIterator[Target]:
    name, app = "t_" + uuid.uuid4().hex[:12], "faulty-" + uuid.uuid4().hex[:8]
    checker_uri = with_database(secantus_server_uri, name)
    yield Target(server=secantus_server_uri, app=app, uri=f"{checker_uri}?appName={app}", checker_uri=checker_uri)
    client: AsyncMongoClient = AsyncMongoClient(secantus_server_uri)
    try:
        await client.drop_database(name)
    finally:
        await client.close()


class FailedCommands(monitoring.CommandListener):
    """Names of the commands that failed on a client."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self.names.append(event.command_name)


async def _task(store: Store, task_id: str = "train:t0000") -> Task:
    return Task.from_mongo(await store.db[Task.collection].find_one({"_id": task_id}))


async def _assert_group_settled_once(store: Store, scores: dict[int, float], task_id: str = "train:t0000") -> None:
    """Each slot settled exactly once with its first attempt's score; no lease left; the group stage runs once."""
    task = await _task(store, task_id)
    assert sorted(task.settled_slots) == sorted(scores) == sorted(task.completed_slots)
    assert task.failed_slots == [] and task.remaining == 0 and task.unclaimed == 0
    records = await store.records.for_task(task_id)
    assert [(r.slot, r.attempt) for r in records] == [(slot, 1) for slot in sorted(scores)]
    assert {r.slot: r.score for r in records} == scores
    assert all(r.status == RecordStatus.SCORED and not r.leased for r in records)
    group = await store.slots.claim_group_stage(None, "closer", split="train")
    assert group is not None and group.task.id == task_id
    assert await store.slots.claim_group_stage(None, "other", split="train") is None
    assert (await store.slots.complete_group(group)).status == TaskStatus.COMPLETED


@pytest.mark.parametrize("fault", [FAILED, APPLIED_BUT_ERROR], ids=["failed", "applied-but-error"])
async def test_failed_settle_in_finish_is_completed_by_a_take_over(target: Target, fault: dict) -> None:
    """(a) ``finish`` wrote the Record's outcome, then its ``findAndModify`` on the Task failed: the Record keeps
    its lease until it expires; then another sampler's take-over completes the settlement, not a new attempt."""
    async with Store(target.uri, lease_s=LEASE_S) as store, Store(target.checker_uri, lease_s=LEASE_S) as other:
        await insert_tasks(store, 1, num_generations=2)
        doomed, sibling = await store.slots.claim("train", "a"), await store.slots.claim("train", "b")
        assert await store.slots.finish(sibling, RecordStatus.SCORED, score=0.0) is None
        with (fail_command(target.server, ["findAndModify"], app_name=target.app, **fault),
              pytest.raises(OperationFailure) as error):
            await store.slots.finish(doomed, RecordStatus.SCORED, score=1.0)
        assert error.value.code == (96 if fault is FAILED else 64)
        record = await store.records.get(doomed.record_id)
        assert record.status == RecordStatus.SCORED and record.score == 1.0 and record.leased
        assert (await _task(store)).remaining == (1 if fault is FAILED else 0)
        assert await other.slots.claim("train", "c") is None  # the lease still holds: nothing to take
        assert (await store.records.get(doomed.record_id)).leased
        await asyncio.sleep(LEASE_S + SLACK_S)
        assert await other.slots.recover("train", "c") is None  # settled by the take-over, no new attempt
        await _assert_group_settled_once(other, {0: 1.0, 1: 0.0})


async def test_dropped_connection_during_settle_is_ridden_out_by_finish(target: Target) -> None:
    """(a) The settle's ``findAndModify`` loses its connection on the first try and on the driver's retry: the
    store re-runs the (idempotent) settle itself, so ``finish`` completes and hands out the group stage."""
    failures = FailedCommands()
    async with (Store(target.uri, lease_s=LEASE_S, event_listeners=[failures]) as store,
                Store(target.checker_uri, lease_s=LEASE_S) as other):
        await insert_tasks(store, 1, num_generations=2)
        first, last = await store.slots.claim("train", "a"), await store.slots.claim("train", "b")
        assert await store.slots.finish(first, RecordStatus.SCORED, score=0.0) is None
        with fail_command(target.server, ["findAndModify"], app_name=target.app, times=2, **DROPPED):
            group = await store.slots.finish(last, RecordStatus.SCORED, score=1.0)
        assert failures.names == ["findAndModify", "findAndModify"]  # the driver's try and retry were cut
        assert group is not None and group.task.remaining == 0
        assert (await other.slots.complete_group(group)).status == TaskStatus.COMPLETED
        task = await _task(other)
        assert task.settled_slots == [0, 1] and task.completed_slots == [0, 1] and task.remaining == 0
        assert {r.slot: (r.attempt, r.score, r.leased) for r in await other.records.for_task(task.id)} == {
            0: (1, 0.0, False), 1: (1, 1.0, False)}


@pytest.mark.parametrize(("fault", "raised"), [(FAILED, OperationFailure), ({**DROPPED, "times": 2}, AutoReconnect)],
                         ids=["failed", "dropped"])
async def test_failed_record_insert_of_a_claim_is_recovered_by_sweep(target: Target, fault: dict, raised: type) -> None:
    """(b) The Task's ``findAndModify`` claimed a slot, then the insert of its Record failed: no lease covers the
    slot. ``sweep`` leaves it alone while the claim could still be in progress and recovers it after a lease."""
    async with Store(target.uri, lease_s=LEASE_S) as store, Store(target.checker_uri, lease_s=LEASE_S) as other:
        await insert_tasks(store, 1, num_generations=2)
        with fail_command(target.server, ["insert"], app_name=target.app, **fault), pytest.raises(raised):
            await store.slots.claim("train", "a")
        task = await _task(other)
        assert task.unclaimed == 1 and len(task.claim_ids) == 1 and task.status == TaskStatus.RUNNING
        assert await other.db["Record"].count_documents({}) == 0
        sibling = await other.slots.claim("train", "b")  # the Task is not wedged: its other slot is handed out
        assert sibling is not None and sibling.slot == 1
        await other.slots.finish(sibling, RecordStatus.SCORED, score=0.0)
        assert await other.slots.sweep("train", "c") is None  # too early: the claim may still be inserting
        await asyncio.sleep(LEASE_S + SLACK_S)
        recovered = await other.slots.sweep("train", "c")
        assert recovered is not None and (recovered.slot, recovered.attempt) == (0, 1)
        assert await other.slots.sweep("train", "d") is None
        group = await other.slots.finish(recovered, RecordStatus.SCORED, score=1.0)
        assert group is not None
        await other.slots.complete_group(group)
        task = await _task(other)
        assert task.settled_slots == [1, 0] and task.remaining == 0 and task.status == TaskStatus.COMPLETED
        assert {r.slot: (r.attempt, r.score) for r in await other.records.for_task(task.id)} == {
            0: (1, 1.0), 1: (1, 0.0)}


def _sample(i: int) -> DBRecordData:
    return DBRecordData(id=f"s{i}", record_id=f"r{i}", task_id="t", seq=i + 1, input_ids=[1, 2, 3],
                        loss_mask=[0, 1, 1], logprobs=[0.0, -0.1, -0.2], versions=[-1, 0, 0],
                        advantages=[0.0, 1.0, 1.0], num_tokens=3)


async def _claims(store: Store) -> dict[str, tuple[int, int]]:
    """Every claimed sample's (rank, step), from the database."""
    return {doc["_id"]: (doc["claimed_rank"], doc["claimed_step"]) async for doc in
            store.db[DBRecordData.collection].find({"status": "claimed"})}


async def test_claim_batch_cut_by_dropped_connections_is_retried_by_the_store(target: Target) -> None:
    """(c) ``claim_batch``'s third ``findAndModify`` loses its connection, and so does the driver's retry: the store
    re-runs ``claim_batch``, which finds the two samples it claimed and tops them up; none is claimed twice."""
    failures = FailedCommands()
    async with Store(target.uri, event_listeners=[failures]) as store, Store(target.checker_uri) as other:
        assert await store.samples.enqueue([_sample(i) for i in range(8)]) == 8
        with fail_command(target.server, ["findAndModify"], app_name=target.app, skip=2, times=2, **DROPPED):
            batch = await store.samples.claim_batch(0, 5, 4)
        assert failures.names == ["findAndModify", "findAndModify"]
        assert [s.id for s in batch] == ["s0", "s1", "s2", "s3"]
        assert await _claims(other) == {s.id: (0, 5) for s in batch}
        rival = await other.samples.claim_batch(1, 5, 2)
        assert [s.id for s in rival] == ["s4", "s5"]
        assert [s.id for s in await store.samples.claim_batch(0, 5, 4)] == [s.id for s in batch]
        assert len(await _claims(other)) == 6


async def test_claim_batch_cut_after_an_applied_claim_resumes_for_the_same_rank_and_step(target: Target) -> None:
    """(c) ``claim_batch``'s third ``findAndModify`` claims a sample but the caller gets an error instead of it:
    asking again for the same (rank, step) returns the three samples claimed for it plus a new one, while another
    rank that claimed meanwhile got none of them."""
    async with Store(target.uri) as store, Store(target.checker_uri) as other:
        assert await store.samples.enqueue([_sample(i) for i in range(8)]) == 8
        with (fail_command(target.server, ["findAndModify"], app_name=target.app, skip=2, **APPLIED_BUT_ERROR),
              pytest.raises(WriteConcernError)):
            await store.samples.claim_batch(0, 5, 4)
        assert await _claims(other) == {f"s{i}": (0, 5) for i in range(3)}
        rival = await other.samples.claim_batch(1, 5, 2)  # another rank claims meanwhile
        assert [s.id for s in rival] == ["s3", "s4"]
        again = await store.samples.claim_batch(0, 5, 4)
        assert [s.id for s in again] == ["s0", "s1", "s2", "s5"]
        assert await store.samples.claim_batch(0, 5, 4) == again  # and again: the same samples
        claims = await _claims(other)
        assert len(claims) == 6 and sorted(claims) == sorted(s.id for s in again + rival)
        assert {k for k, v in claims.items() if v == (0, 5)} == {s.id for s in again}


@pytest.mark.parametrize("fault", [FAILED, APPLIED_BUT_ERROR], ids=["failed", "applied-but-error"])
async def test_mark_trained_retried_after_an_error_is_idempotent(target: Target, fault: dict) -> None:
    """(d) ``mark_trained``'s ``update`` fails (not applied, or applied with the reply lost): the caller's retry
    succeeds and leaves exactly the step's samples trained, once."""
    async with Store(target.uri) as store, Store(target.checker_uri) as other:
        await store.samples.enqueue([_sample(i) for i in range(4)])
        batch = await store.samples.claim_batch(0, 1, 2)
        ids = [s.id for s in batch]
        with fail_command(target.server, ["update"], app_name=target.app, **fault), pytest.raises(OperationFailure):
            await store.samples.mark_trained(0, 1, ids)
        await store.samples.mark_trained(0, 1, ids)  # the caller's retry (after applied-but-error, a repeat)
        assert await other.samples.counts() == {"queued": 2, "claimed": 0, "trained": 2}
        trained = [doc async for doc in other.db[DBRecordData.collection].find({"status": "trained"})]
        assert sorted(doc["_id"] for doc in trained) == sorted(ids)


@pytest.mark.parametrize("fault", [FAILED, APPLIED_BUT_ERROR], ids=["failed", "applied-but-error"])
async def test_mark_trained_through_retried_after_an_error_is_idempotent(target: Target, fault: dict) -> None:
    """(d) ``mark_trained_through`` (after a checkpoint) fails, then is retried: the claims of the steps up to the
    checkpoint are trained, later steps' claims stay claimed, and a further retry changes nothing."""
    async with Store(target.uri) as store, Store(target.checker_uri) as other:
        await store.samples.enqueue([_sample(i) for i in range(6)])
        for step in (1, 2, 3):
            await store.samples.claim_batch(0, step, 2)
        with fail_command(target.server, ["update"], app_name=target.app, **fault), pytest.raises(OperationFailure):
            await store.samples.mark_trained_through(0, 2)
        assert await store.samples.mark_trained_through(0, 2) == (4 if fault is FAILED else 0)
        assert await store.samples.mark_trained_through(0, 2) == 0
        assert await other.samples.counts() == {"queued": 0, "claimed": 2, "trained": 4}
        assert await _claims(other) == {"s4": (0, 3), "s5": (0, 3)}
