"""Helpers for the tool tests: the real `agentrl tools ...` commands as subprocesses, free ports, process lookup."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

PYTHON = sys.executable


def agentrl_command(*args: str) -> list[str]:
    """The `agentrl` console script, run with this interpreter."""
    return [PYTHON, "-m", "agentrl.cli.main", *args]


def serve_command(name: str, *args: str) -> list[str]:
    return agentrl_command("tools", "serve", name, *args)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s:\n{log.read_text()[-3000:]}")


@contextmanager
def background_server(command: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Start ``command`` (a server on 127.0.0.1:``port``), wait until it listens, stop it afterwards."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                   start_new_session=True)
        try:
            wait_for_port(port, process, Path(log.name))
            yield process
        finally:
            stop(process)
            Path(log.name).unlink(missing_ok=True)


def stop(process: subprocess.Popen) -> None:
    """Terminate a process we started (and its process group), killing it if it does not exit."""
    if process.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def child_pids(*needles: str) -> list[int]:
    """Direct children of this process whose command line contains every needle."""
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == me and all(needle in cmdline for needle in needles):
            found.append(int(entry.name))
    return found


EVERYTHING_PACKAGE = "@modelcontextprotocol/server-everything@2026.8.31"
"""The reference MCP server of the MCP project (npm), pinned: its ``get-tiny-image`` tool returns a PNG."""


def install_everything_server(directory: Path) -> Path | None:
    """``npm install`` the pinned server-everything into ``directory`` (once: a second call finds it); its entry
    script, or None where npm or the registry is not available (the tests that need it skip)."""
    entry = directory / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
    if entry.is_file():
        return entry
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(directory), EVERYTHING_PACKAGE],
                          capture_output=True, text=True, timeout=300)
    return entry if done.returncode == 0 and entry.is_file() else None
