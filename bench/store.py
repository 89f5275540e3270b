"""Store throughput against the raw driver, measured in the same run on the same server.

    .venv/bin/python bench/store.py [--db_connection_string URI] [--claims 600] [--repeats 3]

* claims/s: ``Store.slots.claim`` (lease on a Task slot: one ``find_one_and_update`` on Task + one ``insert_one``
  of the slot's Record, plus pydantic models and the periodic expired-lease probe) versus a raw loop issuing the
  same ``find_one_and_update`` + ``insert_one`` with ``AsyncMongoClient``;
* record writes/s: a trajectory's LLM calls (two turns) logged in a ``CallLog`` and written by
  ``Store.calls.insert`` (one ``insert_many``) versus the same raw ``insert_many`` of the same documents.

Each figure is the median of ``--repeats`` runs at 1, 4 and 16 concurrent async claimers. Without a connection
string, an embedded NX-27017 server is started on a free port in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from pymongo import AsyncMongoClient, ReturnDocument

from agentrl.store import CallStatus, DispatchedSamplingTask, Store, with_database
from agentrl.store.call_log import CallLog
from agentrl.store.embedded import EmbeddedServer
from agentrl.store.models import utcnow
from agentrl.store.task_files import UploadDefaults, parse_entry

CONCURRENCY = (1, 4, 16)
TASK_GROUP = 8


async def seed_tasks(store: Store, slots: int) -> None:
    defaults = UploadDefaults(num_generations=TASK_GROUP, scorer="math", answer_schema="boxed")
    tasks = [parse_entry({"id": i, "question": f"q{i}", "answer": "1"}, defaults, order=i).to_mongo()
             for i in range(slots // TASK_GROUP + 1)]
    await store.db.Task.insert_many(tasks)
    await store.ensure_indexes()


async def run_workers(concurrency: int, total: int, op: Callable[[int], Awaitable[None]]) -> float:
    """Run ``total`` operations spread over ``concurrency`` workers; returns operations per second."""
    counter = iter(range(total))

    async def worker() -> None:
        for i in counter:
            await op(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - start)


async def store_claims(uri: str, concurrency: int, total: int) -> float:
    async with Store(uri) as store:
        await seed_tasks(store, total)

        async def op(i: int) -> None:
            assert await store.slots.claim("train", f"w{i % concurrency}") is not None

        return await run_workers(concurrency, total, op)


async def raw_claims(uri: str, concurrency: int, total: int) -> float:
    async with Store(uri) as store:
        await seed_tasks(store, total)
    client = AsyncMongoClient(uri, tz_aware=True)
    db = client.get_default_database()

    async def op(i: int) -> None:
        lease_id = uuid.uuid4().hex
        doc = await db.Task.find_one_and_update(
            {"split": "train", "status": {"$in": ["created", "running"]}, "unclaimed": {"$gt": 0}},
            {"$inc": {"unclaimed": -1}, "$push": {"claim_ids": lease_id},
             "$set": {"status": "running", "updated_at": utcnow()}},
            sort=[("round", 1), ("order", 1)], return_document=ReturnDocument.AFTER)
        slot = doc["claim_ids"].index(lease_id)
        await db.Record.insert_one({
            "_id": f"{doc['_id']}/{slot}/1", "task_id": doc["_id"], "split": "train", "slot": slot, "attempt": 1,
            "lease_id": lease_id, "lease_owner": f"w{i % concurrency}", "leased": True,
            "lease_expires_at": utcnow(), "status": "running", "created_at": utcnow()})

    try:
        return await run_workers(concurrency, total, op)
    finally:
        await client.close()


def _calls(i: int) -> CallLog:
    """A two-turn trajectory's calls, finished."""
    calls = CallLog()
    for turn in range(2):
        call = calls.start(DispatchedSamplingTask(id=f"r{i}#{turn}", record_id=f"r{i}", task_id="t", turn=turn,
                                                  input_ids=list(range(300)) if turn == 0 else None,
                                                  previous_call_id=f"r{i}#0" if turn else None))
        calls.finish(call.id, CallStatus.COMPLETED, output_ids=list(range(100)), output_logprobs=[-0.5] * 100,
                     weight_version=1, finish_reason="stop")
    return calls


async def store_writes(uri: str, concurrency: int, total: int) -> float:
    async with Store(uri) as store:
        async def op(i: int) -> None:
            await store.calls.insert(_calls(i).calls())

        return await run_workers(concurrency, total, op)


async def raw_writes(uri: str, concurrency: int, total: int) -> float:
    client = AsyncMongoClient(uri, tz_aware=True)
    collection = client.get_default_database().DispatchedSamplingTask

    async def op(i: int) -> None:
        await collection.insert_many([call.to_mongo() for call in _calls(i).calls()], ordered=False)

    try:
        return await run_workers(concurrency, total, op)
    finally:
        await client.close()


async def measure(server_uri: str, fn, concurrency: int, total: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        uri = with_database(server_uri, "bench_" + uuid.uuid4().hex[:8])
        rates.append(await fn(uri, concurrency, total))
        client = AsyncMongoClient(server_uri)
        await client.drop_database(uri.rsplit("/", 1)[1])
        await client.close()
    return statistics.median(rates)


async def main(args: argparse.Namespace) -> int:
    server = None
    server_uri = args.db_connection_string
    if not server_uri:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = EmbeddedServer(data_dir=Path(tempfile.mkdtemp(prefix="agentrl-bench-")), port=port)
        server_uri = server.start()
    try:
        rows = []
        for concurrency in CONCURRENCY:
            row = {"concurrency": concurrency}
            for name, fn in (("store_claims", store_claims), ("raw_claims", raw_claims),
                             ("store_writes", store_writes), ("raw_writes", raw_writes)):
                row[name] = await measure(server_uri, fn, concurrency, args.claims, args.repeats)
                print(f"  concurrency {concurrency:>2} {name:<12} {row[name]:8.1f}/s", file=sys.stderr)
            rows.append(row)
    finally:
        if server is not None:
            server.stop()
    print(f"\nstore vs raw driver ({args.claims} ops per run, median of {args.repeats}, "
          f"server: {'embedded NX-27017' if server else 'given'})")
    print(f"{'claimers':>8} | {'store claims/s':>14} | {'raw claims/s':>12} | {'ratio':>5} | "
          f"{'store writes/s':>14} | {'raw writes/s':>12} | {'ratio':>5}")
    print("-" * 92)
    worst = 1e9
    for row in rows:
        claim_ratio = row["store_claims"] / row["raw_claims"]
        write_ratio = row["store_writes"] / row["raw_writes"]
        worst = min(worst, claim_ratio, write_ratio)
        print(f"{row['concurrency']:>8} | {row['store_claims']:>14.1f} | {row['raw_claims']:>12.1f} | "
              f"{claim_ratio:>5.2f} | {row['store_writes']:>14.1f} | {row['raw_writes']:>12.1f} | {write_ratio:>5.2f}")
    print(f"\nlowest ratio {worst:.2f} (target >= 0.80)")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db_connection_string", default=None)
    parser.add_argument("--claims", type=int, default=600, help="operations per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    sys.exit(asyncio.run(main(parser.parse_args())))
