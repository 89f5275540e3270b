"""Exact resume: a trainer killed with SIGKILL and resumed trains every sample exactly once, and ends with the
same weights as a run that was never interrupted. The killed trainer is a process of its own; the resumed one runs
in the test's process."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from agentrl.store import sync_client
from trainer_fixtures import (
    enqueue,
    load_weights,
    make_samples,
    max_weight_difference,
    start_trainer,
    train_here,
    train_uninterrupted,
    trainer_args,
)

pytestmark = pytest.mark.slow

STEPS, BATCH = 8, 4


def _trained_steps(db_uri: str) -> list[int]:
    client = sync_client(db_uri)
    try:
        return [doc["step"] for doc in client.get_default_database().Metric.find({}, {"step": 1})]
    finally:
        client.close()


def _kill_after_step(process, db_uri: str, step: int) -> None:
    """SIGKILL the trainer ``process`` as soon as it has logged ``step``."""
    try:
        deadline = time.monotonic() + 120
        while max(_trained_steps(db_uri), default=0) < step:
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, f"the trainer did not reach step {step}"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL


def test_sigkill_then_resume_trains_every_sample_exactly_once(db_uri: str, mongo_server_uri: str, tiny_model_dir: Path,
                                                               tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                               ) -> None:
    samples = make_samples(tiny_model_dir, groups=STEPS * BATCH // 4)
    asyncio.run(enqueue(db_uri, samples))
    out = tmp_path / "killed"
    flags = ("--train_batch_size", str(BATCH), "--max_steps", str(STEPS), "--save_steps", "2", "--enable_sampling",
             "false")
    _kill_after_step(start_trainer(trainer_args(db_uri, tiny_model_dir, out, *flags)), db_uri, 3)
    client = sync_client(db_uri)
    db = client.get_default_database()
    try:
        at_kill = Counter(doc["status"] for doc in db.DBRecordData.find())
        assert at_kill["queued"] > 0, f"the run had nearly finished when killed: {at_kill}"

        code, log = train_here(trainer_args(db_uri, tiny_model_dir, out, *flags, "--resume_from_checkpoint", "latest"),
                               caplog)
        assert code == 0 and "resumed from" in log, log

        docs = list(db.DBRecordData.find())
        assert len(docs) == len(samples) and {d["status"] for d in docs} == {"trained"}, at_kill
        assert Counter(d["claimed_step"] for d in docs) == dict.fromkeys(range(1, STEPS + 1), BATCH)
        assert sorted(d["step"] for d in db.Metric.find()) == list(range(1, STEPS + 1))
        # the step ledger: each step lists exactly the samples it trained, and every sample is in one step
        ledger = {d["step"]: d["sample_ids"] for d in db.Metric.find()}
        listed = [sample_id for ids in ledger.values() for sample_id in ids]
        assert sorted(listed) == sorted(s.id for s in samples), "a sample is missing from the ledger or twice"
        for step, ids in ledger.items():
            assert set(ids) == {d["_id"] for d in docs if d["claimed_step"] == step}, step
    finally:
        client.close()

    # a run on the same data that was never interrupted ends with the same weights: no sample was lost or
    # trained twice, and optimizer, scheduler and data-stream state were restored exactly
    reference = tmp_path / "reference"
    train_uninterrupted(mongo_server_uri, samples, tiny_model_dir, reference, *flags)
    difference = max_weight_difference(load_weights(out / "final"), load_weights(reference / "final"))
    assert difference < 1e-6, difference


def test_a_resume_removes_the_lost_steps_from_the_ledger(db_uri: str, tiny_model_dir: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Killed after step 3 with checkpoint 2: step 3's update is lost, so its Metric (and ledger) must go, even when
    the resumed run never reaches step 3 again."""
    asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=4)))
    out = tmp_path / "out"
    flags = ("--train_batch_size", "2", "--save_steps", "2", "--enable_sampling", "false")
    _kill_after_step(start_trainer(trainer_args(db_uri, tiny_model_dir, out, *flags, "--max_steps", "8")), db_uri, 3)
    code, log = train_here(trainer_args(db_uri, tiny_model_dir, out, *flags, "--max_steps", "2",
                                        "--resume_from_checkpoint", "latest"), caplog)
    assert code == 0 and "their Metric documents are removed from the ledger" in log, log
    assert sorted(_trained_steps(db_uri)) == [1, 2]
