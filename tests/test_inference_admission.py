"""The admission gate behind weight reloads and memory release: what it holds, drains and counts.

The engine-level reload test cannot force a request to arrive inside the (millisecond) swap window of a tiny
model, so the counting that ``num_paused_requests`` reports is pinned down here, step by step.
"""

from __future__ import annotations

import asyncio

import pytest

from agentrl.inference.admission import AdmissionGate


async def test_close_drains_running_work_and_holds_new_arrivals() -> None:
    gate = AdmissionGate()
    running_may_finish = asyncio.Event()
    order: list[str] = []

    async def running() -> None:
        async with gate.admit():
            order.append("running started")
            await running_may_finish.wait()
            order.append("running finished")

    async def late() -> None:
        async with gate.admit():
            order.append("late admitted")

    first = asyncio.create_task(running())
    await asyncio.sleep(0)
    assert gate.active == 1 and gate.held == 0

    closing = asyncio.create_task(gate.close())
    await asyncio.sleep(0)
    assert gate.is_closed and not closing.done()  # waits for the running work

    second = asyncio.create_task(late())
    await asyncio.sleep(0)
    assert (gate.waiting, gate.held) == (1, 1)  # arrived while closed: counted and waiting

    running_may_finish.set()
    await closing  # drained
    assert gate.active == 0 and order == ["running started", "running finished"]
    await asyncio.sleep(0)
    assert not second.done()  # still held while the gate is closed

    await gate.open()
    await asyncio.gather(first, second)
    assert order[-1] == "late admitted" and gate.held == 1 and gate.waiting == 0


async def test_nested_closers_reopen_only_when_all_have_opened() -> None:
    gate = AdmissionGate()
    await gate.close()
    await gate.close()
    await gate.open()
    assert gate.is_closed
    await gate.open()
    assert not gate.is_closed
    with pytest.raises(RuntimeError, match="not closed"):
        await gate.open()


async def test_cancelled_close_reopens_the_gate() -> None:
    gate = AdmissionGate()
    hold = asyncio.Event()

    async def running() -> None:
        async with gate.admit():
            await hold.wait()

    task = asyncio.create_task(running())
    await asyncio.sleep(0)
    closing = asyncio.create_task(gate.close())
    await asyncio.sleep(0)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not gate.is_closed
    hold.set()
    await task
