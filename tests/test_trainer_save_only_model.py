"""``--save_only_model true``: checkpoints without optimizer and scheduler state; a resume from one works (the
optimizer starts fresh, with a warning), keeps the learning-rate schedule and trains every sample exactly once."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from agentrl.store import sync_client
from agentrl.train import main
from trainer_fixtures import enqueue, make_samples, trainer_args

BATCH, LR = 4, 1e-3


def test_resume_from_a_model_only_checkpoint(db_uri: str, tiny_model_dir: Path, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    samples = make_samples(tiny_model_dir, groups=4)  # 16 samples: 4 steps
    asyncio.run(enqueue(db_uri, samples))
    out = tmp_path / "out"
    flags = ("--train_batch_size", str(BATCH), "--save_steps", "2", "--enable_sampling", "false",
             "--save_only_model", "true", "--lr_scheduler_type", "linear")
    assert main(trainer_args(db_uri, tiny_model_dir, out, *flags, "--max_steps", "2")) == 0
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "trainer_state.json").is_file()
    assert not (checkpoint / "optimizer").exists() and not (checkpoint / "scheduler.pt").exists()
    assert json.loads((checkpoint / "trainer_state.json").read_text())["model_only"] is True

    caplog.set_level(logging.WARNING, logger="agentrl")
    assert main(trainer_args(db_uri, tiny_model_dir, out, *flags, "--max_steps", "4", "--resume_from_checkpoint",
                             "latest")) == 0
    [warning] = [r.getMessage() for r in caplog.records if "--save_only_model" in r.getMessage()]
    assert "optimizer state starts fresh" in warning and str(checkpoint) in warning

    client = sync_client(db_uri)
    try:
        db = client.get_default_database()
        docs = list(db.DBRecordData.find())
        assert {d["status"] for d in docs} == {"trained"}
        assert Counter(d["claimed_step"] for d in docs) == dict.fromkeys(range(1, 5), BATCH)
        rates = {m["step"]: m["values"]["learning_rate"] for m in db.Metric.find()}
    finally:
        client.close()
    # the schedule of the resumed run (linear over 4 steps) goes on at step 3, not from its start
    assert rates[3] == pytest.approx(LR * 2 / 4) and rates[4] == pytest.approx(LR * 1 / 4)
