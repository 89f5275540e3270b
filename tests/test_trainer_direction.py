"""One optimiser step moves the policy the way the advantages say, for every policy loss: the trained samples with a
positive advantage become more likely and those with a negative one less likely. The loss tests check the formulas
and the exactness tests check the gradients against references; this checks the whole path in between (the
samples' advantages reaching the right rows, the loss's sign, the optimiser stepping against the gradient)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.training.logprobs import model_token_logprobs
from trainer_fixtures import make_samples, train_uninterrupted


def loss_token_logprob_sums(model_dir: Path, samples) -> list[float]:
    """Each sample's summed logprob over its loss tokens under the model at ``model_dir`` (fp32); before the step
    these are the samples' own behaviour logprobs, which ``make_samples`` computed with the same model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sums = []
    with torch.no_grad():
        for sample in samples:
            logprobs = model_token_logprobs(model, torch.tensor([sample.input_ids]))[0]
            sums.append(float(logprobs[torch.tensor(sample.loss_mask, dtype=torch.bool)].sum()))
    return sums


@pytest.mark.parametrize("loss", ["GRPO", "MINIRL", "GSPO"])
def test_one_step_raises_the_rewarded_samples_and_lowers_the_others(mongo_server_uri: str, tiny_model_dir: Path,
                                                                   tmp_path: Path, loss: str) -> None:
    samples = make_samples(tiny_model_dir, groups=2, group_size=4, seed=3)
    train_uninterrupted(mongo_server_uri, samples, tiny_model_dir, tmp_path / "out", "--loss_calculater", loss,
                        "--train_batch_size", str(len(samples)), "--max_steps", "1", "--learning_rate", "1e-4",
                        "--enable_sampling", "false")
    after = loss_token_logprob_sums(tmp_path / "out" / "final", samples)
    moves = [(next(a for a, m in zip(s.advantages, s.loss_mask) if m), new - sum(s.logprobs))
             for s, new in zip(samples, after)]
    assert {advantage > 0 for advantage, _ in moves if advantage} == {True, False}, moves  # both signs are trained
    assert all(change > 0 for advantage, change in moves if advantage > 0), moves
    assert all(change < 0 for advantage, change in moves if advantage < 0), moves
