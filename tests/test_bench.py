"""AutoRL-Bench end to end: a real `agentrl bench serve` process grading the scripted tiny model through real
`agentrl eval` runs (engine, calculator MCP server over stdio, database), checked against seed 001's and seed
000's endpoint tables; `agentrl bench run` with the template agent (workspace isolation: no held-out data
reachable from the workspace) and with an agent that outlives its timeout (its whole process group is killed).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from rollout_fixtures import agentrl_cmd, run_env
from scripted_model import SCRIPTS

ENGINE_ARGS = "--num_threads 1 --max_total_tokens 8192"
MARKER = "HELD-OUT-MARKER-7f3a"


def write_scenario(tmp_path: Path, model_dir: Path, scenario_id: str = "scripted", baseline: float | None = 50.0
                   ) -> Path:
    """A scenario whose test set the scripted model solves (add, mul) and a training file of its own."""
    data = tmp_path / "scenario-data"
    data.mkdir()
    scripts = {s.task_id: s for s in SCRIPTS}
    (data / "test.jsonl").write_text("".join(
        json.dumps({"id": t, "question": scripts[t].question, "answer": scripts[t].answer, "secret": MARKER}) + "\n"
        for t in ("add", "mul")))
    (data / "train.jsonl").write_text(json.dumps({"id": "coin", "question": scripts["coin"].question,
                                                  "answer": scripts["coin"].answer}) + "\n")
    spec = {"id": scenario_id, "name": "Scripted calculator", "description": "two sums", "base_model": str(model_dir),
            "train_data": "scenario-data/train.jsonl", "test_data": "scenario-data/test.jsonl",
            "baseline_score": baseline, "metric": "accuracy",
            "eval": {"scorer": "math", "answer_schema": "boxed", "max_turns": 3, "max_new_tokens": 40,
                     "tools": ["calculator"]}}
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start_server(tmp_path: Path, db_uri: str, scenario: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        agentrl_cmd("bench", "serve", "--task", "scripted", "--scenario", str(scenario), "--workspace",
                    str(tmp_path / "ws"), "--port", "0", "--db_connection_string", db_uri, "--engine_args",
                    ENGINE_ARGS, "--state_dir", str(tmp_path / "state"), *extra),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env())
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("agentrl bench: serving at "):
            return process, line.strip().removeprefix("agentrl bench: serving at ")
    process.wait()
    raise AssertionError(f"the bench server did not start (exit {process.returncode})")


def test_grading_and_scenario_apis(tmp_path: Path, db_uri: str, scripted_model_dir: Path) -> None:
    process, url = start_server(tmp_path, db_uri, write_scenario(tmp_path, scripted_model_dir))
    ws = tmp_path / "ws"
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            root = http.get("/").json()
            assert root["name"] == "AutoRL-Bench" and {"gsm8k", "arith", "humaneval", "textcraft",
                                                        "scripted"} <= set(root["scenarios"])
            assert "/submit" in root["endpoints"] and "/scenarios/{scenario_id}" in root["endpoints"]
            listed = {s["id"]: s for s in http.get("/scenarios").json()["scenarios"]}
            assert listed["scripted"] == {"id": "scripted", "name": "Scripted calculator", "type": "offline",
                                          "base_model": str(scripted_model_dir), "baseline_score": 50.0,
                                          "metric": "accuracy"}
            detail = http.get("/scenarios/scripted").json()
            assert detail["train_data"] == detail["train_data_path"] and detail["train_data"].endswith("train.jsonl")
            assert detail["test_data_path"] is None and detail["test_data"] == {"num_items": 2, "hidden": True}
            assert detail["base_model_path"] == str(scripted_model_dir) and detail["baseline_score"] == 50.0
            missing = http.get("/scenarios/nope")
            assert missing.status_code == 404 and "scripted" in missing.json()["available"]

            health = http.get("/health").json()
            assert health["status"] == "ok" and health["task"] == "scripted" and health["workspace"] == str(ws)
            assert health["available_gpus"] == [] and health["pending_evaluations"] == 0
            assert http.get("/best").status_code == 404 and http.get("/best").json() == {"error": "No submissions"}
            assert http.get("/history").json() == []
            assert http.post("/set_baseline", json={}).status_code == 400
            assert http.post("/set_baseline", json={"score": 25}).json() == {"baseline_score": 25.0, "status": "set"}
            time_info = http.get("/time").json()
            assert time_info["timeout_s"] is None and time_info["remaining"] is None and time_info["now"] > 0

            # /validate and /submit take model paths inside the workspace only (default: its output dir).
            assert http.post("/validate", json={}).json()["valid"] is False  # output/ is empty
            outside = http.post("/submit", json={"model_path": str(scripted_model_dir)})
            assert outside.status_code == 400 and outside.json()["error"].startswith("Invalid request")
            assert http.post("/validate", json={"model_path": "../x"}).status_code == 400
            v1 = ws / "output" / "v1"
            shutil.copytree(scripted_model_dir, v1)
            assert http.post("/validate", json={"model_path": "output/v1"}).json()["valid"] is True

            first = http.post("/submit", json={"model_path": "output/v1"}).json()
            assert first["submission_id"] == 1 and first["model_path"] == str(v1)
            assert first["score"] == 100.0 and first["baseline_score"] == 25.0 and first["improvement"] == 75.0
            assert first["metrics"]["correct"] == 2 and first["metrics"]["total"] == 2
            assert first["metrics"]["reused"] is False and "error" not in first
            assert first["best"]["submission_id"] == 1 and first["total_submissions"] == 1

            started = time.monotonic()
            again = http.post("/submit", json={"model_path": str(v1)}).json()  # the same model: reused
            assert again["submission_id"] == 2 and again["score"] == 100.0 and again["metrics"]["reused"] is True
            assert time.monotonic() - started < 30

            (ws / "output" / "empty").mkdir()
            failed = http.post("/submit", json={"model_path": "output/empty", "async": True})
            assert failed.status_code == 202 and failed.json()["status"] in ("queued", "running", "failed")
            job_id = failed.json()["job_id"]
            for _ in range(100):
                job = http.get(f"/jobs/{job_id}").json()
                if job["status"] not in ("queued", "running"):
                    break
                time.sleep(0.1)
            assert job["status"] == "failed" and job["result"]["score"] == 0.0
            assert "holds none of" in job["result"]["error"]
            assert http.get("/jobs/nope").status_code == 404

            best = http.get("/best").json()
            assert best["best"]["submission_id"] == 1 and best["total_submissions"] == 3
            history = http.get("/history").json()
            assert [e["submission_id"] for e in history] == [1, 2, 3]
            assert json.loads((ws / "scores.json").read_text()) == history

            # Scenario API (seed 000).
            evaluated = http.post("/evaluate", json={"scenario_id": "scripted", "model_path": str(v1)}).json()
            assert evaluated["score"] == 100.0 and evaluated["baseline"] == 50.0 and evaluated["improvement"] == 50.0
            assert evaluated["improvement_pct"] == "+100.00%" and evaluated["details"]["correct"] == 2
            assert http.post("/evaluate", json={"scenario_id": "nope", "model_path": str(v1)}).status_code == 404
            assert http.post("/evaluate", json={"scenario_id": "scripted",
                                                "model_path": str(tmp_path / "no-model")}).status_code == 404

            # /interact: environment sessions on training goals only.
            started = http.post("/interact", json={"scenario_id": "textcraft", "data_idx": 0}).json()
            assert "Goal" in started["observation"] and started["done"] is False
            step = http.post("/interact", json={"scenario_id": "textcraft", "session_id": started["session_id"],
                                                "action": "inventory"}).json()
            assert step["session_id"] == started["session_id"] and "Inventory" in step["observation"]
            from agentrl.envs.registry import get_spec

            held_out = next(iter(get_spec("textcraft").split("test")))
            refused = http.post("/interact", json={"scenario_id": "textcraft", "data_idx": held_out})
            assert refused.status_code == 400 and "training split" in refused.json()["detail"]
            assert http.post("/interact", json={"scenario_id": "scripted"}).status_code == 400
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0

    calls = [json.loads(line) for line in (ws / "interactions.jsonl").read_text().splitlines()]
    submits = [c for c in calls if c["endpoint"] == "/submit"]
    assert [c["status"] for c in submits] == [400, 200, 200, 202]
    assert submits[1]["request"] == {"model_path": "output/v1"} and submits[1]["response"]["score"] == 100.0
    assert all({"timestamp", "method", "elapsed_seconds"} <= set(c) for c in calls)
    assert MARKER not in (ws / "interactions.jsonl").read_text()


def reachable_text(root: Path) -> str:
    """Every file reachable from ``root``, following symbolic links, as one text."""
    parts = []
    for dirpath, _, files in os.walk(root, followlinks=True):
        for name in files:
            path = Path(dirpath) / name
            parts.append(str(path))
            parts.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(parts)


def run_bench(tmp_path: Path, db_uri: str, scenario: Path, agent: str, timeout: float, *extra: str
              ) -> subprocess.CompletedProcess:
    return subprocess.run(
        agentrl_cmd("bench", "run", "--agent", agent, "--task", "scripted", "--scenario", str(scenario),
                    "--timeout", str(timeout), "--port", "0", "--workspace_root", str(tmp_path / "workspace"),
                    "--results_dir", str(tmp_path / "results"), "--db_connection_string", db_uri,
                    "--engine_args", ENGINE_ARGS, *extra),
        capture_output=True, text=True, env=run_env(), timeout=600)


def test_run_with_the_template_agent(tmp_path: Path, db_uri: str, scripted_model_dir: Path) -> None:
    scenario = write_scenario(tmp_path, scripted_model_dir)
    done = run_bench(tmp_path, db_uri, scenario, "template", 300)
    assert done.returncode == 0, done.stdout + done.stderr
    [result_file] = (tmp_path / "results").glob("*_scripted_template/result.json")
    result = json.loads(result_file.read_text())
    assert result["success"] is True and result["baseline"] == 100.0 and result["total_submissions"] == 1
    assert result["best"]["score"] == 100.0 and result["improvement"] == 0.0
    assert (result_file.parent / "best_model").resolve() == Path(result["workspace"]) / "output" / "v1"
    rows = (tmp_path / "results" / "results.csv").read_text().splitlines()
    assert rows[0].startswith("run_id,") and ",scripted,template," in rows[1]

    workspace = Path(result["workspace"])
    assert sorted(p.name for p in (workspace / "data").iterdir()) == ["train.jsonl"]
    assert stat.S_IMODE((workspace / "data" / "train.jsonl").stat().st_mode) == 0o444  # read-only copy
    assert stat.S_IMODE((workspace / "data").stat().st_mode) == 0o555
    assert json.loads((workspace / "scenario.json").read_text())["test_data_path"] is None
    text = reachable_text(workspace)
    test_file = str(tmp_path / "scenario-data" / "test.jsonl")
    assert MARKER not in text and test_file not in text and "What is 7 * 8?" not in text
    log = (workspace / "agent.log").read_text()
    assert "submit:" in log and str(workspace / "models") in log  # MODEL_PATH was set


def test_timeout_kills_the_agents_process_group(tmp_path: Path, db_uri: str, scripted_model_dir: Path) -> None:
    agents = tmp_path / "agents" / "sleeper"
    agents.mkdir(parents=True)
    (agents / "config.yaml").write_text("name: sleeper\nenv_vars:\n  GREETING: hello\n")
    pid_file = tmp_path / "child.pid"
    (agents / "start.sh").write_text(
        f'echo "$GREETING $TASK $GRADING_SERVER_URL"\n'
        f"sleep 1000 &\necho $! > {pid_file}\n"
        "trap '' TERM\n"  # the leader ignores SIGTERM: SIGKILL must follow
        "while true; do sleep 1; done\n")
    scenario = write_scenario(tmp_path, scripted_model_dir)
    started = time.monotonic()
    done = run_bench(tmp_path, db_uri, scenario, "sleeper", 5, "--agents_dir", str(tmp_path / "agents"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "timed out after 5 s" in done.stdout and time.monotonic() - started < 240
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    [result_file] = (tmp_path / "results").glob("*_scripted_sleeper/result.json")
    result = json.loads(result_file.read_text())
    assert result["success"] is False and result["best"] is None and result["total_submissions"] == 0
    assert result["how_it_ended"] == "timed out after 5 s"
    assert "hello scripted http://127.0.0.1:" in (Path(result["workspace"]) / "agent.log").read_text()


def test_unknown_agent_and_bad_scenario_are_clear_errors(tmp_path: Path) -> None:
    done = subprocess.run(agentrl_cmd("bench", "run", "--agent", "nope", "--task", "arith", "--workspace_root",
                                      str(tmp_path / "ws")), capture_output=True, text=True, env=run_env(), timeout=60)
    assert done.returncode == 2 and "unknown agent 'nope'" in done.stderr and "template" in done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("id: x\nname: X\ntrain_data: missing.jsonl\ntest_data: missing.jsonl\nmetric: 3\n")
    done = subprocess.run(agentrl_cmd("bench", "list", "--scenario", str(bad)), capture_output=True, text=True,
                          env=run_env(), timeout=60)
    assert done.returncode == 2 and str(bad) in done.stderr and "metric" in done.stderr
    assert not (tmp_path / "ws").exists()
