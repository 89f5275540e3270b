"""Requests spread over the live inference services registered in the store (least loaded first).

The pick costs no database round trip: the pool keeps a view of the live services (their load, ``running_requests``,
as last read) and counts its own in-flight requests per service locally. A request goes to the service with the
least ``others' load as last read + this pool's requests now`` (below ``target_concurrency``). In the background,
at most every ``sync_s`` while the pool is in use, it writes its share on each service whose count changed
(``ServiceRegistry.sync_share``: one update per service, fenced on the share it last wrote), then reads the view
again (and the Run's adapter). So other samplers see this pool's load, and it sees theirs, ``sync_s`` late at
most. Shares are also refreshed every third of ``owner_ttl_s`` while requests run, and the pool reclaims the shares
of owners not seen for ``owner_ttl_s`` (samplers that died with requests in flight). A service it cannot connect
to is marked DOWN at once (and dropped from its view), so that no sampler picks it until its own heartbeat (the
engine's, or the static-URL health watcher's) marks it UP again. When no live service answers, ``generate`` raises
:class:`NoInferenceService`: an infrastructure failure, which the sampler does not score (it gives the slot back
and waits in :meth:`InferencePool.wait_until_live`).

When the trainer publishes LoRA adapters (``Run.lora_name``), every request names the current adapter in
``lora_path`` (read from the Run with the view). A service that does not have it (it started
or restarted after the publish) is given it from ``Run.weights_path`` and the request is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import os
import socket
import time
import uuid
from collections import Counter
from typing import Any

import httpx

from agentrl.inference.client import GenerateResult, InferenceRequestError, InferenceServiceError, SGLangClient
from agentrl.log import redact
from agentrl.store import InferenceService, Store

logger = logging.getLogger(__name__)

DEFAULT_OWNER_TTL_S = 60.0
CONNECT_PROBE_S = 5.0
OUTAGE_PAUSE_S = 1.0
MAX_OUTAGE_PAUSE_S = 60.0
LIVE_POLL_MAX_S = 5.0
LOAD_SYNC_S = 1.0
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
                 max_attempts: int = 6, sync_s: float = LOAD_SYNC_S):
        self.store = store
        self.owner = owner or default_owner()
        self.owner_ttl_s = owner_ttl_s
        self.target_concurrency = target_concurrency
        self.timeout_s = timeout_s
        self.wait_for_service_s = wait_for_service_s
        self.max_attempts = max_attempts
        self.sync_s = sync_s
        self._clients: dict[str, SGLangClient] = {}
        self._in_flight: Counter[str] = Counter()  # this pool's requests in flight, per service
        self._shares: dict[str, int] = {}  # this pool's share as last written, per service (absent: none stored)
        self._started: Counter[str] = Counter()  # requests started since the last sync (``total_requests``)
        self._share_seen_at: dict[str, float] = {}  # when each share's ``seen`` was last written (monotonic)
        self._view: list[InferenceService] | None = None  # the live services as last read
        self._view_shares: dict[str, int] = {}  # this pool's shares included in the view's loads
        self._used = False  # a request was sent since the view was last read
        self._sync_lock = asyncio.Lock()
        self._keeper: asyncio.Task | None = None
        self._next_reclaim = 0.0
        self._outages = 0  # NoInferenceService raised since the last successful generation
        self._live_lock = asyncio.Lock()
        self._paused = False
        self._adapter: tuple[str, str] | None = None  # (name, path) of the policy's adapter, if it is one

    def client(self, base_url: str) -> SGLangClient:
        if base_url not in self._clients:
            self._clients[base_url] = SGLangClient(base_url, timeout_s=self.timeout_s, max_retries=1)
        return self._clients[base_url]

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                       image_data: list[str] | None = None) -> tuple[GenerateResult, str]:
        """Generate on the least-loaded live service (with the prompt's images, data: URIs, if any); returns the
        result and the id of the service that made it.

        A generation the service aborted (``finish_reason: abort``, e.g. it is shutting down) is retried like a
        failed one. Raises :class:`InferenceRequestError` when a service rejects the request,
        :class:`NoInferenceService` when no live service answered within ``wait_for_service_s`` or every attempt
        failed."""
        if self._keeper is None or self._keeper.done():  # its own context: not counted as any trajectory's
            self._keeper = asyncio.create_task(self._keep_alive(), name=f"inference-load-{self.owner}",
                                               context=contextvars.Context())
        failed: list[str] = []
        errors: list[str] = []
        deadline = time.monotonic() + self.wait_for_service_s
        delay = 0.05
        while len(errors) < self.max_attempts:
            service = await self._pick(failed)
            if service is None:
                failed.clear()  # every other service is busy or failed already: any may be tried again
                if time.monotonic() > deadline:
                    self._outages += 1
                    raise NoInferenceService(
                        f"no live inference service within {self.wait_for_service_s:g} s"
                        + (f"; errors: {'; '.join(errors)}" if errors else ""))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                await self._reclaim()  # a dead sampler's requests may be what keeps the services full
                await self._refresh()
                continue
            self._in_flight[service.id] += 1
            self._started[service.id] += 1
            try:
                result = await self._generate_on(service.base_url, input_ids, sampling_params, image_data)
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
                    self._view = [s for s in self._view or [] if s.id != service.id]
            finally:
                self._in_flight[service.id] -= 1
                if not self._in_flight[service.id]:
                    del self._in_flight[service.id]
        self._outages += 1
        raise NoInferenceService("generation failed on every attempt: " + "; ".join(errors))

    async def _pick(self, exclude: list[str]) -> InferenceService | None:
        """The least-loaded service of the view not in ``exclude`` and below ``target_concurrency``; ``None`` when
        there is none. Reads the view first if it was never read."""
        if self._view is None:
            await self._refresh()
        self._used = True

        def load(service: InferenceService) -> int:
            return service.running_requests - self._view_shares.get(service.id, 0) + self._in_flight[service.id]

        candidates = [s for s in self._view or [] if s.id not in exclude and load(s) < self.target_concurrency]
        return min(candidates, key=load, default=None)

    async def _refresh(self) -> None:
        """Write this pool's changed shares, then read the view of the live services and the Run's adapter."""
        async with self._sync_lock:
            await self._sync_shares()
            self._used = False
            self._view = await self.store.services.live()
            self._view_shares = dict(self._shares)
            await self._read_adapter()

    async def _sync_shares(self) -> None:
        """Write the shares that changed since the last sync (and, while requests run, refresh their ``seen``
        every third of the owner TTL), one update per service."""
        now = time.monotonic()
        for service_id in sorted(set(self._shares) | set(self._in_flight) | set(self._started)):
            n, stored, started = self._in_flight[service_id], self._shares.get(service_id), self._started[service_id]
            seen_due = n > 0 and now - self._share_seen_at.get(service_id, -math.inf) >= self.owner_ttl_s / 3
            if not started and not seen_due and n == (stored or 0):
                continue
            written = await self.store.services.sync_share(service_id, self.owner, n, started=started,
                                                           expected=stored)
            self._started[service_id] -= started
            if not self._started[service_id]:
                del self._started[service_id]
            if written is None:  # the service is not registered any more
                self._shares.pop(service_id, None)
            else:
                self._shares[service_id] = written
                self._share_seen_at[service_id] = now

    async def _read_adapter(self) -> None:
        """Read the policy's published adapter ``(name, path)`` (``None`` when the services serve full weights)."""
        run = await self.store.runs.get()
        self._adapter = (run.lora_name, run.weights_path) if run and run.lora_name and run.weights_path else None

    async def _generate_on(self, base_url: str, input_ids: list[int], sampling_params: dict[str, Any],
                           image_data: list[str] | None = None) -> GenerateResult:
        """Generate on one service with the policy's adapter, giving the service the adapter if it lacks it."""
        client = self.client(base_url)
        adapter = self._adapter
        try:
            return await client.generate(input_ids, sampling_params, lora_path=adapter[0] if adapter else None,
                                         image_data=image_data)
        except InferenceRequestError as error:
            if adapter is None or not any(text in error.cause for text in _NOT_LOADED):
                raise
        await self._read_adapter()  # a newer one, or the service restarted
        adapter = self._adapter
        if adapter is not None:
            with contextlib.suppress(InferenceRequestError):  # "already loaded": another sampler was first
                await client.load_lora_adapter(*adapter)
                logger.info("gave inference service %s the policy's adapter %s", redact(base_url), adapter[0])
        return await client.generate(input_ids, sampling_params, lora_path=adapter[0] if adapter else None,
                                     image_data=image_data)

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
            self._view = None  # the next pick reads the services afresh
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
        """Every ``sync_s``: write the shares that changed and read the view again when the pool was used (so it
        stays idle when idle), and reclaim dead owners' shares."""
        while True:
            await asyncio.sleep(self.sync_s)
            try:
                if self._used or self._in_flight or self._started or any(self._shares.values()):
                    await self._refresh()
                await self._reclaim()
            except Exception as error:  # noqa: BLE001 - the database may come back; keep going
                logger.warning("inference load sync of %s failed: %s", self.owner, redact(str(error)))

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        with contextlib.suppress(Exception):
            async with self._sync_lock:
                await self._sync_shares()
            await self.store.services.forget(self.owner)
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
