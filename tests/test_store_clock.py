"""The database server's clock (``agentrl.store.clock``) against a real server that is stopped and restarted: a
measurement that waited out an outage is not trusted, a reconnect measures again, and so does time.

Every test runs on one machine, where the true offset is zero; a skewed machine is simulated in the test's
process with ``time_machine`` (it shifts the wall clock, not ``time.monotonic``, which asyncio and the round-trip
timing use)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import time_machine

from agentrl.store import Store
from agentrl.store import clock as clock_module
from agentrl.store.embedded import EmbeddedServer
from conftest import free_port, with_database

OUTAGE_S = 4.0
SKEW_S = 120.0
FAST_HEARTBEATS = {"heartbeatFrequencyMS": 500}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A database server of the test's own, to stop and restart on the same port with the same data."""
    server = EmbeddedServer(data_dir=tmp_path / "db", port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def eventually_offset(store: Store, expected_s: float, timeout_s: float = 30.0) -> float:
    """Call ``now()`` (which starts due measurements) until the offset is within 1 s of ``expected_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        store.clock.now()
        offset = store.clock.offset.total_seconds()
        if abs(offset - expected_s) < 1.0 or asyncio.get_running_loop().time() > deadline:
            return offset
        await asyncio.sleep(0.2)


async def test_a_store_opened_during_an_outage_measures_only_short_round_trips(
        server: EmbeddedServer, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the offset was the midpoint of the one hello, which waited out the outage: off by half of it (2 s).
    server.stop()
    store = Store(with_database(server.uri(), "clock"), connect_timeout_s=60)
    opening = asyncio.create_task(store.connect())
    await asyncio.sleep(OUTAGE_S)
    assert not opening.done()
    await asyncio.to_thread(server.start)
    try:
        with caplog.at_level(logging.WARNING, logger="agentrl.store.clock"):
            await asyncio.wait_for(opening, 60)
        assert abs(store.clock.offset.total_seconds()) < 0.5, store.clock.offset
        assert store.clock.round_trip_s is not None and store.clock.round_trip_s <= clock_module.MAX_ROUND_TRIP_S
        assert "clock is" not in caplog.text
    finally:
        await store.close()


async def test_a_measurement_cut_off_by_an_outage_waits_for_short_round_trips(server: EmbeddedServer) -> None:
    async with Store(with_database(server.uri(), "clock")) as store:
        server.stop()
        measuring = asyncio.create_task(store.clock.sync())
        await asyncio.sleep(OUTAGE_S)
        assert not measuring.done()
        await asyncio.to_thread(server.start)
        offset = await asyncio.wait_for(measuring, 60)
        assert abs(offset.total_seconds()) < 0.5, offset


async def test_a_reconnect_measures_the_clock_again(server: EmbeddedServer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    async with Store(with_database(server.uri(), "clock"), **FAST_HEARTBEATS) as store:
        assert abs(store.clock.offset.total_seconds()) < 0.5
        # From now on this machine's clock runs two minutes ahead; nothing re-measures for RESYNC_S (300 s) ...
        with time_machine.travel(datetime.now(UTC) + timedelta(seconds=SKEW_S), tick=True):
            assert abs(await eventually_offset(store, -SKEW_S, timeout_s=2.0)) < 0.5
            # ... except the database coming back after an outage.
            with caplog.at_level(logging.WARNING, logger="agentrl.store.outage"):
                server.stop()
                while "unreachable" not in caplog.text:
                    await asyncio.sleep(0.2)
                await asyncio.to_thread(server.start)
                while "reachable again" not in caplog.text:
                    await asyncio.sleep(0.2)
            assert await eventually_offset(store, -SKEW_S) == pytest.approx(-SKEW_S, abs=1.0)
            assert store.clock.now() == pytest.approx(datetime.now(UTC) - timedelta(seconds=SKEW_S),
                                                      abs=timedelta(seconds=1))


async def test_the_clock_is_measured_again_every_resync_s(server: EmbeddedServer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clock_module, "RESYNC_S", 1.0)
    async with Store(with_database(server.uri(), "clock")) as store:
        with time_machine.travel(datetime.now(UTC) + timedelta(seconds=SKEW_S), tick=True):
            assert await eventually_offset(store, -SKEW_S, timeout_s=15.0) == pytest.approx(-SKEW_S, abs=1.0)


async def test_only_short_round_trips_set_the_offset(server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Readings whose round trip is over the bound are ignored; with none short enough the offset stays."""
    async with Store(with_database(server.uri(), "clock")) as store:
        measured = store.clock.offset
        real_read = store.clock._read

        async def slow_read() -> clock_module.ClockReading | None:
            reading = await real_read()
            return clock_module.ClockReading(offset=reading.offset + timedelta(seconds=30), round_trip_s=60.0)

        monkeypatch.setattr(store.clock, "_read", slow_read)
        with caplog.at_level(logging.WARNING, logger="agentrl.store.clock"):
            assert await store.clock.sync() == measured
        assert "could not measure the database's clock" in caplog.text and store.clock.offset == measured

        readings = iter([(5.0, 0.9), (0.0, 0.01), (3.0, 0.5)])  # (extra offset, round trip): the shortest wins

        async def mixed_read() -> clock_module.ClockReading | None:
            reading = await real_read()
            extra, round_trip_s = next(readings)
            return clock_module.ClockReading(offset=reading.offset + timedelta(seconds=extra),
                                             round_trip_s=round_trip_s)

        monkeypatch.setattr(store.clock, "_read", mixed_read)
        assert abs((await store.clock.sync()).total_seconds()) < 0.5
        assert store.clock.round_trip_s == 0.01
