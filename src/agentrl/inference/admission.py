"""An admission gate: concurrent work flows through it until someone closes it, which drains the work first.

Weight updates and memory release close the gate: requests already admitted run to completion, new requests
wait (they are never dropped) and are admitted once the gate reopens. This is how the engine guarantees that a
response was produced by exactly one set of weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class AdmissionGate:
    """Counts admitted work (``active``), work waiting at the gate (``waiting``) and, since creation, work that
    arrived while the gate was closed and had to wait (``held``)."""

    def __init__(self) -> None:
        self._condition = asyncio.Condition()
        self._closers = 0
        self.active = 0
        self.waiting = 0
        self.held = 0

    @property
    def is_closed(self) -> bool:
        return self._closers > 0

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Wait until the gate is open, then hold an admission for the duration of the block."""
        async with self._condition:
            if self._closers:
                self.held += 1
            self.waiting += 1
            try:
                await self._condition.wait_for(lambda: self._closers == 0)
            finally:
                self.waiting -= 1
            self.active += 1
        try:
            yield
        finally:
            async with self._condition:
                self.active -= 1
                self._condition.notify_all()

    async def close(self) -> None:
        """Stop admitting and wait until every admitted piece of work has finished."""
        async with self._condition:
            self._closers += 1
            try:
                await self._condition.wait_for(lambda: self.active == 0)
            except BaseException:
                self._closers -= 1
                self._condition.notify_all()
                raise

    async def open(self) -> None:
        """Undo one :meth:`close`; admissions resume when every closer has reopened."""
        async with self._condition:
            if self._closers == 0:
                raise RuntimeError("the admission gate is not closed")
            self._closers -= 1
            self._condition.notify_all()

    @asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        """Hold the gate closed (and drained) for the duration of the block."""
        await self.close()
        try:
            yield
        finally:
            await self.open()
