"""Per-token log-probabilities of a causal LM, aligned to the tokens they score.

``out[b, i] = log p(input_ids[b, i] | input_ids[b, :i])``, read from the logits at position ``i - 1``;
``out[b, 0]`` is 0 (the first token has no prediction). This is the alignment of ``MergedSample`` and
``MicroBatch`` labels, so the result goes straight into the loss with ``old_logprobs`` of the same shape.

Precision: the trainer's logprobs are compared with the inference engine's (importance ratios), so they come from
fp32 logits in every precision mode. ``model_token_logprobs`` computes the LM head itself, in fp32 (fp64 for an
fp64 model) with autocast off, from the final hidden states — bf16 logits would be off by up to ~2⁻⁹ of their
magnitude (~0.05 nats for a logit of 20) before any upcast. The fp32 ``[tokens, vocab]`` logits are made in chunks
of at most ``LOGIT_CHUNK_BYTES``; with gradients each chunk is recomputed in the backward pass (activation
checkpointing), so at most one chunk of fp32 logits is alive at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOGIT_CHUNK_BYTES = 1 << 28
"""Largest fp32 logits block (rows × vocabulary × 4 bytes) made at once: 256 MiB."""


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities ``[B, T]`` (float32 or wider) of ``input_ids`` ``[B, T]`` under ``logits`` ``[B, T, V]``.

    ``temperature`` divides the logits first: use the sampling temperature when the behaviour logprobs are
    those of the tempered distribution. Computed as ``gathered logit - logsumexp`` without a ``[B, T, V]``
    log-softmax copy.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    _check_temperature(temperature)
    picked = _picked_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    first = picked.new_zeros((input_ids.shape[0], 1))
    return torch.cat([first, picked], dim=1)


def model_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    scored: torch.Tensor | None = None,
    chunk_bytes: int = LOGIT_CHUNK_BYTES,
) -> torch.Tensor:
    """Run a Hugging Face causal LM on ``input_ids`` ``[B, T]`` and return ``token_logprobs`` ``[B, T]``.

    The LM head runs in fp32 (see the module doc). With ``scored`` (``[B, T]`` bool), only the positions scored in
    some row get their logprob (the others are 0): the LM head runs only at the positions before them
    (``logits_to_keep``), which skips most of a prompt-heavy sequence's ``[T, V]`` logits — their cost and memory
    — in the forward and backward pass. With nothing scored the model still runs (all logprobs 0, with a graph):
    a padding pass must make the same FSDP2 collectives as the other ranks' real passes.
    """
    _check_temperature(temperature)
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits: the trainer's fp32 LM head does not "
                         "support final_logit_softcapping")
    if scored is None:
        targets = torch.arange(1, input_ids.shape[1], device=input_ids.device)
    else:
        targets = scored[:, 1:].any(dim=0).nonzero().squeeze(-1) + 1  # token positions scored in any row
    nothing_scored = targets.numel() == 0
    if nothing_scored:
        if input_ids.shape[1] < 2:
            return torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        # Still one forward over the batch (the head at one position): FSDP2 ranks must make the same collectives,
        # and the caller's backward needs a graph. Every logprob stays 0.
        targets = torch.ones(1, dtype=torch.long, device=input_ids.device)
    head = model.get_output_embeddings()
    with _scoring(head, input_ids[:, targets], temperature, chunk_bytes):
        # the model's forward ends in our head, which returns [B, K] logprobs in place of [B, K, V] logits
        picked = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                       logits_to_keep=targets - 1).logits
    if picked.shape != (input_ids.shape[0], targets.numel()):
        raise ValueError(f"{type(model).__name__} transformed its LM head output (got {tuple(picked.shape)}): "
                         "its logprobs cannot be computed with the fp32 head")
    if nothing_scored:
        picked = picked * 0.0
    out = torch.zeros(input_ids.shape, dtype=picked.dtype, device=input_ids.device)
    return out.index_copy(1, targets, picked)


@contextlib.contextmanager
def _scoring(head: torch.nn.Module, target_ids: torch.Tensor, temperature: float, chunk_bytes: int) -> Iterator[None]:
    """Within the block, ``head`` (the model's ``lm_head``) maps hidden states ``[B, K, H]`` to the fp32 logprobs
    ``[B, K]`` of ``target_ids``. The head stays the model's own module, so FSDP2 gathers its weight as usual."""
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"the LM head is a {type(head).__name__}, not a Linear layer")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return head_logprobs(hidden, head.weight, head.bias, target_ids, temperature, chunk_bytes)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target_ids: torch.Tensor,
                  temperature: float, chunk_bytes: int = LOGIT_CHUNK_BYTES) -> torch.Tensor:
    """Logprobs ``[B, K]`` of ``target_ids`` ``[B, K]`` under ``softmax((hidden @ weight.T + bias) / temperature)``
    (``hidden`` ``[B, K, H]``), the logits made in fp32 (or wider) chunks of positions of at most ``chunk_bytes``,
    recomputed in backward when there are several."""
    per_position = 4 * weight.shape[0] * hidden.shape[0]  # fp32 logits of one position of every row
    step = max(1, chunk_bytes // per_position)
    if hidden.shape[1] <= step:
        return _chunk_logprobs(hidden, weight, bias, target_ids, temperature)
    parts = []
    for start in range(0, hidden.shape[1], step):
        args = (hidden[:, start:start + step], weight, bias, target_ids[:, start:start + step], temperature)
        parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else _chunk_logprobs(*args))
    return torch.cat(parts, dim=1)


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return _picked_logprobs(logits, targets, temperature)


def _picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``targets`` (``logits`` ``[..., V]``, ``targets`` ``[...]``), in
    fp32 or wider, without a log-softmax copy of the logits."""
    scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        scores = scores / temperature
    return scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scores, dim=-1)


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
