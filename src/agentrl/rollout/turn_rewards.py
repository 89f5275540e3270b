"""Per-turn rewards from a scorer: what it sees of a tool task's turns, and the rewards it may give each.

A scorer's ``config["turns"]`` lists the trajectory's LLM calls in order, each ``{"output", "tool_calls",
"tool_results", "status"}`` (the call's text, the tool calls parsed from it, their results and the call's status).
Beside its score, a scorer may return ``(score, {"turn_rewards": [r_0, ..., r_{K-1}]})``: one finite number per
call, in that order, the reward the call's action earned (they need not sum to the score). A per-turn
``--adv_estimator`` computes each call's return to go from them, instead of crediting the whole score to the last
call; the group stage writes each on its call (``step_reward``). The score stays the trajectory's verdict (its
episode term, and everything ``grpo`` does). A list of another length, or anything not a finite number in it, is a
scoring error (the Record ``failed`` with ``score_error``), never a silent reward. Environment episodes have their
environment's step rewards; a scorer's ``turn_rewards`` for one is an error too.

Beware of what such rewards let through: a reward per well-formed call pays for extra calls (SkyRL#2104), so pay
for progress (the first time a needed fact is fetched), not for activity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from agentrl.store.models import DispatchedSamplingTask

TURN_REWARDS = "turn_rewards"
"""The ``details`` key of a scorer's per-turn rewards (and of the Record's ``score_details``)."""


def scorer_turns(calls: Sequence[DispatchedSamplingTask]) -> list[dict[str, Any]]:
    """What a scorer sees of each LLM call (``config["turns"]``)."""
    return [{"output": call.output_text, "tool_calls": call.tool_calls, "tool_results": call.tool_results,
             "status": str(call.status)} for call in calls]


def turn_rewards_error(details: dict[str, Any], num_calls: int, scorer: str, *, episode: bool) -> str | None:
    """Why a scorer's ``turn_rewards`` cannot be used (None: absent, or one finite number per call)."""
    if TURN_REWARDS not in details:
        return None
    rewards = details[TURN_REWARDS]
    if episode:
        return (f"scorer {scorer!r} returned {TURN_REWARDS} for an environment episode, whose turns have the "
                "environment's rewards")
    if not isinstance(rewards, list) or len(rewards) != num_calls:
        got = f"{len(rewards)} values" if isinstance(rewards, list) else type(rewards).__name__
        return f"scorer {scorer!r}: {TURN_REWARDS} must be a list of {num_calls} numbers (one per LLM call), got {got}"
    for index, value in enumerate(rewards):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"scorer {scorer!r}: {TURN_REWARDS}[{index}] must be a finite number, got {value!r}"
    return None
