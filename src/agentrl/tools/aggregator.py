"""Client of the original AgentRL's HTTP tool aggregator (``--mcp_manager_url http://host:port/mcpapi``).

Protocol (AgentCPM's MCP manager, also served by ``agentrl tools aggregate``):

- ``GET  {url}/servers``             → ``{"servers": [name, ...]}`` (entries may also be ``{"name": ...}``)
- ``GET  {url}/tools``               → ``{"tools": [...]}`` (all tools)
- ``GET  {url}/server/{name}/tools`` → the server's tools in OpenAI function format (a list, or ``{"tools": [...]}``)
- ``POST {url}/tool/{server}.{tool}`` with the arguments as JSON body → ``{"status": "success"|"error",
  "content": ...}``; errors may also come as HTTP status >= 400 with ``{"detail": ...}``, or as a content
  object with an ``error`` key.

One ``httpx.AsyncClient`` is kept for the life of the process.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx

from agentrl.log import redact
from agentrl.tools.errors import ToolConnectionError, ToolFailedError
from agentrl.tools.types import ToolSpec, ToolStatus


def _tool_entries(payload: Any) -> list[dict[str, Any]]:
    if isinstance(payload, dict):
        payload = payload.get("tools", [])
    if not isinstance(payload, list):
        raise ValueError(f"expected a list of tools, got {type(payload).__name__}")
    return [entry for entry in payload if isinstance(entry, dict)]


def _spec_from_entry(entry: dict[str, Any], server: str) -> ToolSpec:
    """Accept OpenAI format (``{"type": "function", "function": {...}}``) or MCP format (``inputSchema``)."""
    function = entry.get("function", entry)
    schema = function.get("parameters") or function.get("inputSchema") or function.get("input_schema")
    annotations = entry.get("annotations") or function.get("annotations") or {}
    idempotent = bool(
        annotations.get("idempotentHint") or annotations.get("readOnlyHint")
        or annotations.get("idempotent_hint") or annotations.get("read_only_hint")
    )
    return ToolSpec(
        name=str(function["name"]),
        description=str(function.get("description") or ""),
        input_schema=schema or {"type": "object", "properties": {}},
        server=server,
        idempotent=idempotent,
    )


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False)


class AggregatorClient:
    """Tools of an MCP aggregator reached over its HTTP API."""

    def __init__(self, base_url: str, *, auth_token: str | None = None, connect_timeout: float = 30.0):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(connect_timeout))

    async def list_tools(self, servers: list[str] | None = None) -> list[ToolSpec]:
        """Tools of the selected servers (``None``: every server the aggregator lists)."""
        try:
            listed = (await self._get_json("/servers")).get("servers", [])
            available = [entry["name"] if isinstance(entry, dict) else str(entry) for entry in listed]
            if servers is not None:
                unknown = [name for name in servers if name not in available]
                if unknown:
                    raise ToolConnectionError(
                        f"aggregator {redact(self.base_url)} has no server(s) {', '.join(unknown)}; "
                        f"it has: {', '.join(available) or 'none'}"
                    )
            specs: list[ToolSpec] = []
            for server in servers if servers is not None else available:
                payload = await self._get_json(f"/server/{quote(server, safe='')}/tools")
                specs.extend(_spec_from_entry(entry, server) for entry in _tool_entries(payload))
            return specs
        except ToolConnectionError:
            raise
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise ToolConnectionError(
                f"cannot list tools of aggregator {redact(self.base_url)}: {type(exc).__name__}: {redact(str(exc))}"
            ) from exc

    async def call_tool(
        self, server: str, tool: str, arguments: dict[str, Any], timeout: float
    ) -> tuple[ToolStatus, str]:
        """Call ``server.tool``: ``(status, text)`` for an answer, ``ToolFailedError`` when there is none.

        HTTP 422 and answers marked ``"error_type": "formaterror"`` are format errors; other errors are tool
        failures.
        """
        url = f"{self.base_url}/tool/{quote(server, safe='')}.{quote(tool, safe='')}"
        try:
            response = await self._http.post(url, json=arguments, timeout=httpx.Timeout(timeout, connect=10.0))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            message = f"aggregator unreachable for {server}.{tool}: {type(exc).__name__}"
            raise ToolFailedError(message, sent=False) from exc
        except httpx.TimeoutException as exc:
            raise ToolFailedError(f"tool {tool!r} timed out after {timeout:g} s") from exc
        except httpx.HTTPError as exc:
            raise ToolFailedError(f"aggregator call {server}.{tool} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise ToolFailedError(
                f"aggregator answered HTTP {response.status_code} for {server}.{tool}: {response.text[:500]}"
            )
        try:
            body = response.json()
        except ValueError:
            body = {"status": "success" if response.is_success else "error", "content": response.text}
        if not isinstance(body, dict):
            body = {"status": "success", "content": body}
        format_error = response.status_code == 422 or body.get("error_type") == "formaterror"
        failed = ToolStatus.FORMATERROR if format_error else ToolStatus.TOOLFAILED
        if response.status_code >= 400 or (isinstance(body.get("status_code"), int) and body["status_code"] >= 400):
            return failed, _content_text(body.get("detail", body))
        content = body.get("content")
        if isinstance(content, dict) and "error" in content:
            return failed, _content_text(content["error"])
        if str(body.get("status", "success")).lower() == "error":
            return failed, _content_text(content if content is not None else body.get("detail", "tool error"))
        return ToolStatus.OK, _content_text(content if content is not None else "")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get_json(self, path: str) -> Any:
        response = await self._http.get(self.base_url + path)
        response.raise_for_status()
        return response.json()
