"""MCP configuration files and flags: formats, validation messages, server selection, secrets from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.tools import MCPConfig, ToolConfigError, ToolManager, load_mcp_config, parse_server_filter


def test_servers_list_and_mcpservers_mapping(tmp_path: Path) -> None:
    path = tmp_path / "mcp.yaml"
    path.write_text(
        "servers:\n"
        "  - {name: calc, command: agentrl, args: [tools, serve, calculator], env: {A: '1'}}\n"
        "mcpServers:\n"
        "  search: {url: 'http://127.0.0.1:8000/mcp', bearer_token_env: SEARCH_TOKEN}\n"
        "  legacy: {url: 'http://127.0.0.1:8001/sse'}\n"
        "  forced: {url: 'http://127.0.0.1:8002/events', transport: sse}\n"
    )
    config = load_mcp_config(path)
    kinds = {s.name: s.transport for s in config.servers}
    assert kinds == {"calc": "stdio", "search": "streamable_http", "legacy": "sse", "forced": "sse"}
    assert config.servers[0].env == {"A": "1"}


def test_json_files_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {"calc": {"command": "agentrl", "args": ["tools", "serve", "calculator"]}}}')
    assert [s.name for s in load_mcp_config(path).servers] == ["calc"]


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ([{"name": "x"}], "give exactly one of 'command' (stdio) or 'url'"),
        ([{"name": "x", "command": "a", "url": "http://h/mcp"}], "give exactly one of"),
        ([{"name": "x", "url": "http://h/mcp", "transport": "stdio"}], "uses streamable_http or sse"),
        ([{"name": "x", "command": "a", "transport": "sse"}], "uses the stdio transport"),
        ([{"name": "x", "command": "a"}, {"name": "x", "command": "b"}], "repeated: x"),
        ([{"name": "x", "command": "a", "comand": "typo"}], "Extra inputs are not permitted"),
        ([{"name": "bad name", "command": "a"}], "should match pattern"),
    ],
)
def test_invalid_configs_say_what_is_wrong(servers: list[dict], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MCPConfig.model_validate({"servers": servers})


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ToolConfigError, match="cannot read MCP config .*missing.yaml"):
        load_mcp_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("servers: [{name: x}]")
    with pytest.raises(ToolConfigError, match="invalid MCP config .*bad.yaml"):
        load_mcp_config(bad)


def test_bearer_tokens_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = MCPConfig.model_validate({"servers": [{"name": "s", "url": "http://h/mcp", "bearer_token_env": "TKN"}]})
    monkeypatch.delenv("TKN", raising=False)
    with pytest.raises(ToolConfigError, match="environment variable TKN"):
        config.servers[0].bearer_token()
    monkeypatch.setenv("TKN", "abc")
    assert config.servers[0].bearer_token() == "abc"


def test_server_selection() -> None:
    assert parse_server_filter(None) is None and parse_server_filter("all") is None
    assert parse_server_filter("a, b") == ["a", "b"]
    config = MCPConfig.model_validate({"servers": [{"name": "a", "command": "x"}, {"name": "b", "command": "y"}]})
    assert [s.name for s in config.select(["b"]).servers] == ["b"]
    with pytest.raises(ToolConfigError, match="unknown MCP server\\(s\\) c; configured: a, b"):
        config.select(["c"])


async def test_a_manager_needs_some_tools() -> None:
    with pytest.raises(ToolConfigError, match="--mcp_config.*--mcp_manager_url"):
        ToolManager()
    manager = ToolManager(MCPConfig())
    with pytest.raises(RuntimeError, match="not open"):
        manager.list_tools()
