"""Settling at shutdown and giving slots up: a Record given back or abandoned ends ``failed`` at once with its
failure class (never left ``running``), its slot is retaken at once, and the started Tasks nobody works on any more
become ``interrupted`` (never left ``running``) until a sampler resumes them.
"""

from __future__ import annotations

import asyncio

import pytest

from agentrl import failpoints
from agentrl.dashboard.queries import RecordFilters
from agentrl.store import LeaseLost, RecordStatus, Store, Task, TaskStatus, sync_client
from agentrl.store.models import FailureClass
from agentrl.store.summary import failure_counts
from store_helpers import insert_tasks


async def _task(store: Store, task_id: str = "train:t0000") -> Task:
    return Task.from_mongo(await store.db.Task.find_one({"_id": task_id}))


async def test_a_released_attempt_ends_failed_at_once_and_its_slot_is_retaken_without_counting(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await insert_tasks(store, 1, num_generations=1)
        lease = await store.slots.claim("train", "s1")
        await store.slots.release(lease, "NoInferenceService: none live", FailureClass.INFERENCE_UNAVAILABLE)
        record = await store.records.get(lease.record_id)
        assert (record.status, record.failure_class, record.error) == (
            RecordStatus.FAILED, FailureClass.INFERENCE_UNAVAILABLE, "NoInferenceService: none live")
        assert record.released and record.given_up and record.finished_at is not None
        with pytest.raises(LeaseLost):  # a late heartbeat of the holder cannot revive it
            await store.slots.heartbeat(lease)
        retaken = await store.slots.claim("train", "s2")
        assert (retaken.slot, retaken.attempt) == (lease.slot, 2)
        assert (await store.records.get(retaken.record_id)).failures == 0
        old = await store.records.get(lease.record_id)
        assert not old.leased and old.failure_class == FailureClass.INFERENCE_UNAVAILABLE


async def test_an_abandoned_attempt_ends_failed_and_counts_as_a_failed_attempt(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await insert_tasks(store, 1, num_generations=1, max_attempts=2)
        first = await store.slots.claim("train", "s1")
        await store.slots.abandon(first, "KeyError: 'x'")
        record = await store.records.get(first.record_id)
        assert (record.status, record.failure_class, record.released) == (
            RecordStatus.FAILED, FailureClass.SAMPLER_ERROR, False)
        second = await store.slots.claim("train", "s2")
        assert (second.attempt, (await store.records.get(second.record_id)).failures) == (2, 1)
        await store.slots.abandon(second, "KeyError: 'x'")
        assert await store.slots.claim("train", "s3") is None  # two failed attempts: the slot is given up
        task = await _task(store)
        assert task.failed_slots == [0] and task.remaining == 0
        errors = [r.error for r in await store.records.for_task(task.id)]
        assert errors == ["KeyError: 'x'; taken over by attempt 2", "KeyError: 'x'; slot given up after 2 failed "
                                                                     "attempts"]


async def test_releasing_an_attempt_whose_outcome_is_written_completes_its_settlement(db_uri: str) -> None:
    """Shutdown cut ``finish`` after the Record's outcome: the slot is settled now, not after the lease expires
    (nothing else would settle it at the end of a run)."""
    async with Store(db_uri) as store:
        await insert_tasks(store, 1, num_generations=1)
        lease = await store.slots.claim("train", "s1")
        await store.slots._record_outcome(lease, RecordStatus.SCORED, {"score": 1.0})
        await store.slots.release(lease)
        record = await store.records.get(lease.record_id)
        assert (record.status, record.score, record.leased, record.failure_class) == (
            RecordStatus.SCORED, 1.0, False, None)
        task = await _task(store)
        assert task.completed_slots == [0] and task.remaining == 0
        assert await store.slots.claim_group_stage(None, "s2", split="train") is not None


async def test_idle_started_tasks_are_interrupted_and_resumed_by_the_next_claim(db_uri: str) -> None:
    async with Store(db_uri, lease_s=30) as store:
        await insert_tasks(store, 3, num_generations=2)
        released = await store.slots.claim("train", "stopping")  # t0000 slot 0: given back at shutdown
        done = await store.slots.claim("train", "stopping")  # t0000 slot 1: finished before
        await store.slots.finish(done, RecordStatus.SCORED, score=1.0)
        live = await store.slots.claim("train", "other")  # t0001: another sampler still works on it
        await store.slots.release(released)

        assert await store.slots.interrupt_idle("train") == ["train:t0000"]
        assert [(await _task(store, f"train:t000{i}")).status for i in range(3)] == [
            TaskStatus.INTERRUPTED, TaskStatus.RUNNING, TaskStatus.CREATED]
        assert await store.db.Record.count_documents({"status": "running"}) == 1  # only the live one
        assert not await store.slots.sampling_finished("train")
        load = await store.slots.sampling_load("train")  # an interrupted group still counts against admission
        assert (load.group_slots, load.unclaimed_in_started_groups) == (4, 1)

        resumed = await store.slots.recover("train", "next")  # the given-back slot is retaken at once
        assert (resumed.task.id, resumed.slot, resumed.attempt) == ("train:t0000", 0, 2)
        assert (await _task(store)).status == TaskStatus.RUNNING
        await store.slots.finish(live, RecordStatus.SCORED, score=0.0)
        group = await store.slots.finish(resumed, RecordStatus.SCORED, score=0.0)
        assert (await store.slots.complete_group(group)).status == TaskStatus.COMPLETED


async def test_an_interrupted_task_with_unclaimed_slots_is_claimed_again(db_uri: str) -> None:
    async with Store(db_uri, lease_s=30) as store:
        await insert_tasks(store, 1, num_generations=2)
        lease = await store.slots.claim("train", "stopping")
        await store.slots.finish(lease, RecordStatus.SCORED, score=1.0)
        assert await store.slots.interrupt_idle("train") == ["train:t0000"]
        again = await store.slots.claim("train", "next")
        assert (again.slot, again.attempt) == (1, 1) and (await _task(store)).status == TaskStatus.RUNNING


async def test_a_claim_cut_off_in_an_interrupted_task_is_swept(db_uri: str) -> None:
    """The sweep looks at interrupted Tasks too: a claim cut off before its Record (simulated: the crash window
    of ``slots.claim.before_record``) in a Task whose samplers all stopped is recovered."""
    async with Store(db_uri, lease_s=0.3) as store:
        await insert_tasks(store, 1, num_generations=2)
        await store.db.Task.update_one({"_id": "train:t0000"}, {"$inc": {"unclaimed": -1},
                                                                 "$push": {"claim_ids": "lost"},
                                                                 "$set": {"status": "running"}})
        assert await store.slots.interrupt_idle("train") == ["train:t0000"]
        await asyncio.sleep(0.3 + 1.1)  # older than a lease (NX-27017 compares dates at one-second resolution)
        recovered = await store.slots.recover("train", "s1")
        assert (recovered.task.id, recovered.slot, recovered.attempt) == ("train:t0000", 0, 1)
        assert (await _task(store)).status == TaskStatus.RUNNING


async def test_a_task_whose_group_stage_is_held_or_pending_is_handled(db_uri: str) -> None:
    """A Task whose group stage a live lease runs stays ``running``; one whose stage nobody holds is interrupted
    and its stage is still claimed (and closes the Task) afterwards."""
    async with Store(db_uri, lease_s=30) as store:
        await insert_tasks(store, 1, num_generations=1)
        group = await store.slots.finish(await store.slots.claim("train", "s1"), RecordStatus.SCORED, score=1.0)
        assert await store.slots.interrupt_idle("train") == []
        await store.slots.release_group(group)  # the stage's sampler stopped
        assert await store.slots.interrupt_idle("train") == ["train:t0000"]
        taken = await store.slots.claim_group_stage(None, "s2", split="train")
        assert taken is not None
        assert (await store.slots.complete_group(taken)).status == TaskStatus.COMPLETED


async def test_a_claim_racing_the_interruption_leaves_the_task_running(db_uri: str) -> None:
    """Both sides write before they look: whatever the interleaving, a Task with a live Record ends ``running``."""
    async with Store(db_uri, lease_s=30) as store:
        await insert_tasks(store, 1, num_generations=8)
        await store.slots.release(await store.slots.claim("train", "stopping"))
        for _ in range(5):
            results = await asyncio.gather(store.slots.interrupt_idle("train"), store.slots.claim("train", "s2"))
            assert results[1] is not None
            assert (await _task(store)).status == TaskStatus.RUNNING
            await store.slots.release(results[1])
        assert await store.slots.interrupt_idle("train") == ["train:t0000"]


async def test_a_claim_between_its_two_writes_keeps_its_task_running(db_uri: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh claim writes the Task (its slot; status ``running``) and then its Record, and never the Task again:
    the interrupter counts a slot claimed without a Record as worked on, for a lease after the claim (a claim cut
    off by a crash then counts like an expired lease: the Task is interrupted and the sweep recovers the slot)."""
    async with Store(db_uri, lease_s=2.0) as store:  # (NX-27017 compares dates at one-second resolution)
        await insert_tasks(store, 1, num_generations=2)
        await store.slots.release(await store.slots.claim("train", "stopping"))  # slot 0: given back
        monkeypatch.setenv(failpoints.ENV, "slots.claim.before_record=raise")
        failpoints.reset()
        try:
            with pytest.raises(failpoints.FailpointHit):
                await store.slots.claim_started("train", "claimer")  # slot 1 claimed on the Task only
        finally:
            monkeypatch.delenv(failpoints.ENV)
            failpoints.reset()
        assert await store.slots.interrupt_idle("train") == []
        assert (await _task(store)).status == TaskStatus.RUNNING
        await asyncio.sleep(2.0 + 1.1)  # the claimer died there
        assert await store.slots.interrupt_idle("train") == ["train:t0000"]
        recovered = {(lease.slot, lease.attempt) for lease in [await store.slots.recover("train", "s"),
                                                                await store.slots.recover("train", "s")]}
        assert recovered == {(0, 2), (1, 1)} and (await _task(store)).status == TaskStatus.RUNNING


async def test_old_documents_without_a_failure_class_read_as_unknown(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await insert_tasks(store, 1, num_generations=1)
        lease = await store.slots.claim("train", "s1")
        await store.db.Record.update_one({"_id": lease.record_id}, {"$set": {"status": "abandoned"},
                                                                   "$unset": {"failure_class": "", "given_up": ""}})
        record = await store.records.get(lease.record_id)
        assert record.failure_class == FailureClass.UNKNOWN and not record.given_up
        client = sync_client(db_uri)
        try:  # counted (report, watch, status, dashboard) and listed (the dashboard's filter) as unknown
            records = client.get_default_database().Record
            assert failure_counts(records) == {"unknown": 1}
            assert records.count_documents(RecordFilters(failure_class="unknown").query()) == 1
            assert records.count_documents(RecordFilters(failure_class="cancelled").query()) == 0
        finally:
            client.close()
        await store.db.Record.update_one({"_id": lease.record_id}, {"$set": {"status": "scored"}})
        assert (await store.records.get(lease.record_id)).failure_class is None  # it may still train


async def test_an_old_released_record_is_taken_over_as_before(db_uri: str) -> None:
    """A Record given back by an earlier version (still ``running``, lease expired, ``released``) is retaken."""
    async with Store(db_uri, lease_s=0.2) as store:
        await insert_tasks(store, 1, num_generations=1)
        lease = await store.slots.claim("train", "s1")
        await store.db.Record.update_one({"_id": lease.record_id}, {
            "$set": {"lease_expires_at": store.slots.now().replace(year=1970), "released": True,
                     "error": "sampler shutting down"}, "$unset": {"given_up": "", "failure_class": ""}})
        retaken = await store.slots.claim("train", "s2")
        assert retaken is not None and retaken.attempt == 2
        old = await store.records.get(lease.record_id)
        assert (old.status, old.failure_class, old.leased) == (RecordStatus.FAILED, FailureClass.UNKNOWN, False)
        assert (await store.records.get(retaken.record_id)).failures == 0
