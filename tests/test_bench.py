"""AutoRL-Bench end to end: a real `agentrl bench serve` process grading the scripted tiny model through real `agentrl
eval` runs (engine, calculator MCP server over stdio, database), checked against AutoRL-Bench's grading and scenario
endpoint tables (docs/autorl-bench.md); `agentrl bench run` with the template agent (contained: no held-out data
reachable from the workspace; results from the grading server's record) and with an agent that outlives its timeout,
contained and uncontained (every process it started is killed). tests/test_bench_containment.py attacks the
containment."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from agentrl.autorl_bench.grading import GradingState
from bench_fixtures import MARKER, needs_containment, reachable_text, run_bench, start_server, write_scenario
from rollout_fixtures import agentrl_cmd, run_env

pytestmark = pytest.mark.slow(start_rank=3)


def _check_scenario_api(http: httpx.Client, ws: Path, model_dir: Path) -> None:
    root = http.get("/").json()
    assert root["name"] == "AutoRL-Bench" and {"gsm8k", "arith", "humaneval", "textcraft",
                                                "scripted"} <= set(root["scenarios"])
    assert "/submit" in root["endpoints"] and "/scenarios/{scenario_id}" in root["endpoints"]
    listed = {s["id"]: s for s in http.get("/scenarios").json()["scenarios"]}
    assert listed["scripted"] == {"id": "scripted", "name": "Scripted calculator", "type": "offline",
                                  "base_model": str(model_dir), "baseline_score": 50.0, "metric": "accuracy"}
    detail = http.get("/scenarios/scripted").json()  # the graded task: the workspace's copies
    assert detail["train_data"] == detail["train_data_path"] == str(ws / "data" / "train.jsonl")
    assert detail["test_data_path"] is None and detail["test_data"] == {"num_items": 2, "hidden": True}
    assert detail["base_model_path"] == str(ws / "models" / model_dir.name) and detail["baseline_score"] == 50.0
    other = http.get("/scenarios/arith").json()  # another scenario: no paths while grading a task
    assert other["train_data"] is None and other["base_model_path"] is None
    missing = http.get("/scenarios/nope")
    assert missing.status_code == 404 and "scripted" in missing.json()["available"]


def _check_foreign_requests_are_refused(http: httpx.Client) -> None:
    """A browser's cross-site form post (text/plain), a cross-origin JSON post, DNS rebinding."""
    plain = http.post("/set_baseline", content=b'{"score": 1}', headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Host": "evil.example:5000"}):
        assert http.post("/set_baseline", json={"score": 1}, headers=headers).status_code == 403, headers
    assert http.get("/history", headers={"Host": "rebound.example"}).status_code == 403


def _check_interact(http: httpx.Client) -> None:
    """/interact: environment sessions on the scenario's training goals only (not on held-out or held-back ones)."""
    from agentrl.autorl_bench.scenarios import ScenarioSet

    textcraft = ScenarioSet().get("textcraft")  # the server's data: one installation, one secret
    train, test = ({json.loads(line)["env"]["data_idx"] for line in Path(path).read_text().splitlines()}
                   for path in (textcraft.train_data_path, textcraft.test_data_path))
    first = min(train)
    started = http.post("/interact", json={"scenario_id": "textcraft", "data_idx": first}).json()
    assert "Goal" in started["observation"] and started["done"] is False and started["info"]["data_idx"] == first
    step = http.post("/interact", json={"scenario_id": "textcraft", "session_id": started["session_id"],
                                        "action": "inventory"}).json()
    assert step["session_id"] == started["session_id"] and "Inventory" in step["observation"]
    held_back = min(set(range(544)) - train - test)
    for refused_idx in (min(test), held_back):
        refused = http.post("/interact", json={"scenario_id": "textcraft", "data_idx": refused_idx})
        assert refused.status_code == 400 and "training data" in refused.json()["detail"], refused_idx
    random_start = http.post("/interact", json={"scenario_id": "textcraft"}).json()
    assert random_start["info"]["data_idx"] in train
    assert http.post("/interact", json={"scenario_id": "scripted"}).status_code == 400


def test_grading_and_scenario_apis(tmp_path: Path, db_uri: str, scripted_model_dir: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data" / "train.jsonl").write_text("{}\n")
    (ws / "models" / scripted_model_dir.name).mkdir(parents=True)
    process, url = start_server(tmp_path, db_uri, write_scenario(tmp_path, scripted_model_dir))
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            _check_scenario_api(http, ws, scripted_model_dir)
            health = http.get("/health").json()
            assert health["status"] == "ok" and health["task"] == "scripted" and health["workspace"] == str(ws)
            assert health["available_gpus"] == [] and health["pending_evaluations"] == 0
            assert http.get("/best").status_code == 404 and http.get("/best").json() == {"error": "No submissions"}
            assert http.get("/history").json() == []
            assert http.post("/set_baseline", json={}).status_code == 400
            _check_foreign_requests_are_refused(http)
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
            assert not any("snapshot" in e or "detail" in e or "database" in e["metrics"] for e in history)

            # Scenario API: on a server grading a task, /evaluate is a recorded grading of the task.
            evaluated = http.post("/evaluate", json={"scenario_id": "scripted", "model_path": str(v1)}).json()
            assert evaluated["score"] == 100.0 and evaluated["baseline"] == 25.0 and evaluated["improvement"] == 75.0
            assert evaluated["improvement_pct"] == "+300.00%" and evaluated["details"]["correct"] == 2
            assert evaluated["details"]["submission_id"] == 4 and "database" not in evaluated["details"]
            assert http.post("/evaluate", json={"scenario_id": "arith", "model_path": str(v1)}).status_code == 403
            assert http.post("/evaluate", json={"scenario_id": "scripted",
                                                "model_path": str(tmp_path / "no-model")}).status_code == 400
            assert [e["via"] for e in http.get("/history").json()] == ["submit"] * 3 + ["evaluate"]

            _check_interact(http)
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0

    # The record is the server's, in its state directory: nothing in the workspace.
    record = GradingState.load(tmp_path / "state" / "grading.json")
    assert [s.public() for s in record.submissions[:3]] == history
    assert record.baseline_score == 25.0 and record.submissions[0].snapshot.startswith(str(tmp_path / "state"))
    assert sorted(p.name for p in ws.iterdir()) == ["data", "models", "output"]
    calls = [json.loads(line) for line in (tmp_path / "state" / "interactions.jsonl").read_text().splitlines()]
    submits = [c for c in calls if c["endpoint"] == "/submit"]
    assert [c["status"] for c in submits] == [400, 200, 200, 202]
    assert submits[1]["request"] == {"model_path": "output/v1"} and submits[1]["response"]["score"] == 100.0
    assert all({"timestamp", "method", "elapsed_seconds"} <= set(c) for c in calls)
    assert MARKER not in (tmp_path / "state" / "interactions.jsonl").read_text()


def test_run_with_the_template_agent(tmp_path: Path, db_uri: str, scripted_model_dir: Path) -> None:
    needs_containment()
    scenario = write_scenario(tmp_path, scripted_model_dir)
    done = run_bench(tmp_path, db_uri, scenario, "template", 300)
    assert done.returncode == 0, done.stdout + done.stderr
    [result_file] = (tmp_path / "results").glob("*_scripted_template/result.json")
    result = json.loads(result_file.read_text())
    assert result["success"] is True and result["baseline"] == 100.0 and result["total_submissions"] == 1
    assert result["best"]["score"] == 100.0 and result["improvement"] == 0.0 and result["contained"] is True
    assert result["best"]["model_path"] == str(Path(result["workspace"]) / "output" / "v1")
    # best_model is the grading server's copy of what it graded, not the agent's directory
    best_model = (result_file.parent / "best_model").resolve()
    assert best_model == Path(result["best_model"])
    assert best_model.parent == result_file.parent / "evaluations" / "models"
    assert sorted(p.name for p in best_model.iterdir()) == sorted(p.name for p in scripted_model_dir.iterdir())
    assert json.loads((result_file.parent / "scores.json").read_text())[0]["score"] == 100.0
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


def _processes_with(marker: str) -> list[int]:
    """PIDs of this machine's processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("mode", ["contained", "uncontained"])
def test_timeout_kills_everything_the_agent_started(tmp_path: Path, db_uri: str, scripted_model_dir: Path,
                                                    mode: str) -> None:
    if mode == "contained":
        needs_containment()
    agents = tmp_path / "agents" / "sleeper"
    agents.mkdir(parents=True)
    (agents / "config.yaml").write_text("name: sleeper\nenv_vars:\n  GREETING: hello\n")
    marker = f"1000.{os.getpid()}{int(time.time())}"  # a sleep no other process runs
    (agents / "start.sh").write_text(
        f'echo "$GREETING $TASK $GRADING_SERVER_URL"\n'
        f"sleep {marker} &\n"
        f"setsid sleep {marker} &\n"  # a new session: no longer in the agent's process group
        "trap '' TERM\n"  # the leader ignores SIGTERM: SIGKILL must follow
        "while true; do sleep 1; done\n")
    scenario = write_scenario(tmp_path, scripted_model_dir)
    started = time.monotonic()
    flags = ["--uncontained"] if mode == "uncontained" else []
    done = run_bench(tmp_path, db_uri, scenario, "sleeper", 5, "--agents_dir", str(tmp_path / "agents"), *flags)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "timed out after 5 s" in done.stdout and time.monotonic() - started < 240
    left = _processes_with(marker)
    if mode == "uncontained":  # a process that left the agent's session outlives it there
        assert len(left) == 1
        os.kill(left[0], signal.SIGKILL)
    else:
        assert left == []
    [result_file] = (tmp_path / "results").glob("*_scripted_sleeper/result.json")
    result = json.loads(result_file.read_text())
    assert result["success"] is False and result["best"] is None and result["total_submissions"] == 0
    assert result["how_it_ended"] == "timed out after 5 s" and result["contained"] is (mode == "contained")
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
