"""Train/inference consistency: compare the engine's behaviour logprobs with a trainer-side forward pass.

The engine reports ``log_softmax((logits - penalties) / temperature)`` of each sampled token (SGLang's convention,
see :mod:`agentrl.inference.sampling`). :func:`trainer_logprobs` recomputes it without penalties, with one causal
forward pass over ``prompt + output``; with identical weights and no penalties the two agree to float rounding
(fp32: well under 1e-4). A growing mismatch means the trainer's and the sampler's policies diverge (wrong weights
loaded, a dtype or temperature mismatch). Tests and benchmarks use :func:`logprob_mismatch`; the trainer measures
the same difference on every step's loss tokens itself (``logprob_mismatch_mean``/``_max``,
``OptimizerStep._micro_step``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, input_ids: Sequence[int], output_ids: Sequence[int],
                     temperature: float = 1.0) -> torch.Tensor:
    """Logprobs of ``output_ids`` given ``input_ids`` under ``model`` (one forward pass, fp32 log-softmax)."""
    if not input_ids or not output_ids:
        raise ValueError("input_ids and output_ids must both be non-empty")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    device = next(model.parameters()).device
    sequence = torch.tensor([list(input_ids) + list(output_ids)], device=device)
    logits = model(input_ids=sequence).logits[0, len(input_ids) - 1:-1].float() / temperature
    targets = torch.tensor(list(output_ids), device=device).unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)


def logprob_mismatch(model: torch.nn.Module, input_ids: Sequence[int], output_ids: Sequence[int],
                     engine_logprobs: Sequence[float], temperature: float = 1.0) -> dict[str, float]:
    """Max and mean absolute difference between ``engine_logprobs`` and :func:`trainer_logprobs`.

    ``temperature`` is the sampling temperature of the request (0, greedy, compares at temperature 1, as the
    engine reports greedy logprobs unscaled). Returns ``{"max_abs_diff", "mean_abs_diff", "num_tokens"}``.
    """
    if len(engine_logprobs) != len(output_ids):
        raise ValueError(f"{len(engine_logprobs)} engine logprobs for {len(output_ids)} output tokens")
    mine = trainer_logprobs(model, input_ids, output_ids, temperature if temperature > 0 else 1.0)
    theirs = torch.tensor(list(engine_logprobs), dtype=torch.float32, device=mine.device)
    diff = (mine - theirs).abs()
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "num_tokens": float(len(diff))}
