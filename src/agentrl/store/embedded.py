"""The embedded database: an NX-27017 server (MongoDB wire protocol on SQLite) on 127.0.0.1.

``start`` launches it in its own session (it survives the command that started it), waits until it answers a
``ping`` and returns its connection string; the PID, log and SQLite files live in ``data_dir``, so data survives
a restart. ``stop`` and ``status`` find the server through its PID file. The server runs through
``agentrl.store.nx_server``, which keeps the dates that updates write as BSON dates.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agentrl.store.ping import answers_ping

DEFAULT_PORT = 27017
DEFAULT_HOST = "127.0.0.1"


def default_data_dir() -> Path:
    """``$AGENTRL_HOME/db`` (default ``~/.agentrl/db``)."""
    return Path(os.environ.get("AGENTRL_HOME", Path.home() / ".agentrl")) / "db"


class EmbeddedDatabaseError(RuntimeError):
    """The embedded server could not be started or reached."""


@dataclass(frozen=True)
class EmbeddedServer:
    """Where an embedded server lives and how to reach it."""

    data_dir: Path
    port: int = DEFAULT_PORT
    host: str = DEFAULT_HOST

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "nx-27017.pid"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "nx-27017.log"

    @property
    def port_file(self) -> Path:
        return self.data_dir / "nx-27017.port"

    def uri(self, database: str | None = None) -> str:
        return f"mongodb://{self.host}:{self.port}/{database or ''}"

    def pid(self) -> int | None:
        """PID of the running server, or ``None`` when it is not running."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        return pid

    def answers_ping(self, timeout_s: float = 1.0) -> bool:
        return answers_ping(self.uri(), timeout_s)

    def start(self, timeout_s: float = 30.0) -> str:
        """Start the server unless it already runs; return its connection string once it answers ``ping``."""
        if self.pid() is not None and self.answers_ping():
            return self.uri()
        if self.answers_ping():
            raise EmbeddedDatabaseError(
                f"port {self.port} on {self.host} is already served by another process (not the embedded "
                f"database of {self.data_dir}); pick another with --port"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "agentrl.store.nx_server",  # NX-27017 that keeps dates written by updates
            "--host", self.host, "--port", str(self.port), "--data-dir", str(self.data_dir / "data"),
            "--pid-file", str(self.pid_file), "--log-file", str(self.log_file),
        ]
        with open(self.log_file, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, cwd=self.data_dir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise EmbeddedDatabaseError(
                    f"the embedded database exited with code {process.returncode}; see {self.log_file}"
                )
            if self.answers_ping(timeout_s=0.5):
                self.port_file.write_text(str(self.port))
                return self.uri()
            time.sleep(0.1)
        process.kill()
        raise EmbeddedDatabaseError(
            f"the embedded database did not answer within {timeout_s:.0f}s; see {self.log_file}")

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the server (SIGTERM, then SIGKILL). Returns whether one was running."""
        pid = self.pid()
        if pid is None:
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.pid() is not None:
            time.sleep(0.1)
        if self.pid() is not None:
            os.kill(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        return True


def embedded_server(data_dir: str | Path | None = None, port: int | None = None) -> EmbeddedServer:
    """The embedded server for ``data_dir`` (default ``~/.agentrl/db``); the port defaults to the one it last used,
    and ``0`` picks a free one."""
    directory = Path(data_dir).expanduser().resolve() if data_dir else default_data_dir()
    if port == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    elif port is None:
        try:
            port = int((directory / "nx-27017.port").read_text().strip())
        except (OSError, ValueError):
            port = DEFAULT_PORT
    return EmbeddedServer(data_dir=directory, port=port)
