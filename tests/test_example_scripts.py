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
           "AGENTRL_DB_DIR": str(db_dir), "EXTRA_SAMPLE_FLAGS": "--seed 1", "EXTRA_TRAIN_FLAGS": "--learning_rate 1e-4"}
    env.pop("AGENTRL_DB", None)
    done = subprocess.run([str(ROOT / "minirl_example.sh"), "ci_minirl"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "MINIRL step 1/1 trained, 4 samples" in out and "run ci_minirl finished" in out, out[-4000:]
    # held-out evaluation of the starting, warmed-up and final models, and the change, in the summary
    assert "held-out accuracy (2 tasks, greedy): before 1.000 → warmup 1.000 → after" in out, out[-4000:]
    assert "change in held-out accuracy: before → warmup +0.000, warmup → after " in out
    assert (run_dir / "output" / "final" / "config.json").is_file()
    assert (run_dir / "output" / "checkpoint-1").is_dir()
    assert (run_dir / "warmup" / "final" / "config.json").is_file()
    demo = json.loads((run_dir / "warmup" / "demos.jsonl").read_text())
    assert demo["messages"][3] == {"role": "tool", "name": "calculate", "content": "42"}  # the real calculator
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["trajectories"] >= 4 and summary["wall_s"] > 0
    for label in ("before", "warmup", "after"):
        assert summary["eval"][label]["num_tasks"] == 2
        assert {"accuracy", "mean_reward"} <= set(summary["eval"][label])
    assert summary["eval"]["before"]["accuracy"] == 1.0  # the scripted model solves add and mul greedily
    assert summary["reward_by_version"][0]["policy_version"] == 0
    assert summary["samples_skipped_stale"] == 0 and summary["diagnosis"] == []

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
        assert {e["name"] for e in documents(uri, "Eval")} == {f"ci_minirl {label}"
                                                               for label in ("before", "warmup", "after")}
    finally:
        server.stop()
