"""The sampler's SGLang semantics: greedy, temperature-scaled logprobs, truncation, reproducible seeds."""

from __future__ import annotations

import torch

from agentrl.inference.sampling import RowParams, penalties, sample, uniform

torch.set_num_threads(1)


def params(rows: int, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           presence: float = 0.0, frequency: float = 0.0, seed: int = 0,
           positions: list[int] | None = None) -> RowParams:
    return RowParams(
        temperature=torch.full((rows,), temperature), top_k=torch.full((rows,), top_k, dtype=torch.int32),
        top_p=torch.full((rows,), top_p), min_p=torch.full((rows,), min_p),
        presence_penalty=torch.full((rows,), presence), frequency_penalty=torch.full((rows,), frequency),
        seed=torch.full((rows,), seed, dtype=torch.int32),
        position=torch.tensor(positions if positions is not None else list(range(rows)), dtype=torch.int32))


def test_greedy_is_argmax_with_unscaled_logprob() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample(logits, params(3, top_k=1))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-6)


def test_logprob_is_after_temperature_before_truncation() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = sample(logits, params(4, temperature=0.7, top_k=5, top_p=0.9))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-6)


def test_truncation_limits_the_support() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(2)).expand(400, 64)
    ranked = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0], -1).sort(descending=True).values
    tokens, _ = sample(logits, params(400, top_k=3))
    assert set(tokens.tolist()) <= set(ranked[:3]) and len(set(tokens.tolist())) > 1
    # top_p keeps a token while the mass before it is <= top_p (SGLang's rule)
    keep = int(((probs.cumsum(0) - probs) <= 0.5).sum())
    tokens, _ = sample(logits, params(400, top_p=0.5))
    assert set(tokens.tolist()) <= set(ranked[:keep])
    threshold = probs[0] * 0.5
    tokens, _ = sample(logits, params(400, min_p=0.5))
    assert set(tokens.tolist()) <= set(ranked[: int((probs >= threshold).sum())])


def test_penalties_follow_openai_semantics_and_shape_the_logprob() -> None:
    generated = [[3, 3, 5], [], [7]]
    rows = params(3, temperature=0.5, presence=0.5, frequency=0.25)
    penalty = penalties(generated, rows.presence_penalty, rows.frequency_penalty, 10)
    # logit -= presence * (count > 0) + frequency * count, over each row's own generated tokens
    assert penalty[0, 3].item() == 0.5 + 0.25 * 2 and penalty[0, 5].item() == 0.5 + 0.25
    assert penalty[1].abs().sum().item() == 0.0 and penalty[2, 7].item() == 0.75
    assert penalty[0, 7].item() == 0.0
    assert penalties(generated, torch.zeros(3), torch.zeros(3), 10) is None
    logits = torch.zeros(3, 10)
    logits[:, 3] = 1.2  # the favourite of row 0 until the penalty (1.0) brings it below 1.2 - 1.0 < 0.3
    logits[:, 4] = 0.3
    tokens, logprobs = sample(logits, params(3, top_k=1, presence=0.5, frequency=0.25), penalty)
    assert tokens.tolist() == [4, 3, 3]
    # the logprob is SGLang's: of the penalised, temperature-scaled distribution (greedy: temperature 1)
    expected = torch.log_softmax(logits - penalty, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-6)
    drawn, scaled = sample(logits, rows, penalty)
    expected = torch.log_softmax((logits - penalty) / 0.5, -1).gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(scaled, expected, atol=1e-6)


def test_draws_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).expand(20000, 4)
    tokens, _ = sample(logits, params(20000, seed=7))
    frequencies = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(frequencies, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.015)


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(3))
    batch = params(6, seed=42, positions=[10, 11, 12, 13, 14, 15])
    tokens, _ = sample(logits, batch)
    alone, _ = sample(logits[2:3], params(1, seed=42, positions=[12]))
    assert alone.item() == tokens[2].item()
    other_seed, _ = sample(logits, params(6, seed=43, positions=[10, 11, 12, 13, 14, 15]))
    assert other_seed.tolist() != tokens.tolist()


def test_uniform_is_deterministic_and_in_range() -> None:
    values = [uniform(s, p) for s in range(20) for p in range(50)]
    assert all(0.0 < v < 1.0 for v in values)
    assert uniform(5, 9) == uniform(5, 9) != uniform(5, 10)
    assert abs(sum(values) / len(values) - 0.5) < 0.03
