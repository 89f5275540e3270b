"""Per-token log-probabilities of a causal LM, aligned to the tokens they score.

``out[b, i] = log p(input_ids[b, i] | input_ids[b, :i])``, read from the logits at position ``i - 1``;
``out[b, 0]`` is 0 (the first token has no prediction). This is the alignment of ``MergedSample`` and
``MicroBatch`` labels, so the result goes straight into the loss with ``old_logprobs`` of the same shape.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities ``[B, T]`` (float32 or wider) of ``input_ids`` ``[B, T]`` under ``logits`` ``[B, T, V]``.

    ``temperature`` divides the logits first: use the sampling temperature when the behaviour logprobs are
    those of the tempered distribution. Computed as ``gathered logit - logsumexp`` without a ``[B, T, V]``
    log-softmax copy.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    scores = logits[:, :-1]
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    if temperature != 1.0:
        scores = scores / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    picked = scores.gather(-1, targets).squeeze(-1) - torch.logsumexp(scores, dim=-1)
    first = picked.new_zeros((input_ids.shape[0], 1))
    return torch.cat([first, picked], dim=1)


def model_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run a Hugging Face causal LM on ``input_ids`` ``[B, T]`` and return ``token_logprobs`` ``[B, T]``.

    With ``scored`` (``[B, T]`` bool), only the positions scored in some row get their logprob (the others are 0):
    the LM head and the log-softmax run only at the positions before them (``logits_to_keep``), which skips most
    of a prompt-heavy sequence's ``[T, V]`` logits — their cost and memory — in the forward and backward pass.
    """
    if scored is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return token_logprobs(logits, input_ids, temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    targets = scored[:, 1:].any(dim=0).nonzero().squeeze(-1) + 1  # token positions scored in any row
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    if targets.numel() == 0:
        return out
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   logits_to_keep=targets - 1).logits  # [B, K, V]: the positions predicting the targets
    scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        scores = scores / temperature
    picked = scores.gather(-1, input_ids[:, targets].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scores, dim=-1)
    return out.index_copy(1, targets, picked.to(out.dtype))
