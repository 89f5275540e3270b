"""Run ``agentrl engine`` as a subprocess: start it, wait until it serves, stop it by its PID.

Used by tests, benchmarks and scripts that need a real engine. The engine prints ``agentrl engine ready at URL``
once it listens; with ``--port 0`` it picks a free port, so there is no port race.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

READY = re.compile(r"agentrl engine ready at (http://\S+)")


class EngineStartError(RuntimeError):
    """The engine exited or stayed silent instead of announcing that it serves."""


class EngineProcess:
    """A running ``agentrl engine``; ``url`` is where it listens and ``output`` what it printed so far.

    ``model_dir`` ``None`` serves the embedded model; ``args`` are extra ``agentrl engine`` flags (``--port 0``
    is set here).
    """

    def __init__(self, model_dir: Path | str | None, *args: str, startup_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None):
        model = ["--model_name_or_path", str(model_dir)] if model_dir is not None else []
        command = [sys.executable, "-m", "agentrl.cli.main", "engine", *model, "--port", "0", *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.url = ""
        self._announced = threading.Event()
        self._reader = threading.Thread(target=self._read, name="engine-output", daemon=True)
        self._reader.start()
        if not self._announced.wait(startup_timeout_s) or not self.url:
            self.stop()
            raise EngineStartError(f"agentrl engine did not start (exit status {self.process.returncode}):\n"
                                   f"{self.output}")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            match = READY.search(line)
            if match and not self.url:
                self.url = match.group(1)
                self._announced.set()
        self._announced.set()  # the process ended

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send ``sig`` to the engine (by PID), wait for it, kill it if it does not exit; return its status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._reader.join(5)
        return self.process.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
