"""Inference for an evaluation: requests go to the evaluated model's own services only.

Training samplers pick any live service registered in the run's ``InferenceService`` collection. An evaluation
must not: the run's services may serve another policy version, and a service registered for the evaluation
would be picked by the run's training samplers. So the engine an evaluation starts is not registered, and this
pool (same ``generate`` interface as :class:`agentrl.rollout.inference_pool.InferencePool`) sends every request
to the given URLs directly, least in-flight first, failing over to another URL on transient errors.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from agentrl.inference.client import GenerateResult, InferenceRequestError, InferenceServiceError, SGLangClient

logger = logging.getLogger(__name__)


class DirectInferencePool:
    """Spread generations over fixed service URLs (at most ``target_concurrency`` in flight per URL)."""

    def __init__(self, urls: list[str], *, target_concurrency: int = 32, timeout_s: float = 600.0,
                 max_attempts: int = 6, retry_delay_s: float = 1.0):
        if not urls:
            raise ValueError("DirectInferencePool needs at least one URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_attempts = max_attempts
        self.retry_delay_s = retry_delay_s
        self._clients = {u: SGLangClient(u, timeout_s=timeout_s, max_retries=1) for u in self.urls}
        self._slots = {u: asyncio.Semaphore(target_concurrency) for u in self.urls}
        self._in_flight = dict.fromkeys(self.urls, 0)

    def client(self, base_url: str) -> SGLangClient:
        return self._clients[base_url.rstrip("/")]

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                       image_data: list[str] | None = None) -> tuple[GenerateResult, str]:
        """Generate on the least-busy URL (with the prompt's images, if any); returns the result and the URL that
        made it."""
        errors: list[str] = []
        failed: set[str] = set()
        for attempt in range(self.max_attempts):
            candidates = [u for u in self.urls if u not in failed] or self.urls
            url = min(candidates, key=lambda u: self._in_flight[u])
            self._in_flight[url] += 1
            try:
                async with self._slots[url]:
                    return await self._clients[url].generate(input_ids, sampling_params, image_data=image_data), url
            except InferenceRequestError:
                raise
            except InferenceServiceError as error:
                logger.warning("%s; retrying", error)
                errors.append(str(error))
                failed.add(url)
                if len(failed) == len(self.urls):
                    failed.clear()
                    await asyncio.sleep(self.retry_delay_s * 2 ** min(attempt, 4))
            finally:
                self._in_flight[url] -= 1
        raise InferenceServiceError(self.urls[0], "/generate",
                                    f"generation failed on every attempt: {'; '.join(errors)}")

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
