"""The example scripts on their embedded path, in a fast configuration (the scripted tiny model, a few tasks, one
trainer step): `minirl_example.sh` starts its own database, engine, sampler and trainer (through `agentrl run`) and
stops exactly those; `eval_example.sh` evaluates, and reuses its stored result."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from pymongo import MongoClient

from agentrl.store.embedded import embedded_server
from example_fixtures import ROOT, ExampleRun
from rollout_fixtures import documents

pytestmark = pytest.mark.slow(start_rank=2)


def test_minirl_example_runs_to_its_summary_and_stops_what_it_started(minirl_example_run: ExampleRun) -> None:
    run_dir, db_dir, done = minirl_example_run.run_dir, minirl_example_run.db_dir, minirl_example_run.done
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "MINIRL step 1/1 trained, 4 samples" in out and "run ci_minirl finished" in out, out[-4000:]
    # the samplers stop with the trainer, before the final evaluation (they would take the engine from it)
    assert out.index("samplers: 1 stopped, the trainer is done") < out.index("held-out evaluation (after)")
    # held-out evaluation of the starting, warmed-up and final models, and the change, in the summary
    assert "held-out accuracy (2 tasks, greedy): before 1.000 → warmup 1.000 → after" in out, out[-4000:]
    assert "change in held-out accuracy: before → warmup +0.000, warmup → after " in out
    assert f"agentrl db start --data_dir {db_dir} && agentrl dashboard --db_connection_string" in out
    assert (run_dir / "output" / "final" / "config.json").is_file()
    assert (run_dir / "output" / "checkpoint-1").is_dir()
    # the weights reached the engine through shared memory (a CPU trainer's default): nothing was written per step
    assert not (run_dir / "output" / "weights").exists() and "removed the published weights (" not in out
    assert f"{run_dir / 'output'}/checkpoint-*   (" in out and "--resume_from_checkpoint" in out
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
        # the script stopped its sampler at the end of the run: nothing is left running
        assert not [r["_id"] for r in documents(uri, "Record") if r["status"] == "running"]
        assert not [t["_id"] for t in documents(uri, "Task") if t["status"] == "running"]
        services = documents(uri, "InferenceService")
        assert [s["status"] for s in services] == ["DOWN"]  # the engine it started marked itself down
        assert {e["name"] for e in documents(uri, "Eval")} == {f"ci_minirl {label}"
                                                               for label in ("before", "warmup", "after")}
    finally:
        server.stop()


def test_eval_example_evaluates_and_reuses_its_stored_result(tmp_path: Path, scripted_model_dir: Path) -> None:
    """`eval_example.sh` (`agentrl run --mode eval`) on its embedded path: tools and one `agentrl eval` (which starts
    its engine) shown on the terminal and in logs/eval.log; run again under the same name it reuses the stored
    result without starting an engine, and FORCE=1 recomputes it. Each time the database it started is stopped."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "add", "question": "What is 12 + 30?", "answer": "42"}) + "\n"
                     + json.dumps({"id": "mul", "question": "What is 7 * 8?", "answer": "56"}) + "\n")
    run_dir, db_dir = tmp_path / "run", tmp_path / "db"
    env = {**{k: v for k, v in os.environ.items() if k != "AGENTRL_DB"}, "MODEL": str(scripted_model_dir),
           "TASKS": str(tasks), "LIMIT": "0", "K": "1", "TEMPERATURE": "0", "MAX_TURNS": "3",
           "MAX_NEW_TOKENS": "40", "ENGINE_THREADS": "1", "RUN_DIR": str(run_dir), "AGENTRL_DB_DIR": str(db_dir)}
    outputs = []
    for force in ("0", "0", "1"):
        done = subprocess.run([str(ROOT / "eval_example.sh"), "ci_eval"], capture_output=True, text=True,
                              env={**env, "FORCE": force}, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs.append(done.stdout + done.stderr)
        assert embedded_server(db_dir).pid() is None, "the script left its database running"
        result = json.loads((run_dir / "eval.json").read_text())
        assert result["metrics"]["accuracy"] == 1.0 and result["num_tasks"] == 2
        assert "result: " in done.stdout and "collection Eval" in done.stdout
        assert "accuracy" in (run_dir / "logs" / "eval.log").read_text()  # the output, also in the log
    assert "reusing the stored result" not in outputs[0]
    assert "reusing the stored result" in outputs[1] and "reusing the stored result" not in outputs[2]
    # an engine only where something is sampled: the reuse starts none
    assert ["serving at" in output for output in outputs] == [True, False, True], outputs


def test_minirl_vision_example_runs_the_loop_with_pictures(tmp_path: Path) -> None:
    """`minirl_vision_example.sh` (`agentrl run --preset cpu-vision-demo`) on its embedded path with a tiny random VLM
    for speed: picture tasks uploaded with their pictures, held-out evaluations, a warm-up on demonstrations with
    pictures, one RL step; the pictures are in GridFS once each and named by the samples the trainer trained."""
    from agentrl.inference.tiny_model import build_tiny_vision_model

    model = build_tiny_vision_model(tmp_path / "vlm", max_pixels=112 * 112)
    run_dir, db_dir = tmp_path / "run", tmp_path / "db"
    env = {**{k: v for k, v in os.environ.items() if k != "AGENTRL_DB"}, "MODEL": str(model), "NUM_TASKS": "4",
           "NUM_EVAL_TASKS": "2", "WARMUP": "2", "WARMUP_THREADS": "1", "TRAIN_STEPS": "1", "TRAIN_TIME_S": "0",
           "TRAIN_BATCH_SIZE": "4", "SAVE_STEPS": "1", "SYNC_EVERY": "1", "ENGINE_THREADS": "1",
           "RUN_DIR": str(run_dir), "AGENTRL_DB_DIR": str(db_dir),  # noise answers: keep the groups
           "EXTRA_SAMPLE_FLAGS": "--seed 1 --zero_variance_threshold 0 --drop_zero_advantage false"}
    done = subprocess.run([str(ROOT / "minirl_vision_example.sh"), "ci_vision"], capture_output=True, text=True,
                          env=env, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    assert "MINIRL step 1/1 trained, 4 samples" in out and "run ci_vision finished" in out, out[-4000:]
    assert "held-out accuracy (2 tasks, greedy): before" in out and "tools: none" in out
    demo = json.loads((run_dir / "warmup" / "demos.jsonl").read_text().splitlines()[0])
    assert demo["messages"][1]["content"][0]["type"] == "image_url"
    tasks = [json.loads(line) for line in (ROOT / "assets/tasks/pictures_rl.jsonl").read_text().splitlines()[:4]]
    server = embedded_server(db_dir)
    server.start()
    try:
        uri = server.uri("ci_vision")
        named = {doc["_id"]: doc.get("images", []) for doc in documents(uri, "Task")}
        assert {len(named[f"train:{task['id']}"]) for task in tasks} == {1}
        pictures = {sha256 for task in tasks for sha256 in named[f"train:{task['id']}"]}
        assert len(pictures) == 4
        client = MongoClient(uri)
        try:  # each stored once (a GridFS files document by sha256)
            assert all(len(list(client.get_default_database()["images.files"].find({"_id": sha256}))) == 1
                       for sha256 in pictures)
        finally:
            client.close()
        trained = [s for s in documents(uri, "DBRecordData") if s["status"] == "trained"]
        assert len(trained) == 4 and all(len(s["images"]) == 1 and s["images"][0] in pictures for s in trained)
    finally:
        server.stop()
