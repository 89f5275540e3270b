"""``ToolManager``: every tool a process may call, behind one async context manager.

Tools come from MCP servers listed in an ``MCPConfig`` (one connection each, opened once per process and
reused by all trajectories) and/or from an HTTP aggregator (``--mcp_manager_url``). ``call_tool`` validates the
arguments against the tool's JSON schema, applies a timeout, retries calls that are safe to retry and returns a
``ToolResult`` whose status is what the agent loop records for the call (``ok``, ``formaterror``,
``toolfailed``); it never raises for a problem of a single call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonschema import SchemaError
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for

from agentrl.log import redact
from agentrl.tools.aggregator import AggregatorClient
from agentrl.tools.config import MCPConfig, MCPServerConfig, load_mcp_config, parse_server_filter
from agentrl.tools.connection import MCPConnection, result_content
from agentrl.tools.errors import ToolConfigError, ToolConnectionError, ToolFailedError, ToolFormatError
from agentrl.tools.types import ToolResult, ToolSpec, ToolStatus
from agentrl.vision.images import LoadedImage

logger = logging.getLogger(__name__)

class ToolManager:
    """Connections to MCP servers and/or an aggregator; ``list_tools`` and ``call_tool`` for the agent loop."""

    def __init__(
        self,
        config: MCPConfig | None = None,
        *,
        manager_url: str | None = None,
        server_names: Sequence[str] | None = None,
        auth_token: str | None = None,
        default_timeout: float = 60.0,
        max_retries: int = 2,
        retry_backoff: float = 0.5,
        connect_timeout: float = 60.0,
    ):
        """``server_names`` keeps only those servers (of the config and of the aggregator); ``None`` keeps all.

        ``auth_token`` is the aggregator's bearer token; config servers name their own (``bearer_token_env``).
        ``default_timeout``/``max_retries`` apply to aggregator tools; config servers have their own settings.
        """
        if config is None and manager_url is None:
            raise ToolConfigError("no tools configured: give an MCP config (--mcp_config) or --mcp_manager_url")
        names = list(server_names) if server_names is not None else None
        self._config = config
        self._manager_url = manager_url
        self._server_names = names
        self._auth_token = auth_token
        self._default_timeout = default_timeout
        self._max_retries = max_retries
        self._retry_backoff = retry_backoff
        self._connect_timeout = connect_timeout
        self._connections: dict[str, MCPConnection] = {}
        self._aggregator: AggregatorClient | None = None
        self._tools: dict[str, ToolSpec] = {}
        self._routes: dict[str, MCPConnection | None] = {}
        self._validators: dict[str, Validator] = {}
        self._entered = False

    @classmethod
    def from_options(
        cls,
        *,
        mcp_config: str | Path | None = None,
        mcp_manager_url: str | None = None,
        mcp_server_name: str | None = None,
        mcp_auth_token: str | None = None,
        **kwargs: Any,
    ) -> ToolManager:
        """Build from the sampler's flags (``--mcp_config``, ``--mcp_manager_url``, ``--mcp_server_name``, ...).

        With both a config and an aggregator, ``--mcp_server_name`` filters the config's servers only when it
        names some of them; names unknown to both are reported when the manager starts.
        """
        config = load_mcp_config(mcp_config) if mcp_config else None
        return cls(
            config,
            manager_url=mcp_manager_url or None,
            server_names=parse_server_filter(mcp_server_name),
            auth_token=mcp_auth_token or None,
            **kwargs,
        )

    # ---------------------------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> ToolManager:
        if self._entered:
            raise RuntimeError("ToolManager is already open")
        self._entered = True
        try:
            await self._start()
        except BaseException:
            await self._shutdown()
            self._entered = False
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._shutdown()
        self._entered = False

    async def _start(self) -> None:
        config_servers = self._selected_config_servers()
        self._connections = {
            server.name: MCPConnection(server, connect_timeout=self._connect_timeout) for server in config_servers
        }
        routes: list[MCPConnection | None] = list(self._connections.values())
        jobs = [conn.connect() for conn in self._connections.values()]
        if self._manager_url:
            self._aggregator = AggregatorClient(
                self._manager_url, auth_token=self._auth_token, connect_timeout=self._connect_timeout
            )
            routes.append(None)
            jobs.append(self._aggregator.list_tools(self._aggregator_server_names(config_servers)))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors:
            if not isinstance(error, Exception):
                raise error
        if errors:
            raise ToolConnectionError("; ".join(str(e) for e in errors)) from errors[0]
        for route, specs in zip(routes, results, strict=True):
            assert isinstance(specs, list)
            for spec in _offered(route, specs):
                self._add_tool(spec, route)
        logger.info(
            "tools ready: %s",
            ", ".join(f"{spec.name} ({spec.server})" for spec in self._tools.values()) or "none",
        )

    async def _shutdown(self) -> None:
        connections, self._connections = list(self._connections.values()), {}
        await asyncio.gather(*(conn.close() for conn in connections), return_exceptions=True)
        if self._aggregator is not None:
            await self._aggregator.aclose()
            self._aggregator = None
        self._tools.clear()
        self._routes.clear()
        self._validators.clear()

    def _selected_config_servers(self) -> list[MCPServerConfig]:
        if self._config is None:
            return []
        if self._server_names is None:
            return list(self._config.servers)
        if self._manager_url is None:
            return list(self._config.select(self._server_names).servers)
        return [s for s in self._config.servers if s.name in self._server_names]

    def _aggregator_server_names(self, config_servers: list[MCPServerConfig]) -> list[str] | None:
        if self._server_names is None:
            return None
        taken = {s.name for s in config_servers}
        return [name for name in self._server_names if name not in taken]

    def _add_tool(self, spec: ToolSpec, route: MCPConnection | None) -> None:
        """Register a tool; ``route`` is its MCP connection, ``None`` for an aggregator tool."""
        existing = self._tools.get(spec.name)
        if existing is not None:
            raise ToolConfigError(
                f"tool {spec.name!r} is offered by both {existing.server!r} and {spec.server!r}; "
                "select one of the servers (--mcp_server_name)"
            )
        try:
            validator_cls = validator_for(spec.input_schema)
            validator_cls.check_schema(spec.input_schema)
        except SchemaError as exc:
            message = f"tool {spec.name!r} ({spec.server}) has an invalid input schema: {exc.message}"
            raise ToolConfigError(message) from exc
        self._tools[spec.name] = spec
        self._routes[spec.name] = route
        self._validators[spec.name] = validator_cls(spec.input_schema)

    # ------------------------------------------------------------------------------------------------- queries

    def list_tools(self) -> list[ToolSpec]:
        """All available tools (fetched once when the manager opened)."""
        self._require_open()
        return list(self._tools.values())

    def openai_tools(self) -> list[dict[str, Any]]:
        """All tools in OpenAI function format, ready for ``apply_chat_template(..., tools=...)``."""
        return [spec.to_openai() for spec in self.list_tools()]

    def get_tool(self, name: str) -> ToolSpec:
        """The tool called ``name``; ``ToolFormatError`` (a message for the model) if there is none."""
        self._require_open()
        spec = self._tools.get(name)
        if spec is None:
            available = ", ".join(sorted(self._tools)) or "none"
            raise ToolFormatError(f"Unknown tool {name!r}. Available tools: {available}.")
        return spec

    def validate_arguments(self, name: str, arguments: Any) -> dict[str, Any]:
        """Check ``arguments`` against the tool's schema; ``ToolFormatError`` explains a violation to the model."""
        spec = self.get_tool(name)
        if not isinstance(arguments, dict):
            raise ToolFormatError(
                f"Arguments of tool {name!r} must be a JSON object, got {type(arguments).__name__}."
            )
        error = best_match(self._validators[name].iter_errors(arguments))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            location = f" at '{where}'" if where else ""
            raise ToolFormatError(
                f"Invalid arguments for tool {name!r}{location}: {error.message}. "
                f"Expected arguments matching this JSON schema: {spec.input_schema}"
            )
        return arguments

    # ---------------------------------------------------------------------------------------------------- calls

    async def call_tool(self, name: str, arguments: Any, timeout: float | None = None, *,
                        images: bool = False) -> ToolResult:
        """Call a tool; the result's status is ``ok``, ``formaterror`` or ``toolfailed`` (never raises for those).
        ``images``: the result's pictures come back as images (a vision-language policy), not as notes in its text
        (through an aggregator they stay notes)."""
        started = time.perf_counter()
        try:
            spec = self.get_tool(name)
            arguments = self.validate_arguments(name, arguments)
        except ToolFormatError as exc:
            return ToolResult(name=name, status=ToolStatus.FORMATERROR, text=str(exc), error=str(exc))
        connection = self._routes[name]
        server_cfg = connection.config if connection is not None else None
        timeout = timeout or (server_cfg.timeout if server_cfg else self._default_timeout)
        max_retries = server_cfg.max_retries if server_cfg else self._max_retries
        attempts = 0
        while True:
            attempts += 1
            try:
                status, text, pictures = await self._call_once(spec, arguments, timeout, images)
                return ToolResult(
                    name=name, server=spec.server, status=status, text=text,
                    error=None if status is ToolStatus.OK else text,
                    elapsed_s=time.perf_counter() - started, attempts=attempts, images=pictures,
                )
            except ToolFormatError as exc:
                return ToolResult(
                    name=name, server=spec.server, status=ToolStatus.FORMATERROR, text=str(exc), error=str(exc),
                    elapsed_s=time.perf_counter() - started, attempts=attempts,
                )
            except ToolFailedError as exc:
                retryable = not exc.sent or spec.idempotent
                if attempts > max_retries or not retryable:
                    message = redact(str(exc))
                    logger.warning("tool %s (%s) failed after %d attempt(s): %s", name, spec.server, attempts, message)
                    return ToolResult(
                        name=name, server=spec.server, status=ToolStatus.TOOLFAILED,
                        text=f"Tool {name!r} failed: {message}", error=message,
                        elapsed_s=time.perf_counter() - started, attempts=attempts,
                    )
                await asyncio.sleep(self._retry_backoff * 2 ** (attempts - 1))

    async def _call_once(self, spec: ToolSpec, arguments: dict[str, Any], timeout: float, images: bool
                         ) -> tuple[ToolStatus, str, list[LoadedImage]]:
        connection = self._routes[spec.name]
        if connection is not None:
            result = await connection.call_tool(spec.name, arguments, timeout)
            text, pictures = result_content(result, images=images)
            return ToolStatus.TOOLFAILED if result.is_error else ToolStatus.OK, text, pictures
        assert self._aggregator is not None
        return *await self._aggregator.call_tool(spec.server, spec.name, arguments, timeout), []

    def _require_open(self) -> None:
        if not self._entered:
            raise RuntimeError("ToolManager is not open: use 'async with ToolManager(...) as tools:'")


def _offered(route: MCPConnection | None, specs: list[ToolSpec]) -> list[ToolSpec]:
    """The tools of a server its config offers (``tools``: those; else all); :class:`ToolConnectionError` for a
    name the server does not list."""
    wanted = route.config.tools if route is not None else None
    if wanted is None:
        return specs
    listed = {spec.name for spec in specs}
    missing = [name for name in wanted if name not in listed]
    if missing:
        raise ToolConnectionError(f"MCP server {route.name!r} has no tool {', '.join(map(repr, missing))} (its "
                                  f"config's 'tools'); it lists: {', '.join(sorted(listed)) or 'none'}")
    return [spec for spec in specs if spec.name in wanted]
