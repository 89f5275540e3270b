"""The group stage's decisions (agentrl.rollout.group_stage): which samples train, on Records in memory, and a
group that only per-turn credit can teach, on the database."""

from __future__ import annotations

from agentrl.rollout.config import GroupConfig
from agentrl.rollout.group_stage import decide, run_group_stage
from agentrl.store import DispatchedSamplingTask, GroupLease, Record, RecordStatus, Store
from agentrl.store.models import ZERO_VARIANCE_DECISION, solved, utcnow
from agentrl.trajectory.advantages import AdvantageConfig, AdvEstimator
from store_helpers import insert_tasks


def records(*members: tuple[str, float, int]) -> list[Record]:
    """Scored Records of one Task: ``(outcome, score, turns)`` each."""
    return [Record(id=f"t/{slot}/0", task_id="t", slot=slot, attempt=0, lease_id="l", lease_owner="s",
                   lease_expires_at=utcnow(), outcome=outcome, score=score, num_turns=turns)
            for slot, (outcome, score, turns) in enumerate(members)]


def test_an_infrastructure_failure_does_not_make_a_solved_group_teach() -> None:
    # Before: three successes and an env_error (scored 0) passed the zero-variance gate, the error was dropped and
    # the successes trained with advantages [0, 0, 0]; the Task counted as taught.
    group = records(("answer", 1.0, 2), ("answer", 1.0, 2), ("answer", 1.0, 3), ("env_error", 0.0, 1))
    kept, dropped, rewards = decide(group, GroupConfig())
    assert kept == {} and rewards == {}
    assert dropped == {"t/0/0": ZERO_VARIANCE_DECISION, "t/1/0": ZERO_VARIANCE_DECISION,
                       "t/2/0": ZERO_VARIANCE_DECISION, "t/3/0": "env_error"}


def test_a_mixed_group_with_an_infrastructure_failure_keeps_the_others() -> None:
    group = records(("answer", 1.0, 2), ("answer", 0.0, 2), ("failed_error", 0.0, 1))
    kept, dropped, rewards = decide(group, GroupConfig())
    assert set(kept) == {"t/0/0", "t/1/0"} and dropped == {"t/2/0": "failed_error"}
    assert rewards == {"t/0/0": 1.0, "t/1/0": 0.0}


def test_efficient_rewarding_acts_on_an_all_solved_group() -> None:
    # Before: the gate looked at the raw scores only, so the shifts by turn count never reached such a group.
    group = records(("answer", 1.0, 1), ("answer", 1.0, 2), ("answer", 1.0, 3), ("answer", 1.0, 4))
    assert decide(group, GroupConfig())[0] == {}
    kept, dropped, rewards = decide(group, GroupConfig(efficient_rewarding=True))
    assert len(kept) == 4 and not dropped
    assert rewards["t/0/0"] > rewards["t/1/0"] > rewards["t/2/0"] > rewards["t/3/0"]  # fewer turns, more reward
    same_turns = records(("answer", 1.0, 2), ("answer", 1.0, 2))
    assert decide(same_turns, GroupConfig(efficient_rewarding=True))[0] == {}  # nothing varies: nothing to teach


def test_only_failures_of_the_infrastructure_keep_their_own_reason() -> None:
    group = records(("env_start_error", 0.0, 0), ("env_error", 0.0, 1))
    assert decide(group, GroupConfig()) == ({}, {"t/0/0": "env_start_error", "t/1/0": "env_error"}, {})


def test_an_episode_is_right_by_its_environments_success_not_by_half_the_score() -> None:
    # Before: one threshold (0.5) for every environment: a SciWorld episode at half its score was "right" for
    # balance_sample, min_turns and efficient_rewarding.
    group = records(("done", 0.6, 3), ("done", 1.0, 5), ("turns_limit_error", 0.1, 8))
    group[0].score_details.update(success=False)  # SciWorld: 60 of 100 points is not a success
    group[1].score_details.update(success=True)
    group[2].score_details.update(success=False)
    kept, _, _ = decide(group, GroupConfig(balance_sample=True))
    assert kept == {"t/0/0": "balanced (wrong)", "t/2/0": "balanced (wrong)", "t/1/0": "balanced (right)"}
    assert solved(group[1]) and not solved(group[0])
    plain = records(("answer", 0.6, 1))[0]  # no environment: the score threshold
    assert solved(plain)


async def group_solved_in_one_and_in_two_turns(store: Store) -> GroupLease:
    """Two samples of one Task, both solved (score 1): one episode in one turn, one in two (a first step that
    earned nothing), their calls stored as an episode's."""
    await insert_tasks(store, 1, num_generations=2)
    group = None
    for turns in (1, 2):
        lease = await store.slots.claim("train", "s")
        calls = [DispatchedSamplingTask(
            id=f"{lease.record_id}/{turn}", record_id=lease.record_id, task_id=lease.task.id, turn=turn,
            status="completed", input_ids=[1, 2, 3] if turn == 0 else None,
            previous_call_id=None if turn == 0 else f"{lease.record_id}/0", prompt_delta_ids=[] if turn == 0 else [4],
            output_ids=[5, 6], output_logprobs=[-0.1, -0.2], weight_version=0,
            step_reward=1.0 if turn == turns - 1 else 0.0, done=turn == turns - 1,
            state_key="start" if turn == 0 else "halfway") for turn in range(turns)]
        await store.calls.insert(calls)
        group = await store.slots.finish(lease, RecordStatus.SCORED, score=1.0, outcome="done", num_turns=turns)
    return group


async def test_a_group_solved_by_all_in_different_numbers_of_turns_teaches_per_turn(db_uri: str) -> None:
    async with Store(db_uri) as store:
        group = await group_solved_in_one_and_in_two_turns(store)
        outcome = await run_group_stage(store, group, GroupConfig(),
                                        AdvantageConfig(adv_estimator=AdvEstimator.TURN_LOO, gamma=0.5))
        calls = {doc["_id"]: doc async for doc in store.db[DispatchedSamplingTask.collection].find({})}
    assert set(outcome.kept.values()) == {"kept (turn credit)"} and len(outcome.kept) == 2
    credit = {call_id.split("/", 1)[-1]: (doc["advantage"], doc["step_return"]) for call_id, doc in calls.items()}
    # the short episode's one step returned 1 in "start", the long one's first step 0.5: the short one is pushed up
    assert credit["0/1/0"] == (0.5, 1.0) and credit["1/1/0"] == (-0.5, 0.5)
    # "halfway": nobody else was there, nor acted at turn 1: no baseline, the plain return to go
    assert credit["1/1/1"] == (1.0, 1.0)


async def test_with_grpo_the_same_group_is_dropped_and_its_calls_get_no_credit(db_uri: str) -> None:
    async with Store(db_uri) as store:
        group = await group_solved_in_one_and_in_two_turns(store)
        outcome = await run_group_stage(store, group, GroupConfig(), AdvantageConfig())
        calls = [doc async for doc in store.db[DispatchedSamplingTask.collection].find({})]
    assert not outcome.kept and set(outcome.dropped.values()) == {ZERO_VARIANCE_DECISION}
    assert all(doc["advantage"] is None and doc["step_return"] is None for doc in calls)
