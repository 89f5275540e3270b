"""The python tool's sandbox: real subprocesses under real limits (network, CPU, memory, wall clock, output)."""

from __future__ import annotations

import asyncio
import os

import pytest

from agentrl.tools.sandbox import SandboxConfig, network_namespace_available, run_python

MODES = [
    pytest.param("namespace", marks=pytest.mark.skipif(not network_namespace_available(),
                                                        reason="network namespaces unavailable here")),
    "audit",
]


async def test_runs_code_in_a_fresh_directory_with_a_clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_TEST_SECRET", "hunter2")
    code = (
        "import os\n"
        "print(os.getcwd())\n"
        "print(sorted(os.listdir('.')))\n"
        "print('AGENTRL_TEST_SECRET' in os.environ)\n"
        "open('state.txt', 'w').write('x')\n"
    )
    first, second = await run_python(code), await run_python(code)
    assert first.exit_code == second.exit_code == 0
    first_cwd, listing, leaked = first.stdout.splitlines()
    assert first_cwd != second.stdout.splitlines()[0]  # each run has its own directory...
    assert listing == second.stdout.splitlines()[1] == "['main.py']"  # ...and sees no file of an earlier run
    assert leaked == "False"
    assert not os.path.exists(first_cwd)  # removed afterwards


@pytest.mark.parametrize("mode", MODES)
async def test_network_is_blocked(mode: str) -> None:
    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

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
        result = await run_python(code, SandboxConfig(network=mode))
    assert result.isolation == mode
    # a real listener was there; in the namespace even loopback is down, in audit mode no socket can be made
    expected = "blocked PermissionError" if mode == "audit" else "blocked OSError"
    assert result.stdout.splitlines() == [expected, expected], result.stdout + result.stderr


async def test_audit_mode_blocks_name_resolution() -> None:
    code = "import socket\ntry:\n    socket.getaddrinfo('localhost', 80)\nexcept PermissionError as e:\n    print(e)\n"
    result = await run_python(code, SandboxConfig(network="audit"))
    assert result.stdout.strip() == "network access is disabled in this sandbox"


async def test_audit_mode_also_blocks_processes_and_native_code() -> None:
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
    result = await run_python(code, SandboxConfig(network="audit"))
    assert result.stdout.splitlines() == ["refused: subprocess.Popen is disabled in this sandbox",
                                          "refused: ctypes.dlopen is disabled in this sandbox",
                                          "refused: ctypes.dlsym is disabled in this sandbox",
                                          "4"], result.stderr


async def test_cpu_limit() -> None:
    config = SandboxConfig(cpu_seconds=1, timeout_s=10)
    result = await run_python("while True:\n    pass\n", config)
    assert result.cpu_limited and not result.timed_out  # the CPU limit fired before the 10 s wall clock
    assert result.text(config) == "[killed: CPU time limit of 1 s exceeded]"


async def test_memory_limit() -> None:
    config = SandboxConfig(memory_mb=256)
    result = await run_python("block = bytearray(1024 * 1024 * 1024)\nprint('allocated')", config)
    assert result.exit_code == 1
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert "[exit code 1]" in result.text(config)


async def test_wall_clock_limit() -> None:
    config = SandboxConfig(timeout_s=1)
    result = await run_python("import time\nprint('start', flush=True)\ntime.sleep(30)", config)
    assert result.timed_out and result.elapsed_s < 15  # killed after 1 s, not after the program's 30 s (slack: load)
    assert result.text(config) == "start\n[killed: wall-clock limit of 1 s exceeded]"  # output so far is kept


async def test_output_is_truncated_and_a_flood_is_stopped() -> None:
    config = SandboxConfig(max_output_chars=500, timeout_s=10)
    flood = await run_python("while True:\n    print('x' * 99)\n", config)
    assert flood.output_limited and flood.truncated and not flood.timed_out  # stopped by the output limit
    assert len(flood.stdout) == 500
    assert flood.text(config).endswith("[output truncated to 500 characters; the program was stopped]")

    long = await run_python("print('y' * 1200)", config)
    assert long.truncated and not long.output_limited and long.exit_code == 0
    assert long.text(config) == "y" * 500 + "\n[output truncated to 500 characters]"


async def test_errors_show_only_the_programs_frames() -> None:
    result = await run_python("def f():\n    raise ValueError('boom')\nf()\n")
    assert result.exit_code == 1
    assert 'File "main.py", line 3' in result.stderr and 'File "main.py", line 2, in f' in result.stderr
    assert "runpy" not in result.stderr and "ValueError: boom" in result.stderr
    assert (await run_python("x = 1")).text(SandboxConfig()) == "(no output; use print() to show results)"
