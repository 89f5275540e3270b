"""Registration of a running engine in the ``InferenceService`` collection: register, heartbeat, mark down.

Samplers pick services from that collection (:mod:`agentrl.store.services`). The engine registers as UP on
startup, refreshes its heartbeat (with its weight version and load) every few seconds, and marks itself DOWN when it
shuts down (uvicorn turns SIGTERM/SIGINT into a graceful shutdown, which runs :meth:`ServiceRegistration.stop`). The
weight version is stored as the run's policy version (:func:`~agentrl.inference.protocol.policy_version`: a non-numeric
one, such as SGLang's ``"default"``, is the initial policy, 0), exactly as samplers stamp the tokens it generates.
Registering at startup resets the service's load counters (nothing can be in flight on a process that just
started; the samplers' releases of requests to a previous process then change nothing). A sampler that cannot
connect to the service marks it DOWN; the next heartbeat marks it UP again.

A service that joins a run already under way (``load_published``) registers as STARTING: samplers do not pick it,
but weight publishes reach it (they wait in its listen queue until it answers). It is first given the run's
published full weights (``Run.weights_path``, which hold version ``Run.weights_version``), reading the Run again
after each load in case a version was published meanwhile; when the Run's version was published in memory (newer
than its files), it waits for the trainer to send it (a trainer sends the current weights to services that are
STARTING and behind). Only then does it mark itself UP: a restarted engine never serves its start-up weights, nor an
older version, to samplers. Runs that publish LoRA adapters need nothing here: samplers give a service the
current adapter when it lacks it (:mod:`agentrl.rollout.inference_pool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from agentrl.inference.protocol import policy_version
from agentrl.log import redact
from agentrl.store import ServiceStatus, Store

logger = logging.getLogger(__name__)

SERVER_SELECTION_TIMEOUT_MS = 5000
CATCH_UP_POLL_S = 1.0
CATCH_UP_LOG_S = 60.0

LoadPublished = Callable[[str, int], Awaitable[None]]
"""``load_published(weights_path, policy_version)``: make the service serve those weights as that version."""


async def check_database(uri: str) -> None:
    """Fail fast, with a clear message, when the database cannot be reached (before loading a model)."""
    store = Store(uri, serverSelectionTimeoutMS=SERVER_SELECTION_TIMEOUT_MS)
    try:
        await store.db.command("ping")
    except Exception as error:
        raise RuntimeError(f"cannot reach the database {redact(uri)}: {redact(str(error))}") from error
    finally:
        await store.close()


class ServiceRegistration:
    """Keeps one service's ``InferenceService`` document up to date while the service runs."""

    def __init__(self, uri: str, base_url: str, *, kind: str, models: list[str],
                 status: Callable[[], dict[str, Any]], weight_version: Callable[[], str], interval_s: float = 5.0):
        self.uri, self.base_url, self.kind, self.models = uri, base_url, kind, models
        self._status, self._weight_version = status, weight_version
        self.interval_s = interval_s
        self.status = ServiceStatus.UP
        self._store: Store | None = None
        self._task: asyncio.Task | None = None
        self._catching_up: asyncio.Task | None = None

    async def start(self, load_published: LoadPublished | None = None) -> None:
        """Register as UP (raises, naming the database, if it cannot be reached) and start heartbeating.

        With ``load_published``, register as STARTING, have it load the run's published full weights (if the run
        has any and serves a newer version than the service), then become UP. A load that fails marks the service
        DOWN and raises: a service that cannot serve the run's policy must not serve its start-up weights."""
        self._store = Store(self.uri, serverSelectionTimeoutMS=SERVER_SELECTION_TIMEOUT_MS)
        self.status = ServiceStatus.UP if load_published is None else ServiceStatus.STARTING
        try:
            await self._store.services.register(
                self.base_url, kind=self.kind, models=self.models,
                weight_version=policy_version(self._weight_version()), fresh_start=True, status=self.status)
        except Exception as error:
            await self._store.close()
            raise RuntimeError(f"cannot register {self.base_url} in the database {redact(self.uri)}: "
                               f"{redact(str(error))}") from error
        self._task = asyncio.create_task(self._beat(), name="engine-heartbeat")
        logger.info("registered %s in InferenceService as %s", self.base_url, self.status)
        if load_published is not None:
            try:
                caught_up = await self._catch_up(load_published, wait=False)
            except BaseException:
                await self.stop()
                raise
            if caught_up:
                await self._mark_up()
            else:  # the server must answer the trainer's calls meanwhile: wait in the background
                self._catching_up = asyncio.create_task(self._up_once_sent(load_published), name="engine-catch-up")

    async def _mark_up(self) -> None:
        self.status = ServiceStatus.UP
        await self.heartbeat()
        logger.info("%s is UP with weight_version %s", self.base_url, self._weight_version())

    async def _up_once_sent(self, load_published: LoadPublished) -> None:
        try:
            await self._catch_up(load_published, wait=True)
        except Exception as error:  # noqa: BLE001 - a load that fails leaves the service STARTING, never UP
            logger.error("%s cannot serve the run's policy (it stays STARTING, samplers keep off it): %s",
                         self.base_url, error)
            return
        await self._mark_up()

    async def _catch_up(self, load_published: LoadPublished, *, wait: bool) -> bool:
        """Serve the Run's policy version: load its newest weight files (``Run.weights_path``, version
        ``Run.weights_version``) when newer than what is served. A later version, published in memory, comes from
        the trainer, which sends it to services that are STARTING and behind: with ``wait``, wait for it; without,
        return False (True: the service serves the Run's version)."""
        assert self._store is not None
        logged_at = None
        while True:
            run = await self._store.runs.get()
            if run is None or run.lora_name or run.policy_version == 0:
                return True
            served = policy_version(self._weight_version())
            if served >= run.policy_version:
                return True
            on_disk = run.policy_version if run.weights_version is None else run.weights_version
            if run.weights_path and served < on_disk:
                logger.info("the run is at policy version %d: loading version %d from %s before serving",
                            run.policy_version, on_disk, run.weights_path)
                await load_published(run.weights_path, on_disk)
                continue
            if not wait:
                return False
            now = asyncio.get_running_loop().time()
            if logged_at is None or now - logged_at >= CATCH_UP_LOG_S:
                logger.info("the run is at policy version %d, published in memory: waiting for the trainer to send "
                            "it (this service serves version %d and stays STARTING until then)",
                            run.policy_version, served)
                logged_at = now
            await asyncio.sleep(CATCH_UP_POLL_S)

    async def heartbeat(self) -> bool:
        """Report liveness, weight version and load now (re-registering if the document disappeared).

        A database failure is logged, not raised: the engine keeps serving and the next heartbeat retries.
        """
        if self._store is None:
            raise RuntimeError("ServiceRegistration.heartbeat() before start()")
        version = policy_version(self._weight_version())
        try:
            found = await self._store.services.heartbeat(self.base_url, weight_version=version,
                                                         engine_load=self._status(), status=self.status)
            if not found:
                await self._store.services.register(self.base_url, kind=self.kind, models=self.models,
                                                    weight_version=version, status=self.status)
        except Exception as error:  # noqa: BLE001 - the database may come back; keep serving meanwhile
            logger.warning("heartbeat to %s failed: %s", redact(self.uri), redact(str(error)))
            return False
        return True

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.heartbeat()

    async def stop(self) -> None:
        """Stop heartbeating and mark the service DOWN."""
        for task in (self._catching_up, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._store is None:
            return
        try:
            await self._store.services.mark_down(self.base_url)
            logger.info("marked %s DOWN in InferenceService", self.base_url)
        except Exception as error:  # noqa: BLE001 - shutting down anyway; leave a trace
            logger.warning("could not mark %s DOWN: %s", self.base_url, redact(str(error)))
        finally:
            await self._store.close()
