"""The environment servers one process talks to: ``--env_server NAME=URL`` entries, else a local server per built-in.

For a name given with ``--env_server`` the pool uses that server (ours or AgentGym's own). For a built-in
environment without one it starts ``agentrl envs serve NAME`` on a free loopback port the first time a Task needs
it, and stops it on :meth:`EnvPool.aclose`. Names that are neither given nor built in are an error naming both
ways to fix it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from agentrl.envs.base import EnvError, EnvSpec
from agentrl.envs.client import AgentGymClient
from agentrl.envs.registry import BUILTIN, get_spec

GENERIC_INSTRUCTION = (
    "You are an agent acting in a text environment. Each message from the user is what you observe. Reply with "
    "your reasoning as 'Thought: ...' and end with one line 'Action: <action>'.")


def parse_env_servers(entries: Iterable[str]) -> dict[str, str]:
    """``["textcraft=http://127.0.0.1:36001", ...]`` -> ``{name: url}``; a malformed entry is a ``ValueError``."""
    servers: dict[str, str] = {}
    for entry in entries:
        name, sep, url = entry.partition("=")
        if not sep or not name.strip() or not url.strip().startswith(("http://", "https://")):
            raise ValueError(f"--env_server {entry!r}: expected NAME=URL, e.g. textcraft=http://127.0.0.1:36001")
        if name.strip() in servers:
            raise ValueError(f"--env_server names {name.strip()!r} twice")
        servers[name.strip()] = url.strip().rstrip("/")
    return servers


class EnvPool:
    """One :class:`AgentGymClient` per environment name (see the module docstring)."""

    def __init__(self, servers: dict[str, str] | None = None, *, timeout: float = 120.0):
        self.servers = dict(servers or {})
        self.timeout = timeout
        self._clients: dict[str, AgentGymClient] = {}
        self._stops: list[Callable[[], None]] = []
        self._lock = asyncio.Lock()

    def spec(self, name: str) -> EnvSpec:
        """The built-in spec of ``name``; for another server's environment a generic one (ReAct actions, success at
        reward 1) — give such Tasks a ``system_prompt`` that explains the environment."""
        if name in BUILTIN:
            return get_spec(name)
        return EnvSpec(name=name, factory=_no_local_instances(name), splits={}, instruction=GENERIC_INSTRUCTION)

    async def client(self, name: str) -> AgentGymClient:
        """The client of ``name``'s server (started first if it is a built-in environment without one)."""
        async with self._lock:
            if name not in self._clients:
                self._clients[name] = AgentGymClient(name, await self._url(name), timeout=self.timeout)
            return self._clients[name]

    async def close_instance(self, name: str, url: str, instance: int) -> bool:
        """Close an instance recorded by an earlier attempt, on the server it was created on. A local server of an
        earlier process is gone with that process (and its instances with it): nothing to close there."""
        current = self.servers.get(name)
        if current == url:
            return await (await self.client(name)).close(instance)
        client = AgentGymClient(name, url, timeout=self.timeout)
        try:
            return await client.close(instance)
        finally:
            await client.aclose()

    async def _url(self, name: str) -> str:
        if name in self.servers:
            return self.servers[name]
        if name not in BUILTIN:
            raise EnvError(f"no server for environment {name!r}: give --env_server {name}=URL (built-in "
                           f"environments, started automatically: {', '.join(sorted(BUILTIN))})")
        from agentrl.envs.local import start_local_server

        url, stop = await asyncio.to_thread(start_local_server, name)
        self._stops.append(stop)
        self.servers[name] = url
        return url

    async def aclose(self) -> None:
        """Close the clients and stop the servers this pool started."""
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
        for stop in self._stops:
            await asyncio.to_thread(stop)
        self._stops.clear()


def _no_local_instances(name: str) -> Callable[[], Any]:
    def factory() -> Any:
        raise EnvError(f"environment {name!r} is served elsewhere (--env_server); it has no local instances")

    return factory
