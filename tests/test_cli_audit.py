"""`agentrl export` and `agentrl status` on a run with real trajectories written through the store."""

from __future__ import annotations

import json
from pathlib import Path

from agentrl.store import CallStatus, DispatchedSamplingTask, RecordStatus, Store
from agentrl.store.call_log import CallLog
from cli_helpers import agentrl
from store_helpers import insert_tasks


async def _trajectory(store: Store) -> str:
    lease = await store.slots.claim("train", "s1")
    first = DispatchedSamplingTask(id=f"{lease.record_id}#0", record_id=lease.record_id, task_id=lease.task.id,
                                   turn=0, input_ids=[1, 2, 3], prompt_delta_text="<user>What is 0 + 1?")
    calls = CallLog()
    calls.start(first)
    calls.finish(first.id, CallStatus.COMPLETED, output_ids=[4, 5], output_logprobs=[-0.1, -0.2],
                 output_text='<tool_call>{"name": "calculator"}</tool_call>',
                 tool_calls=[{"id": "c1", "name": "calculator", "arguments": {"expression": "0+1"}}],
                 tool_results=[{"id": "c1", "name": "calculator", "content": "1"}])
    second = DispatchedSamplingTask(id=f"{lease.record_id}#1", record_id=lease.record_id, task_id=lease.task.id,
                                    turn=1, previous_call_id=first.id, prompt_delta_ids=[6])
    calls.start(second)
    calls.finish(second.id, CallStatus.COMPLETED, output_ids=[7], output_logprobs=[-0.3],
                 output_text="The answer is \\boxed{1}.")
    await store.calls.insert(calls.calls())
    await store.slots.finish(lease, RecordStatus.SCORED, score=1.0, num_turns=2, outcome="answer", final_answer="1")
    return lease.record_id


async def test_export_round_trip_in_both_formats(db_uri: str, tmp_path: Path) -> None:
    async with Store(db_uri) as store:
        await insert_tasks(store, 1, num_generations=2)
        record_id = await _trajectory(store)
        await store.slots.claim("train", "s2")  # a second, still running trajectory with no turns yet
    out = tmp_path / "export.jsonl"
    result = agentrl("export", "--db_connection_string", db_uri, "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in rows] == ["scored", "running"]
    row = rows[0]
    assert row["record_id"] == record_id and row["score"] == 1.0 and row["num_turns"] == 2
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    call = row["messages"][1]["tool_calls"][0]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {
        "expression": "0+1"}
    assert row["messages"][2] == {"role": "tool", "tool_call_id": "c1", "name": "calculator", "content": "1"}
    assert row["messages"][3]["content"] == "The answer is \\boxed{1}."

    gym = tmp_path / "gym.jsonl"
    result = agentrl("export", "--db_connection_string", db_uri, "--out", str(gym), "--format", "agentgym",
                     "--status", "scored")
    assert result.returncode == 0, result.stderr
    [only] = [json.loads(line) for line in gym.read_text().splitlines()]
    assert [(c["from"], c["loss"]) for c in only["conversations"]] == [
        ("human", False), ("gpt", True), ("human", False), ("gpt", True)]
    assert only["conversations"][0]["value"] == "What is 0 + 1?"


async def test_status_shows_counts_leases_services_and_version(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await insert_tasks(store, 2, num_generations=2)
        await _trajectory(store)
        await store.slots.claim("train", "s3")
        await store.services.register("http://127.0.0.1:30000", kind="agentrl-engine", models=["tiny"])
        await store.runs.get_or_create("demo")
        await store.runs.bump_policy_version(expected=0)
        await store.runs.log_metrics(1, {"loss": 0.5, "reward_mean": 0.25})
    result = agentrl("status", "--db_connection_string", db_uri, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["counts"]["Task"]["running"] == 1 and summary["counts"]["Task"]["created"] == 1
    assert summary["counts"]["Record"]["scored"] == 1 and summary["counts"]["Record"]["running"] == 1
    assert summary["counts"]["DispatchedSamplingTask"]["completed"] == 2
    assert summary["leases"] == {"live": 1, "expired": 0}
    assert summary["run"]["policy_version"] == 1
    assert summary["services"][0]["id"] == "http://127.0.0.1:30000" and summary["services"][0]["live"]
    screen = agentrl("status", "--db_connection_string", db_uri)
    assert screen.returncode == 0, screen.stderr
    for text in ("policy version 1", "Task", "running 1", "1 live", "http://127.0.0.1:30000", "loss=0.5"):
        assert text in screen.stdout, text
