"""State keys of a stateful MCP server's tool task (``mcp_state.state_tools``, tau2's write tools): each call's
state is the state-changing calls before it, so trajectories that wrote alike share their states whatever they
read, and per-turn credit groups their turns by it."""

from __future__ import annotations

import pytest

from agentrl.envs.tau2_airline import WRITE_TOOLS, task_row
from agentrl.rollout.group_stage import turn_episode
from agentrl.rollout.mcp_state import McpState, history_state_keys, state_tools
from agentrl.store.models import CallStatus, DispatchedSamplingTask

WRITES = frozenset({"book", "cancel"})


def call(turn: int, *tools: tuple[str, dict, str, str]) -> DispatchedSamplingTask:
    """A completed call at ``turn`` that made ``(name, arguments, status, result)`` tool calls."""
    return DispatchedSamplingTask(
        id=f"r/{turn}", record_id="r", task_id="t", turn=turn, status=CallStatus.COMPLETED, input_ids=[1, 2, turn],
        output_ids=[3], output_logprobs=[-0.1],
        tool_calls=[{"id": f"c{i}", "name": name, "arguments": arguments} for i, (name, arguments, _, _) in
                    enumerate(tools)],
        tool_results=[{"id": f"c{i}", "name": name, "status": status, "content": content} for i, (name, _, status,
                                                                                                  content) in
                      enumerate(tools)])


def test_reads_leave_the_state_writes_change_it() -> None:
    read = ("lookup", {"id": 1}, "ok", "{...}")
    book = ("book", {"flight": "HAT001"}, "ok", "booked R1")
    one = history_state_keys([call(0, read), call(1, book), call(2, read), call(3)], WRITES)
    assert one[0] == one[1]  # the first call only read
    assert one[1] != one[2] and one[2] == one[3]  # the booking changed the state, the read after it did not
    # another trajectory that read other things but booked alike is in the same states
    other = history_state_keys([call(0), call(1, ("lookup", {"id": 7}, "ok", "x"), book), call(2)], WRITES)
    assert other[0] == one[0] and other[2] == one[2]
    # a booking with another result (or arguments, or a failure) is another state
    failed = history_state_keys([call(0, ("book", {"flight": "HAT001"}, "toolfailed", "no seats")), call(1)], WRITES)
    assert failed[1] != one[2]
    assert all(key.startswith("mcp:") for key in one)


def test_turn_episode_keys_tool_calls_by_their_history_when_given() -> None:
    calls = [call(0), call(1, ("book", {}, "ok", "R1")), call(2)]
    keys = history_state_keys(calls, WRITES)
    episode = turn_episode(calls, 1.0, state_keys=keys)
    assert [step.state_key for step in episode.steps] == keys
    assert [step.reward for step in episode.steps] == [0.0, 0.0, 1.0]  # no turn rewards: the score at the end
    by_prompt = turn_episode(calls, 1.0)
    assert all(step.state_key.startswith("prompt:") for step in by_prompt.steps)


def test_tau2_tasks_name_the_servers_write_tools() -> None:
    metadata = {key: value for key, value in task_row("0").items() if key == "mcp_state"}
    assert state_tools(metadata) == frozenset(WRITE_TOOLS) and "book_reservation" in WRITE_TOOLS
    assert state_tools({"mcp_state": {"key_arg": "k"}}) is None and state_tools({}) is None


@pytest.mark.parametrize("bad", ["book", [1], [""], {"book": True}])
def test_malformed_state_tools_are_refused_before_any_rollout(bad: object) -> None:
    with pytest.raises(ValueError, match="metadata.mcp_state.state_tools must be a list of tool names"):
        McpState.of({"mcp_state": {"key_arg": "state_key", "state_tools": bad}}, "record-1")
