"""Credit per turn: from the steps of one group's trajectories to an advantage for each step.

A group is the trajectories sampled for one Task. A trajectory is its episode score ``R`` (what ``grpo`` credits)
and its steps, one per turn that acted: the step's reward ``r_t`` (of the step its action made; 0 where the
environment gives none) and the key of the state it acted in (before its action). A step's return is
``G_t = sum_k gamma^k r_{t+k}`` over the rest of its trajectory. Pure functions on plain floats.

Estimators (``--adv_estimator``):

* ``grpo``: every step gets its trajectory's group advantage (:func:`agentrl.trajectory.advantages.group_advantages`).
* ``gigpo``: GiGPO (arXiv 2505.10978) as verl-agent's ``compute_gigpo_outcome_advantage`` computes it:
  ``A = A_E + omega * A_S``. ``A_E = R - mean`` over the group's *step rows* (a trajectory of T steps counted T
  times), divided by ``std + eps`` in ``mean_std_norm`` (torch's unbiased std over those rows); a group of one row:
  ``R`` itself (mean 0, std 1). ``A_S = G_t - mean`` over the step rows of the group in the same state (the step
  itself and the trajectory's other visits included), normalised alike; a state visited once: 0.
* ``turn_loo``: ours, GiGPO's two terms with baselines that never depend on the trajectory's own actions:
  ``A_E = R_i - mean_{j != i} R_j`` (each trajectory once, leave-one-out) and ``A_S = G_t - b``, with ``b`` the mean
  return of the *other* trajectories' steps in the same state, else of their steps at the same turn index, else
  0. For ``gamma = 1`` its expected gradient is exactly ``(1 + omega)`` times the policy gradient (each term is
  REINFORCE with a baseline independent of the step's action and of everything after it;
  ``tests/test_step_credit.py`` enumerates small MDPs exactly), where GiGPO's self-including means and the
  per-index (MT-GRPO) construction are biased. A group of one gets 0, as in ``grpo``.

``omega = 0`` makes ``gigpo`` GiGPO's episode term alone and ``turn_loo`` leave-one-out GRPO. The options are
:class:`~agentrl.trajectory.advantages.AdvantageConfig`'s (``gamma``, ``step_advantage_w`` = omega, ``gigpo_mode``,
``std_epsilon``); GiGPO's defaults as verl-agent's config: gamma 0.95, omega 1, ``mean_norm``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from agentrl.trajectory.advantages import AdvantageConfig, AdvEstimator, GigpoMode, group_advantages


@dataclass(frozen=True)
class Step:
    """One turn that acted: the reward its action earned and the state it acted in."""

    reward: float
    state_key: str


@dataclass(frozen=True)
class Episode:
    """One trajectory of the group: its score and its steps in order."""

    score: float
    steps: Sequence[Step]


@dataclass(frozen=True)
class StepCredit:
    """A step's advantage and the return it was computed from."""

    advantage: float
    step_return: float


def step_returns(steps: Sequence[Step], gamma: float) -> list[float]:
    """``G_t = r_t + gamma * G_{t+1}`` from the last step back."""
    returns, running = [0.0] * len(steps), 0.0
    for t in reversed(range(len(steps))):
        running = steps[t].reward + gamma * running
        returns[t] = running
    return returns


def step_credits(episodes: Sequence[Episode], config: AdvantageConfig) -> list[list[StepCredit]]:
    """Each step's credit, per episode in the order given (``adv_estimator`` says how; ``grpo`` follows the group
    advantage's other settings, ``scale_rewards`` and ``leave_one_out``)."""
    for index, episode in enumerate(episodes):
        values = [episode.score, *(step.reward for step in episode.steps)]
        if not all(math.isfinite(value) for value in values):
            raise ValueError(f"episode {index} of the group has a reward that is not finite: {values}")
    returns = [step_returns(episode.steps, config.gamma) for episode in episodes]
    if config.adv_estimator == AdvEstimator.GRPO:
        advantages = group_advantages([episode.score for episode in episodes], config)
        per_step = [[a] * len(episode.steps) for a, episode in zip(advantages, episodes)]
    elif config.adv_estimator == AdvEstimator.GIGPO:
        per_step = _gigpo(episodes, returns, config)
    else:
        per_step = _turn_loo(episodes, returns, config.step_advantage_w)
    return [[StepCredit(a, g) for a, g in zip(advantages, rets, strict=True)]
            for advantages, rets in zip(per_step, returns, strict=True)]


def _normalised(values: list[float], config: AdvantageConfig, singleton_mean: float | None) -> list[float]:
    """verl-agent's per-group normalisation: minus the mean (``singleton_mean`` for a group of one), over
    ``std + epsilon`` in ``mean_std_norm`` (unbiased std; 1 for a group of one)."""
    n = len(values)
    mean = math.fsum(values) / n if n > 1 or singleton_mean is None else singleton_mean
    centred = [value - mean for value in values]
    if config.gigpo_mode == GigpoMode.MEAN_NORM:
        return centred
    std = math.sqrt(math.fsum((value - mean) ** 2 for value in values) / (n - 1)) if n > 1 else 1.0
    return [value / (std + config.std_epsilon) for value in centred]


def _gigpo(episodes: Sequence[Episode], returns: list[list[float]], config: AdvantageConfig) -> list[list[float]]:
    rows = [(i, t) for i, episode in enumerate(episodes) for t in range(len(episode.steps))]
    if not rows:
        return [[] for _ in episodes]
    episode_terms = _normalised([episodes[i].score for i, _ in rows], config, singleton_mean=0.0)
    by_state: dict[str, list[int]] = defaultdict(list)
    for row, (i, t) in enumerate(rows):
        by_state[episodes[i].steps[t].state_key].append(row)
    step_terms = [0.0] * len(rows)
    for members in by_state.values():
        for row, value in zip(members, _normalised([returns[rows[r][0]][rows[r][1]] for r in members], config,
                                                   singleton_mean=None)):
            step_terms[row] = value
    per_step: list[list[float]] = [[] for _ in episodes]
    for row, (i, _) in enumerate(rows):
        per_step[i].append(episode_terms[row] + config.step_advantage_w * step_terms[row])
    return per_step


def _turn_loo(episodes: Sequence[Episode], returns: list[list[float]], omega: float) -> list[list[float]]:
    n = len(episodes)
    if n < 2:
        return [[0.0] * len(episode.steps) for episode in episodes]
    total = math.fsum(episode.score for episode in episodes)
    by_state: dict[str, list[tuple[int, float]]] = defaultdict(list)
    by_index: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for i, episode in enumerate(episodes):
        for t, step in enumerate(episode.steps):
            by_state[step.state_key].append((i, returns[i][t]))
            by_index[t].append((i, returns[i][t]))
    per_step = []
    for i, episode in enumerate(episodes):
        episode_term = episode.score - (total - episode.score) / (n - 1)
        advantages = []
        for t, step in enumerate(episode.steps):
            others = [g for j, g in by_state[step.state_key] if j != i] or [g for j, g in by_index[t] if j != i]
            baseline = math.fsum(others) / len(others) if others else 0.0
            advantages.append(episode_term + omega * (returns[i][t] - baseline))
        per_step.append(advantages)
    return per_step
