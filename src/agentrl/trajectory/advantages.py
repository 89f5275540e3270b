"""Advantages: from the rewards of one GRPO group to the advantage of each trajectory and of each LLM call.

Pure functions on plain floats (no database, no tensors). The pipeline per group, in order:

1. ``group_advantages``: ``A_i = R_i - b_i`` with the baseline ``b_i`` the group mean, or with ``leave_one_out``
   the mean of the *other* members; with ``scale_rewards`` divided by ``std + std_epsilon``, ``std`` the group's
   unbiased (Bessel, ``n - 1``) standard deviation, as ``torch.std`` computes it in verl and TRL (the original AgentRL
   never divided its advantage by a std, so there is nothing of it to follow). A group of one has std 0 and
   advantage 0.
2. ``call_advantages``: every LLM call of a trajectory inherits its trajectory's advantage (or, with a per-turn
   ``adv_estimator``, gets its own: ``agentrl.trajectory.step_credit``); calls whose status
   is an error status (``formaterror``, ``repeaterror`` by default) are capped at 0 (never rewarded, may still
   be penalised); calls whose status is not trainable get ``None``. The result is multiplied by
   ``adv_scaling``, and then the drop rule (``drop_zero_advantage`` / ``minimal_advantage``) turns calls with a
   negligible advantage into ``None`` (they stay in the sequence as context, without loss).

Differences from the original AgentRL (docs/original.md), on purpose:

* The group is whatever the caller passes, by position: the original's baseline used ``Task.scores``, which also
  held failed and later-abandoned samples, and removed "the first score equal to mine" by value.
* ``minimal_advantage`` compares the magnitude ``|A|``: the original compared the signed value (so a positive
  threshold silently dropped every negative-advantage turn) and ignored a threshold of 0 (a truthiness test).
* The std option exists (``scale_rewards``); a zero-variance group gets advantage 0, never a division by zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.config_flags import NO_FLAG

TRAINABLE_CALL_STATUSES: frozenset[str] = frozenset({"completed", "toolfailed", "formaterror", "repeaterror"})
"""Statuses of the calls whose sampled tokens are trained (the original's set; ``failed`` calls are not)."""

ERROR_CALL_STATUSES: frozenset[str] = frozenset({"formaterror", "repeaterror"})
"""Statuses whose calls never get a positive advantage (the original set their ``advantage`` to 0)."""


class AdvEstimator(StrEnum):
    """How a trajectory's turns are credited (``agentrl.trajectory.step_credit``)."""

    GRPO = "grpo"
    GIGPO = "gigpo"
    TURN_LOO = "turn_loo"


class GigpoMode(StrEnum):
    MEAN_NORM = "mean_norm"
    MEAN_STD_NORM = "mean_std_norm"


class AdvantageConfig(BaseModel):
    """How rewards become advantages (flags of ``agentrl sample``, whose group stage computes them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adv_estimator: AdvEstimator = Field(
        AdvEstimator.GRPO, description="grpo: every turn gets its trajectory's advantage; gigpo: verl-agent's GiGPO "
        "(an episode and a step term per turn); turn_loo: per-turn credit with leave-one-out baselines, unbiased "
        "(docs/training.md#credit-per-turn)")
    gamma: float = Field(0.95, ge=0.0, le=1.0, description="gigpo, turn_loo: discount of the returns to go")
    step_advantage_w: float = Field(1.0, ge=0.0, description="gigpo, turn_loo: weight of the step term (omega)")
    gigpo_mode: GigpoMode = Field(GigpoMode.MEAN_NORM, description="gigpo: mean_norm or mean_std_norm")

    scale_rewards: bool = Field(
        False, description="divide R - baseline by the group's unbiased standard deviation (n - 1, as verl and "
        "TRL; a group of one gets advantage 0)")
    leave_one_out: bool = Field(False, description="baseline = mean of the other members of the group")
    adv_scaling: float = Field(1.0, description="multiply every advantage by this factor")
    drop_zero_advantage: bool = Field(True, description="no loss on calls whose advantage is exactly 0")
    minimal_advantage: float | None = Field(
        None, ge=0.0, description="no loss on calls with |advantage| below this (replaces the zero rule)"
    )
    reward_sign_threshold: Annotated[float | None, NO_FLAG] = Field(
        None,
        description="if set, rewards above it never get a negative advantage and rewards at or below it never a "
        "positive one (the original hard-wired 0.5 for rewards in [0, 1])",
    )
    std_epsilon: Annotated[float, NO_FLAG] = Field(1e-6, gt=0.0, description="added to the std before dividing")
    trainable_statuses: Annotated[frozenset[str], NO_FLAG] = TRAINABLE_CALL_STATUSES
    error_statuses: Annotated[frozenset[str], NO_FLAG] = ERROR_CALL_STATUSES

    @model_validator(mode="after")
    def _error_statuses_are_trainable(self) -> AdvantageConfig:
        extra = self.error_statuses - self.trainable_statuses
        if extra:
            raise ValueError(f"error_statuses {sorted(extra)} are not in trainable_statuses")
        return self


def group_advantages(rewards: Sequence[float], config: AdvantageConfig) -> list[float]:
    """Advantage of each member of one group (before ``adv_scaling``), in the order of ``rewards``.

    ``R_i - mean(R)``, or ``R_i - mean_{j != i}(R_j)`` with ``leave_one_out`` (0 for a group of one); divided by
    ``std(R) + std_epsilon`` (unbiased std over the whole group, 0 for a group of one) with ``scale_rewards``.
    With ``reward_sign_threshold`` the sign clamp is applied last.
    """
    values = [float(r) for r in rewards]
    for index, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"reward {index} of the group is not finite: {value!r}")
    n = len(values)
    if n == 0:
        return []
    total = math.fsum(values)
    mean = total / n
    if config.leave_one_out:
        advantages = [0.0 if n == 1 else r - (total - r) / (n - 1) for r in values]
    else:
        advantages = [r - mean for r in values]
    if config.scale_rewards:
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in values) / (n - 1)) if n > 1 else 0.0
        advantages = [a / (std + config.std_epsilon) for a in advantages]
    threshold = config.reward_sign_threshold
    if threshold is not None:
        advantages = [max(a, 0.0) if r > threshold else min(a, 0.0) for a, r in zip(advantages, values)]
    return advantages


def keeps_advantage(advantage: float, config: AdvantageConfig) -> bool:
    """The drop rule: whether a call with this (scaled) advantage is trained."""
    if config.minimal_advantage is not None:
        return abs(advantage) >= config.minimal_advantage
    return not (config.drop_zero_advantage and advantage == 0.0)


def call_advantages(
    advantages: float | Sequence[float], call_statuses: Sequence[str], config: AdvantageConfig
) -> list[float | None]:
    """Per-call advantages of one trajectory (``None``: no loss on that call's tokens), from its advantage (every
    call alike, ``grpo``) or one per call (a per-turn estimator, ``agentrl.trajectory.step_credit``).

    A call whose status is not in ``trainable_statuses`` gets ``None``; an error-status call gets
    ``min(A, 0)``; then ``adv_scaling`` and the drop rule apply.
    """
    per_call = [float(advantages)] * len(call_statuses) if isinstance(advantages, (int, float)) else advantages
    if len(per_call) != len(call_statuses):
        raise ValueError(f"{len(per_call)} advantages for {len(call_statuses)} calls")
    result: list[float | None] = []
    for status, call_advantage in zip(call_statuses, per_call):
        status = str(status)
        if status not in config.trainable_statuses:
            result.append(None)
            continue
        advantage = min(call_advantage, 0.0) if status in config.error_statuses else call_advantage
        advantage *= config.adv_scaling
        result.append(advantage if keeps_advantage(advantage, config) else None)
    return result
