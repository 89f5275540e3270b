"""Requests spread over the live inference services registered in the store (least loaded first)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from agentrl.inference.client import GenerateResult, InferenceRequestError, InferenceServiceError, SGLangClient
from agentrl.store import Store

logger = logging.getLogger(__name__)


class NoInferenceService(RuntimeError):
    """No live inference service answered within the deadline."""


class InferencePool:
    """Picks a live service per request (bounded by ``target_concurrency`` in-flight requests per service), fails
    over to another service on transient errors, and keeps one HTTP client per service."""

    def __init__(self, store: Store, *, target_concurrency: int = 32, timeout_s: float = 600.0,
                 wait_for_service_s: float = 120.0, max_attempts: int = 6):
        self.store = store
        self.target_concurrency = target_concurrency
        self.timeout_s = timeout_s
        self.wait_for_service_s = wait_for_service_s
        self.max_attempts = max_attempts
        self._clients: dict[str, SGLangClient] = {}

    def client(self, base_url: str) -> SGLangClient:
        if base_url not in self._clients:
            self._clients[base_url] = SGLangClient(base_url, timeout_s=self.timeout_s, max_retries=1)
        return self._clients[base_url]

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> tuple[GenerateResult, str]:
        """Generate on the least-loaded live service; returns the result and the id of the service that made it."""
        failed: list[str] = []
        errors: list[str] = []
        deadline = time.monotonic() + self.wait_for_service_s
        delay = 0.05
        while len(errors) < self.max_attempts:
            service = await self.store.services.acquire(exclude=failed or None, max_running=self.target_concurrency)
            if service is None:
                failed.clear()  # every other service is busy or failed already: any may be tried again
                if time.monotonic() > deadline:
                    raise NoInferenceService(
                        f"no live inference service within {self.wait_for_service_s:.0f}s"
                        + (f"; errors: {'; '.join(errors)}" if errors else ""))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            try:
                return await self.client(service.base_url).generate(input_ids, sampling_params), service.id
            except InferenceRequestError:
                raise
            except InferenceServiceError as error:
                logger.warning("%s; trying another service", error)
                errors.append(str(error))
                failed.append(service.id)
            finally:
                await self.store.services.release(service.id)
        raise NoInferenceService("generation failed on every attempt: " + "; ".join(errors))

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
