"""Next-token sampling with SGLang's semantics, and which distribution ``output_token_logprobs`` come from.

Reference: SGLang ``python/sglang/srt/layers/sampler.py`` (``Sampler.forward``, 0.5.23),
``python/sglang/srt/sampling/sampling_params.py`` (``SamplingParams.normalize``/``verify``) and
``python/sglang/srt/sampling/penaltylib/{presence,frequency}_penalty.py``. There:

* ``temperature == 0`` (below 1e-6) means greedy: it is normalised to ``temperature = 1, top_k = 1``.
* penalties come first, in place on the logits (``SamplingBatchInfo.apply_logits_bias``, called by
  ``ModelRunner.sample`` before the sampler): ``logits -= presence_penalty * (count > 0) + frequency_penalty *
  count``, counting each token among the request's *generated* tokens (OpenAI semantics).
* ``probs = softmax(logits / temperature)``; the token is drawn from ``probs`` restricted by ``top_k``, then
  ``top_p`` (a token is dropped when the probability mass *before* it already exceeds ``top_p``), then ``min_p``
  (dropped when below ``min_p * max(probs)``), renormalised.
* the reported logprob is ``log(probs[token])``: **after the penalties and temperature scaling, before
  top-k/top-p/min-p truncation** (SGLang's default; its ``SGLANG_RETURN_ORIGINAL_LOGPROB`` switch, which reports
  the distribution before temperature scaling, still after the penalties, is not the default and is not offered
  here). Greedy tokens therefore report ``log_softmax(logits - penalties)[token]``.

This module reproduces exactly that, computing ``log_softmax((logits - penalties) / temperature)`` in fp32 (more
accurate than ``log(softmax)``; the two agree to float rounding). A trainer that wants the behaviour logprob of a
token must therefore compute ``log_softmax(logits / temperature)`` with the same temperature, and cannot reproduce
a penalised one: non-zero penalties bias its importance ratio.

Randomness: each row gets one uniform number derived from ``(seed, position)`` with a SplitMix64 hash, and the
token is found by inverse-CDF over the truncated distribution. The draw depends only on the request's seed, the
position of the token in the sequence and the logits, never on which other requests share the batch, so a
request with ``sampling_seed`` set is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-6
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as 1-D tensors of equal length (one entry per logits row).

    ``temperature`` > 0 (greedy rows carry 1.0 and ``top_k == 1``); ``top_k`` <= 0 means no top-k limit;
    ``seed`` and ``position`` feed the random draw; the penalties feed :func:`penalties`.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor


def splitmix64(value: int) -> int:
    """The SplitMix64 finaliser: a well-mixed 64-bit hash of ``value``."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """A number in (0, 1) determined by ``(seed, position)`` only."""
    bits = splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return ((bits >> 11) + 0.5) / float(1 << 53)


def penalties(generated: list[list[int]], presence: torch.Tensor, frequency: torch.Tensor,
              vocab: int) -> torch.Tensor | None:
    """What to subtract from each row's logits: ``presence * (count > 0) + frequency * count`` over the tokens
    ``generated`` so far by that row's request ([rows, vocab]); None when every penalty is 0."""
    active = (presence != 0) | (frequency != 0)
    if not bool(active.any()):
        return None
    counts = torch.zeros(len(generated), vocab, dtype=torch.float32, device=presence.device)
    for row, tokens in enumerate(generated):
        if tokens and bool(active[row]):
            index = torch.tensor(tokens, dtype=torch.long, device=presence.device)
            counts[row].index_add_(0, index, torch.ones(len(tokens), device=presence.device))
    return presence.unsqueeze(-1) * (counts > 0) + frequency.unsqueeze(-1) * counts


def sample(logits: torch.Tensor, params: RowParams,
           penalty: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ([rows, vocab]); return ``(token_ids, logprobs)``.

    ``logprobs[i]`` is ``log_softmax((logits[i] - penalty[i]) / temperature[i])[token_ids[i]]`` (see the module
    docstring); ``penalty`` comes from :func:`penalties`.
    """
    logits = logits.float()
    if penalty is not None:
        logits = logits - penalty
    vocab = logits.size(-1)
    logprobs_all = torch.log_softmax(logits / params.temperature.unsqueeze(-1), dim=-1)
    greedy = params.top_k == 1
    tokens = torch.argmax(logits, dim=-1)
    if not bool(greedy.all()):
        tokens = torch.where(greedy, tokens, _draw(logprobs_all, params, vocab))
    return tokens, logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _draw(logprobs_all: torch.Tensor, params: RowParams, vocab: int) -> torch.Tensor:
    """Inverse-CDF draw from the truncated distribution of every row (greedy rows are overwritten later)."""
    seeds, positions = params.seed.tolist(), params.position.tolist()
    u = torch.tensor([uniform(s, p) for s, p in zip(seeds, positions, strict=True)], dtype=torch.float64,
                     device=logprobs_all.device)
    probs = logprobs_all.exp()
    top_k = torch.where(params.top_k <= 0, torch.full_like(params.top_k, vocab), params.top_k.clamp(max=vocab))
    truncate = bool(((top_k < vocab) | (params.top_p < 1.0) | (params.min_p > 0.0)).any())
    if truncate:
        probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=probs.device).unsqueeze(0)
        mass_before = probs.cumsum(dim=-1) - probs
        over_top_p = (mass_before > params.top_p.unsqueeze(-1)) & (params.top_p < 1.0).unsqueeze(-1)
        drop = (ranks >= top_k.unsqueeze(-1)) | over_top_p
        drop |= probs < (probs[:, :1] * params.min_p.unsqueeze(-1))
        probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    index = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).clamp(max=vocab - 1)
    return (order.gather(-1, index) if truncate else index).squeeze(-1)
