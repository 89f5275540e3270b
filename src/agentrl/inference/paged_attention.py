"""Attention over transformers' paged KV cache, request by request, for the continuous-batching engine.

transformers' ``sdpa`` path for continuous batching packs every request of a step into one sequence: the keys are
the cached tokens of all the step's requests gathered together, every query attends to all of them through a
block-diagonal mask ``[query tokens, all gathered tokens]`` (built and reset in Python each step) and the key/value
heads are repeated to the query heads. A decode step of B requests of L tokens thus costs B·(B·L) scores per head
where B·L suffice: at 16 requests of 100 tokens the attention is ~15x the work it needs to be, and it grows with B².

This module is the attention implementation :data:`PAGED_ATTENTION`, registered with transformers'
``AttentionInterface``. While a continuous-batching step runs (:func:`paged_step`, set by the engine's model
runner with the step's :class:`StepLayout`), each layer writes its new keys and values into the paged cache and:

* decode requests (one new token each; the scheduler puts them first) attend together: their cached keys and
  values are gathered into a padded ``[requests, kv_heads, longest, head_dim]`` view with a padding mask
  ``[requests, 1, 1, longest]``, and the query heads that share a key/value head are laid out as that head's
  query positions (no ``repeat_kv`` copy);
* prefill requests (a prompt or a chunk of one) attend one by one, over their own new keys or, when part of the
  prompt is already cached (prefix sharing, chunked prefill), over the cached keys and the new ones, through a
  causal mask aligned to the end;
* or, in a step where every request decodes and whose inputs sit in static buffers (:class:`DecodeLayout`, the
  step :mod:`agentrl.inference.decode_graphs` captures as a CUDA graph), the requests attend through the block
  table in place (:mod:`agentrl.inference.decode_kernel`).

**The same numbers whatever is cached.** A token's attention output must not depend on how many other tokens share
its call: otherwise a prompt served from the prefix cache (its last few tokens computed alone) gets other logits
than the same prompt computed whole, and in ``bf16_matmuls`` mode such float-rounding differences grow through the
layers into a different greedy token (measured: the second identical "Say hello." request differed from the first
from its 7th token). CPU SDPA computes query rows in blocks and takes another GEMM kernel for a block of fewer than
4 rows (or a call of 1 or 3) and blocks of 64 or 256 rows for long calls, so on the CPU each prefill's queries are
padded to a multiple of 32 rows (repeats of its last row, dropped after) and attend in calls of exactly 32
(:data:`PREFILL_QUERY_BLOCK`), always with an explicit mask: a row's output is then the same bits for any split of
the prompt (``tests/test_inference_paged_attention.py``).

Outside such a step (e.g. the engine's prompt-logprob pass) it is exactly transformers' ``sdpa``, masks included.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache, group_layers_by_attn_type
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from agentrl.inference.decode_kernel import paged_decode_attention

PAGED_ATTENTION = "agentrl_paged_sdpa"
"""The attention implementation name (``model.set_attn_implementation``)."""

_FULL_ATTENTION = "full_attention"

PREFILL_QUERY_BLOCK = {"cpu": 32}
"""Per device type, the query rows of each SDPA call of a prefill: its queries are padded to a multiple of it and
attend in calls of exactly that many rows, always with an explicit mask (see the module doc), so CPU SDPA, whose
query blocks are 32, 64 or 256 rows by the call's length, splits every prompt alike. Where absent (CUDA) a prefill
with nothing cached keeps ``is_causal``, whose flash kernel an explicit mask would rule out."""

DECODE_KEY_BUCKET = {"cuda": 64}
"""Per device type, the multiple the decode group's padded key length is rounded up to (1 where absent). On CUDA
SDPA picks its kernel per new shape at a host cost that dwarfs the kernel: measured on an H200 (torch 2.11, 64
requests, ``bench/decode_attention.py``) 1.5 ms a call when the keys grow by one each step, 0.04 ms when the length
repeats. On CPUs the choice is cheap and the padding would be work, so they take the exact length."""


@dataclass(frozen=True)
class _DecodeGroup:
    """The requests of a step that decode one token: attended together over a padded view of their caches."""

    rows: slice  # their query rows: the first of the step's packed tokens
    slots: torch.Tensor  # [requests, longest] cache slots of their keys (padding repeats a slot, masked); longest
    # is rounded up to the device's DECODE_KEY_BUCKET
    mask: torch.Tensor  # [requests, 1, 1, longest] True where the key belongs to the request


@dataclass(frozen=True)
class _Prefill:
    """One request that processes several tokens (or its first): attended alone."""

    rows: slice  # its query rows in the step's packed tokens
    queries: torch.Tensor | None  # [padded] indices into its rows: each once, then the last repeated; None: as is
    slots: torch.Tensor | None  # cache slots of all its keys; None: its keys are this step's (nothing cached)
    mask: torch.Tensor | None  # [1, 1, queries, all] causal mask aligned to the end; None: plain causal


@dataclass(frozen=True)
class StepLayout:
    """Where each request of a continuous-batching step finds its queries and keys (computed once per step)."""

    tokens: int  # query tokens in the step
    write_slots: torch.Tensor  # [tokens] cache slots the step's keys and values go to
    decode: _DecodeGroup | None
    prefills: tuple[_Prefill, ...]

    @classmethod
    def from_batch(cls, batch: dict, decoding: Sequence[bool]) -> StepLayout:
        """The layout of a batch made by transformers' ``ContinuousBatchingIOs.get_model_kwargs``; ``decoding``:
        per request of the batch, whether it decodes (a prompt whose only uncomputed token is its last, the rest
        served from the prefix cache, is still a prefill: its numbers must not depend on the cache)."""
        cu_q = batch["cu_seq_lens_q"].tolist()
        cu_k = batch["cu_seq_lens_k"][_FULL_ATTENTION].tolist()
        read_slots, write_slots = batch["read_index"][0], batch["write_index"][0]
        reads_cache = read_slots.numel() > 0  # else no request has cached tokens: keys are the step's own
        decoding_requests = 0  # the scheduler puts decoding requests first: they form the decode group
        prefills = []
        for i in range(len(cu_q) - 1):
            new, total = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
            if new == 1 and reads_cache and decoding[i] and decoding_requests == i:
                decoding_requests += 1
                continue
            past = total - new
            slots = read_slots[cu_k[i]:cu_k[i + 1]] if past > 0 else None
            prefills.append(_prefill(slice(cu_q[i], cu_q[i + 1]), past, slots, read_slots.device))
        decode = _decode_group(cu_k[:decoding_requests + 1], read_slots) if decoding_requests else None
        return cls(tokens=cu_q[-1], write_slots=write_slots[:cu_q[-1]], decode=decode, prefills=tuple(prefills))

    def attend(self, layer_idx: int, cache: PagedAttentionCache, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Store the layer's new keys and values, then attend; ``query`` [1, heads, tokens, dim], ``key`` and
        ``value`` [1, kv_heads, tokens, dim]; returns [1, tokens, heads, dim]."""
        k_pages, v_pages = cache.layer_to_allocator[layer_idx].get_cache_for_block_table(layer_idx)
        k_cache, v_cache = k_pages.flatten(0, 1), v_pages.flatten(0, 1)  # [slots, kv_heads, dim]
        k_cache.index_copy_(0, self.write_slots, key[0, :, :self.tokens].transpose(0, 1))
        v_cache.index_copy_(0, self.write_slots, value[0, :, :self.tokens].transpose(0, 1))
        heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]
        out = query.new_empty(query.shape[2], heads, dim)
        if self.decode is not None:
            group = self.decode
            requests = group.slots.shape[0]
            # The query heads of one key/value head become its query positions: [requests, kv_heads, group, dim].
            q = query[0, :, group.rows].transpose(0, 1).reshape(requests, kv_heads, heads // kv_heads, dim)
            slots, gathered = group.slots.view(-1), (*group.slots.shape, kv_heads, dim)
            k = k_cache.index_select(0, slots).view(gathered).transpose(1, 2)  # [requests, kv_heads, longest, dim]
            v = v_cache.index_select(0, slots).view(gathered).transpose(1, 2)
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling)
            out[group.rows] = attended.reshape(requests, heads, dim)
        for prefill in self.prefills:
            q = query[:, :, prefill.rows]
            if prefill.queries is not None:
                q = q.index_select(2, prefill.queries)
            if prefill.slots is None:
                k, v = key[:, :, prefill.rows], value[:, :, prefill.rows]
            else:
                k = k_cache.index_select(0, prefill.slots).transpose(0, 1).unsqueeze(0)
                v = v_cache.index_select(0, prefill.slots).transpose(0, 1).unsqueeze(0)
            if prefill.queries is None:
                attended = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=prefill.mask, is_causal=prefill.mask is None, scale=scaling, enable_gqa=True)
            else:  # calls of exactly PREFILL_QUERY_BLOCK rows: the same kernel blocks for any length of prompt
                block = PREFILL_QUERY_BLOCK[q.device.type]
                attended = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, start:start + block], k, v, attn_mask=prefill.mask[:, :, start:start + block],
                    scale=scaling, enable_gqa=True) for start in range(0, q.shape[2], block)], dim=2)
            out[prefill.rows] = attended[0, :, :prefill.rows.stop - prefill.rows.start].transpose(0, 1)
        return out.unsqueeze(0)


@dataclass(frozen=True)
class DecodeLayout:
    """A step in which every request decodes one token, in static buffers (:mod:`agentrl.inference.decode_graphs`
    captures it once per batch size and replays it): the keys are read through the block table in place
    (:func:`~agentrl.inference.decode_kernel.paged_decode_attention`), nothing in it depends on the key counts'
    values, and nothing reads a tensor back to the host."""

    write_slots: torch.Tensor  # [requests] cache slot of each request's new key and value
    block_table: torch.Tensor  # [requests, max_pages] int32 cache page of each of a request's pages
    seq_lens: torch.Tensor  # [requests] int32 keys of each request, its new one included
    page_size: int

    def attend(self, layer_idx: int, cache: PagedAttentionCache, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """:meth:`StepLayout.attend`'s contract, for one query token per request."""
        k_pages, v_pages = cache.layer_to_allocator[layer_idx].get_cache_for_block_table(layer_idx)
        k_cache, v_cache = k_pages.flatten(0, 1), v_pages.flatten(0, 1)  # [slots, kv_heads, dim]
        k_cache.index_copy_(0, self.write_slots, key[0].transpose(0, 1))
        v_cache.index_copy_(0, self.write_slots, value[0].transpose(0, 1))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = paged_decode_attention(query[0].transpose(0, 1), k_cache, v_cache, self.block_table, self.seq_lens,
                                     self.page_size, scale)  # [requests, heads, dim]
        return out.unsqueeze(0)


def _prefill(rows: slice, past: int, slots: torch.Tensor | None, device: torch.device) -> _Prefill:
    """A request computing the tokens ``rows`` after ``past`` cached ones: its queries padded and masked where the
    device needs it (:data:`PREFILL_QUERY_BLOCK`), else masked only when keys precede them."""
    new = rows.stop - rows.start
    multiple = PREFILL_QUERY_BLOCK.get(device.type)
    queries = None if multiple is None else torch.arange(-(-new // multiple) * multiple, device=device).clamp(
        max=new - 1)
    if queries is None and past == 0:
        return _Prefill(rows=rows, queries=None, slots=slots, mask=None)
    positions = (torch.arange(new, device=device) if queries is None else queries) + past
    mask = (torch.arange(past + new, device=device)[None, :] <= positions[:, None])[None, None]
    return _Prefill(rows=rows, queries=queries, slots=slots, mask=mask)


def _decode_group(cu_k: list[int], read_slots: torch.Tensor) -> _DecodeGroup:
    """The first ``len(cu_k) - 1`` requests of the step, one query token each, whose keys start at ``cu_k``."""
    device = read_slots.device
    starts = torch.tensor(cu_k[:-1], device=device)
    lengths = torch.tensor(cu_k[1:], device=device) - starts
    longest, bucket = max(b - a for a, b in zip(cu_k, cu_k[1:])), DECODE_KEY_BUCKET.get(device.type, 1)
    positions = torch.arange(-(-longest // bucket) * bucket, device=device)
    mask = positions[None, :] < lengths[:, None]
    slots = read_slots[torch.where(mask, starts[:, None] + positions[None, :], starts[:, None])]
    return _DecodeGroup(rows=slice(0, len(cu_k) - 1), slots=slots, mask=mask[:, None, None, :])


_MODIFIERS = ("sliding_window", "softcap", "s_aux", "position_bias")
"""Attention arguments some models pass that change the scores: served only by transformers' path."""

_STEP: ContextVar[StepLayout | DecodeLayout | None] = ContextVar("agentrl_paged_step", default=None)


@contextmanager
def paged_step(layout: StepLayout | DecodeLayout) -> Iterator[None]:
    """Run a continuous-batching forward pass with ``layout`` (in this thread)."""
    token = _STEP.set(layout)
    try:
        yield
    finally:
        _STEP.reset(token)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            cache: PagedAttentionCache | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: the step's layout inside :func:`paged_step`, else ``sdpa``."""
    layout = _STEP.get()
    if layout is None:
        if isinstance(cache, PagedAttentionCache):
            raise RuntimeError(f"{PAGED_ATTENTION} over a paged cache needs the step's layout (paged_step)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      cache=cache, **kwargs)
    unsupported = sorted(name for name in _MODIFIERS if kwargs.get(name) is not None)
    if unsupported:
        raise NotImplementedError(f"{PAGED_ATTENTION} does not implement {', '.join(unsupported)}")
    return layout.attend(module.layer_idx, cache, query, key, value, scaling), None


def _paged_mask(*args, **kwargs) -> torch.Tensor | None:
    """No mask inside a step (the layout holds what each request sees); ``sdpa``'s mask otherwise."""
    return None if _STEP.get() is not None else sdpa_mask(*args, **kwargs)


def supports(config: PretrainedConfig) -> bool:
    """Whether the model's layers all use plain full attention (sliding windows and soft-capped scores keep
    transformers' path)."""
    config = config.get_text_config()  # a vision-language model's language model
    softcap = getattr(config, "attn_logit_softcapping", None)
    return set(group_layers_by_attn_type(config)) == {_FULL_ATTENTION} and softcap is None


AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(PAGED_ATTENTION, _paged_mask)
