"""Generator of the built-in picture task sets ``assets/tasks/pictures_*.jsonl``: questions only a picture answers.

Each task is one 112 x 112 PNG (16 image tokens for the embedded vision-language model) of flat shapes on a light
background, inline as a ``data:`` URI in the task's ``images``, and a question whose one-word answer is in the picture
alone: the colour of a large shape or of a small one, which side or which half a shape is on, how many shapes there
are, the colour of the larger of two. The six task types are meant to be graded (a large shape's colour is easier
to see than a small one's, two halves easier than four counts); guessing scores 0.29 on average. The picture demo
teaches them to the embedded vision-language model (:mod:`agentrl.inference.embedded_vision_model`; docs/images.md):
colours first, positions and counts hardly.
Answers are scored ``exact`` in the ``boxed`` schema; each task's ``demo_response`` is its warm-up demonstration.

Three disjoint sets are shipped (``SHIPPED_SETS``; different seeds): ``pictures_rl.jsonl`` for RL,
``pictures_heldout.jsonl`` for held-out evaluation, ``pictures_warmup.jsonl`` for warm-up demonstrations.
Regenerate them with ``python -m agentrl.envs.pictures --shipped``.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Callable
from typing import Any

from PIL import Image, ImageDraw

from agentrl.envs.arith import generator_main

SIZE = 112
BACKGROUND = (236, 236, 236)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (214, 39, 40), "green": (44, 160, 44), "blue": (31, 90, 214), "yellow": (235, 200, 30),
    "purple": (148, 62, 189), "black": (25, 25, 25)}
INSTRUCTION = "Give the answer as one word in \\boxed{}."
DEMO_RESPONSE = "The answer is \\boxed{{{answer}}}."
"""A warm-up demonstration's answer (the task's ``demo_response``: no tool is called)."""

Shape = tuple[int, int, int, str]
"""(left, top, side, colour)"""
Problem = tuple[str, str, list[Shape]]
"""(question, answer, shapes to draw)"""


def _place(rng: random.Random, side: int, shapes: list[Shape], x: tuple[int, int] = (0, SIZE),
           y: tuple[int, int] = (0, SIZE)) -> tuple[int, int]:
    """A free spot for a ``side``-pixel shape inside the ranges ``x`` and ``y``, clear of ``shapes`` by 4 pixels."""
    for _ in range(1000):
        left, top = rng.randint(x[0], x[1] - side), rng.randint(y[0], y[1] - side)
        if all(left + side + 4 <= a or a + s + 4 <= left or top + side + 4 <= b or b + s + 4 <= top
               for a, b, s, _ in shapes):
            return left, top
    raise RuntimeError("no free spot for a shape")


def _colour_large(rng: random.Random) -> Problem:
    colour, side = rng.choice(list(COLOURS)), rng.randint(44, 72)
    return "What colour is the shape in the picture?", colour, [(*_place(rng, side, []), side, colour)]


def _colour_small(rng: random.Random) -> Problem:
    colour, side = rng.choice(list(COLOURS)), rng.randint(14, 22)
    return "What colour is the small shape in the picture?", colour, [(*_place(rng, side, []), side, colour)]


def _side(rng: random.Random) -> Problem:
    answer, side = rng.choice(["left", "right"]), rng.randint(24, 40)
    x = (0, SIZE // 2 - 6) if answer == "left" else (SIZE // 2 + 6, SIZE)
    shape = (*_place(rng, side, [], x=x), side, rng.choice(list(COLOURS)))
    return "Is the shape on the left or on the right of the picture?", answer, [shape]


def _half(rng: random.Random) -> Problem:
    answer, side = rng.choice(["top", "bottom"]), rng.randint(24, 40)
    y = (0, SIZE // 2 - 6) if answer == "top" else (SIZE // 2 + 6, SIZE)
    shape = (*_place(rng, side, [], y=y), side, rng.choice(list(COLOURS)))
    return "Is the shape in the top or the bottom half of the picture?", answer, [shape]


def _count(rng: random.Random) -> Problem:
    count, colour, shapes = rng.randint(1, 4), rng.choice(list(COLOURS)), []
    for _ in range(count):
        side = rng.randint(18, 26)
        shapes.append((*_place(rng, side, shapes), side, colour))
    return "How many squares are in the picture?", str(count), shapes


def _colour_of_larger(rng: random.Random) -> Problem:
    large, small = rng.sample(list(COLOURS), 2)
    shapes: list[Shape] = []
    for side, colour in ((rng.randint(40, 56), large), (rng.randint(14, 20), small)):
        shapes.append((*_place(rng, side, shapes), side, colour))
    rng.shuffle(shapes)
    return "What colour is the larger of the two shapes?", large, shapes


TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    "colour_large": _colour_large,
    "side": _side,
    "half": _half,
    "colour_of_larger": _colour_of_larger,
    "colour_small": _colour_small,
    "count": _count,
}


def draw(shapes: list[Shape]) -> bytes:
    """The PNG of ``shapes`` (filled squares) on the background."""
    picture = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    pen = ImageDraw.Draw(picture)
    for left, top, side, colour in shapes:
        pen.rectangle((left, top, left + side - 1, top + side - 1), fill=COLOURS[colour])
    out = io.BytesIO()
    picture.save(out, format="PNG", optimize=True)
    return out.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


SHIPPED_SETS: dict[str, tuple[int, int, str]] = {
    "pictures_rl.jsonl": (480, 10, "pictures"),
    "pictures_heldout.jsonl": (240, 11, "pictures-heldout"),
    "pictures_warmup.jsonl": (240, 12, "pictures-warmup"),
}
"""file name in ``assets/tasks`` → (tasks, seed, id prefix)"""


def generate_picture_tasks(n: int = 240, seed: int = 10, prefix: str = "pictures") -> list[dict[str, Any]]:
    """``n`` tasks, cycling over the templates, reproducible for a given ``seed``; ids ``{prefix}-0000``, ..."""
    rng = random.Random(seed)
    names = list(TEMPLATES)
    tasks = []
    for index in range(n):
        task_type = names[index % len(names)]
        question, answer, shapes = TEMPLATES[task_type](rng)
        tasks.append({"id": f"{prefix}-{index:04d}", "query": f"{question} {INSTRUCTION}", "answer": answer,
                      "images": [data_uri(draw(shapes))], "scorer": "exact", "answer_schema": "boxed",
                      "task_type": task_type, "demo_response": DEMO_RESPONSE.format(answer=answer)})
    return tasks


def main(argv: list[str] | None = None) -> int:
    return generator_main(argv, "Generate the picture tasks.", generate_picture_tasks, SHIPPED_SETS)


if __name__ == "__main__":
    raise SystemExit(main())
