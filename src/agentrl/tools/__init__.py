"""Tools through MCP: one ``ToolManager`` per process over MCP servers and/or an HTTP aggregator.

Typical use in an agent loop::

    async with ToolManager.from_options(mcp_config="mcp.yaml") as tools:
        prompt_tools = tools.openai_tools()             # for the chat template
        result = await tools.call_tool("calculate", {"expression": "12 * 7"})
        result.status                                   # ok | formaterror | toolfailed

Built-in servers (``agentrl tools serve calculator|python``) live in ``agentrl.tools.servers``.
"""

from agentrl.tools.config import MCPConfig, MCPServerConfig, load_mcp_config, parse_server_filter
from agentrl.tools.errors import (
    ToolConfigError,
    ToolConnectionError,
    ToolError,
    ToolFailedError,
    ToolFormatError,
)
from agentrl.tools.manager import ToolManager
from agentrl.tools.types import ToolResult, ToolSpec, ToolStatus

__all__ = [
    "MCPConfig",
    "MCPServerConfig",
    "ToolConfigError",
    "ToolConnectionError",
    "ToolError",
    "ToolFailedError",
    "ToolFormatError",
    "ToolManager",
    "ToolResult",
    "ToolSpec",
    "ToolStatus",
    "load_mcp_config",
    "parse_server_filter",
]
