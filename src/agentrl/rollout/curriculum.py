"""Rounds and the pass-rate curriculum: which train Tasks are sampled again, and when.

A Task's group is sampled once per *round*. With ``rounds`` > 1 the group stage of a train Task creates the Task
of the next round it samples (a new Task document, ``{first round's id}@r{round}``, with fresh slots: each round is
an ordinary group, so the slot protocol of ``agentrl.store.slots`` is unchanged) before it closes its own Task.
Claims take Tasks by round, then upload order, so round 2 starts once every Task of round 1 is claimed.

With the ``pass_rate`` curriculum a Task whose group taught nothing — its rewards did not vary (all solved or all
failed; the group stage's zero-variance drop) — skips its next rounds, each with probability
``1 - revisit_prob``: the next round it is sampled in is ``r + 1 + k`` with ``k`` geometric (seeded by ``seed``,
the Task and the round: reproducible, and the same when a group stage is redone after a crash), so it is
revisited now and then, since the policy moves. A group with varying rewards keeps its Task in every round. This
is the spirit of DAPO's dynamic sampling and Olmo 3's active sampling (spend samples where the pass rate is
neither 0 nor 1), decided per Task from its own last group. Skipped rounds are never Task documents: nothing is
claimed, lost or counted twice; the completed Task records its ``pass_rate``, its ``next_round`` and how many
rounds it skips (``rounds_skipped``), and the next round's Task how many it skipped before it (``skipped_rounds``).

By type (``by_type``): Tasks of one ``task_type`` tend to be all solved or all failed together, so the first round
already learns from its neighbours (``type_order``, read from the split's recently completed Tasks):

- a type whose most recent group taught something is *preferred*: a sampler starting a new group claims the open
  Tasks of preferred types first (their rewards are likely to vary again);
- a type none of whose last groups taught anything (its last ``TYPE_WINDOW``, at least ``TYPE_EVIDENCE``) is
  *deferred*: its open Tasks are claimed only when no other Task is open. Each deferred type is let through now and
  then: with ``revisit_prob`` each time a group of the split completes (a reproducible draw keyed on the number of
  completed groups, which grows while the type waits).

Other types (untried, or without enough evidence) come in between. This only orders claims: no document is written
for it, so it adds no crash window; the closing Task records ``taught`` for it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.config_flags import NO_FLAG, Flag
from agentrl.store import Task, TaskStatus


class CurriculumConfig(BaseModel):
    """How many rounds each train Task is sampled in, and which rounds the curriculum skips."""

    model_config = ConfigDict(extra="forbid")

    rounds: int = Field(
        1, ge=1, description="rounds each Task's group is sampled in: the group stage of round r creates the Task of "
        "the next round it is sampled in; claims take Tasks by round, then upload order")
    mode: Annotated[Literal["pass_rate", "none"], Flag(name="curriculum")] = Field(
        "pass_rate", description="pass_rate: a Task whose last group was all solved or all failed (zero reward "
        "variance) skips each next round with probability 1 - --curriculum_revisit_prob; none: every round samples "
        "every Task (it acts from round 2 on)")
    revisit_prob: Annotated[float, Flag(name="curriculum_revisit_prob")] = Field(
        0.1, ge=0.0, le=1.0, description="with --curriculum pass_rate: the chance that such a Task is sampled in "
        "each next round (seeded by --seed, reproducible)")
    by_type: Annotated[bool, Flag(name="curriculum_by_type")] = Field(
        True, description="with --curriculum pass_rate: new groups start on the Tasks of a task_type whose last group "
        "taught something first, and on those of a task_type whose recent groups all taught nothing only when no "
        "other Task is open (revisited with --curriculum_revisit_prob)")
    seed: Annotated[int, NO_FLAG] = Field(0, description="seed of the revisit draws (the sampler's --seed)")


TYPE_EVIDENCE = 2
"""Groups of a type that must all have taught nothing before it is deferred."""
TYPE_WINDOW = 4
"""A type's most recent groups that count (the policy moves: older outcomes say little)."""


def _uniform(seed: int, task_id: str, round_: int) -> float:
    """A reproducible draw in (0, 1] for ``task_id``'s round ``round_``."""
    digest = hashlib.blake2b(f"{seed}:{task_id}:{round_}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 1) / 2 ** 64


def next_round(cfg: CurriculumConfig, first_id: str, round_: int, taught: bool) -> int | None:
    """The round after ``round_`` in which the Task (first round's id ``first_id``) is sampled next, or ``None``
    when it is not sampled again within ``cfg.rounds``. ``taught``: its group's rewards varied."""
    skip = 0
    if cfg.mode == "pass_rate" and not taught:
        if cfg.revisit_prob <= 0.0:
            return None
        if cfg.revisit_prob < 1.0:  # rounds skipped before the first revisit: geometric, P(k) = (1 - p)^k p
            skip = int(math.log(_uniform(cfg.seed, first_id, round_)) / math.log1p(-cfg.revisit_prob))
    following = round_ + 1 + skip
    return following if following <= cfg.rounds else None


def round_task(task: Task, round_: int) -> Task:
    """The Task of ``task``'s content sampled again in round ``round_``, with fresh slots."""
    first_id = task.first_round_id or task.id
    fresh = {"id": f"{first_id}@r{round_}", "round": round_, "first_round_id": first_id,
             "skipped_rounds": round_ - task.round - 1, "unclaimed": task.num_generations,
             "remaining": task.num_generations, "status": TaskStatus.CREATED}
    content = task.model_dump(include={"split", "order", "query", "answer", "system_prompt", "scorer",
                                       "answer_schema", "task_type", "metadata", "content_hash", "num_generations",
                                       "max_attempts"})
    return Task(**content, **fresh)


@dataclass(frozen=True)
class TypeOrder:
    """The order in which new groups start by ``task_type``: preferred types first, deferred ones last."""

    preferred: frozenset[str] = frozenset()
    deferred: frozenset[str] = frozenset()


def type_order(cfg: CurriculumConfig, outcomes: Iterable[tuple[str | None, bool]], groups_done: int | None = None
               ) -> TypeOrder:
    """Which task types new groups start on first and last: ``outcomes`` are ``(task_type, taught)`` of completed
    groups, oldest first; ``groups_done``: how many groups of the split are complete so far (default: the number of
    ``outcomes``), which keys each deferred type's revisit draw: a new draw with every group that completes, of
    any type (a deferred type's own count does not grow while it is deferred)."""
    outcomes = list(outcomes)
    drawn_at = len(outcomes) if groups_done is None else groups_done
    if cfg.mode != "pass_rate" or not cfg.by_type:
        return TypeOrder()
    recent: dict[str, list[bool]] = {}
    for task_type, taught in outcomes:
        if task_type is not None:
            recent[task_type] = [*recent.get(task_type, []), taught][-TYPE_WINDOW:]
    preferred = frozenset(name for name, taught in recent.items() if taught[-1])
    if cfg.revisit_prob >= 1.0:
        return TypeOrder(preferred)
    deferred = frozenset(name for name, taught in recent.items()
                         if len(taught) >= TYPE_EVIDENCE and not any(taught)
                         and _uniform(cfg.seed, f"type:{name}", drawn_at) > cfg.revisit_prob)
    return TypeOrder(preferred, deferred)
