"""Per-token log-probabilities of a causal LM, aligned to the tokens they score.

``out[b, i] = log p(input_ids[b, i] | input_ids[b, :i])``, read from the logits at position ``i - 1``;
``out[b, 0]`` is 0 (the first token has no prediction). This is the alignment of ``MergedSample`` and
``MicroBatch`` labels, so the result goes straight into the loss with ``old_logprobs`` of the same shape.

Precision: the trainer's logprobs are compared with the inference engine's (importance ratios), so they come from
fp32 logits in every precision mode. ``model_token_logprobs`` computes the LM head itself, from the final hidden
states — bf16 logits would be off by up to ~2⁻⁹ of their magnitude (~0.05 nats for a logit of 20) before any
upcast. What fp32 is needed for is the logits, not the inputs: in bf16 mode on CUDA (the trainer passes its compute
dtype) the head multiplies bf16 hidden states by the bf16-rounded weight in the matrix units, which
accumulate in fp32, and asks for fp32 output (``torch.mm(..., out_dtype=torch.float32)``: ~15× the throughput of an
fp32 matmul on Hopper, the head being a quarter of a small model's matmul FLOPs), as prime-rl's ``FusedOutputLinear``
does; :func:`head_matmul_dtype` decides. The CPU has no such product (a bf16 matmul there rounds its output to bf16),
so there, and in fp32 mode, the head multiplies in fp32 (fp64 for an fp64 model) with autocast off, exact as
before. Either way the log-sum-exp and the picked logprob are fp32, the ``[tokens, vocab]`` logits are made in
chunks of at most ``LOGIT_CHUNK_BYTES`` and recomputed per chunk in the backward pass, so at most one chunk of fp32
logits is alive at a time.

Shared prefixes: ``layout_logprobs`` forwards a micro-batch's prefix forest in one model call, each tree packed into
one row at collate time (``agentrl.training.prefix_tree.forward_layout``): a node's tokens follow its ancestors',
under an explicit 4D mask (a token sees its ancestors' tokens and its own node's earlier ones) and explicit positions
(each node continues its parent's count), so a span shared by several samples is computed once and receives the
sum of their gradients. Hugging Face
uses a 4D mask as given, so restarted positions are never read as packed-sequence boundaries. One call per pass
(instead of one per depth of the forest) keeps the matrix products large and the kernel launches few: on CPU a group
of 4 sharing a 310-token prompt took 1.70-1.78 s packed against 1.99-2.34 s level by level (``docs/benchmarks.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from agentrl.training.prefix_tree import ForwardLayout
    from agentrl.training.vision_batch import VisionBatch

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
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Run a Hugging Face causal LM on ``input_ids`` ``[B, T]`` and return ``token_logprobs`` ``[B, T]``.

    The LM head runs in fp32 (see the module doc). With ``scored`` (``[B, T]`` bool), only the positions scored in
    some row get their logprob (the others are 0): the LM head runs only at the positions before them
    (``logits_to_keep``), which skips most of a prompt-heavy sequence's ``[T, V]`` logits — their cost and memory
    — in the forward and backward pass. With nothing scored the model still runs (all logprobs 0, with a graph):
    a padding pass must make the same FSDP2 collectives as the other ranks' real passes. ``compute_dtype``: the
    model's (bf16 in bf16 mode), for :func:`head_matmul_dtype`.
    """
    _check_model(model, temperature)
    if input_ids.shape[1] < 2:
        return torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    labels = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # position j predicts token j + 1
    if scored is None:
        wanted = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    else:
        wanted = torch.cat([scored[:, 1:].bool(), torch.zeros_like(scored[:, :1], dtype=torch.bool)], dim=1)
    wanted[:, -1] = False
    picked = _predict(model, input_ids, labels, wanted, temperature, chunk_bytes, compute_dtype,
                      attention_mask=attention_mask)
    return torch.cat([picked.new_zeros((input_ids.shape[0], 1)), picked[:, :-1]], dim=1)


def layout_logprobs(model: torch.nn.Module, layout: ForwardLayout, temperature: float = 1.0,
                    chunk_bytes: int = LOGIT_CHUNK_BYTES, compute_dtype: torch.dtype | None = None,
                    vision: VisionBatch | None = None) -> torch.Tensor:
    """``token_logprobs`` ``[B, T]`` of a micro-batch forwarded in one model call along ``layout`` (see the module
    doc and ``agentrl.training.prefix_tree``): equal to ``model_token_logprobs`` of each sample alone, with each
    shared span computed once. The LM head runs (in fp32) only where some sample has a loss token; a pass without one
    still runs the model (FSDP2 ranks make the same collectives). Needs a model that ``shared_prefix_unsupported``
    accepts when the layout has a mask. ``compute_dtype``: as for :func:`model_token_logprobs`. ``vision``: the
    pixel inputs of the layout's rows (a vision-language model; a layout without a mask)."""
    _check_model(model, temperature)
    if layout.mask is not None:
        picked = _predict(model, layout.input_ids, layout.labels, layout.scored, temperature, chunk_bytes,
                          compute_dtype, attention_mask=_attention_mask(layout.mask, model),
                          position_ids=layout.positions)
    elif layout.computed_tokens:
        picked = _predict(model, layout.input_ids, layout.labels, layout.scored, temperature, chunk_bytes,
                          compute_dtype, **({} if vision is None else vision.model_kwargs(layout.input_ids)))
    else:  # nothing to predict: the model still runs (FSDP2 ranks make the same collectives; the loss needs a graph)
        pad = torch.zeros((1, 1), dtype=torch.long, device=layout.out_index.device)
        picked = _predict(model, pad, pad, pad.bool(), temperature, chunk_bytes, compute_dtype)
    flat = torch.cat([picked.new_zeros(1), picked.reshape(-1)])
    return flat[layout.out_index]


def _attention_mask(allowed: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """The layout's ``[R, W, W]`` mask as the model takes it: ``[R, 1, W, W]``, bool for SDPA, additive for eager."""
    mask = allowed[:, None]
    if model.config._attn_implementation != "sdpa":
        dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def shared_prefix_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot forward shared prefixes once (``None``: it can). A packed row's tokens attend to their
    ancestors' under an explicit 4D mask: that needs SDPA or eager attention and full attention in every layer (a
    sliding window would need the window in the mask)."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} takes no 4D mask (sdpa and eager do)"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        odd = sorted(set(layer_types) - {"full_attention"})
        if odd:
            return f"the model has {', '.join(odd)} layers"
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "the model uses sliding-window attention"
    return None


def _predict(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, wanted: torch.Tensor,
             temperature: float, chunk_bytes: int, compute_dtype: torch.dtype | None,
             **model_kwargs) -> torch.Tensor:
    """``[n, w]``: at ``(r, j)`` where some row is ``wanted`` at column ``j``, the logprob of ``labels[r, j]`` given
    row ``r`` up to position ``j``; 0 elsewhere. The model's head step runs only at those columns
    (``logits_to_keep``), the LM head itself only at the wanted positions.

    With nothing wanted the model still runs (the head at one column, the result times 0): FSDP2 ranks must make
    the same collectives, and the caller's backward needs a graph."""
    keep = wanted.any(dim=0).nonzero().squeeze(-1)
    nothing = keep.numel() == 0
    if nothing:
        keep = torch.zeros(1, dtype=torch.long, device=input_ids.device)
    head = model.get_output_embeddings()
    matmul_dtype = head_matmul_dtype(input_ids.device, compute_dtype)
    with _scoring(head, labels[:, keep], None if nothing else wanted[:, keep], temperature, chunk_bytes, matmul_dtype):
        # the model's forward ends in our head, which returns [n, K] logprobs in place of [n, K, V] logits
        picked = model(input_ids=input_ids, use_cache=False, logits_to_keep=keep, **model_kwargs).logits
    if picked.shape != (input_ids.shape[0], keep.numel()):
        raise ValueError(f"{type(model).__name__} transformed its LM head output (got {tuple(picked.shape)}): "
                         "its logprobs cannot be computed with the fp32 head")
    if nothing:
        picked = picked * 0.0
    out = torch.zeros(input_ids.shape, dtype=picked.dtype, device=input_ids.device)
    return out.index_copy(1, keep, picked)


def _check_model(model: torch.nn.Module, temperature: float) -> None:
    _check_temperature(temperature)
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits: the trainer's fp32 LM head does not "
                         "support final_logit_softcapping")


@contextlib.contextmanager
def _scoring(head: torch.nn.Module, target_ids: torch.Tensor, where: torch.Tensor | None, temperature: float,
             chunk_bytes: int, matmul_dtype: torch.dtype | None) -> Iterator[None]:
    """Within the block, ``head`` (the model's ``lm_head``) maps hidden states ``[B, K, H]`` to the fp32 logprobs
    ``[B, K]`` of ``target_ids`` at the positions ``where`` (``head_logprobs``). The head stays the model's own
    module, so FSDP2 gathers its weight as usual."""
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"the LM head is a {type(head).__name__}, not a Linear layer")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return head_logprobs(hidden, head.weight, head.bias, target_ids, temperature, chunk_bytes, where,
                             matmul_dtype=matmul_dtype)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def head_matmul_dtype(device: torch.device, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype the LM head multiplies in with fp32 output (see the module doc): the model's ``compute_dtype`` when
    it is bf16 or fp16 and ``device`` has a matmul with fp32 output for it (CUDA); None: fp32 (or wider) inputs."""
    if device.type != "cuda" or compute_dtype not in (torch.bfloat16, torch.float16):
        return None
    return compute_dtype


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target_ids: torch.Tensor,
                  temperature: float, chunk_bytes: int = LOGIT_CHUNK_BYTES, where: torch.Tensor | None = None, *,
                  matmul_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logprobs ``[B, K]`` of ``target_ids`` ``[B, K]`` under ``softmax((hidden @ weight.T + bias) / temperature)``
    (``hidden`` ``[B, K, H]``) at the positions ``where`` (``[B, K]`` bool; default all) and 0 elsewhere, the
    logits made in fp32 (or wider) chunks of at most ``chunk_bytes``, recomputed in backward when there are several.
    ``matmul_dtype`` (bf16, fp16): the product's inputs in it, its output fp32 (:class:`_LowPrecisionHead`).
    With no position to score the result is zeros with a graph to ``hidden`` but not to the weight (whose gradient
    would be all zeros, as costly as a real one): FSDP2 prepares a layer's backward from its output's graph."""
    if where is None:
        where = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    rows, targets = hidden[where], target_ids[where]  # [P, H], [P]
    if rows.shape[0] == 0:
        return torch.zeros(where.shape, dtype=torch.float32, device=hidden.device) + rows.sum() * 0.0
    step = max(1, chunk_bytes // (4 * weight.shape[0]))  # positions per chunk of fp32 logits
    if matmul_dtype is not None:  # recomputes its chunks in backward itself
        picked = torch.cat([_LowPrecisionHead.apply(rows[start:start + step], weight, bias,
                                                    targets[start:start + step], temperature, matmul_dtype)
                            for start in range(0, rows.shape[0], step)])
    elif rows.shape[0] <= step:
        picked = _chunk_logprobs(rows, weight, bias, targets, temperature)
    else:
        parts = []
        for start in range(0, rows.shape[0], step):
            args = (rows[start:start + step], weight, bias, targets[start:start + step], temperature)
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled()
                         else _chunk_logprobs(*args))
        picked = torch.cat(parts)
    return torch.zeros(where.shape, dtype=picked.dtype, device=hidden.device).masked_scatter(where, picked)


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return _picked_logprobs(logits, targets, temperature)


class _LowPrecisionHead(torch.autograd.Function):
    """One chunk's picked logprobs ``[P]`` with the head's product in ``matmul_dtype`` and fp32 output; only the
    inputs and the log-sum-exp are kept for backward, which makes the chunk's fp32 logits again."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                temperature: float, matmul_dtype: torch.dtype) -> torch.Tensor:
        scores = _scores(hidden, weight, bias, temperature, matmul_dtype)
        lse = torch.logsumexp(scores, dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.matmul_dtype = temperature, matmul_dtype
        return scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        dtype = ctx.matmul_dtype
        # d(picked)/d(scores) = onehot(target) - softmax(scores); the scores are the logits over the temperature
        grad_scores = torch.exp(_scores(hidden, weight, bias, ctx.temperature, dtype) - lse[:, None])
        grad_scores.mul_(-grad[:, None]).scatter_add_(-1, targets[:, None], grad[:, None])
        grad_logits = grad_scores.div_(ctx.temperature)  # fp32; the products below take it in ``dtype``
        low = grad_logits.to(dtype)
        grad_hidden = _mm_fp32_out(low, weight.to(dtype)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = _mm_fp32_out(low.t(), hidden.to(dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad_logits.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _scores(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
            matmul_dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``(hidden @ weight.T + bias) / temperature`` ``[P, V]``, the product's inputs in ``matmul_dtype``."""
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logits = _mm_fp32_out(hidden.to(matmul_dtype), weight.to(matmul_dtype).t())
    if bias is not None:
        logits = logits + bias.float()
    return logits / temperature if temperature != 1.0 else logits


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two low-precision matrices, accumulated and returned in fp32: the matrix units' product on CUDA;
    elsewhere (tests) the same value from fp32 copies (low-precision values are exact in fp32)."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


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
