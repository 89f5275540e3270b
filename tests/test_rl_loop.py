"""The whole loop on real parts: a registered engine serves the scripted tiny model, a sampler rolls out and
queues samples, the trainer trains on them, publishes each step's weights to the live engine (which the sampler
then samples from), is SIGKILLed, resumes from its checkpoint, and finishes with every sample trained once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from agentrl.inference.client import SGLangClient
from inference_fixtures import start_engine
from rollout_fixtures import documents, run_env, sample_args, upload, write_mcp_config
from trainer_fixtures import run_trainer, start_trainer, trainer_args

pytestmark = pytest.mark.slow

STEPS, BATCH = 3, 4


def wait_for(condition, timeout_s: float, what: str, *processes: subprocess.Popen, logs: tuple[Path, ...] = ()
             ) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        problem = next((f"{p.args[3:5]} exited early" for p in processes if p.poll() is not None), None)
        if problem is None and time.monotonic() > deadline:
            problem = "timed out"
        if problem is not None:
            raise AssertionError(f"{problem} while waiting for {what}\n" + "\n".join(
                log.read_text()[-3000:] for log in logs))
        time.sleep(0.2)


def test_samplers_feed_the_trainer_which_publishes_and_resumes(db_uri: str, tmp_path: Path,
                                                               scripted_model_dir: Path) -> None:
    # "coin" has two trained endings (right and wrong), so sampled groups have reward variance
    tasks = tmp_path / "coin.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"coin{i}", "question": "What is 9 + 10?", "answer": "19"}) + "\n"
                             for i in range(10)))
    upload(db_uri, tasks, "--num_generations", "4")
    sampler_log = tmp_path / "sampler.log"
    engine = start_engine(scripted_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    sampler = subprocess.Popen(
        sample_args(db_uri, scripted_model_dir, None, write_mcp_config(tmp_path / "mcp.json"), "--temperature", "1.0",
                    "--seed", "3", "--train_batch_size", str(BATCH), "--max_staleness", "1",
                    "--exit_when_done", "false"),
        stdout=sampler_log.open("w"), stderr=subprocess.STDOUT, text=True, env=run_env())
    out = tmp_path / "trainer"
    flags = trainer_args(db_uri, scripted_model_dir, out, "--train_batch_size", str(BATCH), "--max_steps",
                         str(STEPS), "--save_steps", "1", "--loss_calculater", "MINIRL", "--token_level_loss",
                         "false", "--strict_in_bound", "true", "--skip_length_normalization", "true")
    trainer = start_trainer(flags)
    try:
        wait_for((out / "checkpoint-1").exists, 240, "the first checkpoint", sampler, trainer, logs=(sampler_log,))
        trainer.send_signal(signal.SIGKILL)
        trainer.communicate(timeout=30)

        resumed = run_trainer([*flags, "--resume_from_checkpoint", "latest"], timeout_s=300)
        assert resumed.returncode == 0, resumed.stdout
        assert "resumed from" in resumed.stdout, resumed.stdout

        async def served_version() -> str:
            async with SGLangClient(engine.url) as client:
                return (await client.get_model_info()).weight_version

        # Versions only grow (the killed trainer published too): the engine serves the run's latest version.
        (run,) = documents(db_uri, "Run")
        assert run["policy_version"] >= STEPS
        assert asyncio.run(served_version()) == str(run["policy_version"])
    finally:
        for process in (sampler, trainer):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        sampler.wait(timeout=60)
        engine.stop()
    assert sampler.returncode == 0, sampler_log.read_text()[-3000:]

    metrics = documents(db_uri, "Metric")
    assert sorted(m["step"] for m in metrics) == list(range(1, STEPS + 1))
    trained = [s for s in documents(db_uri, "DBRecordData") if s["status"] == "trained"]
    assert Counter(s["claimed_step"] for s in trained) == dict.fromkeys(range(1, STEPS + 1), BATCH)
    # Samples of trained records came from real rollouts; the sampler kept sampling with published weights.
    calls = documents(db_uri, "DispatchedSamplingTask")
    assert max(c["weight_version"] or 0 for c in calls) >= 1
    records = documents(db_uri, "Record")
    # The stopped sampler gave back what it held (failed as cancelled, the slot waiting for the next sampler):
    # nothing is left running.
    assert not [r["_id"] for r in records if r["status"] == "running"]
    assert all(r["released"] for r in records if r.get("failure_class") == "cancelled")
    assert not [t["_id"] for t in documents(db_uri, "Task") if t["status"] == "running"]
    assert {r["_id"] for r in records if r["status"] == "trained"} == {s["record_id"] for s in trained}
