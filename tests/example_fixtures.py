"""`minirl_example.sh` run once per test session on its embedded path, in a fast configuration (the scripted tiny
model, a few tasks, one trainer step): the example's own test checks the run, the dashboard's tests read its
database (a real run: engine, sampler, trainer and evaluations wrote it)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_NAME = "ci_minirl"


@dataclass
class ExampleRun:
    run_dir: Path
    db_dir: Path
    done: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def minirl_example_run(tmp_path_factory: pytest.TempPathFactory, scripted_model_dir: Path) -> ExampleRun:
    tmp_path = tmp_path_factory.mktemp("minirl_example")
    tasks = tmp_path / "coin.jsonl"  # two trained endings (right and wrong): groups with reward variance
    tasks.write_text("".join(json.dumps({"id": f"coin{i}", "question": "What is 9 + 10?", "answer": "19",
                                         "scorer": "math", "answer_schema": "boxed"}) + "\n" for i in range(6)))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"id": task, "question": question, "answer": answer, "scorer": "math",
                                            "answer_schema": "boxed"}) + "\n"
                                for task, question, answer in (("add", "What is 12 + 30?", "42"),
                                                               ("mul", "What is 7 * 8?", "56"))))
    warmup = tmp_path / "warmup.jsonl"  # demonstrations of what the scripted model already does
    warmup.write_text(json.dumps({"id": "w", "question": "What is 12 + 30?", "answer": "42",
                                  "expression": "12 + 30", "answer_schema": "boxed"}) + "\n")
    run_dir, db_dir = tmp_path / "run", tmp_path / "db"
    env = {**os.environ, "MODEL": str(scripted_model_dir), "TASKS": str(tasks), "NUM_TASKS": "6", "SCORER": "",
           "EVAL_TASKS": str(held_out), "NUM_EVAL_TASKS": "2", "WARMUP_TASKS": str(warmup), "WARMUP": "1",
           "WARMUP_LEARNING_RATE": "1e-6", "WARMUP_THREADS": "1",
           "MAX_NEW_TOKENS": "40", "MAX_TURNS": "3", "TEMPERATURE": "1.0", "TRAIN_STEPS": "1",
           "TRAIN_BATCH_SIZE": "4", "SAVE_STEPS": "1", "ENGINE_THREADS": "1", "RUN_DIR": str(run_dir),
           "SYNC_EVERY": "1",  # the one step is published (the default, every 2 steps, would publish nothing)
           "AGENTRL_DB_DIR": str(db_dir), "EXTRA_SAMPLE_FLAGS": "--seed 1", "EXTRA_TRAIN_FLAGS": "--learning_rate 1e-4"}
    env.pop("AGENTRL_DB", None)
    process = subprocess.Popen([str(ROOT / "minirl_example.sh"), RUN_NAME], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = process.communicate(timeout=600)
    except BaseException:  # a timeout (this one, or the test's): the run stops what it started on SIGTERM
        process.terminate()
        process.communicate(timeout=120)
        raise
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return ExampleRun(run_dir=run_dir, db_dir=db_dir, done=done)
