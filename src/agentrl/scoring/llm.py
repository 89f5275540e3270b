"""Chat completions over a pool of OpenAI-compatible endpoints with ordered fail-over, retries and timeouts.

When no model answers, :class:`LLMUnavailableError` says whether every attempt failed for want of a reachable
service (``unreachable``: connection error, timeout, HTTP 5xx or 429), which is worth retrying later, or some model
answered unusably or refused the request (bad key, 4xx, no parseable reply), which retrying does not fix.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from agentrl.log import redact
from agentrl.scoring.agent_config import LLMPoolConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LLMUnavailableError(RuntimeError):
    """No model of the pool gave a usable answer; ``failures`` lists what went wrong with each attempt, and
    ``unreachable`` is true when every attempt failed because its service could not be reached or was failing."""

    def __init__(self, failures: list[str], unreachable: bool = False):
        self.failures = failures
        self.unreachable = unreachable
        super().__init__("no model answered: " + "; ".join(failures))


def is_unreachable(error: Exception) -> bool:
    """A connection error, a timeout, an HTTP 5xx or 429: the service is down or overloaded, not the request."""
    import openai  # here, not at the top: a sampler without an LLM judge never needs it (~0.4 s to import)

    if isinstance(error, openai.APIConnectionError | TimeoutError):  # APITimeoutError is a connection error
        return True
    return isinstance(error, openai.APIStatusError) and (error.status_code >= 500 or error.status_code == 429)


async def chat_with_failover(
    pool: LLMPoolConfig,
    messages: list[dict[str, Any]],
    parse: Callable[[str], T],
    **params: Any,
) -> tuple[T, str]:
    """``(parse(reply), model)`` from the first model whose reply ``parse`` accepts.

    Every model of ``pool`` (in order) gets ``pool.max_retries`` attempts; an attempt fails on a transport or
    API error, a timeout (``pool.timeout``), an empty reply, or when ``parse`` raises ``ValueError``. Waits
    between attempts grow by ``backoff_factor``. ``params`` go to ``chat.completions.create``.
    """
    import openai

    failures: list[str] = []
    unreachable = True
    for endpoint in pool.models:
        try:
            api_key = endpoint.api_key()
        except KeyError as exc:
            failures.append(f"{endpoint.model}: {exc.args[0]}")
            unreachable = False
            continue
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=api_key, timeout=pool.timeout, max_retries=0)
        try:
            delay = pool.retry_delay
            for attempt in range(1, pool.max_retries + 1):
                try:
                    response = await client.chat.completions.create(
                        model=endpoint.model, messages=messages, extra_body=pool.extra_body or None, **params
                    )
                    reply = response.choices[0].message.content if response.choices else None
                    if not reply:
                        raise ValueError("empty reply")
                    return parse(reply), endpoint.model
                except (openai.OpenAIError, ValueError, TimeoutError) as exc:
                    message = redact(f"{endpoint.model} attempt {attempt}: {type(exc).__name__}: {exc}")
                    failures.append(message[:500])
                    unreachable = unreachable and is_unreachable(exc)
                    logger.warning("LLM call failed: %s", message[:500])
                if attempt < pool.max_retries:
                    await asyncio.sleep(delay)
                    delay *= pool.backoff_factor
        finally:
            await client.close()
    raise LLMUnavailableError(failures, unreachable=unreachable and bool(failures))
