"""Run progress from the database: `agentrl watch` (live line, zero-variance warning, Records not trained per failure
class) and `agentrl report` (the summary of a run, and why a run trained nothing), on a real sampler's
documents."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from agentrl.store.models import ZERO_VARIANCE_DECISION as ZERO_VARIANCE
from agentrl.store.models import FailureClass
from agentrl.store.progress import Progress
from rollout_fixtures import agentrl_cmd, run_env, sample_args, upload, write_mcp_config, write_script_tasks
from test_rollout_sampler import run_sampler

pytestmark = pytest.mark.slow


def test_the_zero_variance_warning_needs_enough_groups_mostly_dropped() -> None:
    assert Progress(groups_kept=0, groups_dropped=Counter({ZERO_VARIANCE: 3})).zero_variance_warning() is None
    assert Progress(groups_kept=2, groups_dropped=Counter({ZERO_VARIANCE: 4})).zero_variance_warning() is None
    failing = Progress(groups_kept=1, groups_dropped=Counter({ZERO_VARIANCE: 5}), zero_variance_solved=1)
    warning = failing.zero_variance_warning()
    assert warning is not None and warning.startswith(
        "5 of 6 groups were dropped for zero reward variance (1 always solved, 4 never solved)")
    # says what to do about each kind, the more frequent first
    assert warning.index("never solved: give the model a warm start (WARMUP") < warning.index("use harder tasks")


def test_the_zero_variance_warning_says_which_groups_were_dropped() -> None:
    """Groups always solved (as after a warm-up) are never called never solved, not even when as many were."""
    solved = Progress(groups_kept=1, groups_dropped=Counter({ZERO_VARIANCE: 4}), zero_variance_solved=4)
    warning = solved.zero_variance_warning()
    assert "(4 always solved, 0 never solved)" in warning and "use harder tasks" in warning
    assert "never solved:" not in warning and "WARMUP" not in warning
    even = Progress(groups_kept=0, groups_dropped=Counter({ZERO_VARIANCE: 4}), zero_variance_solved=2)
    warning = even.zero_variance_warning()
    assert "(2 always solved, 2 never solved)" in warning and "use harder tasks" in warning and "WARMUP" in warning


def test_watch_and_report_explain_a_run_whose_groups_all_lack_variance(
        db_uri: str, tmp_path: Path, scripted_model_dir: Path, scripted_engine_url: str) -> None:
    # Greedy decoding of the scripted model answers each task the same way every time: no group has variance.
    # Not ``coin``: which of its two trained endings (right, wrong) greedy picks depends on the scripted model's
    # training, which differs in its last bits between machines; ``add`` is asked twice instead.
    tasks = write_script_tasks(tmp_path / "tasks.jsonl", ("add", "mul", "bad"))
    again = json.loads(tasks.read_text().splitlines()[0])
    with tasks.open("a") as rows:
        rows.write(json.dumps({**again, "id": "add-again"}) + "\n")
    upload(db_uri, tasks, "--num_generations", "2")
    run_sampler(sample_args(db_uri, scripted_model_dir, scripted_engine_url, write_mcp_config(tmp_path / "mcp.json"),
                            "--temperature", "0"))
    watch = subprocess.run(agentrl_cmd("watch", "--db_connection_string", db_uri, "--until_pid", "999999999"),
                           capture_output=True, text=True, env=run_env(), timeout=60)
    assert watch.returncode == 0, watch.stderr
    # what the group decisions show: the scripted model answers these four tasks right every time
    assert "warning: 4 of 4 groups were dropped for zero reward variance (4 always solved, 0 never solved)" \
        in watch.stdout
    assert "trajectories 8 done, 0 running" in watch.stdout
    assert "groups 0 kept, 4 dropped (4 zero variance)" in watch.stdout
    assert "| not trained 8 (" in watch.stdout  # every Record, per failure class

    eval_file = tmp_path / "eval-before.json"
    eval_file.write_text(json.dumps({"name": "before", "num_tasks": 4, "metrics": {
        "accuracy": 0.25, "mean_reward": 0.3, "tasks": 4, "correct": 1, "errors": 0},
        "per_task": [{"id": "add", "correct": 1, "valid": 1}]}))
    out = tmp_path / "summary.json"
    report = subprocess.run(agentrl_cmd("report", "--db_connection_string", db_uri, "--eval", f"before={eval_file}",
                                        "--wall_s", "12", "--out", str(out)),
                            capture_output=True, text=True, env=run_env(), timeout=60)
    assert report.returncode == 0, report.stderr
    assert "0 trainer steps: 8 trajectories" in report.stdout and "(whole run 0.2 min)" in report.stdout
    assert "nothing was trained: 4 of 4 groups were dropped for zero reward variance" in report.stdout
    summary = json.loads(out.read_text())
    assert (summary["steps"], summary["trajectories"], summary["wall_s"]) == (0, 8, 12)
    assert summary["groups_dropped"] == {ZERO_VARIANCE: 4}
    assert sum(summary["failures"].values()) == 8 and set(summary["failures"]) <= {str(f) for f in FailureClass}
    assert "8 records not trained, by failure class: " in report.stdout
    assert summary["eval"]["before"]["accuracy"] == 0.25 and summary["eval"]["before"]["num_tasks"] == 4
    assert [v["policy_version"] for v in summary["reward_by_version"]] == [0]
    assert summary["reward_by_version"][0]["records"] == 8

    bad = subprocess.run(agentrl_cmd("report", "--db_connection_string", db_uri, "--eval", "before"),
                         capture_output=True, text=True, env=run_env(), timeout=60)
    assert bad.returncode == 2 and "expected LABEL=FILE" in bad.stderr
