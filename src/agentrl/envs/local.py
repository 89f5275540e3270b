"""A local environment server in a child process: ``agentrl envs serve NAME`` on a free loopback port.

The child is started in its own session (so a terminal's Ctrl-C reaches only the parent, which stops it, and
:meth:`EnvServerProcess.stop` can signal everything the server started, e.g. ScienceWorld's JVMs). It holds the
read end of a pipe whose write end only this process has: when this process exits — cleanly, by an exception or
by SIGKILL — the kernel closes the write end, the child reads end of file and shuts down. (``PR_SET_PDEATHSIG``
would not do: it fires when the *thread* that started the child ends, and the pool starts servers from worker
threads.) The child's stdout is read by a daemon thread, which finds the ready line with the bound port and
copies all its output (stdout and stderr) to this process's stderr.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

from agentrl.envs.base import EnvError
from agentrl.envs.server import PARENT_FD_ENV, READY_LINE

_READY = re.compile(re.escape(READY_LINE).replace(r"\{name\}", r"\S+").replace(r"\{url\}", r"(?P<url>http\S+)"))


class EnvServerProcess:
    """``agentrl envs serve`` as a child process (see the module docstring); use :meth:`start` and :meth:`stop`,
    or ``with``."""

    def __init__(self, name: str, *, host: str = "127.0.0.1", port: int = 0, instance_ttl_s: float | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 120.0, images: bool = False):
        self.name, self.host, self.port = name, host, port
        self.images = images
        self.instance_ttl_s = instance_ttl_s
        self.env = env or {}
        self.startup_timeout_s = startup_timeout_s
        self.url: str | None = None
        self.process: subprocess.Popen | None = None
        self._watch_fd: int | None = None
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._output: list[str] = []

    def __enter__(self) -> EnvServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        """Start the server and return its URL once ``GET /`` answers; ``EnvError`` (with its output) if it does
        not within ``startup_timeout_s``."""
        command = [sys.executable, "-m", "agentrl.cli.main", "envs", "serve", self.name,
                   "--host", self.host, "--port", str(self.port)]
        if self.instance_ttl_s is not None:
            command += ["--instance_ttl_s", str(self.instance_ttl_s)]
        if self.images:
            command.append("--images")
        read_fd, self._watch_fd = os.pipe()
        try:
            self.process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                bufsize=1, start_new_session=True, pass_fds=(read_fd,),
                env={**os.environ, **self.env, PARENT_FD_ENV: str(read_fd)})
        finally:
            os.close(read_fd)
        self._reader = threading.Thread(target=self._read_output, daemon=True, name=f"envs-{self.name}-output")
        self._reader.start()
        try:
            self.url = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (closing its pipe and SIGTERM, then SIGKILL) and whatever it started. Idempotent."""
        if self._watch_fd is not None:
            os.close(self._watch_fd)
            self._watch_fd = None
        process = self.process
        if process is None or process.returncode is not None:
            return
        # signal the group only while the server is unreaped: its pid (the group's id) cannot be reused until then
        _signal_group(process.pid, signal.SIGTERM)
        if not _exited(process.pid, timeout_s):
            _signal_group(process.pid, signal.SIGKILL)
            _exited(process.pid, timeout_s)
        _signal_group(process.pid, signal.SIGKILL)  # anything the server started that outlived it
        process.wait()

    def _read_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            match = _READY.search(line)
            if match and not self._ready.is_set():
                self.url = match["url"]
                self._ready.set()
            self._output.append(line)
            del self._output[:-50]
            sys.stderr.write(line)

    def _wait_ready(self) -> str:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._ready.wait(0.05):
            if _exited(self.process.pid, 0):
                raise EnvError(self._failed("exited"))
            if time.monotonic() > deadline:
                raise EnvError(self._failed(f"printed no ready line within {self.startup_timeout_s:g}s"))
        url = self.url
        assert url is not None
        with httpx.Client(timeout=5.0) as http:
            while True:
                try:
                    if http.get(url + "/").status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
                if _exited(self.process.pid, 0) or time.monotonic() > deadline:
                    raise EnvError(self._failed(f"did not answer GET / at {url}"))
                time.sleep(0.05)

    def _failed(self, what: str) -> str:
        if self._reader is not None and self.process is not None and _exited(self.process.pid, 0):
            self._reader.join(2.0)  # its last lines (the error) may still be in the pipe
        output = "".join(self._output[-20:]).strip()
        return (f"the {self.name} environment server (agentrl envs serve {self.name}) {what}"
                + (f"; its output:\n{output}" if output else " without output"))


def start_local_server(name: str, port: int = 0, **options: object) -> tuple[str, Callable[[], None]]:
    """Start ``agentrl envs serve NAME`` on 127.0.0.1 (``port`` 0: a free one); returns ``(url, stop)``.
    ``options`` are :class:`EnvServerProcess`'s (``instance_ttl_s``, ``env``, ``startup_timeout_s``)."""
    server = EnvServerProcess(name, port=port, **options)  # type: ignore[arg-type]
    return server.start(), server.stop


def _exited(pid: int, timeout_s: float) -> bool:
    """Whether child ``pid`` has exited (waiting up to ``timeout_s``), without reaping it."""
    deadline = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
