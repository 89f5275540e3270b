"""A real sampler process killed at each failpoint of the claim, sample, slot and group-stage protocols
(``agentrl.failpoints``: ``os._exit``, no cleanup, like SIGKILL), then a fresh sampler finishing the split.

Invariants after recovery: every slot settled exactly once with one finished attempt, nothing ``running`` or
leased, every Task ``completed`` with its group stage done, and the queue holds exactly one sample per ``ready``
Record (nothing lost, nothing queued twice).
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest

from agentrl.failpoints import ENV, EXIT_CODE
from rollout_fixtures import documents, run_env, sample_args, upload, write_mcp_config, write_script_tasks

pytestmark = pytest.mark.slow(start_rank=0)

FINISHED = ("scored", "ready", "trained", "abandoned")
COMMON = ("--temperature", "0", "--zero_variance_threshold", "0", "--drop_zero_advantage", "false", "--lease_s",
          "2", "--max_concurrent_samples_per_process", "4")


@pytest.mark.parametrize("crashes", [
    ("slots.claim.before_record=exit@3",),  # a slot claimed on its Task without a Record: sweep
    ("sampler.sample.before_finish=exit@2",),  # a completed, unscored trajectory: retaken as a new attempt
    ("slots.finish.after_record=exit@2",),  # scored, unsettled: take-over completes the settlement
    ("slots.finish.after_settle=exit@4",),  # settled, lease and group stage left: recovered
    ("group_stage.after_credits=exit",),  # per-turn credits written, no Record moved: redone, the same values
    ("group_stage.after_ready=exit@2",),  # the group stage cut mid-way: redone over the same group
    ("group_stage.before_complete=exit",),
    # a completed trajectory left leased, then the sampler taking it over dies between retiring it and inserting
    # its successor: sweep recovers the slot
    ("sampler.sample.before_finish=exit@1", "slots.take_over.between_writes=exit"),
], ids=lambda crashes: "+".join(c.split("=")[0] for c in crashes))
def test_a_sampler_killed_at_each_failpoint_loses_and_repeats_nothing(
        crashes: tuple[str, ...], db_uri: str, tmp_path: Path, scripted_model_dir: Path,
        scripted_engine_url: str) -> None:
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add", "mul")), "--num_generations", "4")
    mcp = write_mcp_config(tmp_path / "mcp.json")
    per_turn = any("after_credits" in crash for crash in crashes)
    common = (*COMMON, *(("--adv_estimator", "turn_loo") if per_turn else ()))
    for crash in crashes:
        done = subprocess.run(
            sample_args(db_uri, scripted_model_dir, scripted_engine_url, mcp, *common, "--sampler_id", "doomed"),
            capture_output=True, text=True, env={**run_env(), ENV: crash}, timeout=240)
        assert done.returncode == EXIT_CODE, f"{crash} was not reached:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    rescued = subprocess.run(
        sample_args(db_uri, scripted_model_dir, scripted_engine_url, mcp, *common, "--sampler_id", "rescuer"),
        capture_output=True, text=True, env=run_env(), timeout=240)
    assert rescued.returncode == 0, rescued.stderr[-3000:]

    records = documents(db_uri, "Record")
    assert not [r["_id"] for r in records if r["status"] in ("running", "completed") or r["leased"]]
    finished = Counter((r["task_id"], r["slot"]) for r in records if r["status"] in FINISHED)
    assert sorted(finished.values()) == [1] * 8, finished  # every slot done exactly once
    for task in documents(db_uri, "Task"):
        assert sorted(task["settled_slots"]) == [0, 1, 2, 3], task["settled_slots"]
        assert task["status"] == "completed" and task["group_stage_done"]
    ready = sorted(r["_id"] for r in records if r["status"] == "ready")
    samples = documents(db_uri, "DBRecordData")
    assert len(ready) == 8 and sorted(s["record_id"] for s in samples) == ready
    if per_turn:  # every kept call has its credit, and its sample's tokens train with exactly it
        calls = documents(db_uri, "DispatchedSamplingTask")
        for sample in samples:
            own = sorted((c for c in calls if c["record_id"] == sample["record_id"]), key=lambda c: c["turn"])
            assert all(c["step_return"] is not None for c in own)
            trained = [a for a, m in zip(sample["advantages"], sample["loss_mask"]) if m]
            assert trained == pytest.approx([c["advantage"] for c in own if c["advantage"] is not None
                                             for _ in c["output_ids"]], abs=1e-6)
