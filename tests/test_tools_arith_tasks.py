"""The built-in task set assets/tasks/arith_tools.jsonl: reproducible from its generator, every answer right."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from agentrl.envs.arith import SHIPPED_SETS, TEMPLATES, generate_arith_tasks
from agentrl.scoring.math_equiv import math_equal, math_score
from agentrl.store.task_files import UploadDefaults, parse_entry
from agentrl.tools.calculator import evaluate, format_number

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "tasks"


def test_the_shipped_files_are_the_generators_output_and_disjoint() -> None:
    questions: dict[str, set[str]] = {}
    for name, (n, seed, prefix) in SHIPPED_SETS.items():
        shipped = [json.loads(line) for line in (ASSETS / name).read_text(encoding="utf-8").splitlines()]
        assert shipped == generate_arith_tasks(n, seed, prefix), name
        assert all(task["id"].startswith(f"{prefix}-") for task in shipped)
        questions[name] = {task["query"] for task in shipped}
    names = list(questions)
    for index, first in enumerate(names):
        for second in names[index + 1:]:
            assert not questions[first] & questions[second], (first, second)  # RL, held-out, warm-up: disjoint


def test_every_answer_is_what_the_calculator_computes() -> None:
    tasks = generate_arith_tasks(200, seed=0)
    counts = Counter(t["task_type"] for t in tasks)
    assert set(counts) == set(TEMPLATES) and max(counts.values()) - min(counts.values()) <= 1  # cycled in turn
    assert len({t["id"] for t in tasks}) == len({t["query"] for t in tasks}) == 200
    for task in tasks:
        assert (task["scorer"], task["answer_schema"]) == ("math", "boxed")
        assert "\\boxed{}" in task["query"]
        assert math_equal(format_number(evaluate(task["expression"])), task["answer"]), task
        assert math_score(f"The result is \\boxed{{{task['answer']}}}.", task["answer"]) == 1.0
        assert math_score("The result is \\boxed{1}.", task["answer"]) == 0.0


def test_the_tasks_upload_with_the_expression_in_metadata() -> None:
    defaults = UploadDefaults(scorer="math", answer_schema="boxed")
    for order, task in enumerate(generate_arith_tasks(16, seed=0)):
        parsed = parse_entry(task, defaults, order)
        assert (parsed.scorer, parsed.answer_schema, parsed.task_type) == ("math", "boxed", task["task_type"])
        assert parsed.metadata == {"expression": task["expression"]}
