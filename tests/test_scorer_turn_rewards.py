"""Per-turn rewards from an ``MCPScorerFactory`` scorer (``agentrl.rollout.turn_rewards``), through a real sampler
process, the scripted model on the real inference server and the real calculator MCP server: the scorer sees the
turns, its rewards reach the calls (``step_reward``) and the per-turn credit, and rewards of the wrong shape are a
scoring error, never a silent reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.rollout.turn_rewards import turn_rewards_error
from agentrl.trajectory.advantages import AdvantageConfig, AdvEstimator
from agentrl.trajectory.step_credit import Episode, Step, step_credits
from rollout_fixtures import documents, sample_args, upload, write_mcp_config, write_script_tasks
from test_rollout_sampler import run_sampler

pytestmark = pytest.mark.slow

# Every answer is right (score 1), so a group is alike in score; the first call's reward grows with each
# trajectory the scorer sees, so the members' turns differ in credit. It also records what it saw of the turns.
SCORER = '''
import itertools

from agentrl.scoring import MCPScorerFactory

seen = itertools.count()


def stepwise(model_answer, ground_truth, config):
    turns = config["turns"]
    first = 0.25 * next(seen)
    return 1.0, {"turn_rewards": [first] + [0.0] * (len(turns) - 1),
                 "saw": [[turn["status"], bool(turn["tool_calls"]), turn["output"][:11]] for turn in turns]}


def too_short(model_answer, ground_truth, config):
    return 1.0, {"turn_rewards": [0.5]}


def not_a_number(model_answer, ground_truth, config):
    return 1.0, {"turn_rewards": [float("nan")] * len(config["turns"])}


for fn in (stepwise, too_short, not_a_number):
    MCPScorerFactory.register_scorer(fn.__name__, fn)
'''


def run(db_uri: str, tmp_path: Path, model_dir: Path, engine_url: str, scorer: str, *extra: str) -> None:
    module = tmp_path / "scorers.py"
    module.write_text(SCORER)
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add",)), "--num_generations", "2",
           "--scorer", scorer)
    run_sampler(sample_args(db_uri, model_dir, engine_url, write_mcp_config(tmp_path / "mcp.json"),
                            "--temperature", "0", "--scorer_module", str(module),
                            "--max_concurrent_samples_per_process", "1", *extra))


def test_a_scorers_turn_rewards_reach_the_calls_and_their_credit(db_uri: str, tmp_path: Path,
                                                                  scripted_model_dir: Path,
                                                                  scripted_engine_url: str) -> None:
    run(db_uri, tmp_path, scripted_model_dir, scripted_engine_url, "stepwise", "--adv_estimator", "turn_loo",
        "--gamma", "1.0")
    records = sorted(documents(db_uri, "Record"), key=lambda r: r["score_details"]["turn_rewards"][0])
    assert [r["score"] for r in records] == [1.0, 1.0]  # alike in score: grpo would drop the group
    saw = [["completed", True, "<tool_call>"], ["completed", False, "The answer "]]  # status, a tool call, text
    assert all(record["score_details"]["saw"] == saw for record in records)
    assert {r["status"] for r in records} == {"ready"}  # kept by turn credit
    assert {r["group_decision"] for r in records} == {"kept (turn credit)"}
    calls = {r["_id"]: sorted(documents(db_uri, "DispatchedSamplingTask", {"record_id": r["_id"]}),
                              key=lambda c: c["turn"]) for r in records}
    rewards = [r["score_details"]["turn_rewards"] for r in records]
    for record, reward in zip(records, rewards):
        assert [c["step_reward"] for c in calls[record["_id"]]] == reward
    expected = step_credits([Episode(1.0, [Step(r, f"s{t}") for t, r in enumerate(row)]) for row in rewards],
                            AdvantageConfig(adv_estimator=AdvEstimator.TURN_LOO, gamma=1.0))
    # the two members share their states only where their prompts are alike: the first prompt (the query)
    for record, credit in zip(records, expected):
        stored = [c["advantage"] for c in calls[record["_id"]]]
        assert stored[0] == pytest.approx(credit[0].advantage)
        assert stored[0] != stored[1]  # the turns of one trajectory are credited apart
    assert rewards[1][0] - rewards[0][0] == pytest.approx(0.25)
    assert calls[records[1]["_id"]][0]["advantage"] - calls[records[0]["_id"]][0]["advantage"] == pytest.approx(0.5)


@pytest.mark.parametrize(("scorer", "why"), [
    ("too_short", "turn_rewards must be a list of 2 numbers (one per LLM call), got 1 values"),
    ("not_a_number", "turn_rewards[0] must be a finite number, got 'nan'"),  # stored as its name
])
def test_turn_rewards_of_the_wrong_shape_are_a_scoring_error(db_uri: str, tmp_path: Path, scripted_model_dir: Path,
                                                             scripted_engine_url: str, scorer: str, why: str) -> None:
    run(db_uri, tmp_path, scripted_model_dir, scripted_engine_url, scorer, "--adv_estimator", "turn_loo")
    records = documents(db_uri, "Record")
    assert len(records) == 2 and {r["status"] for r in records} == {"failed"}
    assert all(why in r["score_error"] and r["score"] is None for r in records)
    assert documents(db_uri, "DBRecordData") == []


def test_an_environment_episode_takes_no_turn_rewards_from_a_scorer() -> None:
    assert "environment episode" in turn_rewards_error({"turn_rewards": [1.0]}, 1, "s", episode=True)
    assert turn_rewards_error({}, 3, "s", episode=True) is None
    assert "got dict" in turn_rewards_error({"turn_rewards": {}}, 3, "s", episode=False)
    assert "[1] must be a finite number, got True" in turn_rewards_error({"turn_rewards": [0, True]}, 2, "s",
                                                                         episode=False)
