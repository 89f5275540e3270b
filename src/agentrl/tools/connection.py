"""One long-lived connection to one MCP server through the official ``mcp`` SDK client.

The SDK's ``Client`` runs its transport inside an anyio task group that must be entered and left by the same
task, and a transport failure cancels that task group. So each connection is owned by a *keeper* task that
enters the client, waits until asked to stop, and leaves it; callers in any task send requests through the
session. A dead server (stdio process gone, HTTP server unreachable) is detected by the failed call or by
the keeper ending; the next call restarts the connection (a fresh subprocess for stdio), with a back-off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INVALID_PARAMS,
    REQUEST_TIMEOUT,
    AudioContent,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from agentrl.log import redact
from agentrl.tools.config import MCPServerConfig
from agentrl.tools.errors import ToolConnectionError, ToolFailedError, ToolFormatError
from agentrl.tools.types import ToolSpec
from agentrl.vision.images import ImageError, LoadedImage, decode_image_string

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0
_MAX_RECONNECT_DELAY_S = 30.0


def result_content(result: CallToolResult, *, images: bool = False) -> tuple[str, list[LoadedImage]]:
    """A tool result's content blocks as the text the model reads and, with ``images``, the pictures it sees (each
    ``ImageContent`` checked by :func:`~agentrl.vision.images.load_image`; one that is not a usable image is a
    note in the text instead). Without ``images`` a picture is a note too."""
    pictures: list[LoadedImage] = []
    parts: list[str] = []
    for index, block in enumerate(result.content):
        if isinstance(block, TextContent):
            parts.append(block.text)
        elif isinstance(block, ImageContent) and images:
            try:
                pictures.append(decode_image_string(block.data, f"content[{index}] ({block.mime_type})"))
            except ImageError as error:
                parts.append(f"[image content omitted: {error}]")
        elif isinstance(block, ImageContent | AudioContent):
            parts.append(f"[{block.type} content ({block.mime_type}) omitted]")
        elif isinstance(block, EmbeddedResource):
            resource = block.resource
            if isinstance(resource, TextResourceContents):
                parts.append(resource.text)
            else:
                parts.append(f"[binary resource {resource.uri} omitted]")
        elif isinstance(block, ResourceLink):
            parts.append(f"[resource link: {block.uri}]")
    if not parts and not pictures and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False), pictures
    return "\n".join(parts), pictures


def _describe(exc: BaseException) -> str:
    """A one-line description of an exception, unwrapping exception groups to their first leaf."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    return redact(f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text)


class MCPConnection:
    """A reusable connection to one MCP server (stdio, streamable HTTP or SSE), restarted when it dies."""

    def __init__(self, config: MCPServerConfig, *, connect_timeout: float = 60.0, reconnect_delay: float = 1.0):
        self.config = config
        self._connect_timeout = connect_timeout
        self._base_reconnect_delay = reconnect_delay
        self._reconnect_delay = reconnect_delay
        self._client: Client | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._generation = 0
        self._next_attempt_at = 0.0
        self._closed = False
        self._lock = asyncio.Lock()
        self._calls = asyncio.Semaphore(config.max_concurrent_calls)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def connected(self) -> bool:
        """True while the session is open (a stdio server that just died is noticed by the next call)."""
        return self._client is not None and self._keeper is not None and not self._keeper.done()

    async def connect(self) -> list[ToolSpec]:
        """Open the connection and list the server's tools (raises ``ToolConnectionError``)."""
        async with self._lock:
            await self._open()
            assert self._client is not None
            try:
                return await asyncio.wait_for(self._list_tools(self._client), self._connect_timeout)
            except Exception as exc:
                await self._discard()
                raise ToolConnectionError(f"MCP server {self.name!r}: listing tools failed: {_describe(exc)}") from exc

    async def call_tool(self, name: str, arguments: dict[str, Any], timeout: float) -> CallToolResult:
        """Call ``name``; raises ``ToolFailedError`` (server down, timeout, transport) or ``ToolFormatError``."""
        async with self._calls:
            client, generation = await self._ensure_connected()
            try:
                async with asyncio.timeout(timeout + 5.0):
                    return await client.call_tool(name, arguments, read_timeout_seconds=timeout)
            except MCPError as exc:
                if exc.code == REQUEST_TIMEOUT:
                    raise ToolFailedError(f"tool {name!r} timed out after {timeout:g} s") from exc
                if exc.code == INVALID_PARAMS:
                    raise ToolFormatError(f"tool {name!r} rejected its arguments: {exc.message}") from exc
                if exc.code == CONNECTION_CLOSED:
                    await self._drop(generation)
                    raise ToolFailedError(
                        f"MCP server {self.name!r} closed the connection during the call to {name!r} "
                        "(the server died?); it will be restarted"
                    ) from exc
                raise ToolFailedError(f"MCP server {self.name!r} failed the call to {name!r}: {exc.message}") from exc
            except TimeoutError as exc:
                raise ToolFailedError(f"tool {name!r} timed out after {timeout:g} s") from exc
            except Exception as exc:
                if not self.connected or isinstance(exc, OSError | httpx2.TransportError):
                    await self._drop(generation)
                raise ToolFailedError(
                    f"MCP server {self.name!r} failed the call to {name!r}: {_describe(exc)}"
                ) from exc

    async def close(self) -> None:
        """Close the connection (stops a stdio server); calls afterwards fail."""
        self._closed = True
        async with self._lock:
            await self._discard()

    # ------------------------------------------------------------------------------------------------ internals

    @asynccontextmanager
    async def _transport(self) -> AsyncIterator[Any]:
        config = self.config
        if config.transport == "stdio":
            assert config.command is not None
            params = StdioServerParameters(
                command=config.command, args=config.args, env=stdio_environment(config.env), cwd=config.cwd
            )
            async with stdio_client(params) as streams:
                yield streams
            return
        assert config.url is not None
        headers = dict(config.headers)
        token = config.bearer_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if config.transport == "sse":
            sse = sse_client(config.url, headers=headers or None, timeout=30.0, sse_read_timeout=3600.0)
            async with sse as streams:
                yield streams
            return
        http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))
        async with http, streamable_http_client(config.url, http_client=http) as streams:
            yield streams

    async def _keep(self, client: Client, ready: asyncio.Future[None], stop: asyncio.Event) -> None:
        """Own the client's context for its whole life (entered and exited in this task)."""
        try:
            async with client:
                ready.set_result(None)
                await stop.wait()
        except Exception as exc:  # noqa: BLE001 - handed to whoever awaits the connection
            if not ready.done():
                ready.set_exception(exc)
            elif not stop.is_set():
                logger.warning("MCP server %r: connection lost: %s", self.name, _describe(exc))
        finally:
            if not ready.done():
                ready.set_exception(ToolConnectionError(f"MCP server {self.name!r}: connection ended during start-up"))

    async def _open(self) -> None:
        client = Client(self._transport(), read_timeout_seconds=None)
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        keeper = asyncio.create_task(self._keep(client, ready, stop), name=f"mcp-connection-{self.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), self._connect_timeout)
        except BaseException as exc:
            await self._stop_keeper(keeper, stop)
            if ready.done() and not ready.cancelled():
                ready.exception()  # retrieved: the reason is reported below
            if isinstance(exc, asyncio.CancelledError):
                raise
            timed_out = isinstance(exc, TimeoutError)
            reason = f"no answer within {self._connect_timeout:g} s" if timed_out else _describe(exc)
            raise ToolConnectionError(
                f"cannot connect to MCP server {self.name!r} ({self._where()}): {reason}"
            ) from exc
        self._client, self._keeper, self._stop = client, keeper, stop
        self._generation += 1

    async def _ensure_connected(self) -> tuple[Client, int]:
        if self._closed:
            raise ToolFailedError(f"MCP server {self.name!r}: the connection is closed", sent=False)
        if self.connected:
            assert self._client is not None
            return self._client, self._generation
        async with self._lock:
            if not self.connected:
                await self._discard()
                now = time.monotonic()
                if now < self._next_attempt_at:
                    raise ToolFailedError(
                        f"MCP server {self.name!r} is down; next restart attempt in "
                        f"{self._next_attempt_at - now:.1f} s",
                        sent=False,
                    )
                try:
                    await self._open()
                except ToolConnectionError as exc:
                    self._next_attempt_at = time.monotonic() + self._reconnect_delay
                    self._reconnect_delay = min(self._reconnect_delay * 2, _MAX_RECONNECT_DELAY_S)
                    message = f"MCP server {self.name!r} is down and restarting it failed: {exc}"
                    raise ToolFailedError(message, sent=False) from exc
                self._reconnect_delay = self._base_reconnect_delay
                logger.info("MCP server %r: reconnected", self.name)
            assert self._client is not None
            return self._client, self._generation

    async def _drop(self, generation: int) -> None:
        """Discard the connection of ``generation`` (if still current) so the next call reconnects."""
        async with self._lock:
            if generation == self._generation and self._client is not None:
                await self._discard()

    async def _discard(self) -> None:
        keeper, stop = self._keeper, self._stop
        self._client = self._keeper = self._stop = None
        if keeper is not None and stop is not None:
            await self._stop_keeper(keeper, stop)

    async def _stop_keeper(self, keeper: asyncio.Task[None], stop: asyncio.Event) -> None:
        stop.set()
        done, _ = await asyncio.wait({keeper}, timeout=_STOP_GRACE_S)
        if not done:
            keeper.cancel()
            await asyncio.wait({keeper})

    async def _list_tools(self, client: Client) -> list[ToolSpec]:
        specs: list[ToolSpec] = []
        cursor: str | None = None
        while True:
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                annotations = tool.annotations
                if self.config.idempotent_tools is not None:
                    idempotent = tool.name in self.config.idempotent_tools
                else:
                    idempotent = bool(annotations and (annotations.idempotent_hint or annotations.read_only_hint))
                specs.append(
                    ToolSpec(
                        name=tool.name,
                        description=tool.description or "",
                        input_schema=tool.input_schema,
                        server=self.name,
                        idempotent=idempotent,
                    )
                )
            cursor = page.next_cursor
            if cursor is None:
                return specs

    def _where(self) -> str:
        if self.config.transport == "stdio":
            return f"stdio: {' '.join([self.config.command or '', *self.config.args])}"
        return redact(f"{self.config.transport}: {self.config.url}")


def stdio_environment(extra: dict[str, str]) -> dict[str, str]:
    """What a stdio server's environment adds to the MCP SDK's safe default (``HOME``, ``PATH``, ``USER``...; no
    secrets): ``PYTHONPATH`` when this process has one, so a server run by this interpreter finds the same packages
    (a checkout used without installing it), then the config's ``env``."""
    inherited = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    return {**inherited, **extra}
