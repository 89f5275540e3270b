"""Task rows and oracle demonstrations of an environment: what ``agentrl envs tasks`` and ``agentrl envs demos`` write.

Task rows are objects ``agentrl tasks upload`` accepts: ``id`` (``NAME-DATA_IDX``), ``query`` (a short label such
as ``textcraft task 17``: the episode's prompt is the environment's own first observation), ``scorer:
env_reward`` (no answer needed), ``task_type`` (``spec.meta["task_type"](data_idx)`` where the spec has one, e.g.
a BabyAI level, else the environment's name) and ``env: {name, data_idx, max_turns}``, which the upload keeps in
the Task's metadata. The upload's flags set the split and the group size.

Demonstrations are OpenAI ``messages`` conversations (``agentrl sft upload``): the environment's instruction and
first observation (:func:`agentrl.envs.actions.episode_messages`), then the oracle's actions as assistant turns
(:func:`~agentrl.envs.actions.format_action`) alternating with the observations they produced, stepped on a real
in-process instance. Only episodes that end in success within ``spec.max_turns`` are kept, and they end at the
assistant turn that succeeded, so each renders to the tokens of a rollout that acted the same. With ``images``
(an environment that draws its observations, e.g. BabyAI) every observation is a picture, as an ``image_url`` part
with a ``data:`` URI, before its text: what a vision-language policy's episode shows (``envs serve --images``).

Both sample the split's task indices with a seeded shuffle, so ``--num N`` takes the first N of one fixed order.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from agentrl.envs.actions import episode_messages, format_action, observation_message, parse_action
from agentrl.envs.base import EnvError, Environment, EnvSpec, StepResult
from agentrl.envs.protocol import episode_reward
from agentrl.envs.registry import get_spec
from agentrl.vision.images import load_image


def sampled_indices(spec: EnvSpec, split: str, num: int | None, seed: int) -> list[int]:
    """The split's task indices in a seeded random order, the first ``num`` of them (all when None)."""
    if num is not None and num < 1:
        raise ValueError(f"num must be at least 1, got {num}")
    indices = list(spec.split(split))
    random.Random(seed).shuffle(indices)
    return indices if num is None else indices[:num]


def task_rows(name: str, split: str = "train", num: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Task rows for ``num`` tasks of ``split`` (see the module docstring)."""
    spec = get_spec(name)
    return [task_row(name, data_idx) for data_idx in sampled_indices(spec, split, num, seed)]


def task_row(name: str, data_idx: int) -> dict[str, Any]:
    """The task row of environment ``name``'s task ``data_idx`` (see the module docstring)."""
    spec = get_spec(name)
    task_type = spec.meta.get("task_type")
    return {"id": f"{spec.name}-{data_idx}", "query": f"{spec.name} task {data_idx}", "scorer": "env_reward",
            "task_type": task_type(data_idx) if callable(task_type) else spec.name,
            "env": {"name": name, "data_idx": data_idx, "max_turns": spec.max_turns}}


def demo_rows(name: str, num: int, seed: int = 0, split: str = "train",
              progress: Callable[[int, int], None] | None = None, images: bool = False) -> list[dict[str, Any]]:
    """Up to ``num`` successful oracle demonstrations from ``split`` (fewer if the split runs out first), with each
    observation's picture when ``images``; ``progress(kept, tried)`` is called after each episode. ``EnvError`` for
    an environment without an oracle, or with ``images`` one that draws no picture."""
    spec = get_spec(name)
    if spec.oracle is None:
        raise EnvError(f"environment {spec.name!r} has no oracle, so it has no demonstrations")
    if num < 1:
        raise ValueError(f"num must be at least 1, got {num}")
    rows: list[dict[str, Any]] = []
    env = spec.factory()
    try:
        for tried, data_idx in enumerate(sampled_indices(spec, split, None, seed), start=1):
            try:
                messages = demonstration(spec, env, data_idx, images=images)
            except EnvError:  # the oracle cannot solve this task, or the task cannot be loaded: skip it
                messages = None
            if messages is not None:
                rows.append({"id": f"{spec.name}-{data_idx}", "messages": messages,
                             "env": {"name": name, "data_idx": data_idx}})
            if progress is not None:
                progress(len(rows), tried)
            if len(rows) == num:
                break
    finally:
        env.close()
    return rows


class NoPictureError(ValueError):
    """Demonstrations with pictures asked of an environment that draws none (a usage error, not a task to skip)."""


def demonstration(spec: EnvSpec, env: Environment, data_idx: int, images: bool = False
                  ) -> list[dict[str, Any]] | None:
    """The oracle's episode on task ``data_idx`` as messages (each observation with its picture when ``images``),
    or None if it does not succeed within the turns; ``ValueError`` if an oracle action would not read back from
    its assistant turn (a bug of the environment), :class:`NoPictureError` if ``images`` and it draws none."""
    assert spec.oracle is not None
    messages = episode_messages(spec.instruction, env.reset(data_idx))
    if images:
        messages[-1] = _with_picture(spec, env, messages[-1])
    steps: list[StepResult] = []
    for action in spec.oracle(data_idx)[:spec.max_turns]:
        reply = format_action(action, spec.action_format)
        if parse_action(reply, spec.action_format) != action:
            raise ValueError(f"environment {spec.name!r}: the oracle's action {action!r} (task {data_idx}) does not "
                           f"survive the {spec.action_format!r} action format, so no rollout could take it")
        steps.append(env.step(action))
        messages.append({"role": "assistant", "content": reply})
        success = episode_reward(steps) >= spec.success_reward
        if success or steps[-1].done:
            return messages if success else None
        message = observation_message(steps[-1].observation)
        messages.append(_with_picture(spec, env, message) if images else message)
    return None


def _with_picture(spec: EnvSpec, env: Environment, message: dict[str, Any]) -> dict[str, Any]:
    """An observation ``message`` with the environment's picture of it before its text (an ``image_url`` part)."""
    data = env.image()
    if data is None:
        raise NoPictureError(f"environment {spec.name!r} draws no picture of its observations: drop --images "
                             f"(BabyAI draws one)")
    picture = load_image(data, f"environment {spec.name!r}'s picture")
    return {**message, "content": [{"type": "image_url", "image_url": {"url": picture.data_uri()}},
                                   {"type": "text", "text": message["content"]}]}
