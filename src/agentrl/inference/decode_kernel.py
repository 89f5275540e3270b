"""Paged decode attention: one query token per request over its pages of the KV cache, read in place.

:func:`paged_decode_attention` takes the requests' queries, the layer's flat cache (``[slots, kv_heads, dim]``, slot
``page * page_size + offset``), a block table (``[requests, max_pages]``: the cache page of each of a request's
``page_size``-token pages) and the requests' key counts, and returns what
``scaled_dot_product_attention`` over each request's keys returns. Nothing is gathered: on CUDA a Triton kernel
reads the keys and values through the block table (flash-decoding, SGLang's and vLLM's Triton decode kernels are the
references): stage 1 runs one program per (request, query head, split) over its share of the keys with an online
softmax and writes a partial output and its log-sum-exp; stage 2 combines the ``KV_SPLITS`` partials. The grid
and every buffer depend only on the number of requests and the block table's width, never on the key counts, so a
CUDA graph captured once replays for any lengths (:mod:`agentrl.inference.decode_graphs`).

Elsewhere (CPU, or without Triton) :func:`paged_decode_reference` computes the same with a gather and SDPA; the
tests compare the kernel with it on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import math
import os

import torch

KV_SPLITS = 8
"""Splits of each request's keys in stage 1 (SGLang's default ``num_kv_splits``): a short context leaves some empty."""
BLOCK_KEYS = 32
"""Keys one stage-1 program reads per iteration."""


def paged_decode_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                           scale: float) -> torch.Tensor:
    """The attention of ``query`` [requests, heads, dim] over each request's first ``seq_lens`` keys, found
    through ``block_table``; returns [requests, heads, dim] (gathers the keys into a padded copy)."""
    requests, heads, dim = query.shape
    kv_heads = k_cache.shape[1]
    longest = int(seq_lens.max())
    positions = torch.arange(longest, device=query.device)
    pages = block_table[:, positions // page_size].long()  # [requests, longest]
    slots = pages * page_size + positions % page_size
    mask = positions[None, :] < seq_lens[:, None]
    k = k_cache[slots.view(-1)].view(requests, longest, kv_heads, dim).transpose(1, 2)
    v = v_cache[slots.view(-1)].view(requests, longest, kv_heads, dim).transpose(1, 2)
    q = query.view(requests, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(requests, heads, dim)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                           scale: float) -> torch.Tensor:
    """:func:`paged_decode_reference`'s result, by the Triton kernel on CUDA (or under ``TRITON_INTERPRET=1``).
    ``block_table`` and ``seq_lens`` are int32; every request has at least one key."""
    if not triton_available(query.device):
        return paged_decode_reference(query, k_cache, v_cache, block_table, seq_lens, page_size, scale)
    split_stage, combine_stage = _kernels()
    requests, heads, dim = query.shape
    group = heads // k_cache.shape[1]
    block_dim = _next_power_of_2(dim)
    partial = torch.empty(requests, heads, KV_SPLITS, dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(requests, heads, KV_SPLITS, dtype=torch.float32, device=query.device)
    split_stage[(requests, heads, KV_SPLITS)](
        query, k_cache, v_cache, block_table, seq_lens, partial, lse, scale,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0), partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, PAGE=page_size, SPLITS=KV_SPLITS, BLOCK_N=BLOCK_KEYS, HEAD_DIM=dim, BLOCK_D=block_dim)
    out = torch.empty_like(query)
    combine_stage[(requests, heads)](
        partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), SPLITS=KV_SPLITS, BLOCK_S=_next_power_of_2(KV_SPLITS), HEAD_DIM=dim,
        BLOCK_D=block_dim)
    return out


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available(device: torch.device) -> bool:
    """Whether the kernel runs for tensors on ``device``: CUDA with Triton, or any device under Triton's
    interpreter."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (device.type == "cuda" or interpreted) and _triton_importable()


@functools.cache
def _kernels():
    """The two Triton kernels (defined at first use: importing Triton costs ~1 s, and the CPU never needs it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_stage(Q, K, V, block_table, seq_lens, partial, lse, scale,
                    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                    GROUP: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        request, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kv_head = head // GROUP
        length = tl.load(seq_lens + request)
        share = tl.cdiv(length, SPLITS)
        start = split * share
        end = tl.minimum(start + share, length)
        dims = tl.arange(0, BLOCK_D)
        in_dim = dims < HEAD_DIM
        q = tl.load(Q + request * stride_qb + head * stride_qh + dims, mask=in_dim, other=0.0).to(tl.float32)
        running_max = tl.full([], float("-inf"), tl.float32)
        total = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for first in range(start, end, BLOCK_N):
            positions = first + tl.arange(0, BLOCK_N)
            valid = positions < end
            page = tl.load(block_table + request * stride_bt + positions // PAGE, mask=valid, other=0)
            slots = page.to(tl.int64) * PAGE + positions % PAGE
            both = valid[:, None] & in_dim[None, :]
            k = tl.load(K + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :], mask=both, other=0.0)
            scores = tl.sum(q[None, :] * k.to(tl.float32), 1) * scale
            scores = tl.where(valid, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 0))
            weights = tl.exp(scores - new_max)
            rescale = tl.exp(running_max - new_max)
            v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :], mask=both, other=0.0)
            acc = acc * rescale + tl.sum(weights[:, None] * v.to(tl.float32), 0)
            total = total * rescale + tl.sum(weights, 0)
            running_max = new_max
        at = request * stride_pb + head * stride_ph + split * stride_ps
        if end > start:
            tl.store(partial + at + dims, acc / total, mask=in_dim)
            tl.store(lse + request * stride_lb + head * stride_lh + split, running_max + tl.log(total))
        else:
            tl.store(lse + request * stride_lb + head * stride_lh + split, float("-inf"))

    @triton.jit
    def combine_stage(partial, lse, out, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
                      stride_oh, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr):
        request, head = tl.program_id(0), tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        dims = tl.arange(0, BLOCK_D)
        in_split, in_dim = splits < SPLITS, dims < HEAD_DIM
        sums = tl.load(lse + request * stride_lb + head * stride_lh + splits, mask=in_split, other=float("-inf"))
        weights = tl.exp(sums - tl.max(sums, 0))  # empty splits: exp(-inf) = 0
        parts = tl.load(partial + request * stride_pb + head * stride_ph + splits[:, None] * stride_ps
                        + dims[None, :], mask=in_split[:, None] & (sums[:, None] > float("-inf")) & in_dim[None, :],
                        other=0.0)
        result = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
        tl.store(out + request * stride_ob + head * stride_oh + dims, result.to(out.dtype.element_ty), mask=in_dim)

    return split_stage, combine_stage
