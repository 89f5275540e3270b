"""Decode steps captured once per batch size and replayed: the engine's hot loop without per-token Python.

A step in which every request decodes one token is the engine's steady state, and on a GPU its eager forward pass
is a few hundred small kernel launches issued from Python per token (measured on an H200: 31 tokens/s for one
request). :class:`DecodeGraphs` runs such steps from static buffers instead, one set per *bucket* of batch sizes
(:func:`buckets`: 1, 2, 4, 8, then multiples of 8): the step's token ids, positions, the cache slots its keys go to,
a block table and the key counts are copied into the bucket's buffers (rows past the batch repeat its first request,
whose results they overwrite with the same values and whose logits are dropped), and the bucket's forward pass —
the model under :class:`~agentrl.inference.paged_attention.DecodeLayout`, whose attention reads the paged cache in
place — runs:

* on CUDA as a CUDA graph, captured the first time the bucket is used (after one eager run of the same step on a
  side stream, which also compiles the Triton kernel), then replayed (``torch.cuda.CUDAGraph``; all buckets share
  one memory pool);
* elsewhere eagerly (the CPU's own path is faster there: see docs/engine.md; the tests run this mode to check the
  step against the engine's eager path on the CPU).

Sampling stays outside the graph (per-request temperature, top-k/p, min-p, penalties and seeds on the graph's
logits), as do steps with a prefill, batches larger than the largest bucket and LoRA-routed steps.

Invariants: a graph reads the parameters' and the KV cache's storage by address, so weight updates copy into the
parameters' storage while graphs exist (:attr:`in_place_weights`, which the batcher's swap honours), and anything
that moves them (a new KV cache after a restart, weights moved off the GPU and back) must call :meth:`reset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from agentrl.inference import paged_attention

_FULL_ATTENTION = "full_attention"


def buckets(max_requests: int) -> list[int]:
    """The batch sizes captured up to ``max_requests``: 1, 2, 4, 8, 16, 24, 32, ... and ``max_requests``."""
    sizes = [size for size in (1, 2, 4) if size < max_requests]
    sizes += list(range(8, max_requests, 8))
    return sorted({*sizes, max_requests})


@dataclass
class _Bucket:
    """The static inputs of one batch size's decode step, and its output once run."""

    input_ids: torch.Tensor  # [1, size]
    position_ids: torch.Tensor  # [1, size]
    layout: paged_attention.DecodeLayout
    logits: torch.Tensor | None = None  # [1, size, vocab], the captured (or last eager) run's output
    graph: torch.cuda.CUDAGraph | None = None

    @classmethod
    def allocate(cls, size: int, max_pages: int, page_size: int, device: torch.device) -> _Bucket:
        ids = torch.zeros(1, size, dtype=torch.long, device=device)
        layout = paged_attention.DecodeLayout(
            write_slots=torch.zeros(size, dtype=torch.long, device=device),
            block_table=torch.zeros(size, max_pages, dtype=torch.int32, device=device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=device), page_size=page_size)
        return cls(input_ids=ids, position_ids=torch.zeros_like(ids), layout=layout)

    def fill(self, batch: dict, requests: int) -> None:
        """Copy a decode-only batch (transformers' ``get_model_kwargs``) of ``requests`` requests into the buffers;
        the rows after it repeat its first request. No host synchronisation."""
        layout, size = self.layout, self.input_ids.shape[1]
        page, max_pages = layout.page_size, layout.block_table.shape[1]
        read_slots = batch["read_index"][0]
        cu_k = batch["cu_seq_lens_k"][_FULL_ATTENTION][:requests + 1]
        positions = torch.arange(size, device=cu_k.device)
        rows = torch.where(positions < requests, positions, 0)  # padding rows are copies of row 0
        starts, ends = cu_k[:-1][rows], cu_k[1:][rows]
        self.input_ids[0].copy_(batch["input_ids"][0, :requests][rows])
        self.position_ids[0].copy_(batch["position_ids"][0, :requests][rows])
        layout.write_slots.copy_(batch["write_index"][0][:requests][rows])
        layout.seq_lens.copy_(ends - starts)
        # A request's key j sits in slot read_slots[start + j]; its page is that slot // page (pages are whole).
        firsts = starts[:, None] + torch.arange(max_pages, device=cu_k.device)[None, :] * page
        firsts = torch.minimum(firsts, (ends - 1)[:, None])  # pages past the request: any of its own
        layout.block_table.copy_(read_slots[firsts] // page)


class DecodeGraphs:
    """Runs decode-only steps of up to ``max_requests`` requests from static buffers, captured as CUDA graphs on
    CUDA (``capture``), eagerly otherwise (see the module doc)."""

    def __init__(self, model: torch.nn.Module, *, max_requests: int, max_pages: int, page_size: int,
                 capture: bool):
        self.model = model
        self.device = next(model.parameters()).device
        self.sizes = buckets(max_requests)
        self.max_pages, self.page_size = max_pages, page_size
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, not {self.device}")
        self.capture = capture
        self._buckets: dict[int, _Bucket] = {}
        self._cache: PagedAttentionCache | None = None
        self._pool = None

    @property
    def in_place_weights(self) -> bool:
        """Whether weight updates must copy into the parameters' storage (captured graphs read it by address)."""
        return self.capture

    @property
    def captured(self) -> list[int]:
        """The bucket sizes captured so far."""
        return sorted(size for size, bucket in self._buckets.items() if bucket.graph is not None)

    def reset(self) -> None:
        """Forget every bucket (their buffers and graphs): the KV cache or the weights moved."""
        self._buckets.clear()
        self._cache = None

    def serves(self, batch: dict, decoding: list[bool]) -> bool:
        """Whether the step is one these buffers run: every request decodes (one token each, cache read) and there
        are at most ``max_requests``."""
        requests = len(decoding)
        return (0 < requests <= self.sizes[-1] and all(decoding) and batch["input_ids"].shape[1] == requests
                and batch["read_index"][0].numel() > 0)

    def forward(self, batch: dict, decoding: list[bool], cache: PagedAttentionCache) -> torch.Tensor:
        """The step's logits [requests, vocab] (the batch must be one :meth:`serves`)."""
        if cache is not self._cache:  # a new KV cache (the loop restarted): graphs captured on the old one are void
            self.reset()
            self._cache = cache
        requests = len(decoding)
        size = next(size for size in self.sizes if size >= requests)
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _Bucket.allocate(size, self.max_pages, self.page_size, self.device)
        bucket.fill(batch, requests)
        if not self.capture:
            bucket.logits = self._run(bucket, cache)
        elif bucket.graph is None:
            self._capture(bucket, cache)
        else:
            bucket.graph.replay()
        assert bucket.logits is not None
        return bucket.logits[0, :requests]

    def _run(self, bucket: _Bucket, cache: PagedAttentionCache) -> torch.Tensor:
        with paged_attention.paged_step(bucket.layout):
            return self.model(input_ids=bucket.input_ids, position_ids=bucket.position_ids, cache=cache,
                              use_cache=False).logits

    def _capture(self, bucket: _Bucket, cache: PagedAttentionCache) -> None:
        """Run the bucket's step once on a side stream (lazy initialisations, Triton's compilation), capture it,
        and replay it for this step's output."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._run(bucket, cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):  # other threads'
            # CUDA work (a weight update being prepared) goes on outside the capture
            bucket.logits = self._run(bucket, cache)
        bucket.graph = graph
        graph.replay()
