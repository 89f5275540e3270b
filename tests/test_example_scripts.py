"""`minirl_example.sh` on its embedded path, in a fast configuration: the scripted tiny model, a few tasks, one
trainer step. The script starts its own database, engine, sampler and trainer, and stops exactly those."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from rollout_fixtures import documents

from agentrl.store.embedded import embedded_server

ROOT = Path(__file__).resolve().parent.parent


def test_minirl_example_runs_to_its_summary_and_stops_what_it_started(tmp_path: Path,
                                                                       scripted_model_dir: Path) -> None:
    tasks = tmp_path / "coin.jsonl"  # two trained endings (right and wrong): groups with reward variance
    tasks.write_text("".join(json.dumps({"id": f"coin{i}", "question": "What is 9 + 10?", "answer": "19",
                                         "scorer": "math", "answer_schema": "boxed"}) + "\n" for i in range(6)))
    run_dir, db_dir = tmp_path / "run", tmp_path / "db"
    env = {**os.environ, "MODEL": str(scripted_model_dir), "TASKS": str(tasks), "NUM_TASKS": "6", "SCORER": "",
           "MAX_NEW_TOKENS": "40", "MAX_TURNS": "3", "TEMPERATURE": "1.0", "TRAIN_STEPS": "1",
           "TRAIN_BATCH_SIZE": "4", "SAVE_STEPS": "1", "ENGINE_THREADS": "1", "RUN_DIR": str(run_dir),
           "AGENTRL_DB_DIR": str(db_dir), "EXTRA_SAMPLE_FLAGS": "--seed 1", "EXTRA_TRAIN_FLAGS": "--learning_rate 1e-4"}
    env.pop("AGENTRL_DB", None)
    done = subprocess.run([str(ROOT / "minirl_example.sh"), "ci_minirl"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "step 1/1" in done.stdout and "run ci_minirl finished" in done.stdout, done.stdout[-4000:]
    assert (run_dir / "output" / "final" / "config.json").is_file()
    assert (run_dir / "output" / "checkpoint-1").is_dir()

    server = embedded_server(db_dir)
    assert server.pid() is None, "the script left its database running"
    for log in (run_dir / "logs").glob("*.log"):  # every process it started has exited: its log is complete
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    server.start()
    try:
        uri = server.uri("ci_minirl")
        (metric,) = documents(uri, "Metric")
        assert metric["step"] == 1
        assert {s["status"] for s in documents(uri, "DBRecordData")} >= {"trained"}
        services = documents(uri, "InferenceService")
        assert [s["status"] for s in services] == ["DOWN"]  # the engine it started marked itself down
    finally:
        server.stop()
