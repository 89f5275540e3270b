"""Record / call transitions, the DBRecordData queue, services, the Run document, indexes."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from pymongo.errors import BulkWriteError

from agentrl.store import (
    CallStatus,
    DBRecordData,
    DispatchedSamplingTask,
    InvalidTransition,
    NotFound,
    RecordStatus,
    Store,
    StoreError,
    VersionConflict,
)
from agentrl.store.call_log import CallLog
from agentrl.store.indexes import INDEXES
from agentrl.store.models import utcnow
from store_helpers import insert_tasks


async def test_record_transitions_follow_the_state_machine(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await insert_tasks(store, 1, num_generations=1)
        lease = await store.slots.claim("train", "s")
        record = await store.records.transition(lease.record_id, RecordStatus.COMPLETED, num_turns=3,
                                                outcome="answer")
        assert record.status == RecordStatus.COMPLETED and record.num_turns == 3
        with pytest.raises(InvalidTransition) as error:
            await store.records.transition(lease.record_id, RecordStatus.TRAINED)
        assert "'completed' -> 'trained'" in str(error.value)
        unchanged = await store.records.get(lease.record_id)
        assert unchanged.status == RecordStatus.COMPLETED and unchanged.score is None
        await store.slots.finish(lease, RecordStatus.SCORED, score=1.0)
        await store.records.transition(lease.record_id, RecordStatus.READY, advantage=0.5)
        await store.records.transition(lease.record_id, RecordStatus.TRAINED)
        with pytest.raises(InvalidTransition):
            await store.records.transition(lease.record_id, RecordStatus.READY, advantage=-1.0)
        final = await store.records.get(lease.record_id)
        assert final.status == RecordStatus.TRAINED and final.advantage == 0.5
        with pytest.raises(NotFound):
            await store.records.transition("nope", RecordStatus.COMPLETED)


async def test_call_transitions_and_relabels_then_one_write(db_uri: str) -> None:
    """A trajectory's calls move through their states in memory and are written once, in one command."""
    async with Store(db_uri) as store:
        calls = CallLog()
        call = calls.start(DispatchedSamplingTask(id="r/0/1#0", record_id="r/0/1", task_id="t", turn=0,
                                                  input_ids=[1, 2, 3]))
        done = calls.finish(call.id, CallStatus.COMPLETED, output_ids=[4, 5], output_logprobs=[-0.1, -0.2],
                            weight_version=3, finish_reason="stop")
        assert done.output_ids == [4, 5] and done.finished_at is not None
        relabelled = calls.relabel(call.id, CallStatus.FORMATERROR, error="bad json")
        assert relabelled.status == CallStatus.FORMATERROR
        with pytest.raises(InvalidTransition):
            calls.relabel(call.id, CallStatus.TOOLFAILED)
        with pytest.raises(InvalidTransition):
            calls.finish(call.id, CallStatus.COMPLETED, output_ids=[9])
        with pytest.raises(ValueError):
            calls.annotate(call.id, status=CallStatus.COMPLETED)
        cut = calls.start(DispatchedSamplingTask(id="r/0/1#1", record_id="r/0/1", task_id="t", turn=1,
                                                 previous_call_id=call.id, prompt_delta_ids=[6]))
        calls.end_running("cancelled")  # the trajectory was cut off mid-generation
        before = sum(store.commands.snapshot().values())
        await store.calls.insert(calls.calls())
        assert sum(store.commands.snapshot().values()) - before == 1
        await store.calls.insert(calls.calls())  # a retry after a broken connection writes nothing new
        stored = (await store.calls.for_records(["r/0/1"]))["r/0/1"]
        assert [(c.id, c.status, c.output_ids) for c in stored] == [
            (call.id, CallStatus.FORMATERROR, [4, 5]), (cut.id, CallStatus.FAILED, [])]
        assert stored[1].error == "cancelled" and stored[0].error == "bad json"

def _sample(i: int) -> DBRecordData:
    return DBRecordData(id=f"s{i}", record_id=f"r{i}", task_id="t", seq=0, input_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                        logprobs=[0.0, -0.1, -0.2], versions=[-1, 0, 0], advantages=[0.0, 1.0, 1.0], num_tokens=3)


async def test_sample_queue_claims_are_exactly_once_and_resumable(db_uri: str) -> None:
    async with Store(db_uri) as store:
        assert await store.samples.enqueue([_sample(i) for i in range(10)]) == 10
        batches = await asyncio.gather(*(store.samples.claim_batch(rank, 0, 3) for rank in range(3)))
        ids = [s.id for batch in batches for s in batch]
        assert len(ids) == len(set(ids)) == 9
        # Asking again for the same (rank, step) returns the same samples: a resumed rank sees the same data.
        again = await store.samples.claim_batch(1, 0, 3)
        assert [s.id for s in again] == [s.id for s in batches[1]]
        await store.samples.mark_trained(0, 0, [s.id for s in batches[0]])
        await store.samples.mark_trained(0, 0, [s.id for s in batches[0]])  # idempotent (a retry after an error)
        with pytest.raises(StoreError):  # but samples claimed by another rank, or not trained by this one, refuse
            await store.samples.mark_trained(0, 0, [s.id for s in batches[0] + batches[1]])
        with pytest.raises(StoreError):
            await store.samples.mark_trained(1, 0, [s.id for s in batches[0]])
        # rank 2 crashed before training step 0: its claims go back to the queue on resume
        assert await store.samples.requeue(rank=2, from_step=0) == 3
        counts = await store.samples.counts()
        assert counts == {"queued": 4, "claimed": 3, "trained": 3}
        leftover = await store.samples.claim_batch(2, 0, 10)
        assert len(leftover) == 4 and {s.id for s in leftover} >= {s.id for s in batches[2]}
        assert leftover[0].claimed_rank == 2 and leftover[0].input_ids == [1, 2, 3]


async def test_the_same_samples_queued_twice_at_once_are_queued_once(db_uri: str) -> None:
    """Two overlapping runs of one group stage queue the same samples concurrently: no duplicate-key error, each
    sample once. A duplicate on another unique key is not swallowed."""
    async with Store(db_uri) as store:
        for attempt in range(5):
            samples = [_sample(i).model_copy(update={"id": f"a{attempt}-s{i}"}) for i in range(8)]
            queued = await asyncio.gather(store.samples.enqueue(samples), store.samples.enqueue(samples))
            assert sum(queued) == 8, queued
        assert await store.db.DBRecordData.count_documents({}) == 40
        await store.db.DBRecordData.delete_many({})
        await store.db.DBRecordData.create_index("task_id", unique=True)
        assert await store.samples.enqueue([_sample(0)]) == 1
        with pytest.raises(BulkWriteError):
            await store.samples.enqueue([_sample(1)])


async def test_trainers_claim_the_oldest_policy_version_first(db_uri: str) -> None:
    # A group sampled by an older policy that finished after a younger one is claimed first, so it is trained
    # before it goes stale; among equal versions enqueue order decides. SFT data (no version) counts as oldest.
    def sample(name: str, versions: list[int]) -> DBRecordData:
        return _sample(0).model_copy(update={"id": name, "record_id": name, "versions": versions})

    async with Store(db_uri) as store:
        await store.samples.enqueue([sample("young", [-1, 3, 3]), sample("young-2", [-1, 3, 4])])
        await store.samples.enqueue([sample("old", [-1, 1, 2]), sample("context-only", [5, 2, 2])])
        await store.samples.enqueue([sample("sft", [-1, -1, -1])])
        stored = {d["_id"]: d["first_version"] async for d in store.db.DBRecordData.find({})}
        assert stored == {"young": 3, "young-2": 3, "old": 1, "context-only": 2, "sft": -1}
        claimed = await store.samples.claim_batch(0, 1, 5)
        assert [s.id for s in claimed] == ["sft", "old", "context-only", "young", "young-2"]


async def test_service_load_shares_and_the_live_view(db_uri: str) -> None:
    async with Store(db_uri) as store:
        one, two = "http://127.0.0.1:1", "http://127.0.0.1:2"
        await store.services.register(one + "/", kind="agentrl-engine", models=["m"])
        await store.services.register(two, kind="sglang", models=["m"])
        assert await store.services.sync_share(one, "sampler-a", 2, started=2) == 2
        assert await store.services.sync_share(one, "sampler-b", 1, started=1) == 1
        assert [s.id for s in await store.services.live()] == [two, one]  # least loaded first
        assert await store.services.sync_share(one, "sampler-a", 0, expected=2) == 0
        doc = await store.db.InferenceService.find_one({"_id": one})
        assert (doc["running_requests"], doc["total_requests"]) == (1, 3)
        # A share that is not what its owner last wrote (here: reset by the engine's fresh registration) is read
        # and replaced: the total never counts a change its owner did not see.
        await store.services.register(one, kind="agentrl-engine", fresh_start=True)
        assert await store.services.sync_share(one, "sampler-b", 2, started=1, expected=1) == 2
        doc = await store.db.InferenceService.find_one({"_id": one})
        assert doc["running_requests"] == 2 and {k: v["n"] for k, v in doc["running_by"].items()} == {"sampler-b": 2}
        assert await store.services.sync_share("http://127.0.0.1:9", "sampler-b", 1) is None  # not registered
        await store.services.mark_down(two)
        assert [s.id for s in await store.services.live()] == [one]
        # a service whose heartbeat stopped is not live
        await store.services.heartbeat(two, weight_version=4, engine_load={"running": 0})
        await store.db.InferenceService.update_one({"_id": one},
                                                   {"$set": {"heartbeat_at": utcnow() - timedelta(minutes=5)}})
        assert [s.id for s in await store.services.live()] == [two]
        assert not await store.services.heartbeat("http://127.0.0.1:9")


async def test_run_policy_version_bumps_are_atomic(db_uri: str) -> None:
    async with Store(db_uri) as store:
        with pytest.raises(NotFound):
            await store.runs.bump_policy_version(expected=0)
        run = await store.runs.get_or_create("demo", {"lr": 1e-6})
        assert run.policy_version == 0 and run.config == {"lr": 1e-6}
        again = await store.runs.get_or_create("demo", {"lr": 5.0})
        assert again.config == {"lr": 1e-6}  # the snapshot is never overwritten
        # 20 concurrent publishers expect version 0: exactly one moves it, the others conflict and change nothing
        results = await asyncio.gather(*(store.runs.bump_policy_version(f"/ckpt/{i}", expected=0) for i in range(20)),
                                       return_exceptions=True)
        winners = [i for i, result in enumerate(results) if result == 1]
        assert len(winners) == 1 and all(isinstance(r, VersionConflict) for r in results if r != 1), results
        run = await store.runs.get()
        assert (run.policy_version, run.weights_path) == (1, f"/ckpt/{winners[0]}")
        assert await store.runs.bump_policy_version("/ckpt/next", expected=1) == 2
        await store.runs.log_metrics(1, {"loss": 0.5})
        await store.runs.log_metrics(1, {"loss": 0.25})
        assert (await store.db.Metric.find_one({"_id": "train/1"}))["values"] == {"loss": 0.25}


async def test_indexes_exist_for_every_claim_and_fetch_query(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.ensure_indexes()  # idempotent
        for collection, indexes in INDEXES.items():
            # compared by key pattern: NX-27017 names indexes its own way
            present = [list(dict(info["key"])) for info in (await store.db[collection].index_information()).values()]
            for index in indexes:
                spec = index.document
                assert list(spec["key"]) in present, f"{collection}: missing index {spec['name']} {spec['key']}"
