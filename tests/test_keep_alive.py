"""``KeepAlive``: a lease's heartbeats stop for good when asked, even when the cancellation is lost on the way.

The heartbeat here is a function, not a database command: what is under test is the loop around it. The lost
cancellation is the real one (Python 3.11's ``asyncio.wait_for`` returns its inner result when cancelled just as that
completes, which pymongo's socket writes do); on later Pythons the same test checks the plain path.
"""

from __future__ import annotations

import asyncio

from agentrl.rollout.keep_alive import KeepAlive
from agentrl.store import LeaseLost

LEASE_S = 0.3  # a heartbeat every 0.1 s


async def test_stop_ends_the_heartbeats_when_the_cancellation_is_swallowed() -> None:
    loop = asyncio.get_running_loop()
    beats: list[asyncio.Future] = []
    sent = asyncio.Event()

    async def beat() -> None:
        reply = loop.create_future()
        beats.append(reply)
        sent.set()
        await asyncio.wait_for(reply, 10)

    work = asyncio.create_task(asyncio.sleep(60))
    keeper = KeepAlive(beat, work, "a test lease", LEASE_S)
    await asyncio.wait_for(sent.wait(), 5)
    beats[-1].set_result(None)  # the reply arrives, then the stop: the cancellation meets a completed write
    await asyncio.wait_for(keeper.stop(), 5)
    count = len(beats)
    await asyncio.sleep(LEASE_S * 2)
    assert len(beats) == count, "a heartbeat was sent after stop() returned"
    assert not work.done()
    work.cancel()


async def test_a_lost_lease_cancels_the_work() -> None:
    async def beat() -> None:
        raise LeaseLost("taken over")

    work = asyncio.create_task(asyncio.sleep(60))
    KeepAlive(beat, work, "a test lease", LEASE_S)
    await asyncio.wait([work], timeout=5)
    assert work.cancelled()


async def test_a_lease_found_gone_after_stop_leaves_the_work_alone() -> None:
    """A heartbeat in flight when the work gave its lease up finds it gone: no take-over, so the work goes on."""
    loop = asyncio.get_running_loop()
    replies: list[asyncio.Future] = []

    async def beat() -> None:
        reply = loop.create_future()
        replies.append(reply)
        await asyncio.wait_for(reply, 10)
        raise LeaseLost("given up by its holder")

    work = asyncio.create_task(asyncio.sleep(60))
    keeper = KeepAlive(beat, work, "a test lease", LEASE_S)
    while not replies:
        await asyncio.sleep(0.01)
    replies[-1].set_result(None)
    keeper.cancel()
    await asyncio.sleep(LEASE_S)
    assert not work.done()
    work.cancel()
