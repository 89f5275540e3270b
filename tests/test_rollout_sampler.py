"""`agentrl sample` end to end: real sampler processes, a real engine serving the scripted tiny model, the real
calculator MCP server over stdio, the embedded database. Token continuity of stored turns, scoring, the group
stage, crash recovery (SIGKILL), tool-server death, custom scorers and configuration errors."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rollout_fixtures import documents, run_env, sample_args, upload, write_mcp_config, write_script_tasks

pytestmark = pytest.mark.slow(start_rank=8)

FINISHED = {"scored", "ready", "abandoned"}


def run_sampler(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, env=run_env(), timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def full_prompts(calls: list[dict]) -> dict[str, list[int]]:
    """Each call's complete prompt, rebuilt from the stored chain (whole prompt or previous prompt + output + delta)."""
    prompts: dict[str, list[int]] = {}
    for call in sorted(calls, key=lambda c: c["turn"]):
        if call.get("input_ids"):
            prompts[call["_id"]] = list(call["input_ids"])
        else:
            previous = next(c for c in calls if c["_id"] == call["previous_call_id"])
            prompts[call["_id"]] = prompts[previous["_id"]] + previous["output_ids"] + call["prompt_delta_ids"]
    return prompts


def test_greedy_rollout_is_token_exact_scored_and_queued(db_uri: str, tmp_path: Path, scripted_model_dir: Path,
                                                          scripted_engine_url: str) -> None:
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl"), "--num_generations", "2")
    done = run_sampler(sample_args(
        db_uri, scripted_model_dir, scripted_engine_url, write_mcp_config(tmp_path / "mcp.json"),
        "--temperature", "0", "--zero_variance_threshold", "0", "--drop_zero_advantage", "false"))
    assert "sampler done: 8 trajectories, 8 scored" in done.stdout

    assert {t["status"] for t in documents(db_uri, "Task")} == {"completed"}
    records = documents(db_uri, "Record")
    assert len(records) == 8 and {r["status"] for r in records} == {"ready"}
    assert not any(r["leased"] for r in records)
    by_task = defaultdict(list)
    for record in records:
        by_task[record["task_id"].split(":")[1]].append(record)
    # The scripted model calls the calculator, reads its result and answers: right for add/mul.
    for task in ("add", "mul"):
        assert [(r["outcome"], r["score"], r["num_turns"]) for r in by_task[task]] == [("answer", 1.0, 2)] * 2

    tokenizer = AutoTokenizer.from_pretrained(scripted_model_dir)
    calls = documents(db_uri, "DispatchedSamplingTask")
    assert len(calls) == 16 and all(c["weight_version"] == 0 for c in calls)
    samples = {s["record_id"]: s for s in documents(db_uri, "DBRecordData")}
    assert set(samples) == {r["_id"] for r in records}
    for record in records:
        own = [c for c in calls if c["record_id"] == record["_id"]]
        prompts = full_prompts(own)
        first, second = sorted(own, key=lambda c: c["turn"])
        # Turn 2 extends turn 1 exactly: its prompt is turn 1's prompt + sampled output + the tool message delta.
        assert second["input_ids"] is None and second["previous_call_id"] == first["_id"]
        assert prompts[second["_id"]][:len(prompts[first["_id"]])] == prompts[first["_id"]]
        assert tokenizer.decode(second["prompt_delta_ids"]) == second["prompt_delta_text"]
        assert "<|im_start|>tool" in second["prompt_delta_text"]
        assert len(first["output_logprobs"]) == len(first["output_ids"]) > 0
        # What the trainer gets is exactly the engine's tokens, with the loss on sampled tokens only.
        sample = samples[record["_id"]]
        assert sample["input_ids"] == prompts[second["_id"]] + second["output_ids"]
        trained = [t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m]
        assert trained == first["output_ids"] + second["output_ids"]
        assert [lp for lp, m in zip(sample["logprobs"], sample["loss_mask"]) if m] == pytest.approx(
            first["output_logprobs"] + second["output_logprobs"], abs=1e-6)

    add_call = next(c for c in calls if c["task_id"].endswith(":add") and c["turn"] == 0)
    assert add_call["status"] == "completed"
    assert add_call["tool_calls"][0]["name"] == "calculate"
    assert add_call["tool_results"][0]["status"] == "ok" and add_call["tool_results"][0]["content"] == "42"
    # A call whose arguments violate the tool's schema is a formaterror; the model is told and goes on.
    bad_call = next(c for c in calls if c["task_id"].endswith(":bad") and c["turn"] == 0)
    assert bad_call["status"] == "formaterror"
    assert bad_call["tool_results"][0]["status"] == "formaterror" and "expression" in bad_call["error"]
    bad_next = next(c for c in calls if c["previous_call_id"] == bad_call["_id"])
    assert "expression" in bad_next["prompt_delta_text"]


def test_sampling_gives_group_variance_and_advantages(db_uri: str, tmp_path: Path, scripted_model_dir: Path,
                                                      scripted_engine_url: str) -> None:
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("coin",)), "--num_generations", "8")
    run_sampler(sample_args(db_uri, scripted_model_dir, scripted_engine_url, write_mcp_config(tmp_path / "m.json"),
                            "--temperature", "1.0", "--seed", "7"))
    records = documents(db_uri, "Record")
    scores = sorted(r["score"] for r in records)
    assert len(records) == 8 and scores[0] == 0.0 and scores[-1] == 1.0, scores
    ready = [r for r in records if r["status"] == "ready"]
    assert ready and sum(r["advantage"] for r in ready) == pytest.approx(0.0, abs=1e-6)
    for record in ready:
        assert (record["advantage"] > 0) == (record["score"] == 1.0)
    samples = documents(db_uri, "DBRecordData")
    assert {s["record_id"] for s in samples} == {r["_id"] for r in ready}
    for sample in samples:
        advantage = next(r["advantage"] for r in ready if r["_id"] == sample["record_id"])
        assert {a for a, m in zip(sample["advantages"], sample["loss_mask"]) if m} == {advantage}


def sampler_mid_run(db_uri: str, tmp_path: Path, model: Path, engine_url: str, lease_s: int, sampler_id: str,
                    **popen: Any) -> tuple[subprocess.Popen, tuple[str, ...]]:
    """A sampler process on 16 slots (2 Tasks x 8), 8 at a time, returned once a Record of it is ``running``
    (trajectories are in flight from then until its last few finish), with the sampler flags that a second sampler
    resuming its work needs."""
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add", "mul")), "--num_generations", "8")
    flags = sample_args(db_uri, model, engine_url, write_mcp_config(tmp_path / "mcp.json"), "--temperature", "0",
                        "--zero_variance_threshold", "0", "--drop_zero_advantage", "false", "--lease_s",
                        str(lease_s), "--max_concurrent_samples_per_process", "8")
    process = subprocess.Popen([*flags, "--sampler_id", sampler_id], env=run_env(), **popen)
    deadline = time.monotonic() + 120
    while (not any(r["status"] == "running" for r in documents(db_uri, "Record"))
           and time.monotonic() < deadline):
        time.sleep(0.02)
    return process, tuple(flags)


def test_sigkilled_sampler_slots_are_redone_by_another(db_uri: str, tmp_path: Path, scripted_model_dir: Path,
                                                        scripted_engine_url: str) -> None:
    victim, flags = sampler_mid_run(db_uri, tmp_path, scripted_model_dir, scripted_engine_url, 3, "victim",
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    held = [r for r in documents(db_uri, "Record") if r["status"] == "running"]
    assert held, "the victim was killed before it held any slot"

    run_sampler([*flags, "--sampler_id", "rescuer"])
    records = documents(db_uri, "Record")
    assert not [r for r in records if r["status"] == "running" or r["leased"]]
    finished = Counter((r["task_id"], r["slot"]) for r in records if r["status"] in FINISHED)
    assert sorted(finished.values()) == [1] * 16  # every slot done exactly once
    ready = {r["_id"] for r in records if r["status"] == "ready"}
    samples = documents(db_uri, "DBRecordData")
    assert sorted(s["record_id"] for s in samples) == sorted(ready) and len(ready) == 16
    assert {t["status"] for t in documents(db_uri, "Task")} == {"completed"}


def test_a_stopped_sampler_leaves_nothing_running_and_the_next_one_resumes(
        db_uri: str, tmp_path: Path, scripted_model_dir: Path, scripted_engine_url: str) -> None:
    """SIGTERM mid-run (as the example scripts stop their samplers at the end of a run): the trajectories in flight
    end ``failed`` as ``cancelled`` and their slots are given back, their Tasks become ``interrupted``; no Record
    and no Task is left ``running``. The next sampler resumes them, and every slot is done exactly once."""
    stopped, flags = sampler_mid_run(db_uri, tmp_path, scripted_model_dir, scripted_engine_url, 30, "stopped",
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped.send_signal(signal.SIGTERM)
    output, _ = stopped.communicate(timeout=60)
    assert stopped.returncode == 0, output
    records, tasks = documents(db_uri, "Record"), documents(db_uri, "Task")
    assert not [r["_id"] for r in records if r["status"] == "running"], records
    assert not [t["_id"] for t in tasks if t["status"] == "running"], tasks
    cancelled = [r for r in records if r.get("failure_class") == "cancelled"]
    assert cancelled, "the sampler was stopped after its last trajectory"
    assert all(r["status"] == "failed" and r["released"] and r["error"] == "sampler shutting down" for r in cancelled)
    assert "interrupted" in {t["status"] for t in tasks} and "left for a later sampler (interrupted)" in output

    run_sampler([*flags, "--sampler_id", "next"])
    records = documents(db_uri, "Record")
    assert not [r for r in records if r["status"] == "running" or r["leased"]]
    finished = Counter((r["task_id"], r["slot"]) for r in records if r["status"] in FINISHED)
    assert sorted(finished.values()) == [1] * 16  # every slot done exactly once
    assert all(r["failures"] == 0 for r in records)  # a slot given back is not a failed attempt
    assert {t["status"] for t in documents(db_uri, "Task")} == {"completed"}


CRASHING_SERVER = '''
import os
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

from agentrl.tools.servers import CALCULATE_DESCRIPTION

server = MCPServer("crashing", log_level="WARNING")


def calculate(expression: Annotated[str, Field(description="the arithmetic expression to evaluate")]) -> str:
    os._exit(3)  # the calculator's exact tool spec (the prompt the scripted model knows), but the server dies


server.add_tool(calculate, description=CALCULATE_DESCRIPTION, structured_output=False)
server.run("stdio")
'''

HALF_SCORER = '''
from agentrl.scoring import MCPScorerFactory


def half(model_answer, ground_truth):
    return 0.5 if model_answer.strip() else 0.0


MCPScorerFactory.register_scorer("half", half)
'''


def test_dead_tool_server_is_toolfailed_and_custom_scorer_scores(db_uri: str, tmp_path: Path,
                                                                 scripted_model_dir: Path,
                                                                 scripted_engine_url: str) -> None:
    server = tmp_path / "crashing_server.py"
    server.write_text(CRASHING_SERVER)
    scorer = tmp_path / "half_scorer.py"
    scorer.write_text(HALF_SCORER)
    mcp = write_mcp_config(tmp_path / "mcp.json", [{"name": "crashing", "command": sys.executable,
                                                    "args": [str(server)], "max_retries": 0}])
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add",)), "--num_generations", "2",
           "--scorer", "half")
    run_sampler(sample_args(db_uri, scripted_model_dir, scripted_engine_url, mcp, "--temperature", "0",
                            "--scorer_module", str(scorer), "--max_concurrent_samples_per_process", "1"))
    first_calls = [c for c in documents(db_uri, "DispatchedSamplingTask") if c["turn"] == 0]
    assert [c["status"] for c in first_calls] == ["toolfailed", "toolfailed"]
    assert all(c["tool_results"][0]["status"] == "toolfailed" for c in first_calls)
    records = documents(db_uri, "Record")
    # The model still answers after the failure note; the user's scorer gives every answer 0.5.
    assert {r["score"] for r in records if r["outcome"] == "answer"} <= {0.5}
    assert {r["status"] for r in records} <= FINISHED


def test_invalid_mcp_config_is_reported_and_nothing_is_claimed(db_uri: str, tmp_path: Path,
                                                               scripted_model_dir: Path,
                                                               scripted_engine_url: str) -> None:
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add",)), "--num_generations", "2")
    bad = tmp_path / "bad_mcp.json"
    bad.write_text('{"servers": [{"name": "calc", "comand": "x"}]}')
    done = subprocess.run(sample_args(db_uri, scripted_model_dir, scripted_engine_url, bad), capture_output=True,
                          text=True, env=run_env(), timeout=120)
    assert done.returncode == 2
    assert "bad_mcp.json" in done.stderr and "comand" in done.stderr
    assert documents(db_uri, "Record") == []


def test_admission_finishes_a_started_group_and_starts_no_other_while_the_pipeline_is_full(
        db_uri: str, tmp_path: Path, scripted_model_dir: Path, scripted_engine_url: str) -> None:
    # Bound (max_staleness + 1) × train_batch_size = 2 is below the group size 4: the first group must still be
    # completed (a started group is always finished), and no other group may start while its 4 samples wait
    # untrained (no trainer runs here).
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add", "mul")), "--num_generations", "4")
    sampler = subprocess.Popen(sample_args(
        db_uri, scripted_model_dir, scripted_engine_url, write_mcp_config(tmp_path / "mcp.json"),
        "--temperature", "0", "--zero_variance_threshold", "0", "--drop_zero_advantage", "false",
        "--max_staleness", "0", "--train_batch_size", "2"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env())
    try:
        first, second = sorted(documents(db_uri, "Task"), key=lambda t: t["order"])
        deadline = time.monotonic() + 180
        while documents(db_uri, "Task", {"_id": first["_id"]})[0]["status"] != "completed":
            assert sampler.poll() is None and time.monotonic() < deadline, "the first group never completed"
            time.sleep(0.2)
        assert documents(db_uri, "Task", {"_id": second["_id"]})[0]["status"] == "created"
        assert not documents(db_uri, "Record", {"task_id": second["_id"]})
        assert len(documents(db_uri, "Record", {"task_id": first["_id"], "status": "ready"})) == 4
    finally:
        sampler.send_signal(signal.SIGTERM)
        output, _ = sampler.communicate(timeout=60)
    assert sampler.returncode == 0, output


async def test_a_heartbeat_falling_due_while_a_slot_settles_does_not_cut_the_settlement(
        db_uri: str, tmp_path: Path, scripted_model_dir: Path, scripted_engine_url: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The trajectory's heartbeats stop before its settlement writes. A heartbeat that fell due after ``finish``
    dropped the lease found it gone, took it for a take-over and cancelled the worker while it claimed the group
    stage: the stage then waited a whole lease for a recovery, and a lone sampler warned that another one had
    taken its trajectory (seen in an evaluation: 40 s for the last of 64 tasks). The database's reply to the lease
    drop is slowed down here (in process) so that a heartbeat falls due meanwhile; nothing else produces that
    timing on demand."""
    import asyncio
    import logging

    from agentrl.cli.main import build_parser
    from agentrl.cli.sample import config_from_args
    from agentrl.rollout.process import sampler_resources
    from agentrl.rollout.sampler import Sampler
    from agentrl.store.slots import SlotLeases

    lease_s = 3.0  # heartbeats every second (the embedded database compares dates to the second)
    drop = SlotLeases._drop_lease

    async def slow_reply(self: SlotLeases, rid: str, lease_id: str) -> None:
        await drop(self, rid, lease_id)
        await asyncio.sleep(lease_s / 3 * 1.5)

    monkeypatch.setattr(SlotLeases, "_drop_lease", slow_reply)
    caplog.set_level(logging.INFO, logger="agentrl.rollout")
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add",)), "--num_generations", "2")
    argv = sample_args(db_uri, scripted_model_dir, scripted_engine_url, write_mcp_config(tmp_path / "mcp.json"),
                       "--temperature", "0", "--lease_s", str(lease_s))
    config = config_from_args(build_parser().parse_args(argv[argv.index("sample"):]))
    async with sampler_resources(config) as resources:
        stats = await asyncio.wait_for(Sampler(resources, owner=resources.inference.owner).run(), 120)
    assert "lost the lease" not in caplog.text, caplog.text[-2000:]
    assert stats.trajectories == 2 and stats.group_stages == 1, stats
    [task] = documents(db_uri, "Task")
    assert task["status"] == "completed" and sorted(task["settled_slots"]) == [0, 1], task
