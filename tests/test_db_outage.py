"""Every process rides out a database outage: the whole loop (registered engine, two samplers, trainer) runs on
its own embedded database server, which is stopped for 60 s mid-run and restarted on the same port with the same
data. Nothing may exit; afterwards the run finishes with every step's samples trained exactly once (by the
ledger), every slot settled once and each process having said that it waited. A sampler and a trainer *started*
while the database is down wait for it the same way; past the tolerance they stop with one line naming the
database and how long they waited."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from agentrl.store.embedded import EmbeddedServer
from conftest import free_port, with_database
from inference_fixtures import start_engine
from rollout_fixtures import documents, run_env, sample_args, upload, write_mcp_config, write_script_tasks
from test_rl_loop import wait_for
from trainer_fixtures import run_trainer, start_trainer, trainer_args

pytestmark = pytest.mark.slow(start_rank=4)

OUTAGE_S = 60.0
STEPS, BATCH = 4, 4


def test_every_process_rides_out_a_60_s_database_outage(tmp_path: Path, scripted_model_dir: Path) -> None:
    server = EmbeddedServer(data_dir=tmp_path / "db", port=free_port())
    server.start()
    db_uri = with_database(server.uri(), "outage")
    tasks = tmp_path / "coin.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"coin{i}", "question": "What is 9 + 10?", "answer": "19"}) + "\n"
                             for i in range(12)))
    upload(db_uri, tasks, "--num_generations", "4")
    engine = start_engine(scripted_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    logs = [tmp_path / f"sampler{i}.log" for i in range(2)]
    samplers = [subprocess.Popen(
        sample_args(db_uri, scripted_model_dir, None, write_mcp_config(tmp_path / "mcp.json"), "--temperature",
                    "1.0", "--seed", str(i), "--train_batch_size", str(BATCH), "--max_staleness", "1",
                    "--zero_variance_threshold", "0", "--drop_zero_advantage", "false",  # every sample trainable
                    "--lease_s", "20", "--exit_when_done", "false", "--max_concurrent_samples_per_process", "2"),
        stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=run_env()) for i, log in enumerate(logs)]
    out = tmp_path / "trainer"
    trainer_log = tmp_path / "trainer.log"
    trainer = start_trainer(trainer_args(db_uri, scripted_model_dir, out, "--train_batch_size", str(BATCH),
                                         "--max_steps", str(STEPS), "--save_steps", "2"))
    processes = (*samplers, trainer)
    try:
        wait_for(lambda: len(documents(db_uri, "Metric")) >= 1, 300, "the first trainer step", *processes,
                 logs=tuple(logs))
        server.stop()
        stopped = time.monotonic()
        while time.monotonic() - stopped < OUTAGE_S:
            exited = [p.args[3:5] for p in processes if p.poll() is not None]
            tails = "\n".join(log.read_text()[-2000:] for log in logs)
            assert not exited, f"{exited} exited during the outage:\n{tails}"
            time.sleep(1.0)
        server.start()
        output, _ = trainer.communicate(timeout=400)
        trainer_log.write_text(output)
        assert trainer.returncode == 0, output[-4000:]
        for sampler in samplers:
            assert sampler.poll() is None, "a sampler exited after the outage"
            sampler.send_signal(signal.SIGTERM)
        for sampler, log in zip(samplers, logs):
            sampler.wait(timeout=60)
            assert sampler.returncode == 0, log.read_text()[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        engine.stop()
    try:
        sampler_text = "\n".join(log.read_text() for log in logs)
        for text, who in ((sampler_text, "samplers"), (output, "trainer")):
            assert "unreachable" in text and "reachable again" in text, f"the {who} did not log the outage"
        # The ledger: every step once, each with BATCH samples, no sample in two steps, all of them trained.
        metrics = documents(db_uri, "Metric")
        assert sorted(m["step"] for m in metrics) == list(range(1, STEPS + 1))
        ledger = [sid for m in metrics for sid in m["sample_ids"]]
        assert len(ledger) == STEPS * BATCH and len(set(ledger)) == len(ledger)
        samples = {s["_id"]: s for s in documents(db_uri, "DBRecordData")}
        assert all(samples[sid]["status"] == "trained" for sid in ledger)
        assert Counter(s["status"] for s in samples.values())["trained"] == len(ledger)
        # Every slot settled at most once; a settled slot has exactly one outcome (scored or failed attempt).
        for task in documents(db_uri, "Task"):
            assert len(task["settled_slots"]) == len(set(task["settled_slots"])), task["_id"]
        outcomes = Counter((r["task_id"], r["slot"]) for r in documents(db_uri, "Record")
                           if r["status"] in ("scored", "ready", "trained", "abandoned"))
        assert all(count == 1 for count in outcomes.values()), outcomes
    finally:
        server.stop()


LATE_START_S = 60.0
AFTER_OUTAGE_S = 90.0


def test_a_sampler_and_a_trainer_started_during_an_outage_wait_for_the_database(tmp_path: Path,
                                                                              scripted_model_dir: Path) -> None:
    """A 60 s outage on one machine: the sampler's clock offset stays under a second (before, it took the midpoint
    of the hello that waited out the outage: 30 s wrong, and the engine's fresh heartbeats looked expired to it),
    so it finds the live engine through the registry and finishes soon after the database is back."""
    server = EmbeddedServer(data_dir=tmp_path / "db", port=free_port())
    server.start()
    db_uri = with_database(server.uri(), "late")
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add", "mul")), "--num_generations", "2")
    engine = start_engine(scripted_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    server.stop()
    log = tmp_path / "sampler.log"
    sampler = subprocess.Popen(
        sample_args(db_uri, scripted_model_dir, None, write_mcp_config(tmp_path / "mcp.json"),
                    "--zero_variance_threshold", "0", "--drop_zero_advantage", "false"),
        stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=run_env())
    trainer = start_trainer(trainer_args(db_uri, scripted_model_dir, tmp_path / "out", "--max_steps", "1",
                                         "--per_device_train_batch_size", "2"))
    try:
        time.sleep(LATE_START_S)
        assert sampler.poll() is None and trainer.poll() is None, log.read_text()[-3000:]
        server.start()
        back = time.monotonic()
        assert sampler.wait(timeout=AFTER_OUTAGE_S) == 0, log.read_text()[-3000:]
        sampled_s = time.monotonic() - back
        output, _ = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, output[-4000:]
    finally:
        for process in (sampler, trainer):
            if process.poll() is None:
                process.kill()
        engine.stop()
    try:
        for text, who in ((log.read_text(), "sampler"), (output, "trainer")):
            assert "unreachable" in text and "reachable again" in text, f"the {who} did not log the outage"
            assert "clock is" not in text, f"the {who} measured a skew that is not there"  # offset under 1 s
        print(f"the sampler finished {sampled_s:.1f} s after the database came back")
        [metric] = documents(db_uri, "Metric")
        assert len(metric["sample_ids"]) == 2
    finally:
        server.stop()


def test_past_the_tolerance_a_late_process_stops_with_one_line(tmp_path: Path, scripted_model_dir: Path) -> None:
    """No database at all, a tolerance of 3 s: each stops after about 3 s with one line, no traceback."""
    uri = with_database(f"mongodb://127.0.0.1:{free_port()}", "nowhere")
    env = {**run_env(), "AGENTRL_DB_OUTAGE_S": "3"}
    sampled = subprocess.run(sample_args(uri, scripted_model_dir, None, write_mcp_config(tmp_path / "mcp.json")),
                             capture_output=True, text=True, env=env, timeout=120)
    trained = run_trainer(trainer_args(uri, scripted_model_dir, tmp_path / "out", "--max_steps", "1"),
                          env={"AGENTRL_DB_OUTAGE_S": "3"}, timeout_s=120)
    for done, output in ((sampled, sampled.stderr), (trained, trained.stdout)):
        assert done.returncode == 1, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        assert re.search(r"cannot reach the database at mongodb://127\.0\.0\.1:\d+/nowhere: waited [34] s "
                         r"\(limit 3 s\)", output), output[-3000:]
        assert "unreachable" in output  # the same outage log line as a running process
