"""Run AgentGym's TextCraft code and write its tasks into ``tests/contracts/agentgym_textcraft.json``.

Not run by the test suite (AgentGym's ``agentenv-textcraft`` is not on PyPI and its code is not copied into this
repository); run it by hand, then review the diff of the fixture and ``tests/test_envs_textcraft.py``. It imports
``agentenv_textcraft/crafting_tree.py``, ``utils.py`` and ``environment.py`` (not the package's ``__init__``,
which starts a server) from either

* a git directory and a commit (a clone or a fetched mirror of ``WooooDyy/AgentGym``)::

    python tests/contracts/extract_agentgym_textcraft.py --git-dir AgentGym/.git --commit SHA \\
        -o tests/contracts/agentgym_textcraft.json

* or a directory holding ``agentenv_textcraft/`` (``AgentGym/agentenv-textcraft`` of a checkout)::

    python tests/contracts/extract_agentgym_textcraft.py --source-dir AgentGym/agentenv-textcraft --label "..."

It needs ``gymnasium`` and ``numpy`` (AgentGym's code imports them). AgentGym's server reads its recipe files in
``os.listdir`` order, which is the filesystem's (and decides both the goal of each ``data_idx`` and which recipe of
a cycle is dropped); here the listing is sorted by name, so the fixture is the same on every machine. For each
``data_idx`` its ``TextCraftEnv.reset`` gives the goal; the fixture records the goal, its depth and the recipes of
its recipe tree (``traverse_recipe_tree``: the commands every task for that goal lists, before distractors),
as indices into the sorted list of all recipes of the tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

PACKAGE = "agentenv_textcraft"
MODULES = ("utils", "crafting_tree", "environment")


def unpack(git_dir: Path, commit: str, into: Path) -> Path:
    """``agentenv-textcraft/`` of ``commit`` written under ``into``; returns the directory holding the package."""
    archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", commit, "agentenv-textcraft"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(into)], input=archive, check=True)
    return into / "agentenv-textcraft"


def load(source_dir: Path) -> tuple[Any, Any]:
    """AgentGym's ``CraftingTree`` and ``TextCraftEnv`` classes, imported from ``source_dir/agentenv_textcraft``."""
    package_dir = source_dir / PACKAGE
    if not (package_dir / "environment.py").is_file():
        raise SystemExit(f"{source_dir}: no {PACKAGE}/environment.py inside")
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(package_dir)]
    sys.modules[PACKAGE] = package
    for name in MODULES:
        spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{name}", package_dir / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[f"{PACKAGE}.crafting_tree"].CraftingTree, sys.modules[f"{PACKAGE}.environment"].TextCraftEnv


def extract(source_dir: Path) -> dict[str, Any]:
    crafting_tree_class, env_class = load(source_dir)
    listdir = os.listdir
    os.listdir = lambda path=".": sorted(listdir(path))  # type: ignore[assignment,misc]
    try:
        tree = crafting_tree_class(minecraft_dir=str(source_dir / PACKAGE) + "/")
    finally:
        os.listdir = listdir
    recipes = sorted({recipe.recipe_str for recipes in tree.itemid_recipes.values() for recipe in recipes})
    index = {recipe: i for i, recipe in enumerate(recipes)}
    env = env_class(crafting_tree=tree, commands=None, goal=None)
    goals = []
    for data_idx in range(sum(1 for _ in tree.item_recipes_min_depth(1))):
        observation, _ = env.reset(data_idx=data_idx)
        needed = {index[recipe.recipe_str] for recipe in tree.traverse_recipe_tree(env.goal, set())}
        assert observation.endswith(f"Goal: craft {env.goal.removeprefix('minecraft:').replace('_', ' ')}.")
        goals.append({"goal": env.goal, "depth": tree.get_min_depth(env.goal), "recipe_tree": sorted(needed)})
    return {"listing": "recipe files in name order", "recipes": recipes, "tasks": goals}


def to_json(fixture: dict[str, Any]) -> str:
    """The fixture as JSON with one recipe or task a line (short diffs)."""
    fields = []
    for key, value in fixture.items():
        if isinstance(value, list):
            value_text = "[\n  " + ",\n  ".join(json.dumps(item) for item in value) + "\n ]"
        else:
            value_text = json.dumps(value)
        fields.append(f" {json.dumps(key)}: {value_text}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--git-dir", type=Path, help="git directory of WooooDyy/AgentGym (with --commit)")
    where.add_argument("--source-dir", type=Path, help="directory holding agentenv_textcraft/")
    parser.add_argument("--commit", help="commit to read from --git-dir")
    parser.add_argument("--label", help="where the source came from (recorded in the fixture)")
    parser.add_argument("-o", "--output", type=Path, help="write the JSON here (default: stdout)")
    args = parser.parse_args(argv)
    if args.git_dir is not None and not args.commit:
        parser.error("--git-dir needs --commit")
    with tempfile.TemporaryDirectory(prefix="agentgym-textcraft-") as scratch:
        if args.git_dir is not None:
            commit = subprocess.run(["git", "--git-dir", str(args.git_dir), "rev-parse", args.commit],
                                    capture_output=True, text=True, check=True).stdout.strip()
            source_dir, label = unpack(args.git_dir, commit, Path(scratch)), f"WooooDyy/AgentGym@{commit}"
        else:
            source_dir, label = args.source_dir, args.label or str(args.source_dir)
        fixture = {"source": label, **extract(source_dir)}
    text = to_json(fixture)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
