"""`agentrl db start|status|stop`, fallback to the embedded server, redaction of credentials."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pymongo import MongoClient

from agentrl.log import RedactingFilter, redact
from cli_helpers import agentrl
from conftest import free_port

pytestmark = pytest.mark.slow


def test_db_start_status_stop_and_data_survives_a_restart(tmp_path: Path) -> None:
    port = str(free_port())
    data = str(tmp_path / "db")
    try:
        started = agentrl("db", "start", "--data_dir", data, "--port", port)
        assert started.returncode == 0, started.stderr
        uri = started.stdout.strip()
        assert uri == f"mongodb://127.0.0.1:{port}/"
        assert agentrl("db", "start", "--data_dir", data).stdout.strip() == uri  # already running: same server
        status = agentrl("db", "status", "--data_dir", data)
        assert status.returncode == 0 and "running: pid" in status.stdout
        client = MongoClient(uri)
        client.keep.Task.insert_one({"_id": "x", "query": "kept?"})
        client.close()
        assert agentrl("db", "stop", "--data_dir", data).returncode == 0
        assert agentrl("db", "status", "--data_dir", data).returncode == 1
        # restarted without --port: it reuses the port it had, and the data is still there
        assert agentrl("db", "start", "--data_dir", data).stdout.strip() == uri
        client = MongoClient(uri)
        assert client.keep.Task.find_one({"_id": "x"})["query"] == "kept?"
        client.close()
    finally:
        agentrl("db", "stop", "--data_dir", data)


def test_commands_fall_back_to_the_embedded_database(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {"AGENTRL_HOME": str(home), "AGENTRL_DB": ""}
    (home / "db").mkdir(parents=True)
    (home / "db" / "nx-27017.port").write_text(str(free_port()))
    try:
        result = agentrl("status", "--json", env=env)
        assert result.returncode == 0, result.stderr
        assert '"database": "agentrl"' in result.stdout
        assert agentrl("db", "status", env=env).returncode == 0
    finally:
        agentrl("db", "stop", env=env)


def test_connection_strings_are_redacted_in_logs(caplog) -> None:
    secret = "mongodb://admin:hunter2@db.example:27017/run?authSource=admin&password=x1"
    assert "hunter2" not in redact(secret) and "x1" not in redact(secret)
    assert redact(secret).startswith("mongodb://***@db.example:27017/run")
    assert redact("Authorization: Bearer sk-abc.def") == "Authorization: Bearer ***"
    logger = logging.getLogger("agentrl.test.redact")
    handler = logging.StreamHandler()
    handler.addFilter(RedactingFilter())
    logger.addHandler(handler)
    caplog.handler.addFilter(RedactingFilter())
    logger.warning("connecting to %s", secret)
    assert "hunter2" not in caplog.text and "***@db.example" in caplog.text


def test_the_log_handler_writes_to_the_stderr_of_the_moment() -> None:
    """A run started in-process (a notebook, a test) whose stderr is replaced afterwards logs to the new stderr, not
    to the stream that was current at set-up (which may be closed by then)."""
    import contextlib
    import io

    from agentrl.log import StderrHandler

    logger = logging.getLogger("agentrl.test.stderr")
    handler = StderrHandler()
    logger.addHandler(handler)
    logger.propagate = False  # only this handler (an in-process run before may have set up the root logger's)
    try:
        first, second = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(first):
            logger.warning("one")
        first.close()
        with contextlib.redirect_stderr(second):
            logger.warning("two")
        assert second.getvalue() == "two\n"
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
