"""An HTTP tool aggregator (``agentrl tools aggregate``): the original AgentRL's ``/mcpapi`` protocol over a
``ToolManager``.

One process holds the MCP connections (e.g. to stdio servers) and serves every sampler of a machine or a
cluster through ``--mcp_manager_url http://host:port/mcpapi``. Routes (see ``agentrl.tools.aggregator``):
``GET /mcpapi/servers``, ``GET /mcpapi/tools``, ``GET /mcpapi/server/{name}/tools``,
``POST /mcpapi/tool/{server}.{tool}``. Tool entries carry the MCP ``annotations`` (``idempotentHint``) next to
the OpenAI function, so clients know which tools they may retry.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, HTTPException, Request

from agentrl.tools.manager import ToolManager
from agentrl.tools.types import ToolSpec

PREFIX = "/mcpapi"


def _entry(spec: ToolSpec) -> dict[str, Any]:
    return {**spec.to_openai(), "server": spec.server, "annotations": {"idempotentHint": spec.idempotent}}


def create_app(manager: ToolManager, *, auth_token: str | None = None) -> FastAPI:
    """The aggregator app; it opens ``manager`` on start-up and closes it on shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with manager:
            yield

    def check_token(request: Request) -> None:
        if auth_token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), auth_token.encode()):
            raise HTTPException(status_code=401, detail="missing or invalid bearer token")

    router = APIRouter(prefix=PREFIX, dependencies=[Depends(check_token)])

    def tools_of(server: str) -> list[ToolSpec]:
        specs = [spec for spec in manager.list_tools() if spec.server == server]
        if not specs:
            raise HTTPException(status_code=404, detail=f"unknown server {server!r}")
        return specs

    @router.get("/servers")
    async def servers() -> dict[str, list[str]]:
        return {"servers": sorted({spec.server for spec in manager.list_tools()})}

    @router.get("/tools")
    async def tools() -> dict[str, list[dict[str, Any]]]:
        return {"tools": [_entry(spec) for spec in manager.list_tools()]}

    @router.get("/server/{server}/tools")
    async def server_tools(server: str) -> list[dict[str, Any]]:
        return [_entry(spec) for spec in tools_of(server)]

    @router.post("/tool/{qualified_name}")
    async def call(qualified_name: str, arguments: Annotated[dict[str, Any] | None, Body()] = None) -> dict[str, Any]:
        server, dot, tool = qualified_name.partition(".")
        if not dot or tool not in {spec.name for spec in tools_of(server)}:
            raise HTTPException(status_code=404, detail=f"unknown tool {qualified_name!r} (expected server.tool)")
        result = await manager.call_tool(tool, arguments or {})
        if result.ok:
            return {"status": "success", "content": result.text}
        return {"status": "error", "error_type": result.status.value, "content": {"error": result.text}}

    app = FastAPI(title="AgentRL MCP aggregator", lifespan=lifespan)
    app.include_router(router)
    return app
