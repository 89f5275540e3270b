"""Fencing of dead attempts and of dead group stages, and the group stage redone after a crash.

- A take-over retires the expired attempt *before* its successor exists, so no write of the old holder can land
  once the new attempt runs (with the old order — insert the successor, then retire — the old holder's ``finish``
  still landed in between: two scored attempts of one slot).
- A heartbeat that lands after a take-over saw the lease expired wins (compare-and-set on the stored expiry).
- The group-stage lease is heartbeated and token-fenced: a stage taken over cannot close the Task.
- A group stage that crashed after moving Records on (and after the trainer trained some of them) is redone over
  the same group, with the same decisions and advantages, and queues nothing twice; no Record is left ``ready``
  once the trainer trained its samples; two overlapping runs of a stage queue each sample once; a sample too large
  for the database drops its Record, not the stage.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentrl import failpoints
from agentrl.failpoints import FailpointHit
from agentrl.rollout.agent import AgentResources
from agentrl.rollout.config import ConcurrencyConfig, GroupConfig, SamplerConfig
from agentrl.rollout.group_stage import run_group_stage
from agentrl.rollout.inference_pool import InferencePool
from agentrl.rollout.sampler import Sampler
from agentrl.rollout.tool_parsers import get_parser
from agentrl.store import CallStatus, DispatchedSamplingTask, GroupLease, LeaseLost, Record, RecordStatus, Store
from agentrl.store.call_log import CallLog
from agentrl.store.models import FailureClass
from agentrl.training.data import move_record
from agentrl.trajectory.advantages import AdvantageConfig
from conftest import with_database
from store_helpers import insert_tasks

pytestmark = pytest.mark.slow

SLACK_S = 1.1  # NX-27017 compares query dates at one-second resolution (see test_store_slots.py)
LEASE_S = 0.5
KEPT_RECORD_WINDOW = "group_stage.after_ready@2"
"""The stage's crash window between a kept Record's two writes (its Record ``ready``, its samples queued)."""


@pytest.fixture
def failpoint_env(monkeypatch: pytest.MonkeyPatch):
    def enable(spec: str) -> None:
        monkeypatch.setenv(failpoints.ENV, spec)
        failpoints.reset()

    yield enable
    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.reset()


async def _expired(store: Store) -> dict:
    await asyncio.sleep(LEASE_S + SLACK_S)
    doc = await store.slots.records.find_one({"leased": True, "lease_expires_at": {"$lt": store.slots.now()}})
    assert doc is not None
    return doc


async def test_the_old_attempt_is_retired_before_its_successor_exists(db_uri: str, failpoint_env) -> None:
    async with Store(db_uri, lease_s=LEASE_S) as store:
        await insert_tasks(store, 1, num_generations=1)
        dead = await store.slots.claim("train", "dead")
        await asyncio.sleep(LEASE_S + SLACK_S)
        failpoint_env("slots.take_over.between_writes")
        with pytest.raises(FailpointHit):
            await store.slots.recover("train", "taker")
        # Between the take-over's two writes the dead holder can no longer write anything.
        with pytest.raises(LeaseLost):
            await store.slots.finish(dead, RecordStatus.SCORED, score=1.0)
        with pytest.raises(LeaseLost):
            await store.slots.heartbeat(dead)
        assert (await store.records.get(dead.record_id)).status == RecordStatus.FAILED
        # The take-over died there: sweep recovers the slot (a retired attempt without successor) once.
        failpoint_env("")
        await asyncio.sleep(LEASE_S + SLACK_S)
        lease = await store.slots.claim("train", "sweeper")
        assert lease is not None and lease.attempt == 2
        group = await store.slots.finish(lease, RecordStatus.SCORED, score=1.0)
        assert group is not None
        records = await store.records.for_task(lease.task.id)
        assert [(r.attempt, r.status) for r in records] == [(1, RecordStatus.FAILED), (2, RecordStatus.SCORED)]
        task = await store.db.Task.find_one({"_id": lease.task.id})
        assert task["settled_slots"] == [0] and task["remaining"] == 0


async def test_a_heartbeat_landing_after_the_expiry_was_seen_keeps_the_lease(db_uri: str) -> None:
    async with Store(db_uri, lease_s=LEASE_S) as store:
        await insert_tasks(store, 1, num_generations=1)
        holder = await store.slots.claim("train", "slow")
        seen = await _expired(store)
        await store.slots.heartbeat(holder)  # the holder comes back between the take-over's read and its write
        assert await store.slots._take_over(Record.from_mongo(seen), "taker", seen["lease_expires_at"]) is None
        await store.slots.finish(holder, RecordStatus.SCORED, score=0.5)
        records = await store.records.for_task(holder.task.id)
        assert [(r.attempt, r.status) for r in records] == [(1, RecordStatus.SCORED)]


async def test_a_group_stage_taken_over_cannot_close_the_task(db_uri: str) -> None:
    async with Store(db_uri, lease_s=LEASE_S) as store:
        await insert_tasks(store, 1, num_generations=1)
        lease = await store.slots.claim("train", "s1")
        first = await store.slots.finish(lease, RecordStatus.SCORED, score=1.0)
        assert first is not None
        # Heartbeats keep the stage: nobody can take it over while they continue.
        for _ in range(3):
            await asyncio.sleep(LEASE_S / 2)
            await store.slots.heartbeat_group(first)
        assert await store.slots.claim_group_stage(None, "s2", split="train") is None
        # Without heartbeats it expires and is taken over: the first stage can neither extend nor close it.
        await asyncio.sleep(LEASE_S + SLACK_S)
        second = await store.slots.claim_group_stage(None, "s1", split="train")  # same owner, new token
        assert second is not None
        with pytest.raises(LeaseLost):
            await store.slots.heartbeat_group(first)
        with pytest.raises(LeaseLost):
            await store.slots.complete_group(first)
        closed = await store.slots.complete_group(second)
        assert closed.group_stage_done
        assert (await store.slots.complete_group(second)).group_stage_done  # idempotent for its own lease


async def _scored_group(store: Store, scores: list[float]) -> GroupLease:
    """One Task whose slots were sampled (one LLM call each, ``len`` 3 + slot output tokens) and scored."""
    await insert_tasks(store, 1, num_generations=len(scores))
    task_id, group = None, None
    for score in scores:
        lease = await store.slots.claim("train", "sampler")
        task_id = lease.task.id
        call = DispatchedSamplingTask(id=f"{lease.record_id}#0", record_id=lease.record_id, task_id=task_id, turn=0,
                                      branch=0, input_ids=[1, 2, 3], prompt_delta_text="p", sampling_params={})
        calls = CallLog()
        calls.start(call)
        output = [10 + lease.slot] * (3 + lease.slot)
        calls.finish(call.id, CallStatus.COMPLETED, output_ids=output, output_logprobs=[-0.5] * len(output),
                     weight_version=0, output_text="o")
        await store.calls.insert(calls.calls())
        group = await store.slots.finish(lease, RecordStatus.SCORED, score=score, num_turns=1, outcome="answer",
                                         final_answer="x", policy_version=0)
    assert group is not None and group.task.id == task_id
    return group


async def _state(store: Store, task_id: str) -> tuple[dict, dict]:
    records = {r.id: (r.advantage, r.group_decision) for r in await store.records.for_task(task_id)}
    samples = {doc["_id"]: doc["advantages"] async for doc in store.db.DBRecordData.find({"task_id": task_id})}
    return records, samples


@pytest.mark.parametrize("crash_at", ["group_stage.after_ready@2", "group_stage.before_complete"])
async def test_a_group_stage_redone_after_a_crash_decides_the_same(db_uri: str, db_name: str, failpoint_env,
                                                                    crash_at: str) -> None:
    scores = [1.0, 0.0, 0.0, 0.0]  # a subset of the group (the Records left scored) would decide otherwise
    group_cfg, adv_cfg = GroupConfig(), AdvantageConfig()
    async with Store(db_uri, lease_s=LEASE_S) as store:
        reference = await _scored_group(store, scores)
        await run_group_stage(store, reference, group_cfg, adv_cfg)
        expected = await _state(store, reference.task.id)
    async with Store(with_database(db_uri, db_name + "_crash"), lease_s=LEASE_S) as store:
        try:
            doomed = await _scored_group(store, scores)
            task_id = doomed.task.id
            failpoint_env(crash_at)
            with pytest.raises(FailpointHit):
                await run_group_stage(store, doomed, group_cfg, adv_cfg)
            failpoint_env("")
            # The trainer trains what reached it meanwhile (Records already ready become trained).
            for doc in [d async for d in store.db.Record.find({"task_id": task_id, "status": "ready"})]:
                assert await move_record(store, doc["_id"], RecordStatus.TRAINED)
            await asyncio.sleep(LEASE_S + SLACK_S)
            group = await store.slots.claim_group_stage(None, "rescuer", split="train")
            assert group is not None and group.task.id == task_id
            await run_group_stage(store, group, group_cfg, adv_cfg)
            records, samples = await _state(store, task_id)
            assert records == expected[0] and samples == expected[1]
            task = await store.db.Task.find_one({"_id": task_id})
            assert task["group_stage_done"] and task["status"] == "completed"
        finally:
            await store.client.drop_database(store.db.name)


async def _train_queued(store: Store, step: int) -> list[str]:
    """What the trainer does with every queued sample: claim it for ``step``, train it, move its Record from
    ``ready`` to ``trained`` (a Record in another state stays as it is), mark the claims trained."""
    claimed = await store.samples.claim_batch(0, step, 1000)
    for record_id in dict.fromkeys(sample.record_id for sample in claimed):
        await move_record(store, record_id, RecordStatus.TRAINED)
    await store.samples.mark_trained(0, step, [sample.id for sample in claimed])
    return [sample.id for sample in claimed]


async def test_samples_trained_while_a_cut_group_stage_waits_leave_no_record_ready(db_uri: str,
                                                                                  failpoint_env) -> None:
    """The stage dies between a kept Record's two writes and the trainer trains everything queued before the stage
    is redone: no Record is left ``ready`` for ever (admission control would count it for the rest of the run)."""
    async with Store(db_uri, lease_s=LEASE_S) as store:
        doomed = await _scored_group(store, [1.0, 0.0, 0.0, 0.0])
        failpoint_env(KEPT_RECORD_WINDOW)
        with pytest.raises(FailpointHit):
            await run_group_stage(store, doomed, GroupConfig(), AdvantageConfig())
        failpoint_env("")
        trained = await _train_queued(store, step=1)
        await asyncio.sleep(LEASE_S + SLACK_S)
        group = await store.slots.claim_group_stage(None, "rescuer", split="train")
        outcome = await run_group_stage(store, group, GroupConfig(), AdvantageConfig())
        trained += await _train_queued(store, step=2)
        records = await store.records.for_task(doomed.task.id)
        assert sorted(trained) == sorted(f"{r.id}#b0" for r in records) and len(outcome.kept) == 4
        assert {r.status for r in records} == {RecordStatus.TRAINED}, [(r.id, r.status) for r in records]
        assert (await store.slots.sampling_load("train")).pending == 0


async def test_two_overlapping_runs_of_a_group_stage_queue_each_sample_once(db_uri: str) -> None:
    """A stage that outlived its lease still runs while the sampler that took it over runs it too: they queue the
    same samples at the same time; neither fails on the other's (a permanent duplicate-key error stopped the
    sampler, and every sampler that claimed the stage next), and the stale one cannot close the Task."""
    async with Store(db_uri, lease_s=LEASE_S) as store:
        slow = await _scored_group(store, [1.0, 0.0, 1.0, 0.0])
        await asyncio.sleep(LEASE_S + SLACK_S)
        taker = await store.slots.claim_group_stage(None, "taker", split="train")
        assert taker is not None
        results = await asyncio.gather(*(run_group_stage(store, group, GroupConfig(), AdvantageConfig())
                                         for group in (slow, taker)), return_exceptions=True)
        assert isinstance(results[0], LeaseLost) and len(results[1].kept) == 4, results
        samples = [doc["record_id"] async for doc in store.db.DBRecordData.find({"task_id": slow.task.id})]
        assert sorted(samples) == sorted(results[1].kept)
        assert {r.status for r in await store.records.for_task(slow.task.id)} == {RecordStatus.READY}
        assert (await store.db.Task.find_one({"_id": slow.task.id}))["status"] == "completed"


async def test_a_sample_over_the_document_limit_drops_its_record_not_the_stage(db_uri: str) -> None:
    """A kept trajectory whose training sample exceeds MongoDB's 16 MiB document limit is abandoned with the
    failure class ``sample_too_large``; the rest of its group is queued and the Task closes (the stage used to
    fail on it every time it was redone)."""
    async with Store(db_uri, lease_s=LEASE_S) as store:
        group = await _scored_group(store, [1.0, 0.0, 1.0, 0.0])
        huge = f"{group.task.id}/1/1#0"  # one LLM call of slot 1, with a prompt of 300k tokens: a ~20 MB sample
        await store.db.DispatchedSamplingTask.update_one({"_id": huge}, {"$set": {"input_ids": [7] * 300_000}})
        outcome = await run_group_stage(store, group, GroupConfig(), AdvantageConfig())
        records = {r.slot: r for r in await store.records.for_task(group.task.id)}
        assert records[1].status == RecordStatus.ABANDONED
        assert records[1].failure_class == FailureClass.SAMPLE_TOO_LARGE and "bytes" in records[1].group_decision
        assert [records[slot].status for slot in (0, 2, 3)] == [RecordStatus.READY] * 3
        assert sorted(outcome.kept) == sorted(records[slot].id for slot in (0, 2, 3))
        assert await store.db.DBRecordData.count_documents({"task_id": group.task.id}) == 3
        assert (await store.db.Task.find_one({"_id": group.task.id}))["status"] == "completed"


async def test_a_permanent_database_error_in_a_recovered_group_stage_does_not_stop_the_sampler(
        db_uri: str, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A stage that fails on a permanent database error is logged and retried once its lease expires; the sampler
    keeps running (it used to stop, and so did every sampler that claimed the stage next). The error comes from a
    unique index the stage's samples violate (a permanent error that cannot be produced otherwise)."""
    caplog.set_level(logging.INFO, logger="agentrl.rollout")
    config = SamplerConfig(db_connection_string=db_uri, concurrency=ConcurrencyConfig(lease_s=1.0),
                           exit_when_done=True)
    async with Store(db_uri, lease_s=config.concurrency.lease_s) as store:
        await store.db.DBRecordData.create_index("task_id", unique=True)
        await _scored_group(store, [1.0, 0.0, 1.0, 0.0])  # its stage is pending: "sampler" never ran it
        pool = InferencePool(store)
        resources = AgentResources(store=store, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                                   inference=pool, parser=get_parser(config.rollout.tool_call_parser), config=config)
        sampler = Sampler(resources, owner=pool.owner)
        run = asyncio.create_task(sampler.run())
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while caplog.text.count("another attempt follows when its lease expires") < 2:
                assert not run.done(), run.exception() if not run.cancelled() else "cancelled"
                assert asyncio.get_running_loop().time() < deadline, caplog.text[-3000:]
                await asyncio.sleep(0.1)
            assert "failed: BulkWriteError: batch op errors occurred" in caplog.text
        finally:
            sampler.stop()
            stats = await asyncio.wait_for(run, 60)
            await pool.close()
        assert stats.group_stages == 0


SKEWED_THIEF = """
import asyncio, sys
from datetime import datetime, timedelta, timezone
import time_machine
from agentrl.store import Store

async def main(uri):
    async with Store(uri, lease_s=60) as store:
        lease = await store.slots.recover("train", "thief")
        print("stole" if lease is not None else "kept off", flush=True)

# This machine's clock runs two minutes (two leases) ahead of the database's.
with time_machine.travel(datetime.now(timezone.utc) + timedelta(seconds=120), tick=True):
    asyncio.run(main(sys.argv[1]))
"""


async def test_a_machine_whose_clock_runs_ahead_does_not_steal_live_leases(db_uri: str) -> None:
    """Leases follow the database server's clock: a sampler on a machine whose clock is 120 s ahead (simulated in
    its own process with ``time_machine``, which shifts every wall-clock reading of the process) sees the
    honest sampler's 60 s lease as live."""
    async with Store(db_uri, lease_s=60) as store:
        await insert_tasks(store, 1, num_generations=1)
        honest = await store.slots.claim("train", "honest")
        thief = await asyncio.create_subprocess_exec(sys.executable, "-c", SKEWED_THIEF, db_uri,
                                                     stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await thief.communicate()
        assert thief.returncode == 0, err.decode()[-2000:]
        assert out.decode().strip() == "kept off", err.decode()[-2000:]
        await store.slots.heartbeat(honest)  # still ours
