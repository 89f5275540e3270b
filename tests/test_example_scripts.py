"""`minirl_example.sh` on its embedded path, in a fast configuration: the scripted tiny model, a few tasks, one
trainer step. The script starts its own database, engine, sampler and trainer, and stops exactly those."""

from __future__ import annotations

import json

from example_fixtures import ExampleRun
from rollout_fixtures import documents

from agentrl.store.embedded import embedded_server


def test_minirl_example_runs_to_its_summary_and_stops_what_it_started(minirl_example_run: ExampleRun) -> None:
    run_dir, db_dir, done = minirl_example_run.run_dir, minirl_example_run.db_dir, minirl_example_run.done
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "MINIRL step 1/1 trained, 4 samples" in out and "run ci_minirl finished" in out, out[-4000:]
    # held-out evaluation of the starting, warmed-up and final models, and the change, in the summary
    assert "held-out accuracy (2 tasks, greedy): before 1.000 → warmup 1.000 → after" in out, out[-4000:]
    assert "change in held-out accuracy: before → warmup +0.000, warmup → after " in out
    assert f"agentrl db start --data_dir {db_dir} && agentrl dashboard --db_connection_string" in out
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
        # the script stopped its sampler at the end of the run: nothing is left running
        assert not [r["_id"] for r in documents(uri, "Record") if r["status"] == "running"]
        assert not [t["_id"] for t in documents(uri, "Task") if t["status"] == "running"]
        services = documents(uri, "InferenceService")
        assert [s["status"] for s in services] == ["DOWN"]  # the engine it started marked itself down
        assert {e["name"] for e in documents(uri, "Eval")} == {f"ci_minirl {label}"
                                                               for label in ("before", "warmup", "after")}
    finally:
        server.stop()
