"""Generator of the built-in task set ``assets/tasks/arith_tools.jsonl``: arithmetic word problems.

The numbers are large enough that a calculator helps (multi-digit products, percentages, decimals), and every
answer is exact (an integer or a short decimal). The 16 task types come in 8 pairs, a simpler and a harder form of
one kind of problem (an average of two numbers and one of four to eight; cartons that divide exactly and cartons
that round up; one price cut and two), so that difficulty is graded within each kind: a small warmed-up model
solves some forms always, some never and many sometimes, and it is the last that RL can learn from.

Each task carries the calculator ``expression`` that computes its answer (kept in the Task's metadata), which
makes tool-use demonstrations for a supervised warm start easy to generate and lets tests check every answer with
the calculator.

Three disjoint sets are shipped in ``assets/tasks/`` (``SHIPPED_SETS``): ``arith_tools.jsonl`` for RL,
``arith_heldout.jsonl`` for held-out evaluation and ``arith_warmup.jsonl`` for warm-up demonstrations (different
seeds; no question appears in two sets). Regenerate them with ``python -m agentrl.envs.arith --shipped``.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

INSTRUCTION = "Give the final answer as a number in \\boxed{}."

Problem = tuple[str, Decimal, str]
"""(question, exact answer, calculator expression)"""


def _money(cents: int) -> Decimal:
    return Decimal(cents) / 100


def _bulk_order(rng: random.Random) -> Problem:
    crates, per_crate = rng.randint(120, 980), rng.randint(12, 96)
    item = rng.choice(["bottles", "jars", "cans", "boxes"])
    question = (
        f"A warehouse ships {crates} crates, and each crate holds {per_crate} {item}. "
        f"How many {item} are shipped in total?"
    )
    return question, Decimal(crates * per_crate), f"{crates} * {per_crate}"


def _shared_bill(rng: random.Random) -> Problem:
    people, share_cents = rng.randint(6, 48), rng.randint(1505, 9875)
    total = _money(people * share_cents)
    question = f"A club of {people} members splits a bill of ${total} equally. How many dollars does each member pay?"
    return question, _money(share_cents), f"{total} / {people}"


def _discount(rng: random.Random) -> Problem:
    price, percent = rng.randint(140, 2400), rng.choice([5, 10, 12, 15, 20, 25, 30, 35, 40])
    item = rng.choice(["laptop", "bicycle", "sofa", "camera", "washing machine"])
    sale = Decimal(price) * (100 - percent) / 100
    question = f"A {item} costs ${price}. It is sold at {percent}% off. What is the sale price in dollars?"
    return question, sale, f"{price} * (100 - {percent}) / 100"


def _revenue(rng: random.Random) -> Problem:
    loaves, cakes = rng.randint(40, 400), rng.randint(12, 150)
    loaf_cents, cake_cents = rng.randint(175, 690), rng.randint(1250, 4599)
    loaf, cake = _money(loaf_cents), _money(cake_cents)
    question = (
        f"A bakery sells {loaves} loaves of bread at ${loaf} each and {cakes} cakes at ${cake} each. "
        "What is its total revenue in dollars?"
    )
    return question, loaves * loaf + cakes * cake, f"{loaves} * {loaf} + {cakes} * {cake}"


def _travel(rng: random.Random) -> Problem:
    speed, hours, minutes = rng.randint(18, 160) * 4, rng.randint(2, 11), rng.choice([15, 30, 45])
    vehicle = rng.choice(["train", "truck", "ferry", "bus"])
    distance = Decimal(speed) * (hours + Decimal(minutes) / 60)
    question = (
        f"A {vehicle} travels at {speed} km per hour for {hours} hours and {minutes} minutes. "
        "How many kilometres does it cover?"
    )
    return question, distance, f"{speed} * ({hours} + {minutes} / 60)"


def _growth(rng: random.Random, years: int = 2) -> Problem:
    start, rate = rng.randint(12, 950) * 100, rng.randint(2, 15)
    things = rng.choice(["a savings account balance", "an investment fund's value", "a company's yearly revenue"])
    value = Decimal(start) * (100 + rate) ** years / 100 ** years
    question = (
        f"{things[0].upper()}{things[1:]} is ${start} and grows by {rate}% each year. "
        f"What is it in dollars after {years} years?"
    )
    return question, value, f"{start} * (1 + {rate} / 100) ** {years}"


def _cartons(rng: random.Random) -> Problem:
    per_carton = rng.choice([6, 8, 12, 18, 24, 30, 36])
    count = rng.randint(1000, 60000)
    if count % per_carton == 0:
        count += 1
    question = (
        f"A farm collects {count} eggs and packs them into cartons of {per_carton}. "
        "How many cartons are needed to pack all the eggs?"
    )
    return question, Decimal(-(-count // per_carton)), f"ceil({count} / {per_carton})"


def _average(rng: random.Random) -> Problem:
    days = rng.choice([4, 5, 8])
    values = [rng.randint(1200, 9800) for _ in range(days)]
    listing = ", ".join(str(v) for v in values[:-1]) + f" and {values[-1]}"
    question = (
        f"A shop's daily sales over {days} days were {listing} dollars. "
        "What were its average daily sales in dollars?"
    )
    return question, Decimal(sum(values)) / days, f"({' + '.join(str(v) for v in values)}) / {days}"


def _pallets(rng: random.Random) -> Problem:
    pallets, crates, per_crate = rng.randint(4, 40), rng.randint(6, 48), rng.randint(12, 96)
    item = rng.choice(["bottles", "jars", "cans", "boxes"])
    question = (
        f"A warehouse ships {pallets} pallets. Each pallet carries {crates} crates, and each crate holds "
        f"{per_crate} {item}. How many {item} are shipped in total?"
    )
    return question, Decimal(pallets * crates * per_crate), f"{pallets} * {crates} * {per_crate}"


def _bill_with_tip(rng: random.Random) -> Problem:
    people, share_cents = rng.randint(4, 24), rng.randint(1505, 9875)
    total_cents = people * share_cents
    tip_cents = rng.randint(total_cents // 10, total_cents // 5)
    bill, tip = _money(total_cents - tip_cents), _money(tip_cents)
    question = (
        f"{people} friends have dinner. The bill is ${bill} and they add a tip of ${tip}. They split the total "
        "equally. How many dollars does each friend pay?"
    )
    return question, _money(share_cents), f"({bill} + {tip}) / {people}"


def _discount_twice(rng: random.Random) -> Problem:
    price = rng.randint(140, 2400)
    first, second = rng.choice([10, 20, 25, 30, 40]), rng.choice([5, 10, 15, 20, 25])
    item = rng.choice(["laptop", "bicycle", "sofa", "camera", "washing machine"])
    sale = Decimal(price) * (100 - first) * (100 - second) / 10000
    question = (
        f"A {item} costs ${price}. It is marked down by {first}%, and the reduced price is then cut by another "
        f"{second}%. What is the final price in dollars?"
    )
    return question, sale, f"{price} * (100 - {first}) / 100 * (100 - {second}) / 100"


def _revenue_one_item(rng: random.Random) -> Problem:
    loaves, loaf_cents = rng.randint(40, 400), rng.randint(175, 690)
    loaf = _money(loaf_cents)
    question = f"A bakery sells {loaves} loaves of bread at ${loaf} each. What is its revenue in dollars?"
    return question, loaves * loaf, f"{loaves} * {loaf}"


def _travel_two_legs(rng: random.Random) -> Problem:
    first, second = rng.randint(18, 160) * 4, rng.randint(18, 160) * 4
    hours_first, hours_second = rng.randint(2, 9), rng.randint(2, 9)
    vehicle = rng.choice(["train", "truck", "ferry", "bus"])
    question = (
        f"A {vehicle} travels at {first} km per hour for {hours_first} hours, then at {second} km per hour for "
        f"{hours_second} hours. How many kilometres does it cover in total?"
    )
    return (question, Decimal(first * hours_first + second * hours_second),
            f"{first} * {hours_first} + {second} * {hours_second}")


def _cartons_exact(rng: random.Random) -> Problem:
    per_carton = rng.choice([6, 8, 12, 18, 24, 30, 36])
    cartons = rng.randint(150, 5000)
    count = cartons * per_carton
    question = (
        f"A farm collects {count} eggs and packs them into cartons of {per_carton}, filling every carton. "
        "How many cartons does it fill?"
    )
    return question, Decimal(cartons), f"{count} / {per_carton}"


def _average_of_two(rng: random.Random) -> Problem:
    first, second = rng.randint(1200, 9800), rng.randint(1200, 9800)
    question = (
        f"A shop's sales were {first} dollars on Monday and {second} dollars on Tuesday. "
        "What were its average daily sales over the two days in dollars?"
    )
    return question, Decimal(first + second) / 2, f"({first} + {second}) / 2"


TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    "bulk_order": _bulk_order,
    "shared_bill": _shared_bill,
    "discount": _discount,
    "revenue": _revenue,
    "travel": _travel,
    "growth": _growth,
    "cartons": _cartons,
    "average": _average,
    "bulk_order_pallets": _pallets,
    "shared_bill_tip": _bill_with_tip,
    "discount_twice": _discount_twice,
    "revenue_one_item": _revenue_one_item,
    "travel_two_legs": _travel_two_legs,
    "growth_three_years": functools.partial(_growth, years=3),
    "cartons_exact": _cartons_exact,
    "average_of_two": _average_of_two,
}


def format_answer(value: Decimal) -> str:
    """An exact decimal without exponent or trailing zeros (``37.50`` → ``37.5``, ``1E+3`` → ``1000``)."""
    text = format(value.normalize(), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


SHIPPED_SETS: dict[str, tuple[int, int, str]] = {
    "arith_tools.jsonl": (200, 0, "arith"),
    "arith_heldout.jsonl": (100, 1, "heldout"),
    "arith_warmup.jsonl": (200, 2, "warmup"),
}
"""file name in ``assets/tasks`` → (tasks, seed, id prefix)"""


def generate_arith_tasks(n: int = 200, seed: int = 0, prefix: str = "arith") -> list[dict[str, Any]]:
    """``n`` tasks, cycling over the templates, reproducible for a given ``seed``; ids ``{prefix}-0000``, ..."""
    rng = random.Random(seed)
    names = list(TEMPLATES)
    tasks = []
    for index in range(n):
        task_type = names[index % len(names)]
        question, answer, expression = TEMPLATES[task_type](rng)
        tasks.append({
            "id": f"{prefix}-{index:04d}",
            "query": f"{question} {INSTRUCTION}",
            "answer": format_answer(answer),
            "scorer": "math",
            "answer_schema": "boxed",
            "task_type": task_type,
            "expression": expression,
        })
    return tasks


def write_jsonl(tasks: list[dict[str, Any]], path: str | Path) -> None:
    """Write one JSON object per line (UTF-8)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for task in tasks:
            handle.write(json.dumps(task, ensure_ascii=False) + "\n")


def generator_main(argv: list[str] | None, description: str,
                   generate: Callable[[int, int, str], list[dict[str, Any]]],
                   shipped_sets: dict[str, tuple[int, int, str]]) -> int:
    """The command line of a task-set generator: ``--out FILE`` (``--n``, ``--seed``, ``--prefix``; defaults: the
    first shipped set's) or ``--shipped [DIR]``, every set of ``shipped_sets`` rewritten."""
    n, seed, prefix = next(iter(shipped_sets.values()))
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=None, help="write N tasks of SEED here")
    parser.add_argument("--n", type=int, default=n)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--prefix", default=prefix, help="task ids are PREFIX-0000, PREFIX-0001, ...")
    parser.add_argument("--shipped", default=None, metavar="DIR", nargs="?", const="assets/tasks",
                        help="regenerate the shipped sets (SHIPPED_SETS) in DIR (default: assets/tasks)")
    args = parser.parse_args(argv)
    if args.shipped:
        for name, (n, seed, prefix) in shipped_sets.items():
            write_jsonl(generate(n, seed, prefix), Path(args.shipped) / name)
            print(f"wrote {n} tasks to {Path(args.shipped) / name}")
    elif args.out:
        write_jsonl(generate(args.n, args.seed, args.prefix), args.out)
        print(f"wrote {args.n} tasks to {args.out}")
    else:
        parser.error("give --out FILE or --shipped [DIR]")
    return 0


def main(argv: list[str] | None = None) -> int:
    return generator_main(argv, "Generate arithmetic tool-use tasks.", generate_arith_tasks, SHIPPED_SETS)


if __name__ == "__main__":
    raise SystemExit(main())
