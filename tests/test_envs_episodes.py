"""Environment episodes end to end: real ``agentrl sample`` processes, a real TextCraft server (``agentrl envs
serve``), a real engine serving a tiny model, the embedded database. Token-exact turns with the observations as
user turns, per-step rewards on the calls, environment rewards reaching the advantages, instances closed — also
those of a SIGKILLed sampler."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import httpx
import numpy as np
import pytest
from pymongo import MongoClient

from agentrl.envs.local import start_local_server
from agentrl.store.models import EPOCH
from agentrl.trajectory.advantages import AdvantageConfig, AdvEstimator
from agentrl.trajectory.step_credit import Episode, Step, step_credits
from env_fixtures import EPISODE_TASKS
from rollout_fixtures import agentrl_cmd, documents, run_env
from test_rollout_sampler import full_prompts
from test_step_credit import verl_agent_gigpo

pytestmark = pytest.mark.slow(start_rank=7)


def write_env_tasks(path: Path, indices: tuple[int, ...], max_turns: int | None = None) -> Path:
    rows = [{"id": f"textcraft-{i}", "query": f"textcraft task {i}", "scorer": "env_reward", "task_type": "textcraft",
             "env": {"name": "textcraft", "data_idx": i, **({"max_turns": max_turns} if max_turns else {})}}
            for i in indices]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def upload_env_tasks(db_uri: str, path: Path, generations: int) -> None:
    done = subprocess.run(agentrl_cmd("tasks", "upload", str(path), "--db_connection_string", db_uri,
                                      "--num_generations", str(generations)),
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert done.returncode == 0, done.stderr


def sample_cmd(db_uri: str, model_dir: Path, engine_url: str, server: str, *extra: str) -> list[str]:
    return agentrl_cmd("sample", "--db_connection_string", db_uri, "--model_name_or_path", str(model_dir),
                       "--inference_urls", engine_url, "--env_server", f"textcraft={server}",
                       "--max_new_tokens", "24", "--max_concurrent_samples_per_process", "4", *extra)


def expire_leases(db_uri: str) -> None:
    """Age the leases of a dead sampler so a take-over need not wait them out."""
    client = MongoClient(db_uri, tz_aware=True)
    try:
        client.get_default_database()["Record"].update_many({"leased": True}, {"$set": {"lease_expires_at": EPOCH}})
    finally:
        client.close()


def live_instances(server: str) -> list[int]:
    return httpx.get(f"{server}/instances", timeout=10).json()["ids"]


def test_episodes_are_token_exact_and_their_rewards_reach_the_advantages(
        db_uri: str, tmp_path: Path, textcraft_model_dir: Path, textcraft_engine_url: str,
        textcraft_server: str) -> None:
    upload_env_tasks(db_uri, write_env_tasks(tmp_path / "tasks.jsonl", EPISODE_TASKS), generations=6)
    done = subprocess.run(sample_cmd(db_uri, textcraft_model_dir, textcraft_engine_url, textcraft_server,
                                     "--max_turns", "2", "--temperature", "1", "--seed", "3",
                                     "--zero_variance_threshold", "0", "--exit_when_done", "true"),
                          capture_output=True, text=True, env=run_env(), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "12 trajectories, 12 scored" in done.stdout

    records = documents(db_uri, "Record")
    calls = documents(db_uri, "DispatchedSamplingTask")
    samples = {s["record_id"]: s for s in documents(db_uri, "DBRecordData")}
    assert len(records) == 12
    rewards = defaultdict(list)
    for record in records:
        details = record["score_details"]
        # An episode that crafted the goal ends `done` with reward 1; `inventory` instead runs into the turn limit.
        assert (record["outcome"], record["score"], details["success"]) in {
            ("done", 1.0, True), ("turns_limit_error", 0.0, False)}
        assert details["name"] == "textcraft" and details["steps"] == 2 and record["num_turns"] == 2
        assert "env_open" not in record and record["env_instance"]["name"] == "textcraft"
        rewards[record["task_id"]].append(record["score"])

        own = sorted((c for c in calls if c["record_id"] == record["_id"]), key=lambda c: c["turn"])
        first, second = own
        prompts = full_prompts(own)
        # Turn 2's prompt is turn 1's prompt + the sampled action + the observation rendered as a user turn.
        assert second["previous_call_id"] == first["_id"] and second["input_ids"] is None
        assert prompts[second["_id"]] == prompts[first["_id"]] + first["output_ids"] + second["prompt_delta_ids"]
        assert first["env_step"]["observation"] in second["prompt_delta_text"]
        assert "<|im_start|>user" in second["prompt_delta_text"]
        assert first["env_step"]["action"].startswith("get ") and first["env_step"]["reward"] == 0
        assert second["env_step"]["reward"] == record["score"] and second["env_step"]["done"] is (
            record["outcome"] == "done")
        # The trainer's sample is exactly the engine's tokens, loss on the two actions only.
        sample = samples[record["_id"]]
        assert sample["input_ids"] == prompts[second["_id"]] + second["output_ids"]
        assert [t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m] == (
            first["output_ids"] + second["output_ids"])
        assert sample["reward"] == record["score"]

    # Environment rewards reach the advantages: in a group with both endings, success is pushed up, failure down.
    mixed = [task for task, values in rewards.items() if 0.0 < sum(values) < len(values)]
    assert mixed, f"no group had both endings: {dict(rewards)}"
    for record in records:
        if record["task_id"] in mixed:
            advantage = max(samples[record["_id"]]["advantages"], key=abs)
            assert (advantage > 0) == (record["score"] == 1.0) and advantage != 0
    assert live_instances(textcraft_server) == []


def test_a_sigkilled_samplers_instances_are_closed_by_the_attempt_that_takes_over(
        db_uri: str, tmp_path: Path, tiny_model_dir: Path, engine_url: str, textcraft_server: str) -> None:
    # The random tiny model never finishes a task: episodes run to the turn limit, so the sampler dies mid-episode.
    upload_env_tasks(db_uri, write_env_tasks(tmp_path / "tasks.jsonl", (0, 3), max_turns=40), generations=1)
    args = ("--max_turns", "40", "--temperature", "1", "--lease_s", "3")
    victim = subprocess.Popen(sample_cmd(db_uri, tiny_model_dir, engine_url, textcraft_server, *args),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=run_env())
    try:
        deadline = time.monotonic() + 120
        while len(live_instances(textcraft_server)) < 2 or len(documents(db_uri, "Record", {
                "env_open": {"$exists": True}})) < 2:
            assert time.monotonic() < deadline, "the sampler never had two episodes running"
            assert victim.poll() is None
            time.sleep(0.2)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    orphans = set(live_instances(textcraft_server))
    assert len(orphans) == 2  # the dead sampler's instances outlive it on the shared server

    done = subprocess.run(sample_cmd(db_uri, tiny_model_dir, engine_url, textcraft_server, *args,
                                     "--exit_when_done", "true"),
                          capture_output=True, text=True, env=run_env(), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = documents(db_uri, "Record")
    assert len({r["task_id"] for r in records if r["attempt"] >= 2}) == 2  # both slots were taken over
    assert not any("env_open" in r for r in records)
    assert live_instances(textcraft_server) == []


@pytest.mark.parametrize("point", ["episode.create.before_record", "episode.close.before_mark"])
def test_a_sampler_killed_in_an_instance_window_leaves_nothing_open(
        point: str, db_uri: str, tmp_path: Path, tiny_model_dir: Path, engine_url: str) -> None:
    """Killed between creating an instance and recording it, the server's idle sweep closes it; killed between
    closing it and marking it closed, the attempt that takes over marks it (closing it again is harmless).

    Both samplers hold long leases, so a loaded machine cannot let one lapse mid-attempt (the sampler would then
    take its own slot over, and die in another window or add an attempt); once the victim is dead the test ages its
    lease instead of waiting it out."""
    url, stop = start_local_server("textcraft", instance_ttl_s=2)
    try:
        upload_env_tasks(db_uri, write_env_tasks(tmp_path / "tasks.jsonl", (0,), max_turns=2), generations=1)
        args = ("--max_turns", "2", "--lease_s", "120", "--exit_when_done", "true")
        victim = subprocess.run(sample_cmd(db_uri, tiny_model_dir, engine_url, url, *args), capture_output=True,
                                text=True, env={**run_env(), "AGENTRL_FAILPOINTS": f"{point}=exit"}, timeout=120)
        assert victim.returncode == 86, victim.stdout + victim.stderr
        assert [r["attempt"] for r in documents(db_uri, "Record")] == [1]
        expire_leases(db_uri)
        if point == "episode.create.before_record":
            assert len(live_instances(url)) == 1 and not documents(db_uri, "Record", {"env_open": {"$exists": True}})
        else:
            assert live_instances(url) == [] and len(documents(db_uri, "Record", {"env_open": {"$exists": True}})) == 1
        done = subprocess.run(sample_cmd(db_uri, tiny_model_dir, engine_url, url, *args), capture_output=True,
                              text=True, env=run_env(), timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        records = documents(db_uri, "Record")
        assert [r["attempt"] for r in records] == [1, 2] and not any("env_open" in r for r in records)
        deadline = time.monotonic() + 10
        while live_instances(url):  # the orphan of the first window waits for the sweep (TTL 2 s)
            assert time.monotonic() < deadline, "the idle sweep never closed the unrecorded instance"
            time.sleep(0.2)
    finally:
        stop()


@pytest.mark.parametrize("estimator", ["turn_loo", "gigpo"])
def test_a_per_turn_estimator_credits_each_turn_of_an_episode(
        db_uri: str, tmp_path: Path, textcraft_model_dir: Path, textcraft_engine_url: str, textcraft_server: str,
        estimator: str) -> None:
    # Before: every call of a trajectory got the trajectory's advantage; the step rewards were stored, never read.
    upload_env_tasks(db_uri, write_env_tasks(tmp_path / "tasks.jsonl", EPISODE_TASKS), generations=6)
    done = subprocess.run(sample_cmd(db_uri, textcraft_model_dir, textcraft_engine_url, textcraft_server,
                                     "--max_turns", "2", "--temperature", "1", "--seed", "3",
                                     "--adv_estimator", estimator, "--exit_when_done", "true"),
                          capture_output=True, text=True, env=run_env(), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = {r["_id"]: r for r in documents(db_uri, "Record")}
    calls = defaultdict(list)
    for call in sorted(documents(db_uri, "DispatchedSamplingTask"), key=lambda c: c["turn"]):
        calls[call["record_id"]].append(call)
    samples = {s["record_id"]: s for s in documents(db_uri, "DBRecordData")}
    assert samples, "no group was kept"
    for record_id, own in calls.items():
        # Each turn: the reward of its step, whether it ended the episode, the state it acted in (TextCraft's own
        # key: the goal and the inventory, empty before the first action).
        assert [c["step_reward"] for c in own] == [c["env_step"]["reward"] for c in own]
        assert [c["done"] for c in own] == [c["env_step"]["done"] for c in own]
        assert own[0]["state_key"].endswith("|") and own[1]["state_key"].startswith(own[0]["state_key"])
        assert own[1]["state_key"] != own[0]["state_key"]  # the first action got something
        if record_id in samples:  # each turn's tokens carry its own advantage, as written on its call
            sample = samples[record_id]
            trained = [a for a, m in zip(sample["advantages"], sample["loss_mask"]) if m]
            assert trained == pytest.approx([c["advantage"] for c in own for _ in c["output_ids"]], abs=1e-6)
            assert all(c["step_return"] is not None for c in own)
    by_task = defaultdict(list)
    for record_id in samples:
        by_task[records[record_id]["task_id"]].append(record_id)
    assert any(calls[rid][0]["advantage"] != calls[rid][1]["advantage"] for rid in samples), "no turn differed"
    for members in by_task.values():  # the stored inputs give the stored advantages, as verl-agent computes them
        episodes = [Episode(records[rid]["score"], [Step(c["step_reward"], c["state_key"]) for c in calls[rid]])
                    for rid in members]
        stored = [c["advantage"] for rid in members for c in calls[rid]]
        if estimator == "gigpo":
            np.testing.assert_allclose(stored, verl_agent_gigpo(episodes, 0.95, 1.0, "mean_norm"), atol=1e-6)
        else:
            expected = step_credits(episodes, AdvantageConfig(adv_estimator=AdvEstimator.TURN_LOO))
            assert stored == pytest.approx([c.advantage for row in expected for c in row], abs=1e-9)
