"""An event loop on a background thread, so the synchronous training loop can call the async store and clients."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs coroutines on its own event loop thread; ``run`` blocks for the result, ``submit`` does not.

    Objects bound to an event loop (the store's ``AsyncMongoClient``, HTTP clients) must be created and used
    through the same ``LoopThread``.
    """

    def __init__(self, name: str = "trainer-io"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and return its result (re-raising its exception)."""
        return self.submit(coro).result()

    def close(self) -> None:
        """Stop the loop after cancelling what still runs on it, and join the thread."""
        if not self._thread.is_alive():
            return

        async def _cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(_cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
