"""The ``InferenceService`` registry as samplers use it: per-owner load counters, re-registration, services that
refuse connections, the static-URL health watcher.

Everything is real: the session's MongoDB-protocol server (and, for the watcher, a second one that is stopped and
restarted), HTTP services served by uvicorn in a thread of this process (their ``/generate`` holds prompts that start
with ``HOLD`` until the test ends, and answers the others at once), and a pool in a child process that is SIGKILLed
with requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response

from agentrl.rollout.inference_pool import InferencePool, NoInferenceService
from agentrl.rollout.process import _watch_static_services
from agentrl.store import Store
from agentrl.store.embedded import EmbeddedServer
from agentrl.store.services import owner_key
from tools_fixtures import free_port

pytestmark = pytest.mark.slow

HOLD = 7
PARAMS = {"max_new_tokens": 2, "temperature": 0.0}
OWNER_TTL_S = 1.5

POOL_PROCESS = f'''
import asyncio, sys
from agentrl.rollout.inference_pool import InferencePool
from agentrl.store import Store

async def main(uri, owner, n):
    async with Store(uri) as store:
        pool = InferencePool(store, owner=owner, owner_ttl_s={OWNER_TTL_S}, target_concurrency=4)
        await asyncio.gather(*(pool.generate([{HOLD}, 1], {PARAMS!r}) for _ in range(n)))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
'''


def service_app(state: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        ids = (await request.json())["input_ids"]
        state["requests"] += 1
        while ids[0] == HOLD and not state["stop"]:
            await asyncio.sleep(0.05)
        return {"text": "ok", "output_ids": [1, 2],
                "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": len(ids),
                              "completion_tokens": 2, "weight_version": "default",
                              "output_token_logprobs": [[-0.5, 1, None], [-0.5, 2, None]]}}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


@contextmanager
def serve(port: int | None = None) -> Iterator[dict[str, Any]]:
    """An inference service on ``port`` (default: a free one); yields its state, with its ``url``."""
    port = port or free_port()
    state: dict[str, Any] = {"url": f"http://127.0.0.1:{port}", "requests": 0, "stop": False}
    server = uvicorn.Server(uvicorn.Config(service_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the service did not start"
        time.sleep(0.02)
    try:
        yield state
    finally:
        state["stop"] = True
        server.should_exit = True
        thread.join(timeout=10)


async def until(predicate: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := await predicate()):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
    return value


async def test_a_killed_samplers_requests_are_reclaimed_and_the_service_is_picked_again(db_uri: str) -> None:
    victim_owner = "gpu-node.example.com:4242:abc123"  # host:pid:hex, as samplers name themselves; dots included
    with serve() as service:
        async with Store(db_uri) as store:
            await store.services.register(service["url"], kind="sglang")

            async def doc(running: int) -> dict | None:
                return await store.db.InferenceService.find_one({"_id": service["url"], "running_requests": running})

            victim = subprocess.Popen([sys.executable, "-c", POOL_PROCESS, db_uri, victim_owner, "3"])
            live = InferencePool(store, owner="live-host.example.com:1:def456", owner_ttl_s=OWNER_TTL_S,
                                 target_concurrency=4, wait_for_service_s=20)
            held = None
            try:
                shares = (await until(lambda: doc(3)))["running_by"]
                assert list(shares) == [owner_key(victim_owner)] and shares[owner_key(victim_owner)]["n"] == 3
                assert "." not in owner_key(victim_owner)
                held = asyncio.create_task(live.generate([HOLD, 2], PARAMS))
                await until(lambda: doc(4))
                waiting = asyncio.create_task(live.generate([1, 2], PARAMS))
                await asyncio.sleep(0.5)
                assert not waiting.done() and service["requests"] == 4  # full: not picked
                victim.kill()  # SIGKILL with 3 requests in flight: nothing releases them
                victim.wait(30)

                # Once the victim has not been seen for the owner TTL, the live pool reclaims its share, and the
                # service is picked again.
                result, service_id = await waiting
                assert (service_id, result.output_ids) == (service["url"], [1, 2])
                await asyncio.sleep(2 * OWNER_TTL_S)  # the live owner's held request outlives the TTL...
                after = await until(lambda: doc(1))
                assert {k: v["n"] for k, v in after["running_by"].items()} == {owner_key(live.owner): 1}  # ...kept
                assert after["total_requests"] == 5
            finally:
                if victim.poll() is None:
                    victim.kill()
                    victim.wait(30)
                if held is not None:
                    held.cancel()
                    await asyncio.gather(held, return_exceptions=True)
                await live.close()
            final = await doc(0)
            assert final is not None and final["running_by"] == {}  # released, and the closed pool forgot itself


async def test_re_registration_keeps_the_counts_of_other_samplers(db_uri: str) -> None:
    with serve() as service:
        url = service["url"]
        async with Store(db_uri) as store:
            await store.services.register(url, kind="agentrl-engine", models=["m"], weight_version=3)
            await store.services.sync_share(url, "sampler-a", 1, started=1)
            await store.services.sync_share(url, "sampler-b", 1, started=1)

            # A sampler started with --inference_urls URL registers (and heartbeats) the service again.
            pool = InferencePool(store, owner="sampler-c")
            watcher = asyncio.create_task(_watch_static_services(store, pool, [url], interval_s=0.1))
            try:
                before = (await store.db.InferenceService.find_one({"_id": url}))["heartbeat_at"]
                await until(lambda: store.db.InferenceService.find_one({"_id": url, "heartbeat_at": {"$gt": before}}))
            finally:
                watcher.cancel()
                await pool.close()
            again = await store.services.register(url, kind="sglang")
            assert (again.running_requests, again.total_requests) == (2, 2)
            assert {k: v["n"] for k, v in again.running_by.items()} == {"sampler-a": 1, "sampler-b": 1}
            assert (again.models, again.weight_version) == (["m"], 3)  # not given: kept

            # An engine that (re)starts has nothing in flight: its own registration starts the counts afresh, and
            # the requests sent to its previous process count no more (never below zero): each sampler's next
            # write finds its share gone and counts only what it has in flight then.
            fresh = await store.services.register(url, kind="agentrl-engine", models=["m"], weight_version=0,
                                                  fresh_start=True)
            assert (fresh.running_requests, fresh.running_by, fresh.weight_version) == (0, {}, 0)
            assert await store.services.sync_share(url, "sampler-a", 1, started=1, expected=1) == 1  # a new one
            assert await store.services.sync_share(url, "sampler-b", 0, expected=1) == 0  # its old one failed
            doc = await store.db.InferenceService.find_one({"_id": url})
            assert doc["running_requests"] == 1 and doc["total_requests"] == 3  # (the total is never reset)
            await store.services.sync_share(url, "sampler-a", 0, expected=1)
            doc = await store.db.InferenceService.find_one({"_id": url})
            assert doc["running_requests"] == 0 and doc["running_by"]["sampler-a"]["n"] == 0


async def test_a_service_that_refuses_connections_is_marked_down_at_once(db_uri: str) -> None:
    dead_port = free_port()
    dead = f"http://127.0.0.1:{dead_port}"  # registered, but nothing listens
    with serve() as alive:
        async with Store(db_uri) as store:
            await store.services.register(dead, kind="sglang")
            await store.services.register(alive["url"], kind="sglang")
            await store.services.sync_share(alive["url"], "other", 1, started=1)  # the dead one is the least loaded
            pool = InferencePool(store, owner="sampler", wait_for_service_s=5, timeout_s=0.5, max_attempts=2)
            try:
                result, service_id = await pool.generate([1, 2], PARAMS)  # fails over to the live one
                assert service_id == alive["url"]
                assert [s.id for s in await store.services.live()] == [alive["url"]]  # no sampler picks it now
                assert (await store.db.InferenceService.find_one({"_id": dead}))["status"] == "DOWN"

                # A service that is slow (here: a request that times out) is reachable: not marked down.
                with pytest.raises(NoInferenceService, match="timed out"):
                    await pool.generate([HOLD, 1], PARAMS)
                assert (await store.db.InferenceService.find_one({"_id": alive["url"]}))["status"] == "UP"

                # Its heartbeat (here the --inference_urls health watcher) marks it UP as soon as it answers again.
                watcher = asyncio.create_task(_watch_static_services(store, pool, [dead], interval_s=0.1))
                try:
                    await asyncio.sleep(0.5)
                    assert (await store.db.InferenceService.find_one({"_id": dead}))["status"] == "DOWN"
                    with serve(dead_port):
                        await until(lambda: store.db.InferenceService.find_one({"_id": dead, "status": "UP"}))
                finally:
                    watcher.cancel()
            finally:
                await pool.close()


async def test_the_health_watcher_survives_database_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    database = EmbeddedServer(data_dir=tmp_path / "db", port=free_port())
    database.start()
    try:
        with serve() as service:
            async with Store(database.uri("watch"), serverSelectionTimeoutMS=300) as store:
                pool = InferencePool(store, owner="sampler")
                watcher = asyncio.create_task(_watch_static_services(store, pool, [service["url"]], interval_s=0.1))
                try:
                    first = await until(lambda: store.db.InferenceService.find_one({"_id": service["url"]}))
                    with caplog.at_level(logging.WARNING, logger="agentrl.rollout.process"):
                        database.stop()
                        await asyncio.sleep(1.5)
                        assert not watcher.done()
                        assert "health watch of inference service" in caplog.text
                        database.start()
                    await until(lambda: store.db.InferenceService.find_one(
                        {"_id": service["url"], "heartbeat_at": {"$gt": first["heartbeat_at"]}}))
                finally:
                    watcher.cancel()
                    await pool.close()
    finally:
        database.stop()
