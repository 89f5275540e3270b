"""The /mcpapi aggregator protocol: `agentrl tools aggregate` (a real HTTP server fronting a stdio calculator) and
the ToolManager's aggregator client (``--mcp_manager_url``); `agentrl tools list` on the command line."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
import pytest_asyncio
import yaml

from agentrl.tools import ToolConnectionError, ToolManager, ToolStatus
from tools_fixtures import agentrl_command, background_server, free_port, serve_command

TOKEN = "aggregator-token"


@pytest.fixture(scope="module")
def mcp_config_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    calculator = serve_command("calculator")
    path = tmp_path_factory.mktemp("mcp") / "mcp.yaml"
    path.write_text(yaml.safe_dump({"mcpServers": {"calculator": {"command": calculator[0], "args": calculator[1:]}}}))
    return str(path)


@pytest.fixture(scope="module")
def aggregator_url(mcp_config_file: str):
    port = free_port()
    command = agentrl_command("tools", "aggregate", "--mcp_config", mcp_config_file, "--port", str(port),
                              "--auth_token_env", "AGG_TOKEN")
    with background_server(command, port, env={"AGG_TOKEN": TOKEN}):
        yield f"http://127.0.0.1:{port}/mcpapi"


@pytest_asyncio.fixture(scope="module")
async def aggregated_tools(aggregator_url: str):
    async with ToolManager(manager_url=aggregator_url, auth_token=TOKEN, retry_backoff=0.1) as manager:
        yield manager


def test_the_http_protocol(aggregator_url: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=aggregator_url, headers=headers) as client:
        assert client.get("/servers").json() == {"servers": ["calculator"]}
        [tool] = client.get("/tools").json()["tools"]
        assert tool["function"]["name"] == "calculate" and tool["server"] == "calculator"
        [entry] = client.get("/server/calculator/tools").json()
        assert entry["type"] == "function" and entry["annotations"] == {"idempotentHint": True}
        assert client.post("/tool/calculator.calculate", json={"expression": "2**10"}).json() == {
            "status": "success", "content": "1024"}
        failed = client.post("/tool/calculator.calculate", json={"expression": "1/0"}).json()
        assert failed["status"] == "error" and "division by zero" in failed["content"]["error"]
        assert client.post("/tool/calculator.nope", json={}).status_code == 404
        assert client.get("/server/nope/tools").status_code == 404
    assert httpx.get(f"{aggregator_url}/servers").status_code == 401
    assert httpx.get(f"{aggregator_url}/servers", headers={"Authorization": "Bearer wrong"}).status_code == 401


async def test_tools_through_the_aggregator(aggregated_tools: ToolManager) -> None:
    [spec] = aggregated_tools.list_tools()
    assert (spec.name, spec.server, spec.idempotent) == ("calculate", "calculator", True)
    ok = await aggregated_tools.call_tool("calculate", {"expression": "12 * (3 + 4)"})
    assert (ok.status, ok.text, ok.server) == (ToolStatus.OK, "84", "calculator")
    failed = await aggregated_tools.call_tool("calculate", {"expression": "1/0"})
    assert failed.status is ToolStatus.TOOLFAILED and "division by zero" in failed.text
    invalid = await aggregated_tools.call_tool("calculate", {"expression": ["1"]})
    assert invalid.status is ToolStatus.FORMATERROR and "is not of type 'string'" in invalid.text


async def test_server_filter_and_token_errors(aggregator_url: str) -> None:
    with pytest.raises(ToolConnectionError, match="has no server.*nope.*it has: calculator"):
        async with ToolManager(manager_url=aggregator_url, server_names=["nope"], auth_token=TOKEN):
            pass
    with pytest.raises(ToolConnectionError, match="401"):
        async with ToolManager(manager_url=aggregator_url, auth_token="wrong"):
            pass


async def test_an_aggregator_that_went_away_is_toolfailed(mcp_config_file: str) -> None:
    port = free_port()
    command = agentrl_command("tools", "aggregate", "--mcp_config", mcp_config_file, "--port", str(port))
    with background_server(command, port):
        manager = ToolManager(manager_url=f"http://127.0.0.1:{port}/mcpapi", retry_backoff=0.05)
        await manager.__aenter__()
    try:
        result = await manager.call_tool("calculate", {"expression": "1+1"})
    finally:
        await manager.__aexit__(None, None, None)
    assert result.status is ToolStatus.TOOLFAILED
    assert result.attempts == 3  # never sent: retried, then reported
    assert "unreachable" in result.text


def test_agentrl_tools_list(mcp_config_file: str) -> None:
    done = subprocess.run(agentrl_command("tools", "list", "--mcp_config", mcp_config_file, "--json"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [tool] = json.loads(done.stdout)
    assert tool["function"]["name"] == "calculate"
    missing = subprocess.run(agentrl_command("tools", "list", "--mcp_config", mcp_config_file,
                                             "--mcp_server_name", "nope"),
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert "unknown MCP server(s) nope; configured: calculator" in missing.stdout + missing.stderr
