"""AutoRL-Bench test helpers: a scenario the scripted model solves, a `bench serve` process, `bench run`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from agentrl.autorl_bench import containment
from rollout_fixtures import agentrl_cmd, run_env
from scripted_model import SCRIPTS

ENGINE_ARGS = "--num_threads 1 --max_total_tokens 8192"


def needs_containment() -> None:
    """Skip where an agent cannot be contained (no bubblewrap, no user namespaces)."""
    try:
        containment.check()
    except containment.ContainmentUnavailable as error:
        pytest.skip(str(error))


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


def reachable_text(root: Path) -> str:
    """Every file reachable from ``root``, following symbolic links, as one text."""
    parts = []
    for dirpath, _, files in os.walk(root, followlinks=True):
        for name in files:
            path = Path(dirpath) / name
            parts.append(str(path))
            parts.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(parts)


def run_bench(tmp_path: Path, db_uri: str, scenario: Path, agent: str, timeout: float, *extra: str,
              env: dict[str, str] | None = None, task: str = "scripted") -> subprocess.CompletedProcess:
    """``agentrl bench run`` of ``agent`` on ``task`` (default: the scripted scenario), with the scripted scenario
    file known (workspaces and results under ``tmp_path``)."""
    return subprocess.run(
        agentrl_cmd("bench", "run", "--agent", agent, "--task", task, "--scenario", str(scenario),
                    "--timeout", str(timeout), "--port", "0", "--workspace_root", str(tmp_path / "workspace"),
                    "--results_dir", str(tmp_path / "results"), "--db_connection_string", db_uri,
                    "--engine_args", ENGINE_ARGS, *extra),
        capture_output=True, text=True, env=env or run_env(), timeout=600)
