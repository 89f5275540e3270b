"""``--trajectory_weight once``: each trajectory (branch) weighs as one turn in a summed loss, whatever its number
of turns; refused where the aggregation already weighs each sample once, and for CrossEntropy."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from agentrl.training.batching import collate
from agentrl.training.loss_config import LossConfig
from agentrl.training.losses import LossInput, global_normaliser, loss_fn
from agentrl.trajectory.merge import MergedSample, TurnSpan

MINIRL = {"loss_calculater": "MINIRL", "token_level_loss": False, "strict_in_bound": True,
          "skip_length_normalization": True}


def sample(turns: list[tuple[int, int, float, bool]], name: str) -> MergedSample:
    """Turns of (new prompt tokens, output tokens, advantage, trained)."""
    merged, position = MergedSample(), 0
    for index, (prompt, output, advantage, trained) in enumerate(turns):
        start = position
        merged.input_ids += [5] * prompt + [7] * output
        merged.loss_mask += [0] * prompt + [int(trained)] * output
        merged.logprobs += [0.0] * prompt + [-0.5 if trained else 0.0] * output
        merged.versions += [-1] * prompt + [0] * output
        merged.advantages += [0.0] * prompt + [advantage if trained else 0.0] * output
        position += prompt + output
        merged.turns.append(TurnSpan(f"{name}:{index}", start, start + prompt, start + prompt + output, trained))
    return merged


LONG = sample([(3, 2, 1.0, True), (2, 3, -0.5, True), (1, 2, 0.0, False), (2, 4, 2.0, True)], "long")
SHORT = sample([(4, 3, -1.0, True)], "short")


def loss_and_grad(config: LossConfig, samples: list[MergedSample]) -> tuple[float, torch.Tensor]:
    batch = collate(samples)
    logprobs = batch.old_logprobs.clone().requires_grad_(True)  # ratio 1: the loss is -Σ A·ℓ / N
    normaliser = global_normaliser(config, [batch])
    out = loss_fn(config, LossInput.from_batch(batch, logprobs), normaliser)
    out.loss.backward()
    return float(out.loss.detach()), logprobs.grad


def test_weighed_once_divides_the_trained_turns_advantages_by_their_number() -> None:
    once = LONG.weighed_once()
    assert once.advantages == [a / 3 for a in LONG.advantages]  # three trained turns of four
    assert LONG.advantages[3] == 1.0 and once.advantages[3] == pytest.approx(1 / 3)
    assert SHORT.weighed_once() is SHORT  # one turn: nothing to divide
    assert once.input_ids == LONG.input_ids and once.loss_mask == LONG.loss_mask


@pytest.mark.parametrize("recipe", [MINIRL, {"loss_calculater": "GRPO", "token_level_loss": True}])
def test_each_trajectory_weighs_as_one_turn(recipe: dict) -> None:
    turns, once = LossConfig(**recipe), LossConfig(**recipe, trajectory_weight="once")
    loss_turns, grad_turns = loss_and_grad(turns, [LONG, SHORT])
    loss_once, grad_once = loss_and_grad(once, [LONG.weighed_once(), SHORT.weighed_once()])
    # the long trajectory's gradient is a third of what it was, the short one's is unchanged
    assert torch.allclose(grad_once[0], grad_turns[0] / 3) and torch.equal(grad_once[1], grad_turns[1])
    # at ratio 1 both losses' gradient is -A/N on every loss token
    normaliser = global_normaliser(turns, [collate([LONG, SHORT])])
    for row, merged in enumerate((LONG, SHORT)):
        expected = torch.tensor([-a / normaliser if m else 0.0 for a, m in zip(merged.advantages, merged.loss_mask)])
        assert torch.allclose(grad_turns[row, :merged.num_tokens], expected)
    assert loss_once != loss_turns


@pytest.mark.parametrize("options", [
    {"loss_calculater": "GSPO"},
    {"loss_calculater": "MINIRL", "token_level_loss": False, "skip_length_normalization": False},
    {"loss_calculater": "CrossEntropy"},
])
def test_once_is_refused_where_it_would_not_mean_once(options: dict) -> None:
    with pytest.raises(ValidationError, match="trajectory_weight once"):
        LossConfig(**options, trajectory_weight="once")
    LossConfig(**options)  # the default stays valid
