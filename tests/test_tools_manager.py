"""ToolManager against real MCP servers: the built-in servers as subprocesses over stdio, streamable HTTP (with a
bearer token) and SSE, killed servers, schema violations, timeouts."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import pytest_asyncio

from agentrl.tools import MCPConfig, ToolConnectionError, ToolManager, ToolStatus
from tools_fixtures import PYTHON, background_server, child_pids, free_port, serve_command

pytestmark = pytest.mark.slow


def stdio_server(name: str, server: str, *args: str) -> dict:
    command = serve_command(server, *args)
    return {"name": name, "command": command[0], "args": command[1:]}


@pytest_asyncio.fixture(scope="module")
async def stdio_tools():
    config = MCPConfig.model_validate({"servers": [
        stdio_server("calc", "calculator"),
        stdio_server("py", "python", "--timeout_s", "5", "--cpu_seconds", "5"),
    ]})
    async with ToolManager(config) as manager:
        yield manager


async def test_lists_tools_in_openai_format(stdio_tools: ToolManager) -> None:
    specs = {spec.name: spec for spec in stdio_tools.list_tools()}
    assert set(specs) == {"calculate", "execute_code"}
    assert (specs["calculate"].server, specs["calculate"].idempotent) == ("calc", True)
    assert (specs["execute_code"].server, specs["execute_code"].idempotent) == ("py", False)
    openai_tools = {tool["function"]["name"]: tool for tool in stdio_tools.openai_tools()}
    calculate = openai_tools["calculate"]
    assert calculate["type"] == "function"
    assert calculate["function"]["parameters"]["required"] == ["expression"]
    assert "sqrt" in calculate["function"]["description"]


async def test_calls_the_calculator_over_stdio(stdio_tools: ToolManager) -> None:
    result = await stdio_tools.call_tool("calculate", {"expression": "(1234 * 56) / 7"})
    assert (result.status, result.text, result.server, result.attempts) == (ToolStatus.OK, "9872", "calc", 1)
    assert result.ok and result.error is None and result.elapsed_s > 0


async def test_unknown_tool_is_a_format_error(stdio_tools: ToolManager) -> None:
    result = await stdio_tools.call_tool("calculator", {"expression": "1"})
    assert result.status is ToolStatus.FORMATERROR
    assert "Unknown tool 'calculator'" in result.text and "calculate" in result.text


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "'expression' is a required property"),
        ({"expression": 5}, "5 is not of type 'string'"),
        ({"expr": "1+1"}, "'expression' is a required property"),
        ("1+1", "must be a JSON object"),
    ],
)
async def test_schema_violations_are_format_errors(stdio_tools: ToolManager, arguments: object, message: str) -> None:
    result = await stdio_tools.call_tool("calculate", arguments)
    assert result.status is ToolStatus.FORMATERROR
    assert message in result.text
    assert result.attempts == 0  # refused before anything was sent


async def test_a_tool_error_is_toolfailed(stdio_tools: ToolManager) -> None:
    result = await stdio_tools.call_tool("calculate", {"expression": "1/0"})
    assert result.status is ToolStatus.TOOLFAILED
    assert "division by zero" in result.text
    assert result.attempts == 1  # the tool answered: nothing to retry


async def test_runs_python_and_reuses_one_server_for_concurrent_calls(stdio_tools: ToolManager) -> None:
    servers_before = set(child_pids("tools serve python"))
    results = await asyncio.gather(
        *(stdio_tools.call_tool("execute_code", {"code": f"print({i} ** 2)"}) for i in range(6))
    )
    assert all(r.status is ToolStatus.OK for r in results)
    assert [int(r.text) for r in results] == [i**2 for i in range(6)]
    # every run went to the one python server (the sandbox's PID namespace hides its pid from the code)
    assert set(child_pids("tools serve python")) == servers_before and len(servers_before) == 1


async def test_a_timeout_is_toolfailed_and_not_retried_for_python(stdio_tools: ToolManager) -> None:
    result = await stdio_tools.call_tool("execute_code", {"code": "import time\ntime.sleep(4)"}, timeout=1)
    assert result.status is ToolStatus.TOOLFAILED
    assert "timed out after 1 s" in result.text
    assert result.attempts == 1
    after = await stdio_tools.call_tool("execute_code", {"code": "print('still alive')"})
    assert after.text == "still alive"


async def test_killed_stdio_servers_give_toolfailed_and_are_restarted() -> None:
    def new_pids(kind: str) -> set[int]:
        return set(child_pids(f"tools serve {kind}")) - existing[kind]

    existing = {kind: set(child_pids(f"tools serve {kind}")) for kind in ("python", "calculator")}
    config = MCPConfig.model_validate({"servers": [stdio_server("calc", "calculator"), stdio_server("py", "python")]})
    async with ToolManager(config, retry_backoff=0.1) as manager:
        [python_pid], [calculator_pid] = new_pids("python"), new_pids("calculator")
        os.kill(python_pid, signal.SIGKILL)
        os.kill(calculator_pid, signal.SIGKILL)
        await asyncio.sleep(0.2)

        # python is not idempotent: the failed call is reported, not repeated
        failed = await manager.call_tool("execute_code", {"code": "print(1)"})
        assert failed.status is ToolStatus.TOOLFAILED
        assert "'py'" in failed.text and failed.attempts == 1
        # the next call starts a fresh server
        again = await manager.call_tool("execute_code", {"code": "print(2)"})
        assert (again.status, again.text) == (ToolStatus.OK, "2")
        assert len(new_pids("python") - {python_pid}) == 1

        # the calculator is idempotent: the call is retried on a restarted server and succeeds
        retried = await manager.call_tool("calculate", {"expression": "6*7"})
        assert (retried.status, retried.text, retried.attempts) == (ToolStatus.OK, "42", 2)
        assert len(new_pids("calculator") - {calculator_pid}) == 1
    assert new_pids("python") == new_pids("calculator") == set()  # closing the manager stopped its servers


async def test_a_server_that_cannot_start_is_reported_by_name() -> None:
    config = MCPConfig.model_validate({"servers": [
        {"name": "broken", "command": PYTHON, "args": ["-c", "import sys; sys.exit(3)"]},
    ]})
    with pytest.raises(ToolConnectionError, match="MCP server 'broken'"):
        async with ToolManager(config, connect_timeout=20):
            pass


# ------------------------------------------------------------------------------------------ HTTP and SSE servers


@pytest.fixture(scope="module")
def http_servers():
    token = "test-token-123"
    http_port, sse_port = free_port(), free_port()
    http = serve_command("python", "--transport", "http", "--port", str(http_port),
                         "--auth_token_env", "TEST_MCP_TOKEN")
    sse = serve_command("calculator", "--transport", "sse", "--port", str(sse_port))
    with background_server(http, http_port, env={"TEST_MCP_TOKEN": token}), background_server(sse, sse_port):
        yield {"http": f"http://127.0.0.1:{http_port}/mcp", "sse": f"http://127.0.0.1:{sse_port}/sse",
               "sse_port": sse_port, "token": token}


async def test_streamable_http_with_a_bearer_token(http_servers: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PY_TOKEN", http_servers["token"])
    config = MCPConfig.model_validate({"servers": [{"name": "py", "url": http_servers["http"],
                                                     "bearer_token_env": "PY_TOKEN"}]})
    async with ToolManager(config) as manager:
        assert manager.get_tool("execute_code").server == "py"
        result = await manager.call_tool("execute_code", {"code": "print(sum(range(10)))"})
        assert (result.status, result.text) == (ToolStatus.OK, "45")


async def test_a_wrong_bearer_token_is_refused(http_servers: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PY_TOKEN", "wrong")
    config = MCPConfig.model_validate({"servers": [{"name": "py", "url": http_servers["http"],
                                                     "bearer_token_env": "PY_TOKEN"}]})
    with pytest.raises(ToolConnectionError, match="cannot connect to MCP server 'py'"):
        async with ToolManager(config, connect_timeout=20):
            pass


async def test_sse_transport(http_servers: dict) -> None:
    config = MCPConfig.model_validate({"servers": [{"name": "calc", "url": http_servers["sse"]}]})
    assert config.servers[0].transport == "sse"
    async with ToolManager(config) as manager:
        result = await manager.call_tool("calculate", {"expression": "3^3 + sqrt(16)"})
        assert (result.status, result.text) == (ToolStatus.OK, "31")


async def test_an_http_server_that_dies_and_comes_back() -> None:
    port = free_port()
    config = MCPConfig.model_validate({"servers": [{"name": "calc", "url": f"http://127.0.0.1:{port}/mcp",
                                                     "max_retries": 1}]})
    command = serve_command("calculator", "--transport", "http", "--port", str(port))
    with background_server(command, port):
        manager = ToolManager(config, retry_backoff=0.1)
        await manager.__aenter__()
    try:
        down = await manager.call_tool("calculate", {"expression": "1+1"})
        assert down.status is ToolStatus.TOOLFAILED
        assert down.attempts == 2  # idempotent: retried once, then reported
        with background_server(command, port):
            await asyncio.sleep(1.1)  # past the reconnect back-off
            back = await manager.call_tool("calculate", {"expression": "1+1"})
            assert (back.status, back.text) == (ToolStatus.OK, "2")
    finally:
        await manager.__aexit__(None, None, None)


ENVIRONMENT_SERVER = '''
import os

from mcp.server.mcpserver import MCPServer

server = MCPServer("environment", log_level="WARNING")


def variable(name: str) -> str:
    return os.environ.get(name, "<unset>")


server.add_tool(variable, description="the value of an environment variable", structured_output=False)
server.run("stdio")
'''


async def test_stdio_servers_get_pythonpath_but_not_the_clients_other_variables(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server module found only through the client's PYTHONPATH starts (a checkout used without installing it:
    the GPU check runs so); the client's other variables stay out, the config's env comes in."""
    (tmp_path / "environment_server.py").write_text(ENVIRONMENT_SERVER)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("AGENTRL_TEST_SECRET", "do-not-leak")
    config = MCPConfig.model_validate({"servers": [
        {"name": "env", "command": PYTHON, "args": ["-m", "environment_server"], "env": {"GIVEN": "yes"}}]})
    async with ToolManager(config, connect_timeout=30) as manager:
        found = {name: (await manager.call_tool("variable", {"name": name})).text
                 for name in ("AGENTRL_TEST_SECRET", "GIVEN", "PYTHONPATH")}
    assert found["AGENTRL_TEST_SECRET"] == "<unset>" and found["GIVEN"] == "yes"
    assert found["PYTHONPATH"].startswith(str(tmp_path))
