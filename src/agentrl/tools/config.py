"""MCP configuration: which tool servers a process connects to.

A config file (YAML or JSON) lists servers, either as ``servers: [...]`` or in the common ``mcpServers: {name:
{...}}`` form::

    servers:
      - name: calculator                     # stdio: the client starts the server as a subprocess
        command: agentrl
        args: [tools, serve, calculator]
        env: {OMP_NUM_THREADS: "1"}
      - name: search                         # streamable HTTP
        url: http://127.0.0.1:8000/mcp
        bearer_token_env: SEARCH_TOKEN       # the token is read from this environment variable
      - name: legacy                         # SSE (inferred from the /sse path; or say transport: sse)
        url: http://127.0.0.1:8001/sse

Secrets never appear in the file: tokens are named by environment variable. A stdio server does not inherit the
client's environment: it gets the MCP SDK's safe default (``HOME``, ``PATH``, ``USER``...), ``PYTHONPATH`` when the
client has one, and its ``env``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentrl.tools.errors import ToolConfigError

Transport = Literal["stdio", "streamable_http", "sse"]

_TRANSPORT_ALIASES = {"http": "streamable_http", "streamable-http": "streamable_http"}


class MCPServerConfig(BaseModel):
    """One MCP server: a command to run over stdio, or a URL (streamable HTTP or SSE)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of a stdio server")
    cwd: str | None = None
    url: str | None = None
    transport: Transport | None = Field(
        None, description="default: stdio for a command, sse for a URL ending in /sse, else streamable_http"
    )
    bearer_token_env: str | None = Field(None, description="environment variable holding the bearer token")
    headers: dict[str, str] = Field(default_factory=dict, description="extra (non-secret) HTTP headers")
    timeout: float = Field(60.0, gt=0, description="default per-call timeout in seconds")
    max_retries: int = Field(2, ge=0, description="retries of a failed call (idempotent tools, or unsent calls)")
    max_concurrent_calls: int = Field(32, ge=1)
    idempotent_tools: list[str] | None = Field(
        None, description="tools safe to retry; default: those the server annotates idempotent or read-only"
    )
    tools: list[str] | None = Field(
        None, description="offer only these tools of the server to the model (default: all it lists); a name the "
        "server does not list is an error when connecting"
    )

    @model_validator(mode="before")
    @classmethod
    def _normalise_transport(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("transport"), str):
            value = data["transport"].strip().lower()
            data = {**data, "transport": _TRANSPORT_ALIASES.get(value, value)}
        return data

    @model_validator(mode="after")
    def _check_kind(self) -> MCPServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"server {self.name!r}: give exactly one of 'command' (stdio) or 'url' (HTTP/SSE)")
        if self.transport is None:
            if self.command:
                self.transport = "stdio"
            elif urlsplit(self.url or "").path.rstrip("/").endswith("/sse"):
                self.transport = "sse"
            else:
                self.transport = "streamable_http"
        if self.command and self.transport != "stdio":
            raise ValueError(f"server {self.name!r}: a 'command' server uses the stdio transport")
        if self.url and self.transport == "stdio":
            raise ValueError(f"server {self.name!r}: a 'url' server uses streamable_http or sse, not stdio")
        return self

    def bearer_token(self) -> str | None:
        """The bearer token from ``bearer_token_env`` (an error if the variable is named but unset)."""
        if self.bearer_token_env is None:
            return None
        token = os.environ.get(self.bearer_token_env)
        if not token:
            raise ToolConfigError(
                f"server {self.name!r}: environment variable {self.bearer_token_env} (bearer token) is not set"
            )
        return token


class MCPConfig(BaseModel):
    """The list of MCP servers a process uses."""

    model_config = ConfigDict(extra="forbid")

    servers: list[MCPServerConfig] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _accept_mcp_servers_mapping(cls, data: Any) -> Any:
        if isinstance(data, dict) and "mcpServers" in data:
            rest = {k: v for k, v in data.items() if k != "mcpServers"}
            servers = [{"name": name, **(spec or {})} for name, spec in (data["mcpServers"] or {}).items()]
            return {**rest, "servers": list(rest.get("servers", [])) + servers}
        return data

    @model_validator(mode="after")
    def _unique_names(self) -> MCPConfig:
        names = [s.name for s in self.servers]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"server names must be unique; repeated: {', '.join(duplicates)}")
        return self

    def select(self, names: list[str] | None) -> MCPConfig:
        """Only the servers named (``None``: all); an unknown name is an error listing the known ones."""
        if names is None:
            return self
        known = {s.name for s in self.servers}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ToolConfigError(
                f"unknown MCP server(s) {', '.join(unknown)}; configured: {', '.join(sorted(known)) or 'none'}"
            )
        return MCPConfig(servers=[s for s in self.servers if s.name in names])


BUILTIN_SERVERS = ("calculator", "python")
"""The servers of ``agentrl tools serve NAME``."""


def builtin_servers_config(names: list[str]) -> MCPConfig:
    """An MCPConfig starting the named built-in servers (``agentrl tools serve NAME``) over stdio."""
    unknown = [n for n in names if n not in BUILTIN_SERVERS]
    if unknown:
        raise ToolConfigError(f"unknown built-in tool server(s) {', '.join(unknown)}; "
                              f"available: {', '.join(BUILTIN_SERVERS)}")
    return MCPConfig.model_validate({"servers": [
        {"name": name, "command": sys.executable, "args": ["-m", "agentrl.cli.main", "tools", "serve", name]}
        for name in names]})


def load_mcp_config(path: str | Path) -> MCPConfig:
    """Read an MCP config file (YAML or JSON)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ToolConfigError(f"cannot read MCP config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"MCP config {path} is not valid YAML/JSON: {exc}") from exc
    try:
        return MCPConfig.model_validate(data or {})
    except ValidationError as exc:
        raise ToolConfigError(f"invalid MCP config {path}: {_describe_errors(exc)}") from None


def parse_server_filter(value: str | None) -> list[str] | None:
    """``--mcp_server_name``: ``None``/``"all"`` selects every server, else a comma-separated list of names."""
    if value is None or value.strip().lower() in ("", "all"):
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _describe_errors(exc: ValidationError) -> str:
    """Validation errors without the offending input values (they may hold secrets)."""
    errors = exc.errors(include_input=False)
    return "; ".join(f"{'.'.join(str(p) for p in error['loc']) or 'file'}: {error['msg']}" for error in errors)
