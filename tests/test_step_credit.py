"""Per-turn credit (agentrl.trajectory.step_credit): exact expected gradients on small MDPs, and GiGPO's math.

Each MDP is enumerated exactly: every trajectory with its probability under a softmax policy, every group of ``n``
independent trajectories with the product of theirs. An estimator's expected gradient is
``E[sum_i sum_t A_it grad log pi(a_it | s_it)]`` over the groups; the true policy gradient is
``grad J = E[R grad log P(tau)]`` (exact for a finite set of trajectories). An unbiased estimator's expectation is a
known multiple of ``grad J`` (``n (1 + omega)`` for ``turn_loo`` at ``gamma = 1``); a biased one's is not parallel
to it.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from agentrl.trajectory.advantages import AdvantageConfig, AdvEstimator, GigpoMode, group_advantages
from agentrl.trajectory.step_credit import Episode, Step, step_credits, step_returns

# ------------------------------------------------------------------------------------------------ small MDPs

Outcome = tuple[float, float, str | None]  # (probability, reward, next state or None: the episode ends)


@dataclass(frozen=True)
class MDP:
    """States by name, two actions each; ``step(state, action)`` -> outcomes; ``key(state)`` -> the state key the
    policy and the estimators see (several states may share one: aliased observations); at most ``horizon``
    steps (the episode ends after the last whatever the outcome)."""

    start: str
    step: Callable[[str, int], list[Outcome]]
    key: Callable[[str], str]
    horizon: int


def stop_or_continue() -> MDP:
    """Stop (nothing) or go on for an intermediate reward of 0.5, then one right (1) and one wrong (0) answer: the
    policy decides how many turns the episode has."""
    def step(state: str, action: int) -> list[Outcome]:
        if state == "s0":
            return [(1.0, 0.0, None)] if action == 0 else [(1.0, 0.5, "s1")]
        return [(1.0, 1.0 if action == 0 else 0.0, None)]
    return MDP("s0", step, key=lambda s: s, horizon=2)


def loop_back() -> MDP:
    """Stay (back to the same state, reward 0.1) or leave for a right (1) or wrong (0) answer; the state recurs
    within a trajectory."""
    def step(state: str, action: int) -> list[Outcome]:
        if state == "s0":
            return [(1.0, 0.1, "s0")] if action == 0 else [(1.0, 0.0, "s1")]
        return [(1.0, 1.0 if action == 0 else 0.0, None)]
    return MDP("s0", step, key=lambda s: s, horizon=3)


def aliased() -> MDP:
    """Go on (to one of two states that look the same, "o") or take 0.2; at "o" the right action depends on the
    hidden state."""
    def step(state: str, action: int) -> list[Outcome]:
        if state == "s0":
            return [(0.7, 0.0, "a"), (0.3, 0.0, "b")] if action == 0 else [(1.0, 0.2, None)]
        right = 0 if state == "a" else 1
        return [(1.0, 1.0 if action == right else 0.0, None)]
    return MDP("s0", step, key=lambda s: "o" if s in ("a", "b") else s, horizon=2)


@dataclass(frozen=True)
class Trajectory:
    probability: float
    keys: tuple[str, ...]  # the state key each step acted in
    actions: tuple[int, ...]
    rewards: tuple[float, ...]

    @property
    def score(self) -> float:
        return sum(self.rewards)

    def episode(self) -> Episode:
        return Episode(self.score, [Step(r, k) for r, k in zip(self.rewards, self.keys)])


def policy(theta: dict[str, np.ndarray], key: str) -> np.ndarray:
    logits = theta[key]
    return np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()


def trajectories(mdp: MDP, theta: dict[str, np.ndarray]) -> list[Trajectory]:
    found: list[Trajectory] = []

    def walk(state: str | None, probability: float, keys: tuple, actions: tuple, rewards: tuple) -> None:
        if state is None or len(actions) == mdp.horizon:
            found.append(Trajectory(probability, keys, actions, rewards))
            return
        pi = policy(theta, mdp.key(state))
        for action in (0, 1):
            for chance, reward, after in mdp.step(state, action):
                walk(after, probability * pi[action] * chance, (*keys, mdp.key(state)), (*actions, action),
                     (*rewards, reward))

    walk(mdp.start, 1.0, (), (), ())
    assert math.isclose(sum(t.probability for t in found), 1.0)
    return found


def score_function(trajectory: Trajectory, theta: dict[str, np.ndarray], t: int) -> dict[str, np.ndarray]:
    """grad_theta log pi(a_t | s_t) of a softmax policy: onehot(a) - pi at the step's key."""
    key = trajectory.keys[t]
    grad = {k: np.zeros_like(v) for k, v in theta.items()}
    grad[key] = -policy(theta, key)
    grad[key][trajectory.actions[t]] += 1.0
    return grad


def flat(grad: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([grad[k] for k in sorted(grad)])


def true_gradient(paths: list[Trajectory], theta: dict[str, np.ndarray]) -> np.ndarray:
    return sum(p.probability * p.score * sum(flat(score_function(p, theta, t)) for t in range(len(p.actions)))
               for p in paths)


Estimator = Callable[[list[Episode]], list[list[float]]]


def expected_gradient(paths: list[Trajectory], theta: dict[str, np.ndarray], n: int, estimator: Estimator
                      ) -> np.ndarray:
    total = 0.0
    for group in itertools.product(paths, repeat=n):
        advantages = estimator([p.episode() for p in group])
        estimate = sum(a * flat(score_function(p, theta, t))
                       for p, row in zip(group, advantages) for t, a in enumerate(row))
        total = total + math.prod(p.probability for p in group) * estimate
    return total


def ours(omega: float) -> Estimator:
    config = AdvantageConfig(adv_estimator=AdvEstimator.TURN_LOO, gamma=1.0, step_advantage_w=omega)
    return lambda episodes: [[c.advantage for c in row] for row in step_credits(episodes, config)]


def gigpo(omega: float = 1.0) -> Estimator:
    config = AdvantageConfig(adv_estimator=AdvEstimator.GIGPO, gamma=1.0, step_advantage_w=omega)
    return lambda episodes: [[c.advantage for c in row] for row in step_credits(episodes, config)]


def per_index(episodes: list[Episode]) -> list[list[float]]:
    """MT-GRPO style (verl#7244): each turn's reward minus the mean reward of the group's turns at that index,
    summed over the turns ahead: a baseline term per remaining turn of the trajectory's own length."""
    by_index: dict[int, list[float]] = defaultdict(list)
    for episode in episodes:
        for t, step in enumerate(episode.steps):
            by_index[t].append(step.reward)
    normalised = [[step.reward - np.mean(by_index[t]) for t, step in enumerate(e.steps)] for e in episodes]
    return [[sum(row[t:]) for t in range(len(row))] for row in normalised]


def turn_loo_including_self(episodes: list[Episode]) -> list[list[float]]:
    """Ours, but with the step baseline's mean taken over every step in the state, the step's own included."""
    returns = [step_returns(e.steps, 1.0) for e in episodes]
    by_state: dict[str, list[float]] = defaultdict(list)
    for e, rets in zip(episodes, returns):
        for step, g in zip(e.steps, rets):
            by_state[step.state_key].append(g)
    episode_terms = group_advantages([e.score for e in episodes], AdvantageConfig(leave_one_out=True))
    return [[a + g - np.mean(by_state[s.state_key]) for s, g in zip(e.steps, rets)]
            for a, e, rets in zip(episode_terms, episodes, returns)]


MDPS = {"stop or continue": (stop_or_continue, ("s0", "s1")), "loop back": (loop_back, ("s0", "s1")),
        "aliased": (aliased, ("s0", "o"))}
"""name -> (the MDP, the state keys the policy has parameters for)"""


def setup(name: str, seed: int) -> tuple[list[Trajectory], dict[str, np.ndarray]]:
    """The MDP's trajectories under a random softmax policy, and the policy."""
    make, keys = MDPS[name]
    rng = np.random.default_rng(seed)
    theta = {key: rng.normal(size=2) for key in keys}
    return trajectories(make(), theta), theta


def off_direction(expected: np.ndarray, truth: np.ndarray) -> float:
    """How far ``expected`` is from every multiple of ``truth``, relative to its size."""
    scale = expected @ truth / (truth @ truth)
    return float(np.linalg.norm(expected - scale * truth) / np.linalg.norm(expected))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("omega", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("name", list(MDPS))
def test_turn_loo_is_an_unbiased_policy_gradient(name: str, omega: float, n: int) -> None:
    for seed in range(3):
        paths, theta = setup(name, seed)
        truth = true_gradient(paths, theta)
        expected = expected_gradient(paths, theta, n, ours(omega))
        np.testing.assert_allclose(expected, n * (1 + omega) * truth, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", list(MDPS))
def test_grpo_is_unbiased_and_the_per_turn_constructions_of_others_are_not(name: str) -> None:
    n = 3
    paths, theta = setup(name, 0)
    truth = true_gradient(paths, theta)
    grpo = AdvantageConfig()
    grpo_estimate = expected_gradient(paths, theta, n, lambda eps: [[c.advantage for c in row]
                                                                   for row in step_credits(eps, grpo)])
    np.testing.assert_allclose(grpo_estimate, (n - 1) * truth, rtol=1e-9, atol=1e-12)  # mean baseline: (n-1)/n
    biased = {"gigpo": gigpo(), "per-index (MT-GRPO)": per_index, "turn_loo with itself in the baseline":
              turn_loo_including_self}
    off = {label: off_direction(expected_gradient(paths, theta, n, estimator), truth)
           for label, estimator in biased.items()}
    assert all(value > 1e-3 for value in off.values()), off
    assert off_direction(expected_gradient(paths, theta, n, ours(1.0)), truth) < 1e-12


def test_gigpos_episode_term_alone_is_biased_by_trajectory_length() -> None:
    # Its episode mean counts a trajectory of T steps T times: with the stop/continue choice, longer trajectories
    # pull the baseline towards their scores.
    paths, theta = setup("stop or continue", 1)
    assert off_direction(expected_gradient(paths, theta, 3, gigpo(omega=0.0)), true_gradient(paths, theta)) > 1e-3


# ------------------------------------------------------------------------------------------- the estimators


def test_omega_zero_is_leave_one_out_grpo_and_grpo_is_todays_computation() -> None:
    episodes = [Episode(1.0, [Step(0.0, "a"), Step(1.0, "b")]), Episode(0.0, [Step(0.0, "a")]),
                Episode(0.5, [Step(0.2, "a"), Step(0.0, "c"), Step(0.3, "b")])]
    loo = group_advantages([e.score for e in episodes], AdvantageConfig(leave_one_out=True))
    credits = step_credits(episodes, AdvantageConfig(adv_estimator=AdvEstimator.TURN_LOO, step_advantage_w=0.0))
    assert [[c.advantage for c in row] for row in credits] == [[a] * len(e.steps) for a, e in zip(loo, episodes)]
    for config in (AdvantageConfig(), AdvantageConfig(scale_rewards=True)):
        grpo = group_advantages([e.score for e in episodes], config)
        credits = step_credits(episodes, config)
        assert [[c.advantage for c in row] for row in credits] == [[a] * len(e.steps) for a, e in zip(grpo, episodes)]


def test_turn_loo_baselines_fall_back_from_the_state_to_the_turn_index_to_nothing() -> None:
    episodes = [Episode(1.0, [Step(0.0, "x"), Step(1.0, "seen")]),
                Episode(0.0, [Step(0.0, "x"), Step(0.0, "alone"), Step(0.0, "last")]),
                Episode(0.0, [Step(0.0, "seen")])]
    [first, second, third] = step_credits(episodes, AdvantageConfig(adv_estimator=AdvEstimator.TURN_LOO,
                                                                     gamma=1.0))
    episode_terms = [1.0 - 0.0, 0.0 - 0.5, 0.0 - 0.5]
    assert [c.step_return for c in first] == [1.0, 1.0] and [c.step_return for c in second] == [0.0, 0.0, 0.0]
    # first, turn 0 in "x": the other trajectory in "x" returned 0; turn 1 in "seen": the third returned 0 there
    assert [c.advantage for c in first] == [episode_terms[0] + 1.0, episode_terms[0] + 1.0]
    # second, turn 1 in "alone": nobody else there, the first's turn 1 (return 1) is the baseline; turn 2: nothing
    assert [c.advantage for c in second] == [episode_terms[1] - 1.0, episode_terms[1] - 1.0, episode_terms[1]]
    # third, turn 0 in "seen": the first's step there returned 1
    assert [c.advantage for c in third] == [episode_terms[2] - 1.0]
    assert step_credits([episodes[0]], AdvantageConfig(adv_estimator=AdvEstimator.TURN_LOO))[0][0].advantage == 0.0


def test_an_infinite_reward_is_refused_with_the_episode_named() -> None:
    with pytest.raises(ValueError, match="episode 1 of the group"):
        step_credits([Episode(1.0, [Step(0.0, "a")]), Episode(0.0, [Step(math.inf, "a")])], AdvantageConfig())


# --------------------------------------------------------------------------------------- GiGPO = verl-agent


def verl_agent_gigpo(episodes: list[Episode], gamma: float, omega: float, mode: str,
                     epsilon: float = 1e-6) -> list[float]:
    """verl-agent's ``compute_gigpo_outcome_advantage`` as its code computes it, transcribed to the step rows of
    one group in float32 torch: per-trajectory discounted returns (``compute_step_discounted_returns``), the
    episode term over all step rows of the group (``compute_mean_std_cross_steps=True``: each row's score counted,
    a single row normalised by mean 0 and std 1), the anchor groups by identical observation, the step term within
    each (a single member: its own mean, std 1), ``torch.std`` unbiased, and their sum with ``step_advantage_w``."""
    remove_std = mode == "mean_norm"
    scores = torch.tensor([e.score for e in episodes for _ in e.steps], dtype=torch.float32)
    step_rewards = []
    for e in episodes:
        rewards = np.array([s.reward for s in e.steps], dtype=np.float32)
        rets, running = np.zeros_like(rewards), 0
        for t in reversed(range(len(rewards))):
            running = rewards[t] + gamma * running
            rets[t] = running
        step_rewards.extend(rets)
    step_rewards = torch.tensor(np.array(step_rewards), dtype=torch.float32)
    anchors = [s.state_key for e in episodes for s in e.steps]

    def normalise(values: torch.Tensor, groups: list, singleton_mean_zero: bool) -> torch.Tensor:
        members: dict = defaultdict(list)
        for i, g in enumerate(groups):
            members[g].append(values[i])
        out = values.clone()
        for i, g in enumerate(groups):
            if len(members[g]) == 1:
                mean = torch.tensor(0.0) if singleton_mean_zero else torch.mean(torch.tensor(members[g]))
                std = torch.tensor(1.0)
            else:
                mean, std = torch.mean(torch.tensor(members[g])), torch.std(torch.tensor([members[g]]))
            out[i] = values[i] - mean if remove_std else (values[i] - mean) / (std + epsilon)
        return out

    episode_adv = normalise(scores, ["group"] * len(anchors), singleton_mean_zero=True)
    step_adv = normalise(step_rewards, anchors, singleton_mean_zero=False)
    return (episode_adv + omega * step_adv).tolist()


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize(("gamma", "omega"), [(0.95, 1.0), (1.0, 0.5), (0.9, 0.0)])
def test_gigpo_equals_verl_agents_math(mode: str, gamma: float, omega: float) -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        episodes = [Episode(float(rng.integers(0, 2)),
                            [Step(float(rng.choice([0.0, 0.0, 0.5, 1.0])), f"s{rng.integers(0, 4)}")
                             for _ in range(int(rng.integers(1, 5)))]) for _ in range(int(rng.integers(1, 5)))]
        config = AdvantageConfig(adv_estimator=AdvEstimator.GIGPO, gamma=gamma, step_advantage_w=omega,
                                  gigpo_mode=GigpoMode(mode))
        ours_flat = [c.advantage for row in step_credits(episodes, config) for c in row]
        np.testing.assert_allclose(ours_flat, verl_agent_gigpo(episodes, gamma, omega, mode), rtol=0, atol=1e-6)
