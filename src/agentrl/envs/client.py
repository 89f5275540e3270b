"""Async client of any AgentGym environment server (ours or AgentGym's own), on ``httpx.AsyncClient``.

The environment's dialect (id field, task field, response shapes) comes from :mod:`agentrl.envs.protocol` by
name; names it does not know get the generic rules (id field ``id``, responses read leniently).

- ``reset`` is always explicit, so the task an episode plays is the one asked for, never the task TextCraft's
  ``create`` loads by itself (task number = instance id).
- An ``{"error": ...}`` body (and any other answer the server gives but the request cannot use: HTTP 4xx/5xx, a
  body that is not JSON) raises :class:`EnvServerError` with the server's message.
- A server that cannot be reached raises :class:`EnvUnavailable` (infrastructure, not the policy's fault). A
  request that never left (connection refused, connect or pool timeout) is retried with exponential backoff
  whatever it is; a request that may have reached the server (read error or timeout, a dropped connection,
  HTTP 502/503/504) is retried only if repeating it is harmless: ``reset``, ``observation``, ``close``,
  ``health`` — never ``create`` or ``step``.
- Episode reward: :func:`episode_reward` (re-exported from the protocol) — the latest cumulative ``score`` where
  the server reports one (``StepResult.info["score"]``: BabyAI, SciWorld), else the sum of step rewards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from agentrl.envs.base import EnvError, StepResult
from agentrl.envs.protocol import (
    ProtocolError,
    create_body,
    episode_reward,
    error_of,
    first_observation,
    image_of,
    instance_body,
    read_id,
    read_observation,
    read_step,
    reset_body,
    state_key_of,
    step_body,
    wire_format,
)
from agentrl.vision.images import LoadedImage

__all__ = ["AgentGymClient", "EnvServerError", "EnvUnavailable", "episode_reward"]

_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_UNAVAILABLE_STATUS = (502, 503, 504)


class EnvServerError(EnvError):
    """The environment server answered, refusing the request; the message is the server's. ``status_code`` is
    200 for AgentGym's ``{"error": ...}`` bodies."""

    def __init__(self, message: str, *, status_code: int):
        super().__init__(message)
        self.status_code = status_code


class EnvUnavailable(EnvError):
    """The environment server could not be reached (after the retries that were safe)."""


class AgentGymClient:
    """One environment server. Safe to share between concurrent episodes (one instance id each).

    ``max_connections`` is small on purpose: httpx's connection pool costs more per request the more connections
    it holds (bench/envs.py, TextCraft, 32 concurrent episodes: 331 steps/s with up to 256 connections, 576 with 16,
    817 with 8; 1 and 8 concurrent episodes are unaffected). Extra episodes wait for a connection, which costs
    little next to an LLM turn."""

    def __init__(self, name: str, base_url: str, *, timeout: float = 120.0, retries: int = 3,
                 backoff_s: float = 0.5, max_connections: int = 8):
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.format = wire_format(name)
        self.retries = retries
        self.backoff_s = backoff_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    async def __aenter__(self) -> AgentGymClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def create(self, data_idx: int | None = None) -> int:
        """A new instance's id. ``data_idx`` matters only to servers whose ``create`` takes the task (SearchQA)."""
        response = await self._request("POST", "/create", json=create_body(self.format, data_idx), idempotent=False)
        return self._read(read_id, self.format, response)

    async def reset(self, instance: int, data_idx: int) -> str:
        """Load task ``data_idx`` into ``instance``; returns the episode's first observation."""
        return (await self.reset_keyed(instance, data_idx))[0]

    async def reset_keyed(self, instance: int, data_idx: int) -> tuple[str, str]:
        """:meth:`reset`, and the key of the first state (``agentrl.envs.protocol.state_key_of``)."""
        return (await self.reset_seen(instance, data_idx))[:2]

    async def reset_seen(self, instance: int, data_idx: int) -> tuple[str, str, LoadedImage | None]:
        """:meth:`reset_keyed`, and the first observation's picture where the server draws one."""
        response = await self._request("POST", "/reset", json=reset_body(self.format, instance, data_idx),
                                       idempotent=True)
        observation = self._read(first_observation, self.format, response)
        return observation, state_key_of(observation, response), self._read(image_of, response)

    async def step(self, instance: int, action: str) -> StepResult:
        """Apply ``action``: ``reward`` is this step's; ``info["score"]`` the cumulative score where reported."""
        response = await self._request("POST", "/step", json=step_body(self.format, instance, action),
                                       idempotent=False)
        return self._read(read_step, response)

    async def observation(self, instance: int) -> str:
        """The instance's current observation (``GET /observation``)."""
        response = await self._request("GET", "/observation", params=instance_body(self.format, instance),
                                       idempotent=True)
        return self._read(read_observation, response)

    async def close(self, instance: int) -> bool:
        """Close ``instance``: True if the server closed it, False if it was not open (or the server has no
        ``/close``, as ALFWorld's)."""
        try:
            response = await self._request("POST", "/close", json=instance_body(self.format, instance),
                                           idempotent=True)
        except EnvServerError as error:
            if error.status_code in (200, 404):  # AgentGym's error body / no such route
                return False
            raise
        return response is True

    async def health(self) -> str:
        """The server's banner (``GET /``); raises :class:`EnvUnavailable` when it cannot be reached."""
        response = await self._request("GET", "/", idempotent=True)
        return response if isinstance(response, str) else str(response)

    async def _request(self, method: str, path: str, *, json: dict[str, Any] | None = None,
                       params: dict[str, Any] | None = None, idempotent: bool) -> Any:
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), 5.0))
            try:
                response = await self._http.request(method, path, json=json, params=params)
            except _NEVER_SENT as error:
                failure = f"{type(error).__name__}: {error}"
                continue
            except httpx.TransportError as error:
                failure = f"{type(error).__name__}: {error}"
                if idempotent:
                    continue
                raise EnvUnavailable(self._unavailable(path, failure, attempt + 1, retried=False)) from error
            if response.status_code in _UNAVAILABLE_STATUS:
                failure = f"HTTP {response.status_code}"
                if idempotent:
                    continue
                raise EnvUnavailable(self._unavailable(path, failure, attempt + 1, retried=False))
            return self._decode(path, response)
        raise EnvUnavailable(self._unavailable(path, failure, self.retries + 1, retried=True))

    def _decode(self, path: str, response: httpx.Response) -> Any:
        if response.status_code != 200:
            raise EnvServerError(f"{self.name} server {path}: HTTP {response.status_code}: "
                                 f"{response.text[:500]}", status_code=response.status_code)
        try:
            body = response.json()
        except ValueError:
            raise EnvServerError(f"{self.name} server {path}: expected a JSON body, got {response.text[:200]!r}",
                                 status_code=200) from None
        message = error_of(body)
        if message is not None:
            raise EnvServerError(message, status_code=200)
        return body

    def _read(self, reader: Callable[..., Any], *args: Any) -> Any:
        try:
            return reader(*args)
        except ProtocolError as error:
            raise EnvServerError(f"{self.name} server: {error}", status_code=200) from error

    def _unavailable(self, path: str, failure: str, attempts: int, *, retried: bool) -> str:
        why = "" if retried else " (not retried: the request may have reached the server)"
        return (f"environment server {self.name} at {self.base_url} unavailable: {path} failed after "
                f"{attempts} attempt{'s' if attempts > 1 else ''}{why}: {failure}")
