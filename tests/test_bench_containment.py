"""AutoRL-Bench's containment and grading record, attacked: a snooping agent (tests/agents/snoop) run by a real
`agentrl bench run` tries to read the held-out data, the grading state, other processes and the evaluation
database, and to change its results; it finds and changes nothing, and every grading is recorded and counted. A
grading that crashes is recorded as failed and the run ends; an evaluation past its timeout fails; a machine that
cannot contain the agent refuses to run it; submitted models are copied without following links or blocking."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from pymongo.uri_parser import parse_uri

from agentrl.autorl_bench.agent import PASSED_THROUGH
from agentrl.autorl_bench.evaluation import Evaluator
from agentrl.autorl_bench.grading import GradingState
from agentrl.autorl_bench.scenarios import ScenarioSet, bench_home, load_file
from agentrl.autorl_bench.snapshots import SnapshotError, SnapshotStore
from bench_fixtures import ENGINE_ARGS, MARKER, needs_containment, run_bench, write_scenario
from rollout_fixtures import agentrl_cmd, run_env

pytestmark = pytest.mark.slow(start_rank=9)

AGENTS = Path(__file__).parent / "agents"
OTHER_RUN_SECRET = "OTHER-RUN-SECRET-41c9"


def _result(tmp_path: Path, agent: str) -> dict:
    [result_file] = (tmp_path / "results").glob(f"*_scripted_{agent}/result.json")
    return json.loads(result_file.read_text())


def test_a_snooping_agent_finds_and_changes_nothing(tmp_path: Path, db_uri: str, scripted_model_dir: Path) -> None:
    needs_containment()
    scenario = write_scenario(tmp_path, scripted_model_dir)
    other_run = tmp_path / "workspace" / "scripted" / "20000101T000000_other" / "output"
    other_run.mkdir(parents=True)
    (other_run / "notes.txt").write_text(OTHER_RUN_SECRET)
    builtin_test = ScenarioSet().get("arith").test_data_path  # a built-in test set in the bench cache
    database = parse_uri(db_uri)
    host, port = database["nodelist"][0]
    targets = {"files": [str(tmp_path / "scenario-data" / "test.jsonl"), builtin_test, str(other_run / "notes.txt")],
               "dirs": [str(tmp_path / "results"), str(tmp_path / "workspace"), str(bench_home()), str(tmp_path),
                        str(Path.home() / ".agentrl")],
               "database": f"{host}:{port}", "stamp": f"snoop-was-here-{uuid.uuid4().hex}"}
    done = run_bench(tmp_path, db_uri, scenario, "snoop", 300, "--agents_dir", str(AGENTS), "--max_evaluations", "4",
                     "--agent_env", "SNOOP_TARGETS", env={**run_env(), "SNOOP_TARGETS": json.dumps(targets)})
    assert done.returncode == 0, done.stdout + done.stderr
    result = _result(tmp_path, "snoop")
    workspace = Path(result["workspace"])
    report = json.loads((workspace / "output" / "snoop.json").read_text())
    text = json.dumps(report)

    # Found nothing: no held-out row, no other run's file, no database, no server or evaluation process.
    for secret in (MARKER, "What is 7 * 8?", OTHER_RUN_SECRET, database["database"], "autorl-bench",
                   "--db_connection_string", "--tasks", "AGENTRL_BENCH_ADMIN_TOKEN", "Bearer", "mongodb://"):
        assert secret not in text, secret
    assert all(content.startswith("ERROR") for content in report["files"].values()), report["files"]
    assert report["database"].startswith("ERROR")
    for root in (tmp_path / "results", bench_home(), Path.home() / ".agentrl"):
        assert report["walked"][str(root)] == {}
    assert all(not name.endswith("test.jsonl") for name in report["beside_train_data"])
    assert set(report["environ"]) <= {"PATH", "HOME", "LANG", "TASK", "BASE_MODEL", "WORKSPACE", "MODEL_PATH",
                                      "DATA_PATH", "OUTPUT_DIR", "GRADING_SERVER_URL", "PWD", "SHLVL", "_",
                                      *PASSED_THROUGH}
    commands = [row["cmdline"] for row in report["processes"]]
    assert len(commands) <= 5 and not any("bench serve" in c or "agentrl.cli.main" in c for c in commands), commands
    assert "bwrap --args " in commands[0]  # its mounts are not on its command line: no host path shows there
    assert not any(str(tmp_path / "results") in c or str(scripted_model_dir) in c for c in commands)
    fds = {target for target in report["fds"].values() if not target.startswith("/proc/")}
    assert fds <= {"/dev/null", str(workspace / "agent.log")}, report["fds"]

    # Changed nothing: forged records are ignored (what the orchestrator wrote is read-only), the baseline stays.
    forged = report["forge"]
    assert forged[str(workspace / "run_meta.json")].startswith("ERROR")
    assert forged[str(workspace / "output" / "scores.json")] == "written"
    assert report["hard_link"] == "linked"  # the writable directories are one file system, as uncontained
    assert {name: reply["status"] for name, reply in report["set_baseline"].items()} == {
        "json": 403, "guessed_token": 403, "cross_site_plain": 403}
    for root in targets["dirs"]:
        assert not (Path(root) / targets["stamp"]).exists()

    # Every grading recorded and counted, failed ones too; the budget holds; nothing graded off the record.
    assert report["evaluate"]["test_file"]["status"] == 400
    assert report["evaluate"]["other_scenario"]["status"] == 403
    honest = json.loads(report["evaluate"]["honest"]["body"])
    assert honest["score"] == 100.0 and honest["details"]["submission_id"] == 1
    assert "is not a regular file" in json.loads(report["validate"]["linked"]["body"])["error"]
    assert report["validate"]["elsewhere"]["status"] == 400
    submits = report["submit"]
    for name in ("linked", "fifo"):
        assert "is not a regular file" in json.loads(submits[name]["body"])["error"]
    assert submits["elsewhere"]["status"] == 400 and submits["over_budget"]["status"] == 429
    assert json.loads(submits["honest"]["body"])["score"] == 100.0
    assert result["total_submissions"] == 4 and result["failed_submissions"] == 2 and result["max_evaluations"] == 4
    assert result["baseline"] == 100.0 and result["best"]["score"] == 100.0 and result["best"]["submission_id"] == 1
    record = GradingState.load(Path(result["best_model"]).parents[1] / "grading.json")
    assert [s.via for s in record.submissions] == ["evaluate", "submit", "submit", "submit"]
    assert record.baseline_score == 100.0
    best_model = Path(result["best_model"])
    assert (best_model / "config.json").read_text() == (scripted_model_dir / "config.json").read_text()
    assert best_model.is_relative_to(tmp_path / "results") and not best_model.is_relative_to(workspace)


def test_a_grading_that_crashes_is_recorded_and_the_run_ends(tmp_path: Path, db_uri: str,
                                                             scripted_model_dir: Path) -> None:
    """The grading code raises after the evaluation (a failpoint in the grading server only: the agent's clean
    environment does not carry it); the template agent's submission ends as a recorded failure and the run ends."""
    needs_containment()
    scenario = write_scenario(tmp_path, scripted_model_dir)
    started = time.monotonic()
    done = run_bench(tmp_path, db_uri, scenario, "template", 300,
                     env={**run_env(), "AGENTRL_FAILPOINTS": "bench.grade.before_record"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 300
    result = _result(tmp_path, "template")
    assert result["total_submissions"] == 1 and result["failed_submissions"] == 1 and result["best_model"] is None
    assert result["best"]["score"] == 0.0 and result["best"]["error"] == "the grading failed inside the grading server"
    assert "the grading failed inside the grading server" in (Path(result["workspace"]) / "agent.log").read_text()


def test_an_evaluation_past_its_timeout_fails_and_is_stopped(tmp_path: Path, db_uri: str,
                                                             scripted_model_dir: Path) -> None:
    scenario = load_file(write_scenario(tmp_path, scripted_model_dir))
    model = shutil.copytree(scripted_model_dir, tmp_path / "model")  # a path no other process names
    evaluator = Evaluator(db_connection_string=db_uri, state_dir=tmp_path / "state", engine_args=ENGINE_ARGS,
                          timeout_s=2)
    started = time.monotonic()
    result = asyncio.run(evaluator.evaluate(scenario, model, "slow"))
    assert result.score is None and result.error == "the evaluation did not finish within 2 s"
    assert time.monotonic() - started < 30
    [log] = (tmp_path / "state" / "logs").glob("*.log")
    assert str(log) in result.detail and str(log) not in result.error
    deadline = time.monotonic() + 20  # the engine it started is stopped with it
    while _processes_with(str(model)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_with(str(model)) == []


def _processes_with(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_no_containment_no_run(tmp_path: Path, scripted_model_dir: Path) -> None:
    """Where bubblewrap cannot run, `bench run` refuses before it prepares anything, and says how to go on."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    if any(shutil.which("bwrap", path=str(directory)) for directory in (empty, "/usr/sbin", "/sbin")):
        pytest.skip("bwrap is installed in /usr/sbin or /sbin here")
    scenario = write_scenario(tmp_path, scripted_model_dir)
    done = subprocess.run(
        agentrl_cmd("bench", "run", "--agent", "template", "--task", "scripted", "--scenario", str(scenario),
                    "--workspace_root", str(tmp_path / "workspace"), "--results_dir", str(tmp_path / "results")),
        capture_output=True, text=True, env={**run_env(), "PATH": str(empty)}, timeout=120)
    assert done.returncode == 2 and "cannot be contained" in done.stderr and "not found on PATH" in done.stderr
    assert "--uncontained" in done.stderr
    assert not (tmp_path / "workspace").exists() and not (tmp_path / "results").exists()


def _model(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(b"\0" * 1024)
    return directory


def test_snapshots_refuse_links_and_fifos_and_share_equal_models(tmp_path: Path) -> None:
    workspace, secret = tmp_path / "ws", tmp_path / "secret.jsonl"
    secret.write_text(MARKER)
    store = SnapshotStore(tmp_path / "store")
    first, second = _model(workspace / "output" / "a"), _model(workspace / "output" / "b")
    copy = store.take(workspace, first)
    assert store.take(workspace, second) == copy and copy.parent == store.root  # equal models, one copy
    assert (copy / "config.json").read_text() == '{"model_type": "llama"}'

    (second / "config.json").unlink()
    (second / "config.json").symlink_to(secret)
    with pytest.raises(SnapshotError, match="is not a regular file"):
        store.take(workspace, second)
    (second / "config.json").unlink()
    os.mkfifo(second / "config.json")  # a reader would block: refused without opening it
    with pytest.raises(SnapshotError, match="is not a regular file"):
        store.take(workspace, second)
    # A directory swapped for a link after the path was checked: never followed.
    (workspace / "output" / "elsewhere").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(SnapshotError, match="symbolic links are not followed"):
        store.take(workspace, workspace / "output" / "elsewhere")
    assert not any(MARKER in p.read_text(errors="replace") for p in store.root.rglob("*") if p.is_file())

    third = _model(workspace / "output" / "c")
    (third / "model.safetensors").write_bytes(b"\1" * 1024)
    other = store.take(workspace, third)
    store.release(other)
    store.prune(keep={copy})  # `copy` is also still in use; `other` is neither
    assert copy.is_dir() and not other.exists()
    assert [p for p in store.root.iterdir() if p.name.startswith(".tmp-")] == []
    (store.root / ".tmp-killed").mkdir()  # a copy a killed server left half made: gone when the store reopens
    SnapshotStore(store.root)
    assert sorted(p.name for p in store.root.iterdir()) == [copy.name]


def test_sigterm_during_the_baseline_stops_the_server_and_its_evaluation(tmp_path: Path, db_uri: str,
                                                                        scripted_model_dir: Path) -> None:
    model = shutil.copytree(scripted_model_dir, tmp_path / "model")  # a path no other process names
    scenario = write_scenario(tmp_path, model)
    process = subprocess.Popen(
        agentrl_cmd("bench", "run", "--agent", "template", "--task", "scripted", "--scenario", str(scenario),
                    "--port", "0", "--workspace_root", str(tmp_path / "workspace"), "--results_dir",
                    str(tmp_path / "results"), "--db_connection_string", db_uri, "--engine_args", ENGINE_ARGS,
                    "--uncontained"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env())
    assert process.stdout is not None
    for line in process.stdout:
        if "baseline: evaluating" in line:
            break
    deadline = time.monotonic() + 60  # until the evaluation runs
    while not _processes_with(f"{tmp_path}/results") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_processes_with(f"{tmp_path}/results")) >= 2  # the grading server and agentrl eval
    process.terminate()
    assert process.wait(timeout=60) == 130
    deadline = time.monotonic() + 30
    while _processes_with(str(tmp_path)) and time.monotonic() < deadline:  # the engine names the model there
        time.sleep(0.5)
    assert _processes_with(str(tmp_path)) == []


def test_the_best_of_equal_scores_is_a_graded_submission() -> None:
    """A failed grading scores 0; a model graded 0 beats it (its copy becomes best_model), then the earliest."""
    def entry(number: int, score: float, error: str | None) -> dict:
        return {"submission_id": number, "timestamp": "t", "model_path": "m", "score": score, "baseline_score": 0.0,
                "improvement": score, "elapsed_seconds": 1.0, "metrics": {}, "error": error}

    state = GradingState.model_validate({"submissions": [entry(1, 0.0, "copy refused"), entry(2, 0.0, None),
                                                         entry(3, 0.0, None)]})
    assert state.best().submission_id == 2
    state.submissions.append(GradingState.model_validate({"submissions": [entry(4, 5.0, None)]}).submissions[0])
    assert state.best().submission_id == 4
    assert GradingState().best() is None
