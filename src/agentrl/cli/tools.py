"""``agentrl tools``: run the built-in MCP servers, list tools, serve an HTTP tool aggregator.

- ``agentrl tools serve calculator|python [--transport stdio|http|sse] [--host 127.0.0.1] [--port 8000]``
  (``python``: ``[--isolation auto|bwrap|unshare] [--allow_unsandboxed]`` and limits; see ``agentrl.tools.sandbox``)
- ``agentrl tools list --mcp_config FILE | --mcp_manager_url URL [--mcp_server_name NAMES] [--json]``
- ``agentrl tools aggregate --mcp_config FILE [--host 127.0.0.1] [--port 9700]`` (clients then use
  ``--mcp_manager_url http://HOST:PORT/mcpapi``)
"""

from __future__ import annotations

import argparse
import os

_BUILTIN = ("calculator", "python")  # agentrl.tools.config.BUILTIN_SERVERS, without importing it at start-up


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tools", help="MCP tool servers: serve built-ins, list tools, aggregate")
    sub = parser.add_subparsers(dest="tools_command", metavar="ACTION", required=True)

    serve = sub.add_parser("serve", help="run a built-in MCP server (calculator, python)")
    serve.add_argument("name", choices=_BUILTIN)
    serve.add_argument("--transport", choices=("stdio", "http", "sse"), default="stdio",
                       help="stdio (default), http (streamable HTTP at /mcp) or sse (at /sse)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--auth_token_env", default=None,
                       help="environment variable holding a bearer token HTTP clients must send")
    sandbox = serve.add_argument_group("python sandbox limits")
    sandbox.add_argument("--timeout_s", type=float, default=10.0, help="wall-clock limit per run")
    sandbox.add_argument("--cpu_seconds", type=int, default=10)
    sandbox.add_argument("--memory_mb", type=int, default=1024)
    sandbox.add_argument("--max_processes", type=int, default=32, help="processes and threads at once")
    sandbox.add_argument("--max_output_chars", type=int, default=8000)
    sandbox.add_argument("--isolation", choices=("auto", "bwrap", "unshare"), default="auto",
                         help="namespace mechanism: bubblewrap, util-linux unshare, or auto (the first that works)")
    sandbox.add_argument("--allow_unsandboxed", action="store_true",
                         help="where this machine cannot isolate code, run it with audit hooks only (no file system "
                              "or process isolation) instead of refusing every call")
    serve.set_defaults(func=_serve)

    listing = sub.add_parser("list", help="connect to MCP servers / an aggregator and print their tools")
    _add_source_flags(listing)
    listing.add_argument("--json", action="store_true", help="print the tools in OpenAI function format")
    listing.set_defaults(func=_list)

    aggregate = sub.add_parser("aggregate", help="serve the MCP servers of a config over the /mcpapi HTTP protocol")
    aggregate.add_argument("--mcp_config", required=True, help="YAML/JSON file listing MCP servers")
    aggregate.add_argument("--mcp_server_name", default="all", help="'all' or comma-separated server names")
    aggregate.add_argument("--host", default="127.0.0.1")
    aggregate.add_argument("--port", type=int, default=9700)
    aggregate.add_argument("--auth_token_env", default=None,
                           help="environment variable holding a bearer token clients must send")
    aggregate.set_defaults(func=_aggregate)


def _add_source_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mcp_config", default=None, help="YAML/JSON file listing MCP servers")
    parser.add_argument("--mcp_manager_url", default=None, help="HTTP aggregator, e.g. http://host:9700/mcpapi")
    parser.add_argument("--mcp_server_name", default="all", help="'all' or comma-separated server names")
    parser.add_argument("--mcp_auth_token", default=os.environ.get("AGENTRL_MCP_AUTH_TOKEN"),
                        help="aggregator bearer token (default: $AGENTRL_MCP_AUTH_TOKEN)")


def _token_from_env(name: str | None) -> str | None:
    if name is None:
        return None
    token = os.environ.get(name)
    if not token:
        raise SystemExit(f"environment variable {name} (bearer token) is not set")
    return token


def _serve(args: argparse.Namespace) -> int:
    from agentrl.tools.sandbox import SandboxConfig
    from agentrl.tools.servers import serve

    sandbox = SandboxConfig(
        timeout_s=args.timeout_s, cpu_seconds=args.cpu_seconds, memory_mb=args.memory_mb,
        max_processes=args.max_processes, max_output_chars=args.max_output_chars, isolation=args.isolation,
        allow_unsandboxed=args.allow_unsandboxed,
    )
    serve(args.name, transport=args.transport, host=args.host, port=args.port,
          auth_token=_token_from_env(args.auth_token_env), sandbox=sandbox)
    return 0


def _list(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    from agentrl.tools import ToolError, ToolManager

    async def run() -> list:
        manager = ToolManager.from_options(
            mcp_config=args.mcp_config, mcp_manager_url=args.mcp_manager_url,
            mcp_server_name=args.mcp_server_name, mcp_auth_token=args.mcp_auth_token,
        )
        async with manager:
            return manager.list_tools()

    try:
        specs = asyncio.run(run())
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([spec.to_openai() for spec in specs], indent=2, ensure_ascii=False))
        return 0
    for spec in specs:
        retry = "retried" if spec.idempotent else "not retried"
        print(f"{spec.server}.{spec.name} ({retry}): {spec.description.splitlines()[0] if spec.description else ''}")
    return 0


def _aggregate(args: argparse.Namespace) -> int:
    import uvicorn

    from agentrl.tools import ToolManager
    from agentrl.tools.aggregator_server import PREFIX, create_app

    manager = ToolManager.from_options(mcp_config=args.mcp_config, mcp_server_name=args.mcp_server_name)
    app = create_app(manager, auth_token=_token_from_env(args.auth_token_env))
    print(f"aggregator: http://{args.host}:{args.port}{PREFIX}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
