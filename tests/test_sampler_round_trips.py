"""Database round trips per trajectory (issue 28 item 4), counted by PyMongo's command monitoring in a real
``agentrl sample`` process (``agentrl.store.command_count``): from its claim to its settlement a trajectory costs
2 commands to claim (its slot on the Task, its Record), none per LLM or tool call (the inference pool picks a
service from its cached view; the lease's fence needs no heartbeat while the lease holds long enough), 1 to write
its calls and 3 to settle (its outcome with the score, the slot on the Task, the lease dropped) — 6 whatever its
number of turns. Per group come 2 for admission control, 1 to hand the group stage over and the stage itself;
once per process the pool's first view of the services and the first claim's recovery probe."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from rollout_fixtures import agentrl_cmd, documents, run_env, sample_args, upload, write_mcp_config, write_script_tasks

pytestmark = pytest.mark.slow

PER_TRAJECTORY = 6
GENERATIONS = 4


def _run(args: list[str]) -> tuple[float, dict[int, int], dict[str, int]]:
    """The median commands per trajectory, the histogram and the commands by part of one sampler run."""
    done = subprocess.run(args, capture_output=True, text=True, env=run_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    median = float(re.search(r"database commands per trajectory: ([\d.]+) \(median\)", done.stdout).group(1))
    line = next(line for line in done.stderr.splitlines() if "trajectories by their commands" in line)
    histogram = {int(k): v for k, v in json.loads(line.rsplit("settlement: ", 1)[1]).items()}
    by_part = re.search(r"\(([^()]*)\); trajectories by their commands", line).group(1)
    parts = {name: int(n) for name, n in re.findall(r"(\w+) (\d+)", by_part)}
    return median, histogram, parts


@pytest.mark.parametrize("turns", [2, 1])
def test_a_trajectory_costs_six_commands_whatever_its_turns(db_uri: str, tmp_path: Path, scripted_model_dir: Path,
                                                            scripted_engine_url: str, turns: int) -> None:
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add", "mul")), "--num_generations",
           str(GENERATIONS))
    common = ("--temperature", "0", "--max_concurrent_samples_per_process", "1")
    if turns == 2:  # the scripted model calls the calculator, reads its result and answers
        args = sample_args(db_uri, scripted_model_dir, scripted_engine_url, write_mcp_config(tmp_path / "mcp.json"),
                           *common)
    else:  # one LLM call and nothing else: no tools, one turn
        args = agentrl_cmd("sample", "--db_connection_string", db_uri, "--model_name_or_path",
                           str(scripted_model_dir), "--inference_urls", scripted_engine_url, "--max_turns", "1",
                           "--max_new_tokens", "40", "--exit_when_done", "true", *common)
    median, histogram, parts = _run(args)
    calls = documents(db_uri, "DispatchedSamplingTask")
    assert len(calls) == 2 * GENERATIONS * turns and all(c["status"] != "running" for c in calls)
    trajectories, groups = 2 * GENERATIONS, 2
    assert sum(histogram.values()) == trajectories
    assert median == PER_TRAJECTORY
    # Beyond the 6: the last trajectory of each group hands its group stage over (1); the first of the process
    # also looks for expired leases and for a started group (2) and reads the services (2). Under load (the suite's
    # parallel workers) a call may find the pool's view of the services stale and read it again: a few more.
    assert sum(n * count for n, count in histogram.items()) <= PER_TRAJECTORY * trajectories + groups + 4 + 4, (
        histogram, parts)
    assert parts["admission"] <= 2 * groups
