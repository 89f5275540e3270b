"""A stand-alone claimer run as a separate OS process by the store tests.

    python claimer_process.py URI drain OWNER        claim slots until none is left; print each record id
    python claimer_process.py URI hold OWNER LEASE_S claim one slot, print its record id, heartbeat forever
    python claimer_process.py URI samples RANK N     claim DBRecordData for steps 0.. of N until the queue is empty
"""

from __future__ import annotations

import asyncio
import json
import sys

from agentrl.store import Store


async def drain(uri: str, owner: str) -> None:
    async with Store(uri) as store:
        while (lease := await store.slots.claim("train", owner)) is not None:
            print(json.dumps({"record_id": lease.record_id, "task": lease.task.id, "slot": lease.slot}), flush=True)


async def hold(uri: str, owner: str, lease_s: float) -> None:
    async with Store(uri, lease_s=lease_s) as store:
        lease = await store.slots.claim("train", owner)
        print(json.dumps({"record_id": lease.record_id}), flush=True)
        while True:
            await store.slots.heartbeat(lease)
            await asyncio.sleep(lease_s / 4)


async def samples(uri: str, rank: int, size: int) -> None:
    async with Store(uri) as store:
        step = 0
        while batch := await store.samples.claim_batch(rank, step, size):
            print(json.dumps({"step": step, "ids": [s.id for s in batch]}), flush=True)
            step += 1


if __name__ == "__main__":
    uri, mode, *rest = sys.argv[1:]
    if mode == "drain":
        asyncio.run(drain(uri, rest[0]))
    elif mode == "hold":
        asyncio.run(hold(uri, rest[0], float(rest[1])))
    else:
        asyncio.run(samples(uri, int(rest[0]), int(rest[1])))
