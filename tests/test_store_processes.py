"""Claims across real OS processes: races, and a SIGKILLed claimer whose lease expires and is reclaimed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from agentrl.store import DBRecordData, RecordStatus, Store, TaskStatus
from store_helpers import insert_tasks

CLAIMER = str(Path(__file__).with_name("claimer_process.py"))


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CLAIMER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def lines(process: subprocess.Popen, timeout: float = 120) -> list[dict]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def test_four_processes_claim_every_slot_exactly_once(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await insert_tasks(store, 30, num_generations=4)
        processes = [spawn(db_uri, "drain", f"p{i}") for i in range(4)]
        claims = [claim for process in processes for claim in lines(process)]
        per_slot = Counter((c["task"], c["slot"]) for c in claims)
        assert len(per_slot) == 120 and set(per_slot.values()) == {1}
        assert sum(1 for p in processes if p.returncode == 0) == 4
        assert await store.db.Record.count_documents({}) == 120
        # every process got some of the work (the race was real)
        assert await store.db.Task.count_documents({"unclaimed": 0}) == 30


async def test_sigkilled_claimer_slot_is_reclaimed_and_completed_by_another(db_uri: str) -> None:
    async with Store(db_uri, lease_s=30) as store:  # the holder process uses 0.5 s leases
        await insert_tasks(store, 1, num_generations=2)
        holder = spawn(db_uri, "hold", "doomed", "0.5")
        held = json.loads(holder.stdout.readline())["record_id"]
        mine = await store.slots.claim("train", "survivor")
        assert mine.record_id != held
        time.sleep(1.0)  # the holder heartbeats: its lease stays valid
        assert await store.slots.claim("train", "survivor") is None
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (taken := await store.slots.claim("train", "survivor")) is None:
            assert time.monotonic() < deadline, "the dead claimer's lease was never reclaimed"
            time.sleep(0.2)
        assert taken.record_id.rsplit("/", 1)[0] == held.rsplit("/", 1)[0] and taken.attempt == 2
        assert await store.slots.finish(mine, RecordStatus.SCORED, score=1.0) is None
        group = await store.slots.finish(taken, RecordStatus.SCORED, score=0.0)
        assert group is not None
        assert (await store.slots.complete_group(group)).status == TaskStatus.COMPLETED
        dead = await store.records.get(held)
        assert dead.status == RecordStatus.FAILED and "doomed" in dead.error
        assert await store.db.Record.count_documents({"status": "scored"}) == 2


async def test_trainer_ranks_in_separate_processes_claim_each_sample_once(db_uri: str) -> None:
    async with Store(db_uri) as store:
        samples = [DBRecordData(id=f"s{i}", record_id=f"r{i}", task_id="t", seq=0, input_ids=[1, 2], loss_mask=[0, 1],
                                logprobs=[0.0, -0.5], versions=[-1, 0], advantages=[0.0, 1.0], num_tokens=2)
                   for i in range(200)]
        await store.samples.enqueue(samples)
        processes = [spawn(db_uri, "samples", str(rank), "8") for rank in range(4)]
        claimed = [i for p in processes for batch in lines(p) for i in batch["ids"]]
        assert sorted(claimed) == sorted(s.id for s in samples)
        assert (await store.samples.counts())["claimed"] == 200
