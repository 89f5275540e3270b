"""Requests spread over the live inference services registered in the store (least loaded first).

The pool counts its in-flight requests on each service under its ``owner`` (``ServiceRegistry.acquire`` /
``release``), refreshes that share while requests run, and reclaims the shares of owners not seen for
``owner_ttl_s`` (samplers that died with requests in flight). A service it cannot connect to is marked DOWN at
once, so that no sampler picks it until its own heartbeat (the engine's, or the static-URL health watcher's)
marks it UP again. When no live service answers, ``generate`` raises :class:`NoInferenceService`: an
infrastructure failure, which the sampler does not score (it gives the slot back and waits in
:meth:`InferencePool.wait_until_live`).

When the trainer publishes LoRA adapters (``Run.lora_name``), every request names the current adapter in
``lora_path`` (read from the Run at most every ``ADAPTER_REFRESH_S``). A service that does not have it (it started
or restarted after the publish) is given it from ``Run.weights_path`` and the request is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections import Counter
from typing import Any

import httpx
from pymongo.errors import PyMongoError

from agentrl.inference.client import GenerateResult, InferenceRequestError, InferenceServiceError, SGLangClient
from agentrl.log import redact
from agentrl.store import Store

logger = logging.getLogger(__name__)

DEFAULT_OWNER_TTL_S = 60.0
CONNECT_PROBE_S = 5.0
OUTAGE_PAUSE_S = 1.0
MAX_OUTAGE_PAUSE_S = 60.0
LIVE_POLL_MAX_S = 5.0
ADAPTER_REFRESH_S = 1.0
_NOT_LOADED = ("not loaded", "never been loaded")  # SGLang's (and the engine's) errors for an unknown adapter


class NoInferenceService(RuntimeError):
    """No live inference service answered within the deadline (an infrastructure failure, not the request's)."""


def default_owner() -> str:
    """``host:pid:random``: the identity of this process's requests (and of its sampler)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class InferencePool:
    """Picks a live service per request (bounded by ``target_concurrency`` in-flight requests per service), fails
    over to another service on transient errors, and keeps one HTTP client per service."""

    def __init__(self, store: Store, *, owner: str | None = None, owner_ttl_s: float = DEFAULT_OWNER_TTL_S,
                 target_concurrency: int = 32, timeout_s: float = 600.0, wait_for_service_s: float = 120.0,
                 max_attempts: int = 6):
        self.store = store
        self.owner = owner or default_owner()
        self.owner_ttl_s = owner_ttl_s
        self.target_concurrency = target_concurrency
        self.timeout_s = timeout_s
        self.wait_for_service_s = wait_for_service_s
        self.max_attempts = max_attempts
        self._clients: dict[str, SGLangClient] = {}
        self._in_flight: Counter[str] = Counter()
        self._keeper: asyncio.Task | None = None
        self._next_reclaim = 0.0
        self._outages = 0  # NoInferenceService raised since the last successful generation
        self._live_lock = asyncio.Lock()
        self._paused = False
        self._adapter: tuple[str, str] | None = None  # (name, path) of the policy's adapter, if it is one
        self._adapter_read_at = -math.inf

    def client(self, base_url: str) -> SGLangClient:
        if base_url not in self._clients:
            self._clients[base_url] = SGLangClient(base_url, timeout_s=self.timeout_s, max_retries=1)
        return self._clients[base_url]

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> tuple[GenerateResult, str]:
        """Generate on the least-loaded live service; returns the result and the id of the service that made it.

        A generation the service aborted (``finish_reason: abort``, e.g. it is shutting down) is retried like a
        failed one. Raises :class:`InferenceRequestError` when a service rejects the request,
        :class:`NoInferenceService` when no live service answered within ``wait_for_service_s`` or every attempt
        failed."""
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.create_task(self._keep_alive(), name=f"inference-load-{self.owner}")
        failed: list[str] = []
        errors: list[str] = []
        deadline = time.monotonic() + self.wait_for_service_s
        delay = 0.05
        while len(errors) < self.max_attempts:
            service = await self.store.services.acquire(self.owner, exclude=failed or None,
                                                        max_running=self.target_concurrency)
            if service is None:
                failed.clear()  # every other service is busy or failed already: any may be tried again
                if time.monotonic() > deadline:
                    self._outages += 1
                    raise NoInferenceService(
                        f"no live inference service within {self.wait_for_service_s:g} s"
                        + (f"; errors: {'; '.join(errors)}" if errors else ""))
                await self._reclaim()  # a dead sampler's requests may be what keeps the services full
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            self._in_flight[service.id] += 1
            try:
                result = await self._generate_on(service.base_url, input_ids, sampling_params)
                if result.finish_reason == "abort":  # the service stopped it (shutting down): not the policy's doing
                    logger.warning("inference service %s aborted a generation; trying another service",
                                   redact(service.base_url))
                    errors.append(f"{redact(service.base_url)} aborted the generation")
                    failed.append(service.id)
                    continue
                self._outages = 0
                return result, service.id
            except InferenceRequestError:
                raise
            except InferenceServiceError as error:
                logger.warning("%s; trying another service", error)
                errors.append(str(error))
                failed.append(service.id)
                if error.status_code is None and not await self._reachable(service.base_url):
                    logger.warning("cannot connect to inference service %s: marking it DOWN (its heartbeat marks "
                                   "it UP again)", redact(service.base_url))
                    await self.store.services.mark_down(service.id)
            finally:
                self._in_flight[service.id] -= 1
                if not self._in_flight[service.id]:
                    del self._in_flight[service.id]
                try:
                    await self.store.services.release(service.id, self.owner)
                except PyMongoError as error:  # not retried (not idempotent): the share stays one high meanwhile
                    logger.warning("could not count a request on %s as finished (%s)", service.id, error)
        self._outages += 1
        raise NoInferenceService("generation failed on every attempt: " + "; ".join(errors))

    async def _current_adapter(self, refresh: bool = False) -> tuple[str, str] | None:
        """The policy's published adapter ``(name, path)``, or ``None`` when the services serve full weights."""
        if refresh or time.monotonic() - self._adapter_read_at > ADAPTER_REFRESH_S:
            run = await self.store.runs.get()
            self._adapter = (run.lora_name, run.weights_path) if run and run.lora_name and run.weights_path else None
            self._adapter_read_at = time.monotonic()
        return self._adapter

    async def _generate_on(self, base_url: str, input_ids: list[int], sampling_params: dict[str, Any]
                           ) -> GenerateResult:
        """Generate on one service with the policy's adapter, giving the service the adapter if it lacks it."""
        client = self.client(base_url)
        adapter = await self._current_adapter()
        try:
            return await client.generate(input_ids, sampling_params, lora_path=adapter[0] if adapter else None)
        except InferenceRequestError as error:
            if adapter is None or not any(text in error.cause for text in _NOT_LOADED):
                raise
        adapter = await self._current_adapter(refresh=True)  # a newer one, or the service restarted
        if adapter is not None:
            with contextlib.suppress(InferenceRequestError):  # "already loaded": another sampler was first
                await client.load_lora_adapter(*adapter)
                logger.info("gave inference service %s the policy's adapter %s", redact(base_url), adapter[0])
        return await client.generate(input_ids, sampling_params, lora_path=adapter[0] if adapter else None)

    async def wait_until_live(self) -> None:
        """Return once a live service is registered, after a pause that doubles with every consecutive outage
        (``OUTAGE_PAUSE_S`` up to ``MAX_OUTAGE_PAUSE_S``: services that are live but failing are not hammered)."""
        if not self._paused:
            self._paused = True
            logger.warning("no live inference service answers: sampler %s paused until one is live", self.owner)
        await asyncio.sleep(min(OUTAGE_PAUSE_S * 2 ** max(self._outages - 1, 0), MAX_OUTAGE_PAUSE_S))
        async with self._live_lock:  # one poller; the others find the answer when it is done
            delay = OUTAGE_PAUSE_S
            while not (live := await self.store.services.live()):
                await asyncio.sleep(delay)
                delay = min(delay * 2, LIVE_POLL_MAX_S)
            if self._paused:
                self._paused = False
                logger.info("inference service %s is live: sampler %s resumes", redact(live[0].base_url),
                            self.owner)

    async def _reachable(self, base_url: str) -> bool:
        """Whether a TCP connection to the service opens within ``CONNECT_PROBE_S`` (a slow or failing service is
        reachable; one that refuses or drops connections is not)."""
        url = httpx.URL(base_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(url.host, port), CONNECT_PROBE_S)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def _reclaim(self) -> None:
        """Reclaim dead owners' shares (at most every third of the owner TTL)."""
        if time.monotonic() < self._next_reclaim:
            return
        self._next_reclaim = time.monotonic() + self.owner_ttl_s / 3
        await self.store.services.reclaim(self.owner_ttl_s, keep=self.owner)

    async def _keep_alive(self) -> None:
        """Keep this owner's shares seen while requests run, and reclaim dead owners' shares."""
        while True:
            await asyncio.sleep(self.owner_ttl_s / 3)
            try:
                if self._in_flight:
                    await self.store.services.keep_alive(list(self._in_flight), self.owner)
                await self._reclaim()
            except Exception as error:  # noqa: BLE001 - the database may come back; keep going
                logger.warning("inference load keep-alive of %s failed: %s", self.owner, redact(str(error)))

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        with contextlib.suppress(Exception):
            await self.store.services.forget(self.owner)
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
