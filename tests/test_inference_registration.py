"""The engine registers in ``InferenceService``, heartbeats its version and load, and marks itself DOWN."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pymongo import MongoClient
from pymongo.uri_parser import parse_uri

from agentrl.inference import SGLangClient
from agentrl.inference.process import EngineProcess, EngineStartError

pytestmark = pytest.mark.slow


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
async def test_engine_registers_heartbeats_and_marks_itself_down(
        db_uri: str, launch_engine: Callable[..., EngineProcess], tiny_model_dir: Path, tiny_model_b_dir: Path,
        stop_signal: int) -> None:
    engine = launch_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "0.3")
    mongo: MongoClient = MongoClient(db_uri, tz_aware=True)
    services = mongo[parse_uri(db_uri)["database"]]["InferenceService"]
    try:
        doc = services.find_one({"_id": engine.url})
        assert doc is not None, engine.output
        assert (doc["status"], doc["kind"], doc["weight_version"]) == ("UP", "agentrl-engine", 0)
        assert doc["models"] == [tiny_model_dir.name] and doc["base_url"] == engine.url
        first_beat = doc["heartbeat_at"]
        assert wait_until(lambda: services.find_one({"_id": engine.url})["heartbeat_at"] != first_beat, 10)
        assert set(services.find_one({"_id": engine.url})["engine_load"]) == {"running", "queued"}

        async with SGLangClient(engine.url) as client:
            await client.update_weights_from_disk(str(tiny_model_b_dir))
        assert services.find_one({"_id": engine.url})["weight_version"] == 1  # reported right after the update

        assert engine.stop(stop_signal) == 0, engine.output
        doc = services.find_one({"_id": engine.url})
        assert doc["status"] == "DOWN" and doc["running_requests"] == 0
    finally:
        engine.stop()
        mongo.close()


def test_unreachable_database_fails_startup(launch_engine: Callable[..., EngineProcess],
                                            tiny_model_dir: Path) -> None:
    with pytest.raises(EngineStartError) as failure:
        launch_engine(tiny_model_dir, "--db_connection_string", "mongodb://user:s3cret@127.0.0.1:9/run")
    message = str(failure.value)
    assert "exit status 1" in message and "Traceback" not in message
    assert "error: cannot reach the database mongodb://***@127.0.0.1:9/run" in message
    assert "s3cret" not in message
