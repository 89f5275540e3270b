"""Crash windows of the slot protocol: a sampler dying between the writes of ``finish`` never wedges its Task,
and ``sweep`` finds the Tasks that need recovery however many Tasks are merely running long trajectories.

After recovery the invariants hold: the slot is settled exactly once, the Record keeps its score (no new attempt
re-samples it), the Task's group stage runs and closes it, and nothing stays ``running`` or leased.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from agentrl import failpoints
from agentrl.store import RecordStatus, Store, Task, TaskStatus
from agentrl.store.models import utcnow
from store_helpers import insert_tasks

pytestmark = pytest.mark.slow

SLACK_S = 1.1  # NX-27017 compares query dates at one-second resolution (see test_store_slots.py)

DOOMED_FINISHER = """
import asyncio, sys
from agentrl.store import RecordStatus, Store

async def main(uri):
    async with Store(uri, lease_s=0.5) as store:
        lease = await store.slots.claim("train", "doomed")
        print(lease.record_id, flush=True)
        await store.slots.finish(lease, RecordStatus.SCORED, score=0.75, score_details={"by": "doomed"})
        print("finished", flush=True)

asyncio.run(main(sys.argv[1]))
"""


async def _task(store: Store, task_id: str = "train:t0000") -> Task:
    return Task.from_mongo(await store.db.Task.find_one({"_id": task_id}))


async def _assert_settled_once_and_closed(store: Store, task_id: str, scores: dict[int, float]) -> None:
    """Every slot settled exactly once with its original score; the group stage runs; nothing left running."""
    task = await _task(store, task_id)
    assert sorted(task.settled_slots) == sorted(scores) and len(task.settled_slots) == len(set(task.settled_slots))
    assert sorted(task.completed_slots) == sorted(scores) and task.failed_slots == [] and task.remaining == 0
    records = await store.records.for_task(task_id)
    assert {r.slot: r.score for r in records} == scores and len(records) == len(scores)  # no re-sampled attempt
    assert all(r.status == RecordStatus.SCORED and not r.leased for r in records)
    group = await store.slots.claim_group_stage(None, "recoverer", split="train")
    assert group is not None and group.task.id == task_id
    assert (await store.slots.complete_group(group)).status == TaskStatus.COMPLETED
    assert await store.db.Task.count_documents({"status": "running"}) == 0
    assert await store.db.Record.count_documents({"$or": [{"status": "running"}, {"leased": True}]}) == 0
    assert (await store.slots.sampling_load("train")).group_slots == 0


async def test_finish_cut_after_the_record_write_is_settled_by_take_over(db_uri: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    async with Store(db_uri, lease_s=0.3) as store:
        await insert_tasks(store, 1, num_generations=2)
        doomed, sibling = await store.slots.claim("train", "a"), await store.slots.claim("train", "b")
        assert await store.slots.finish(sibling, RecordStatus.SCORED, score=0.0) is None
        monkeypatch.setenv(failpoints.ENV, "slots.finish.after_record=raise")
        failpoints.reset()
        try:
            with pytest.raises(failpoints.FailpointHit):
                await store.slots.finish(doomed, RecordStatus.SCORED, score=1.0)
        finally:
            monkeypatch.delenv(failpoints.ENV)
            failpoints.reset()
        # "a" died there: its Record has its score, the Task does not know yet.
        assert (await _task(store)).remaining == 1
        assert await store.slots.claim("train", "c") is None  # the lease is still valid: nothing to do
        await asyncio.sleep(0.3 + SLACK_S)
        assert await store.slots.claim("train", "c") is None  # recovered by settling, not by a new attempt
        await _assert_settled_once_and_closed(store, "train:t0000", {0: 1.0, 1: 0.0})


async def test_sigkilled_finisher_between_record_and_task_writes_is_recovered(db_uri: str) -> None:
    """A real process dies (``os._exit`` at the failpoint: no cleanup) between the two writes of ``finish``."""
    async with Store(db_uri, lease_s=30) as store:
        await insert_tasks(store, 1, num_generations=1)
        env = {**os.environ, failpoints.ENV: "slots.finish.after_record=exit"}
        done = subprocess.run([sys.executable, "-c", DOOMED_FINISHER, db_uri], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == failpoints.EXIT_CODE, (done.returncode, done.stdout, done.stderr)
        record_id = done.stdout.split()[0]
        record = await store.records.get(record_id)
        assert record.status == RecordStatus.SCORED and record.score == 0.75
        assert (await _task(store)).remaining == 1 and (await _task(store)).status == TaskStatus.RUNNING
        deadline = time.monotonic() + 10
        while (await _task(store)).remaining:
            assert time.monotonic() < deadline, "the cut-off settlement was never completed"
            assert await store.slots.claim("train", "survivor") is None
            await asyncio.sleep(0.2)
        await _assert_settled_once_and_closed(store, "train:t0000", {0: 0.75})
        assert (await store.records.get(record_id)).score_details == {"by": "doomed"}


async def test_scored_record_without_lease_or_settlement_is_settled_by_sweep(db_uri: str) -> None:
    """The state a crash left with versions whose ``finish`` dropped the lease in its first write: a scored
    Record, no lease, the slot unsettled. Neither take-over nor sweep revisited it; the Task stayed running."""
    async with Store(db_uri, lease_s=0.2) as store:
        await insert_tasks(store, 1, num_generations=2)
        cut, sibling = await store.slots.claim("train", "a"), await store.slots.claim("train", "b")
        await store.db.Record.update_one({"_id": cut.record_id}, {"$set": {
            "status": "scored", "score": 1.0, "leased": False, "updated_at": utcnow(), "finished_at": utcnow()}})
        assert await store.slots.finish(sibling, RecordStatus.SCORED, score=0.5) is None
        await asyncio.sleep(0.2 + SLACK_S)
        assert await store.slots.claim("train", "c") is None
        await _assert_settled_once_and_closed(store, "train:t0000", {0: 1.0, 1: 0.5})


async def _healthy_and_cut(store: Store, healthy: int, *, cut_first: bool) -> str:
    """``healthy`` Tasks each running one long trajectory (a live, heartbeated lease), and one Task whose claim
    was cut off before its Record was inserted (inserted last; touched first or last). Returns its id."""
    await insert_tasks(store, healthy + 1, num_generations=1)
    cut_id = f"train:t{healthy:04d}"

    async def cut() -> None:
        await store.db.Task.update_one({"_id": cut_id}, {"$inc": {"unclaimed": -1}, "$push": {"claim_ids": "lost"},
                                                         "$set": {"status": "running", "updated_at": utcnow()}})

    if cut_first:
        await cut()
        await asyncio.sleep(SLACK_S)  # strictly older than every healthy Task, even at one-second resolution
    leases = [await store.slots.claim("train", f"s{i}") for i in range(healthy)]
    assert {lease.task.id for lease in leases} == {f"train:t{i:04d}" for i in range(healthy)}
    if not cut_first:
        await asyncio.sleep(SLACK_S)
        await cut()
    await asyncio.sleep(store.slots.lease_s + SLACK_S)  # every Task is now untouched for longer than a lease
    for lease in leases:
        await store.slots.heartbeat(lease)  # ... but every trajectory is alive
    return cut_id


async def test_sweep_finds_a_task_needing_recovery_behind_many_long_running_ones(db_uri: str) -> None:
    async with Store(db_uri, lease_s=2.0) as store:
        cut_id = await _healthy_and_cut(store, 40, cut_first=False)
        recovered = await store.slots.claim("train", "rescuer")
        assert recovered is not None and (recovered.task.id, recovered.slot, recovered.attempt) == (cut_id, 0, 1)
        assert await store.slots.claim("train", "rescuer") is None


async def test_sweep_considers_the_least_recently_touched_tasks_first(db_uri: str) -> None:
    async with Store(db_uri, lease_s=2.0) as store:
        cut_id = await _healthy_and_cut(store, 12, cut_first=True)
        recovered = await store.slots.sweep("train", "rescuer", max_tasks=4)
        assert recovered is not None and (recovered.task.id, recovered.slot) == (cut_id, 0)


async def test_recover_takes_over_lost_slots_but_never_starts_a_new_group(db_uri: str) -> None:
    """What a sampler calls while admission control holds new groups back (the wedged groups count there)."""
    async with Store(db_uri, lease_s=0.2) as store:
        await insert_tasks(store, 2, num_generations=1)
        lost = await store.slots.claim("train", "dead")
        assert await store.slots.recover("train", "s") is None  # t0001 is free, but it would be a new group
        await asyncio.sleep(0.2 + SLACK_S)
        taken = await store.slots.recover("train", "s")
        assert (taken.task.id, taken.slot, taken.attempt) == (lost.task.id, 0, 2)
        assert (await _task(store, "train:t0001")).status == TaskStatus.CREATED
