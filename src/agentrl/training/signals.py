"""SIGTERM and SIGINT as a request to stop at the next step boundary."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Within the block, SIGTERM/SIGINT set ``stop`` (main thread only; elsewhere signals are left as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum: int, _frame: Any) -> None:
        if not stop.is_set():
            logger.info("%s received: stopping after the current step", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
