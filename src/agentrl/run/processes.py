"""The processes `agentrl run` starts: each tracked by PID from the moment it exists, and all stopped by PID when the
run ends, fails or is interrupted.

Every child runs in a process group of its own (its PID), with no terminal input: a Ctrl-C at the terminal reaches
the driver alone, which then stops the children in the reverse order of their start — SIGTERM, and SIGKILL after
``grace_s`` — so that, e.g., the samplers give their slots back before the engine goes away. A child's group is
swept afterwards: whatever it started and left behind in its group (an engine of an `agentrl eval` that died) is
stopped too. SIGINT, SIGTERM and SIGHUP to the driver raise :class:`Stopped` (never while a child is being started
and recorded); a second one during the stop skips the grace periods.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
logger = logging.getLogger(__name__)


class Stopped(BaseException):
    """The driver received a stop signal; it exits with ``128 + signum`` once its children are stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunFailed(Exception):
    """A stage of the run failed; the message says which and where its log is."""


@dataclass
class Child:
    """A started process and the file its output goes to (``None``: the terminal)."""

    name: str
    process: subprocess.Popen
    log: Path | None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def status(self) -> int | None:
        """Its exit status, ``None`` while it runs."""
        return self.process.poll()

    def tail(self, lines: int) -> str:
        """The last ``lines`` lines of its log."""
        if self.log is None or not self.log.exists():
            return ""
        return "".join(self.log.read_text(encoding="utf-8", errors="replace").splitlines(True)[-lines:])


def say(message: str) -> None:
    """A progress line of the run: ``[HH:MM:SS] message`` with a bold time stamp (lost, not an error, when the
    terminal is gone: the run still stops what it started after a SIGHUP)."""
    with suppress(OSError):
        print(f"\033[1m[{time.strftime('%H:%M:%S')}]\033[0m {message}", flush=True)


class Processes:
    """Starts, waits for and stops the run's processes; use as a context manager around the whole run."""

    def __init__(self, log_dir: Path, grace_s: float = 30.0):
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.children: list[Child] = []
        self._starting = False
        self._pending: int | None = None
        self._stopping = False
        self._hurry = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Processes:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping = True
        try:
            self.stop_all()
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._stopping:
            self._hurry = True
        elif self._starting:
            self._pending = self._pending or signum
        else:
            raise Stopped(signum)

    @contextmanager
    def _recording(self) -> Iterator[None]:
        """No :class:`Stopped` between the start of a process and its record (it would escape the stop)."""
        self._starting = True
        try:
            yield
        finally:
            self._starting = False
        if self._pending is not None:
            raise Stopped(self._pending)

    def start(self, name: str, command: Sequence[str], log: Path | None | bool = True, append: bool = False,
              pipe: bool = False) -> Child:
        """Start ``command`` in the background: its output (stdout and stderr) to ``log_dir/NAME.log``
        (``log=True``), to the file ``log`` or to a pipe (``pipe``); or its stdout and stderr to the driver's
        (``log=None``)."""
        path = self.log_dir / f"{name}.log" if log is True else log or None
        output: IO | int | None = subprocess.PIPE if pipe else None
        with self._recording():
            handle = open(path, "ab" if append else "wb") if path is not None and not pipe else None  # noqa: SIM115
            try:
                process = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=handle or output,
                                           stderr=subprocess.STDOUT if handle or pipe else None, process_group=0)
            finally:
                if handle is not None:
                    handle.close()
            child = Child(name, process, path)
            self.children.append(child)
        logger.debug("%s (pid %d): %s", name, process.pid, shlex.join(command))
        return child

    def call(self, name: str, command: Sequence[str], log: Path | None | bool = None, append: bool = False) -> Child:
        """Run ``command`` until it exits (output as for :meth:`start`; default: the terminal)."""
        child = self.start(name, command, log, append)
        self.wait(child)
        return child

    def call_showing(self, name: str, command: Sequence[str]) -> Child:
        """Run ``command`` until it exits, its output on the terminal and in ``log_dir/NAME.log``."""
        child = self.start(name, command, pipe=True)
        child.log = self.log_dir / f"{name}.log"
        assert child.process.stdout is not None
        with open(child.log, "wb") as log:
            while chunk := os.read(child.process.stdout.fileno(), 65536):
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                log.write(chunk)
        child.process.stdout.close()
        self.wait(child)
        return child

    def wait(self, child: Child) -> int:
        """Wait for ``child`` to exit, stop what it left in its group, and return its exit status."""
        status = child.process.wait()
        self._sweep(child, self.grace_s)
        return status

    def wait_until_ready(self, child: Child, pattern: str, timeout_s: float) -> re.Match[str]:
        """Wait until ``child`` prints ``pattern`` in its log; :class:`RunFailed` with its last lines if it dies
        first or stays silent past ``timeout_s``."""
        assert child.log is not None
        deadline = time.monotonic() + timeout_s
        while True:
            text = child.log.read_text(encoding="utf-8", errors="replace") if child.log.exists() else ""
            if match := re.search(pattern, text):
                return match
            if child.process.poll() is not None:
                print(child.tail(30), end="", flush=True)
                raise RunFailed(f"{child.name} failed to start")
            if time.monotonic() > deadline:
                raise RunFailed(f"{child.name} did not start within {timeout_s:g} s")
            time.sleep(0.5)

    def stop(self, child: Child) -> None:
        """Stop ``child`` if it still runs (SIGTERM, SIGKILL after the grace period), then sweep its group."""
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
            self._wait_for(child.process, self.grace_s)
            if child.process.poll() is None:
                say(f"{child.name} (pid {child.pid}) did not stop within {self.grace_s:g} s; killing it")
                child.process.kill()
            child.process.wait()
            self._sweep(child, 5.0)

    def stop_all(self) -> None:
        """Stop every child still running, the last started first, then sweep their process groups."""
        self._stopping = True
        for child in reversed(self.children):
            self.stop(child)

    def _wait_for(self, process: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while process.poll() is None and time.monotonic() < deadline and not self._hurry:
            time.sleep(0.1)

    def _sweep(self, child: Child, timeout_s: float) -> None:
        """Stop the processes left in ``child``'s process group (SIGTERM, then SIGKILL after ``timeout_s``)."""
        group = child.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                return
            deadline = time.monotonic() + timeout_s
            while sig == signal.SIGTERM and time.monotonic() < deadline and not self._hurry:
                time.sleep(0.1)
                try:
                    os.killpg(group, 0)
                except (ProcessLookupError, PermissionError):
                    return
