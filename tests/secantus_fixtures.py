"""SecantusDB, a second MongoDB implementation (MongoDB wire protocol on WiredTiger), as a test server.

SecantusDB (PyPI ``secantusdb``, GPL-2.0) is a test-only dependency installed by ``scripts/setup_venv.sh``. It is
only ever run as a separate process (``python -m secantus``), never imported, so none of its code enters ours.
It is started with ``--enable-test-commands``, which turns on mongod's ``configureFailPoint``: tests use its
``failCommand`` failpoint to make chosen commands fail (:func:`fail_command`).

Policy: a missing package is an error, never a skip — the test command installs it, so a test that asks for
SecantusDB and cannot have it fails. ``--mongo-server=secantus`` (see ``conftest.py``) runs every test that uses
``mongo_server_uri`` against it; tests that need failpoints use ``secantus_server_uri`` directly.

Registered as a plugin by ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from agentrl.store.ping import answers_ping
from conftest import free_port

START_TIMEOUT_S = 60.0
MISSING = ("the test dependency secantusdb is not installed in this environment; run scripts/setup_venv.sh "
           "(it is pinned in requirements.txt)")


class SecantusServer:
    """A SecantusDB server process on 127.0.0.1:``port`` storing its WiredTiger files in ``data_dir``."""

    def __init__(self, data_dir: Path, port: int):
        self.data_dir = data_dir
        self.port = port
        self.log_file = data_dir / "secantusdb.log"
        self.process: subprocess.Popen | None = None

    def uri(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/"

    def start(self) -> str:
        """Start the server and return its connection string once it answers ``ping``."""
        if importlib.util.find_spec("secantus") is None:
            raise RuntimeError(MISSING)
        config = self.data_dir / "secantusd.toml"
        config.write_text("")  # an explicit, empty config: no secantusd.toml of the machine is picked up
        command = [sys.executable, "-m", "secantus", "--config", str(config), "--host", "127.0.0.1",
                   "--port", str(self.port), "--storage-path", str(self.data_dir / "data"),
                   "--enable-test-commands", "--log-level", "WARNING"]
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=self.data_dir)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"SecantusDB exited with code {self.process.returncode}: "
                                   f"{self.log_file.read_text()[-2000:]}")
            if answers_ping(self.uri(), timeout_s=0.5):
                return self.uri()
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"SecantusDB did not answer within {START_TIMEOUT_S:.0f} s; see {self.log_file}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (it closes WiredTiger cleanly), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="session")
def secantus_server_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Connection string (no database) of the session's SecantusDB server, test commands enabled."""
    server = SecantusServer(Path(tmp_path_factory.mktemp("secantusdb")), port=free_port())
    try:
        uri = server.start()
    except RuntimeError as error:
        pytest.fail(str(error), pytrace=False)
    try:
        yield uri
    finally:
        server.stop()


@contextlib.contextmanager
def fail_command(server_uri: str, commands: list[str], *, app_name: str, times: int = 1, skip: int = 0,
                 **data: Any) -> Iterator[None]:
    """Arm ``failCommand`` for ``commands`` (e.g. ``errorCode=96`` or ``closeConnection=True``), only on
    connections of clients named ``app_name`` (so the test's own checking client is never hit): the next ``times``
    matching commands after ``skip`` fail. Switched off on exit."""
    client: MongoClient = MongoClient(server_uri)
    try:
        client.admin.command("configureFailPoint", "failCommand", mode={"times": times, "skip": skip},
                             data={"failCommands": commands, "appName": app_name, **data})
        yield
    finally:
        try:
            client.admin.command("configureFailPoint", "failCommand", mode="off")
        finally:
            client.close()
