"""The SciWorld environment on the real ``scienceworld`` package (JVMs started through py4j; one environment
instance is shared by the tests that only play, since each JVM takes about a second to start)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.envs.actions import format_action, parse_action
from agentrl.envs.base import EnvError, EnvSpec
from agentrl.envs.sciworld import EXCLUDED_TASKS, GoldPaths, SciWorldEnv, _list_tasks, sciworld_tasks, spec


def java_children() -> set[int]:
    """The ids of this process's child processes that run java."""
    children: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process has gone
            continue
        command, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if command == "java" and int(fields[1]) == os.getpid():
            children.add(int(stat.parent.name))
    return children


@pytest.fixture(scope="module")
def sciworld() -> EnvSpec:
    return spec()


@pytest.fixture(scope="module")
def env(sciworld: EnvSpec) -> Iterator[SciWorldEnv]:
    instance = sciworld.factory()
    assert isinstance(instance, SciWorldEnv)
    yield instance
    instance.close()


def index_of(task_id: str, variation: int) -> int:
    return next(i for i, task in enumerate(sciworld_tasks())
                if (task.task_id, task.variation) == (task_id, variation))


def test_task_list_is_agentgyms_without_the_excluded_tasks(sciworld: EnvSpec) -> None:
    tasks = sciworld_tasks()
    assert sciworld_tasks() is tasks  # built once per process
    assert len(tasks) == sciworld.num_tasks == 4639
    assert sciworld.splits == {"train": range(0, 4136), "test": range(4136, 4639)}
    assert not {task.task_id for task in tasks} & EXCLUDED_TASKS
    assert (tasks[0].task_id, tasks[0].task_name, tasks[0].variation) == ("1-1", "boil", 0)
    assert (tasks[-1].task_id, tasks[-1].variation) == ("8-2", 9)
    assert tasks[4136].task_id == "6-1" and tasks[4135].task_id == "4-4"
    assert _list_tasks(ask_the_jvm=True) == tasks  # the pinned variation counts are what the JVM says
    for previous, task in zip(tasks, tasks[1:]):  # each task's variations in order, from 0
        assert task.variation == (previous.variation + 1 if task.task_id == previous.task_id else 0)
    assert sciworld.success_reward == 100 and sciworld.reward_scale == 0.01
    assert sciworld.action_format == "react"
    assert sciworld.meta["task_type"](0) == "sciworld-boil" and sciworld.meta["task_type"](4638) == (
        "sciworld-identify-life-stages-2")


def test_reset_starts_with_the_task_then_looks_around(env: SciWorldEnv) -> None:
    first = env.reset(0)
    assert first.startswith("Your task is to boil water.")
    assert "\nThis room is called the " in first
    detail = env.detail()
    assert (detail["task_name"], detail["var_num"], detail["data_idx"]) == ("boil", 0, 0)
    assert first == f"{detail['task_description']}\n{detail['observation']}" == env.observation()
    mixing = env.reset(4136)
    assert mixing.startswith("Your task is") and mixing != first
    assert env.detail()["task_name"] == "chemistry-mix" and env.detail()["var_num"] == 0
    assert env.detail()["task_description"] in mixing


def test_steps_report_the_score_and_its_change(env: SciWorldEnv) -> None:
    env.reset(index_of("7-1", 124))  # the animals are outside, next to the greenhouse the agent starts in
    look = env.step("look around")
    assert look.observation.startswith("This room is called the greenhouse")
    assert (look.reward, look.done, look.info["score"]) == (0.0, False, 0)
    unknown = env.step("fly to the moon")
    assert unknown.observation == "No known action matches that input." and not unknown.done
    assert env.step("open door to outside").observation == "The door is now open."
    outside = env.step("go to outside")
    assert (outside.reward, outside.info["score"], outside.done) == (50.0, 50, False)
    failed = env.step("focus on baby chipmunk")  # not the longest-lived animal: ScienceWorld fails the task
    assert failed.done and failed.info["raw_score"] == -100
    assert (failed.reward, failed.info["score"]) == (-50.0, 0)  # clamped: the episode's total reward is 0
    with pytest.raises(EnvError, match="has finished"):
        env.step("look around")


def test_bad_task_indices_are_errors(env: SciWorldEnv) -> None:
    for bad in (-1, 4639, True):
        with pytest.raises(EnvError, match=r"out of range.*\[0, 4639\)"):
            env.reset(bad)


def test_oracle_completes_tasks(sciworld: EnvSpec, env: SciWorldEnv) -> None:
    oracle = sciworld.oracle
    assert isinstance(oracle, GoldPaths)
    try:
        for data_idx in (index_of("4-2", 150), index_of("7-1", 124)):
            plan = oracle(data_idx)
            env.reset(data_idx)
            total, taken = 0.0, 0
            for action in plan:  # until done: the gold sequence may go on after the task is complete
                assert parse_action(format_action(action, "react", thought="go on"), "react") == action
                result = env.step(action)
                total, taken = total + result.reward, taken + 1
                if result.done:
                    break
            assert result.done and result.info["score"] == 100 and total == sciworld.success_reward
            assert taken <= sciworld.max_turns
    finally:
        oracle.close()


def test_points_scored_by_the_start_are_paid_with_the_first_step(env: SciWorldEnv) -> None:
    env.reset(index_of("4-2", 150))  # the agent starts in the kitchen, where the red box is
    assert env.detail()["score"] > 0
    first = env.step("look around")
    assert first.reward == env.detail()["score"] == first.info["score"]


def test_close_stops_the_jvm(sciworld: EnvSpec) -> None:
    before = java_children()
    instance = sciworld.factory()
    started = java_children() - before
    assert len(started) == 1
    instance.close()
    assert java_children() & started == set()
    instance.close()  # closing twice is harmless
    with pytest.raises(EnvError, match="closed"):
        instance.reset(0)


def test_state_keys_tell_apart_states_one_observation_shows_alike(env: SciWorldEnv) -> None:
    """The key is the room and inventory as the agent would see them, not the last feedback: the same feedback in
    two rooms is two states, the same room reached twice is one."""
    env.reset(index_of("7-1", 124))
    start = env.state_key()
    assert start is not None and start.startswith("7-1:124|score 0|")
    assert env.step("look around").observation.startswith("This room is called the greenhouse")
    assert env.state_key() == start  # looking changes nothing
    here = env.step("inventory")
    assert env.state_key() == start
    env.step("open door to outside")
    opened = env.state_key()
    assert opened != start  # the room shows an open door
    env.step("go to outside")
    outside = env.state_key()
    assert outside not in (start, opened) and "|score 50|" in outside
    there = env.step("inventory")
    assert there.observation == here.observation and env.state_key() == outside  # same feedback, other state
    env.step("go to greenhouse")
    assert env.state_key() not in (start, opened)  # back in the greenhouse, but with 50 points
    assert env.state_key().split("|")[2] == opened.split("|")[2]  # the room and inventory as before
