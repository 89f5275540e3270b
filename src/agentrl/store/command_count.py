"""Counting the database commands a process sends (PyMongo command monitoring), by command name.

Every ``Store`` registers one ``CommandCounter`` on its client (``Store.commands``); the sampler reports its count
per trajectory (``agentrl sample``'s last line, ``bench/rollout.py``), so a change that adds round trips to the
trajectory path shows up as a number. ``tally()`` also counts the commands of one block of code and of the asyncio
tasks it starts (a context variable: PyMongo's async client reports a command in the task that sent it), which is
how the sampler tells a trajectory's commands from its group stages' and its polling. Server-monitoring
heartbeats are not commands of the process and are not counted; cursor continuations (``getMore``) are.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from contextvars import ContextVar

from pymongo import monitoring

_TALLY: ContextVar[Counter[str] | None] = ContextVar("agentrl_command_tally", default=None)


class CommandCounter(monitoring.CommandListener):
    """Thread-safe counts of started commands by name (PyMongo calls listeners from its own threads too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        with self._lock:
            self._counts[event.command_name] += 1
        tally = _TALLY.get()
        if tally is not None:
            tally[event.command_name] += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def snapshot(self) -> Counter[str]:
        """The counts so far (a copy)."""
        with self._lock:
            return Counter(self._counts)

    @staticmethod
    @contextlib.contextmanager
    def tally() -> Iterator[Counter[str]]:
        """Count, by name, the commands sent inside the block (and by the tasks started in it, while they run)."""
        counts: Counter[str] = Counter()
        token = _TALLY.set(counts)
        try:
            yield counts
        finally:
            _TALLY.reset(token)
