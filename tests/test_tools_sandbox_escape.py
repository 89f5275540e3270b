"""Escape attempts against the python tool's sandbox, one per vector, each with real processes (no mocks), in each
namespace mechanism that runs here: every attempt must fail. (The audit-hook mode is not a boundary, which is why
the sandbox refuses to run without namespaces unless ``allow_unsandboxed`` is set: see test_tools_sandbox.py.)"""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agentrl.tools.sandbox import SandboxConfig, run_python
from test_tools_sandbox import MECHANISMS

pytestmark = [pytest.mark.parametrize("mechanism", MECHANISMS), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def processes_in(directory: str) -> list[int]:
    """Host pids of the processes whose working directory is ``directory`` (also once it is deleted)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:  # not a process, or gone
            continue
        if cwd == directory or cwd.startswith((directory + "/", directory + " (deleted)")):
            found.append(int(entry.name))
    return found


CONNECT = """
import socket, sys
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    print(sys.argv[1], "connected", flush=True)
except OSError as exc:
    print(sys.argv[1], "blocked", exc.errno, flush=True)
"""

SPAWN_CHILDREN = """
import _posixsubprocess, os, subprocess, sys
child = {child!r}
exe = sys.executable
exec(child.replace("sys.argv[1]", "'in-process'"))
subprocess.run([exe, "-c", child, "subprocess"])
os.waitpid(os.posix_spawn(exe, [exe, "-c", child, "posix_spawn"], os.environ), 0)
errpipe_read, errpipe_write = os.pipe()
pid = _posixsubprocess.fork_exec(  # under subprocess and its audit event; arguments as CPython 3.11 passes them
    [exe, "-c", child, "fork_exec"], [os.fsencode(exe)], True, (errpipe_write,), None, None,
    -1, -1, -1, -1, -1, -1, errpipe_read, errpipe_write, True, False, -1, None, None, None, -1, None, True)
os.waitpid(pid, 0)
if os.fork() == 0:
    exec(child.replace("sys.argv[1]", "'fork'"))
    os._exit(0)
os.wait()
"""


async def test_no_process_it_starts_reaches_a_port_of_this_machine(mechanism: str) -> None:
    """(a) subprocess, os.posix_spawn, _posixsubprocess.fork_exec, fork and the program itself: no connection."""
    accepted: list[bool] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(True)
        writer.close()

    listener = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    code = SPAWN_CHILDREN.format(child=CONNECT.format(port=port))
    async with listener:
        result = await run_python(code, SandboxConfig(isolation=mechanism, timeout_s=30))  # type: ignore[arg-type]
    reports = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()}
    assert reports == dict.fromkeys(["in-process", "subprocess", "posix_spawn", "fork_exec", "fork"], "blocked"), (
        result.stdout + result.stderr)
    assert not accepted


READ_ENVIRONS = """
import os
for pid in {pids}:
    try:
        print(pid, open(f"/proc/{{pid}}/environ", "rb").read())
    except OSError as exc:
        print(pid, type(exc).__name__)
processes = [entry for entry in os.listdir("/proc") if entry.isdigit()]
leaked = []
for pid in processes:
    try:
        if b"AGENTRL_DB_PASSWORD" in open(f"/proc/{{pid}}/environ", "rb").read():
            leaked.append(pid)
    except OSError:
        pass
print(len(processes))
print(leaked)
"""


async def test_other_processes_and_their_environment_are_invisible(mechanism: str) -> None:
    """(b) /proc/PID/environ of the test process and of a process holding a secret in its environment."""
    secret = f"db-password-{uuid.uuid4().hex}"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, "AGENTRL_DB_PASSWORD": secret})
    try:
        deadline = time.monotonic() + 10
        while secret not in Path(f"/proc/{holder.pid}/environ").read_text(errors="replace"):  # until it has exec'd
            assert time.monotonic() < deadline, "the process holding the secret did not start"
            time.sleep(0.01)
        code = READ_ENVIRONS.format(pids=(holder.pid, os.getpid()))
        result = await run_python(code, SandboxConfig(isolation=mechanism))  # type: ignore[arg-type]
    finally:
        holder.kill()
        holder.wait()
    holder_line, test_line, count, leaked = result.stdout.splitlines()
    assert holder_line == f"{holder.pid} FileNotFoundError" and test_line == f"{os.getpid()} FileNotFoundError"
    assert int(count) <= 4 and leaked == "[]"  # only the sandbox's own few processes are there
    assert secret not in result.stdout + result.stderr


async def test_files_outside_cannot_be_read_or_written(mechanism: str, tmp_path: Path) -> None:
    """(c) a task's answer file, the repository, host directories; and writing outside the working directory."""
    answer = tmp_path / "answer.txt"
    answer.write_text("the answer is 42")
    readme = REPO / "README.md"
    assert readme.is_file()
    targets = [answer, readme, REPO / "src" / "agentrl" / "tools" / "sandbox.py", Path("/etc/passwd"),
               Path.home() / ".bashrc"]
    written = [tmp_path / "written.txt", REPO / "escape-marker.txt", Path("/usr/escape-marker.txt")]
    code = (
        "import os\n"
        f"for path in {[str(p) for p in targets]!r}:\n"
        "    try:\n"
        "        print('read', open(path).read()[:40])\n"
        "    except OSError as exc:\n"
        "        print('denied', type(exc).__name__)\n"
        f"for path in {[str(p) for p in written]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('escaped')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print('denied', type(exc).__name__)\n"
        f"print(sorted(os.listdir({str(REPO)!r})) if os.path.isdir({str(REPO)!r}) else 'no repository')\n"
        "print(sorted(os.listdir('/')))\n"
    )
    result = await run_python(code, SandboxConfig(isolation=mechanism))  # type: ignore[arg-type]
    lines = result.stdout.splitlines()
    assert all(line.startswith("denied") for line in lines[: len(targets) + len(written)]), result.stdout
    assert not any(path.exists() for path in written)
    assert "42" not in result.stdout
    repository_view, root = lines[-2:]
    # the virtual environment may live in the repository: then it, read-only, is all that is there
    assert repository_view in ("no repository", "['.venv']"), repository_view
    assert not {"home", "srv", "var", "mnt", "opt", "boot"} & set(ast.literal_eval(root))


async def test_a_fork_bomb_is_contained_and_killed(mechanism: str) -> None:
    """(d) children fork without end: the process limit holds, the wall clock ends the run, nothing is left."""
    code = (
        "import os, time\n"
        "print(os.getcwd(), flush=True)\n"
        "refused, start = 0, time.monotonic()\n"
        "while time.monotonic() - start < 1:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            while True:\n"
        "                try:\n"
        "                    os.fork()\n"
        "                except OSError:\n"
        "                    pass\n"
        "    except OSError:\n"
        "        refused += 1\n"
        "print(len([e for e in os.listdir('/proc') if e.isdigit()]), refused > 0, flush=True)\n"
        "while True:\n"
        "    pass\n"
    )
    config = SandboxConfig(isolation=mechanism, max_processes=8, timeout_s=3)  # type: ignore[arg-type]
    started = time.monotonic()
    result = await run_python(code, config)
    workdir, census = result.stdout.splitlines()
    processes, refused = census.split()
    assert int(processes) <= config.max_processes + 2 and refused == "True"  # + the supervisor and bwrap's init
    assert result.timed_out and time.monotonic() - started < config.timeout_s + 10  # slack for a loaded machine
    assert processes_in(workdir) == []


@pytest.mark.parametrize("ending", ["exits", "times out"])
async def test_a_setsid_double_forked_child_dies_with_the_run(mechanism: str, ending: str) -> None:
    """(e) a grandchild in its own session keeps running; the run must not wait for it, nor leave it behind."""
    code = (
        "import os, time\n"
        "print(os.getcwd(), flush=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        print('grandchild running', flush=True)\n"
        "        while True:\n"
        "            time.sleep(0.05)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "time.sleep(0.5)\n"
        + ("time.sleep(60)\n" if ending == "times out" else "print('parent done')\n")
    )
    config = SandboxConfig(isolation=mechanism, timeout_s=3)  # type: ignore[arg-type]
    result = await run_python(code, config)
    workdir, *rest = result.stdout.splitlines()
    assert "grandchild running" in rest, result.stdout + result.stderr
    if ending == "exits":
        assert rest[-1] == "parent done" and result.exit_code == 0 and not result.timed_out  # not held up by it
    else:
        assert result.timed_out
    assert processes_in(workdir) == []
