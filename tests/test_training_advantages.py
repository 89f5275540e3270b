"""Group and per-call advantages on hand-computed groups."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from agentrl.store.models import CallStatus
from agentrl.trajectory.advantages import AdvantageConfig, call_advantages, group_advantages, keeps_advantage


def approx(values: list[float]):
    return pytest.approx(values, abs=1e-9)


def test_group_mean_baseline() -> None:
    assert group_advantages([1, 0, 0, 1], AdvantageConfig()) == approx([0.5, -0.5, -0.5, 0.5])
    assert group_advantages([3.0, 1.0, 2.0], AdvantageConfig()) == approx([1.0, -1.0, 0.0])
    assert group_advantages([], AdvantageConfig()) == []


def test_leave_one_out_baseline() -> None:
    cfg = AdvantageConfig(leave_one_out=True)
    # 1 - mean(0, 0, 1) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    assert group_advantages([1, 0, 0, 1], cfg) == approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # 3 - mean(1, 2) = 1.5 ; 1 - mean(3, 2) = -1.5 ; 2 - mean(3, 1) = 0
    assert group_advantages([3.0, 1.0, 2.0], cfg) == approx([1.5, -1.5, 0.0])
    # equal to G/(G-1) times the mean baseline, computed by position (duplicates do not matter)
    assert group_advantages([0.2, 0.2, 0.8], cfg) == approx([-0.3, -0.3, 0.6])
    assert group_advantages([0.7], cfg) == [0.0]


def test_scale_rewards_divides_by_the_unbiased_std() -> None:
    cfg = AdvantageConfig(scale_rewards=True, std_epsilon=1e-12)
    # (1, 0, 0, 1): mean 0.5, squared deviations sum to 1, Bessel: std = sqrt(1/3) -> ±0.5·sqrt(3)
    assert group_advantages([1, 0, 0, 1], cfg) == approx([0.5 * math.sqrt(3), -0.5 * math.sqrt(3),
                                                           -0.5 * math.sqrt(3), 0.5 * math.sqrt(3)])
    # (3, 1, 2): squared deviations sum to 2, over n - 1 = 2: std 1
    assert group_advantages([3.0, 1.0, 2.0], cfg) == approx([1.0, -1.0, 0.0])
    # (0.2, 0.2, 0.8): mean 0.4, deviations (-0.2, -0.2, 0.4), sum of squares 0.24, std sqrt(0.12)
    std = math.sqrt(0.12)
    assert group_advantages([0.2, 0.2, 0.8], cfg) == approx([-0.2 / std, -0.2 / std, 0.4 / std])
    loo = AdvantageConfig(scale_rewards=True, leave_one_out=True, std_epsilon=1e-12)
    assert group_advantages([1, 0, 0, 1], loo) == approx([2 / 3 * math.sqrt(3), -2 / 3 * math.sqrt(3),
                                                          -2 / 3 * math.sqrt(3), 2 / 3 * math.sqrt(3)])
    # a group of one has std 0 and advantage 0 (no division by zero, with or without leave-one-out)
    assert group_advantages([0.7], cfg) == [0.0] and group_advantages([0.7], loo) == [0.0]


def test_zero_variance_group_gets_zero_not_nan() -> None:
    for cfg in (AdvantageConfig(), AdvantageConfig(scale_rewards=True), AdvantageConfig(leave_one_out=True)):
        assert group_advantages([1.0, 1.0, 1.0], cfg) == [0.0, 0.0, 0.0]


def test_reward_sign_threshold() -> None:
    cfg = AdvantageConfig(reward_sign_threshold=0.5)
    # mean 0.6 -> (0, 0.4, -0.4)
    assert group_advantages([0.6, 1.0, 0.2], cfg) == approx([0.0, 0.4, -0.4])
    # a correct answer below the mean is not punished: mean 0.65 -> (-0.05 -> 0, 0.35, 0.35, -0.65)
    assert group_advantages([0.6, 1.0, 1.0, 0.0], cfg) == approx([0.0, 0.35, 0.35, -0.65])
    # a wrong answer above the mean is not rewarded: mean 0.1 -> (0.3 -> 0, -0.1, -0.1, -0.1)
    assert group_advantages([0.4, 0.0, 0.0, 0.0], cfg) == approx([0.0, -0.1, -0.1, -0.1])


def test_non_finite_reward_is_an_error() -> None:
    with pytest.raises(ValueError, match="reward 1 of the group is not finite"):
        group_advantages([1.0, float("nan")], AdvantageConfig())


def test_call_advantages_statuses_scaling_and_error_cap() -> None:
    statuses = [CallStatus.COMPLETED, CallStatus.FORMATERROR, CallStatus.FAILED, "toolfailed", "repeaterror"]
    cfg = AdvantageConfig(adv_scaling=2.0)
    # positive: error calls are capped at 0, then dropped as zero; failed calls are never trained
    assert call_advantages(0.5, statuses, cfg) == [1.0, None, None, 1.0, None]
    # negative: error calls keep their penalty
    assert call_advantages(-0.5, statuses, cfg) == [-1.0, -1.0, None, -1.0, -1.0]
    keep_zero = AdvantageConfig(drop_zero_advantage=False)
    assert call_advantages(0.5, statuses, keep_zero) == [0.5, 0.0, None, 0.5, 0.0]
    assert call_advantages(0.0, ["completed"], AdvantageConfig()) == [None]


def test_minimal_advantage_is_a_magnitude_threshold() -> None:
    cfg = AdvantageConfig(minimal_advantage=0.3)
    assert call_advantages(-0.25, ["completed"], cfg) == [None]
    # the original AgentRL compared the signed value and would have dropped this strongly negative call
    assert call_advantages(-0.4, ["completed"], cfg) == [-0.4]
    assert call_advantages(0.3, ["completed"], cfg) == [0.3]
    # compared after adv_scaling
    assert call_advantages(0.2, ["completed"], AdvantageConfig(minimal_advantage=0.3, adv_scaling=2)) == [0.4]
    # an explicit 0 threshold keeps zero advantages (the original ignored a 0 threshold)
    zero = AdvantageConfig(minimal_advantage=0.0, drop_zero_advantage=True)
    assert keeps_advantage(0.0, zero) and call_advantages(0.0, ["completed"], zero) == [0.0]


def test_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="not in trainable_statuses"):
        AdvantageConfig(trainable_statuses=frozenset({"completed"}))
    with pytest.raises(ValidationError, match="scale_reward"):
        AdvantageConfig(scale_reward=True)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        AdvantageConfig(minimal_advantage=-0.1)
