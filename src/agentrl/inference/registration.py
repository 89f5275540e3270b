"""Registration of a running engine in the ``InferenceService`` collection: register, heartbeat, mark down.

Samplers pick services from that collection (DESIGN §3). The engine registers as UP on startup, refreshes its
heartbeat (with its weight version and load) every few seconds, and marks itself DOWN when it shuts down
(uvicorn turns SIGTERM/SIGINT into a graceful shutdown, which runs :meth:`ServiceRegistration.stop`). The weight
version is stored as the run's policy version (:func:`~agentrl.inference.protocol.policy_version`: a non-numeric
one, such as SGLang's ``"default"``, is the initial policy, 0), exactly as samplers stamp the tokens it generates.
Registering at startup resets the service's load counters (nothing can be in flight on a process that just
started; the samplers' releases of requests to a previous process then change nothing). A sampler that cannot
connect to the service marks it DOWN; the next heartbeat marks it UP again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from agentrl.inference.protocol import policy_version
from agentrl.log import redact
from agentrl.store import Store

logger = logging.getLogger(__name__)

SERVER_SELECTION_TIMEOUT_MS = 5000


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
        self._store: Store | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Register as UP (raises, naming the database, if it cannot be reached) and start heartbeating."""
        self._store = Store(self.uri, serverSelectionTimeoutMS=SERVER_SELECTION_TIMEOUT_MS)
        try:
            await self._store.services.register(
                self.base_url, kind=self.kind, models=self.models,
                weight_version=policy_version(self._weight_version()), fresh_start=True)
        except Exception as error:
            await self._store.close()
            raise RuntimeError(f"cannot register {self.base_url} in the database {redact(self.uri)}: "
                               f"{redact(str(error))}") from error
        self._task = asyncio.create_task(self._beat(), name="engine-heartbeat")
        logger.info("registered %s in InferenceService", self.base_url)

    async def heartbeat(self) -> bool:
        """Report liveness, weight version and load now (re-registering if the document disappeared).

        A database failure is logged, not raised: the engine keeps serving and the next heartbeat retries.
        """
        if self._store is None:
            raise RuntimeError("ServiceRegistration.heartbeat() before start()")
        version = policy_version(self._weight_version())
        try:
            found = await self._store.services.heartbeat(self.base_url, weight_version=version,
                                                         engine_load=self._status())
            if not found:
                await self._store.services.register(self.base_url, kind=self.kind, models=self.models,
                                                    weight_version=version)
        except Exception as error:  # the database may come back; keep serving meanwhile
            logger.warning("heartbeat to %s failed: %s", redact(self.uri), redact(str(error)))
            return False
        return True

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.heartbeat()

    async def stop(self) -> None:
        """Stop heartbeating and mark the service DOWN."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._store is None:
            return
        try:
            await self._store.services.mark_down(self.base_url)
            logger.info("marked %s DOWN in InferenceService", self.base_url)
        except Exception as error:  # shutting down anyway; leave a trace
            logger.warning("could not mark %s DOWN: %s", self.base_url, redact(str(error)))
        finally:
            await self._store.close()
