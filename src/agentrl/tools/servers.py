"""Built-in MCP servers (``agentrl tools serve calculator|python``), on the SDK's ``MCPServer``.

- ``calculator``: tool ``calculate(expression)`` over the safe evaluator of ``agentrl.tools.calculator``;
  read-only and idempotent (clients may retry it).
- ``python``: tool ``execute_code(code)`` running the code in the sandbox of ``agentrl.tools.sandbox``; not
  idempotent (never retried). It fails closed: where this machine cannot isolate code, every call is refused with
  an error naming ``--allow_unsandboxed``, unless the server was started with it (then a warning is logged at start).

HTTP transports bind 127.0.0.1 by default. With ``auth_token`` set, HTTP clients must send
``Authorization: Bearer <token>`` (checked by the SDK's bearer-auth middleware).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Annotated, Literal

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

from agentrl.tools.calculator import CalculatorError, evaluate, format_number
from agentrl.tools.sandbox import SandboxConfig, SandboxUnavailable, run_python, select_isolation

logger = logging.getLogger(__name__)

ServeTransport = Literal["stdio", "http", "sse"]


class _StaticTokenVerifier:
    """Accepts exactly one bearer token (compared in constant time)."""

    def __init__(self, token: str):
        self._token = token

    async def verify_token(self, token: str) -> AccessToken | None:
        if hmac.compare_digest(token.encode(), self._token.encode()):
            return AccessToken(token=token, client_id="agentrl", scopes=[])
        return None


def _auth_kwargs(auth_token: str | None, host: str, port: int) -> dict[str, object]:
    if not auth_token:
        return {}
    return {
        "auth": AuthSettings(issuer_url=f"http://{host}:{port}", resource_server_url=None),
        "token_verifier": _StaticTokenVerifier(auth_token),
    }


CALCULATE_DESCRIPTION = ("Evaluate an arithmetic expression and return the number: + - * / // % ** ( ), pi, e, "
                         "sqrt, abs, round, floor, ceil, log, exp, min, max, factorial. Example: (1234 * 56) / 7")
"""Every rollout's system prompt carries it (for templates without tool support): kept to one short line."""


def calculator_server(**server_kwargs: object) -> MCPServer:
    """The ``calculator`` server."""
    server = MCPServer(
        "calculator",
        instructions="Arithmetic calculator. Call `calculate` with an expression such as '(1234 * 56) / 7'.",
        log_level="WARNING",
        **server_kwargs,  # type: ignore[arg-type]
    )

    def calculate(expression: Annotated[str, Field(description="the arithmetic expression to evaluate")]) -> str:
        try:
            return format_number(evaluate(expression))
        except CalculatorError as exc:
            raise ToolError(f"Cannot evaluate {expression!r}: {exc}") from None

    server.add_tool(
        calculate,
        description=CALCULATE_DESCRIPTION,
        annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False),
        structured_output=False,
    )
    return server


def python_server(sandbox: SandboxConfig | None = None, **server_kwargs: object) -> MCPServer:
    """The ``python`` server (code runs under the limits of ``sandbox``); logs how code will be isolated, if at all."""
    config = sandbox or SandboxConfig()
    try:
        isolation = select_isolation(config)
    except SandboxUnavailable as exc:
        logger.error("python tool: every execute_code call will be refused: %s", exc)
    else:
        if isolation == "audit":
            logger.warning("python tool: this machine cannot sandbox code, and --allow_unsandboxed was given: code "
                           "runs UNSANDBOXED, with audit hooks only (the file system, other processes and native code "
                           "are not isolated)")
    server = MCPServer(
        "python",
        instructions="Runs Python code in a sandbox and returns what it prints.",
        log_level="WARNING",
        **server_kwargs,  # type: ignore[arg-type]
    )

    async def execute_code(code: Annotated[str, Field(description="the Python program to run")]) -> str:
        try:
            result = await run_python(code, config)
        except SandboxUnavailable as exc:
            raise ToolError(str(exc)) from None
        return result.text(config)

    server.add_tool(
        execute_code,
        description=(
            "Run a Python 3 program and return what it prints (stdout, then stderr). Use print() to show "
            f"results. Limits: no network, {config.timeout_s:g} s wall clock, {config.cpu_seconds} s CPU, "
            f"{config.memory_mb} MB memory, {config.max_output_chars} characters of output; every call starts "
            "fresh (no state is kept between calls)."
        ),
        annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=False, destructive_hint=False,
                                    open_world_hint=False),
        structured_output=False,
    )
    return server


BUILTIN_SERVERS: dict[str, Callable[..., MCPServer]] = {"calculator": calculator_server, "python": python_server}


def build_server(name: str, *, sandbox: SandboxConfig | None = None, **server_kwargs: object) -> MCPServer:
    """A built-in server by name (``sandbox`` applies to ``python``)."""
    if name not in BUILTIN_SERVERS:
        raise ValueError(f"unknown built-in MCP server {name!r}; available: {', '.join(BUILTIN_SERVERS)}")
    if name == "python":
        return python_server(sandbox, **server_kwargs)
    return calculator_server(**server_kwargs)


def serve(
    name: str,
    *,
    transport: ServeTransport = "stdio",
    host: str = "127.0.0.1",
    port: int = 8000,
    auth_token: str | None = None,
    sandbox: SandboxConfig | None = None,
) -> None:
    """Run a built-in server until interrupted (``http`` is streamable HTTP at ``/mcp``; ``sse`` at ``/sse``)."""
    logging.getLogger("mcp").setLevel(logging.WARNING)  # a failed call is the caller's news, not this log's
    if transport == "stdio":
        if auth_token:
            raise ValueError("a bearer token only applies to the http and sse transports")
        build_server(name, sandbox=sandbox).run("stdio")
        return
    server = build_server(name, sandbox=sandbox, **_auth_kwargs(auth_token, host, port))
    if transport == "http":
        server.run("streamable-http", host=host, port=port)
    else:
        server.run("sse", host=host, port=port)
