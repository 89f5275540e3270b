"""Weights in memory, both ends: SGLang's weight-update group and its flattened buckets.

**The group** (SGLang's ``init_custom_process_group``, ``sglang/srt/utils/common.py``; the facts are pinned in
``tests/contracts/sglang_api.json`` under ``weight_update_group``): every member calls ``rendezvous("tcp://ADDR:PORT",
rank, world_size, timeout=...)`` (rank 0 hosts the TCP store), wraps the store as ``PrefixStore(group_name,
store)`` and makes the group with ``torch.distributed``'s ``_new_process_group_helper`` (no default group needed,
so a trainer keeps its own training group), registering its ranks in ``_world.pg_group_ranks``. The trainer is
rank 0; a server's ranks start at ``rank_offset``. A trainer written for SGLang (verl, slime and AReaL copy the
helper) and an ``agentrl engine`` therefore meet in the same group, and our trainer updates a real SGLang server.

**An update** (``POST /update_weights_from_distributed``): the request names the tensors (``names``, ``dtypes`` as
``str(dtype)`` without ``torch.``, ``shapes``) and rank 0 broadcasts them in that order, one broadcast per tensor;
with ``load_format: "flattened_bucket"`` it broadcasts one ``uint8`` tensor instead, the tensors' bytes
concatenated in the order of ``names`` without padding (SGLang's ``FlattenedTensorBucket``; each must start at a
multiple of its element size, so a sender puts one dtype in a bucket). Every collective has the group's timeout,
so a peer that never joins or dies mid-transfer ends the call with an error instead of hanging.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUCKET_FORMAT = "flattened_bucket"


class WeightSyncError(ValueError):
    """An update whose tensors cannot be received or do not fit (names the tensor and what was expected)."""


def init_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float) -> dist.ProcessGroup:
    """Join the weight-update group as ``rank`` (blocks until all ``world_size`` members joined, or the timeout)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (SGLang's spelling in ``dtypes``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r}: expected a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an update: its name, dtype, shape and, in a flattened bucket, its byte span."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int = 0
    end: int = 0


def specs(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorSpec]:
    """The request's tensors, checked (equal lengths, known dtypes, non-negative dimensions), with their byte spans
    in a flattened bucket (each aligned to its element size, as SGLang's ``FlattenedTensorBucket.empty``)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightSyncError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                              f"{len(shapes)})")
    if not names:
        raise WeightSyncError("the update names no tensor")
    out, offset = [], 0
    for name, dtype_text, shape in zip(names, dtypes, shapes):
        dtype = parse_dtype(dtype_text)
        if any(not isinstance(dim, int) or dim < 0 for dim in shape):
            raise WeightSyncError(f"{name}: shape {list(shape)} is not a list of non-negative integers")
        if offset % dtype.itemsize:
            raise WeightSyncError(f"{name}: byte offset {offset} in the bucket is not aligned to {dtype_text}")
        size = torch.Size(shape).numel() * dtype.itemsize
        out.append(TensorSpec(name, dtype, tuple(shape), offset, offset + size))
        offset += size
    return out


def bucket_layout(named: Sequence[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """:func:`specs` of tensors: their byte spans in a flattened bucket (one dtype per bucket is always aligned)."""
    return specs([name for name, _ in named], [dtype_name(t.dtype) for _, t in named],
                 [list(t.shape) for _, t in named])


def flatten(named: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, list[TensorSpec]]:
    """One ``uint8`` tensor holding ``named``'s bytes in order (:func:`bucket_layout`); with ``out`` (a ``uint8``
    buffer at least that long, reused from bucket to bucket: no new pages to fault in), a view of it."""
    layout = bucket_layout(named)
    size = layout[-1].end if layout else 0
    flat = torch.empty(size, dtype=torch.uint8, device=named[0][1].device) if out is None else out[:size]
    for spec, (_, tensor) in zip(layout, named):
        flat[spec.start:spec.end].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
    return flat, layout


def unflatten(flat: torch.Tensor, layout: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    return [(spec.name, flat[spec.start:spec.end].view(spec.dtype).reshape(spec.shape)) for spec in layout]


def receive(group: dist.ProcessGroup, layout: Sequence[TensorSpec], load_format: str | None,
            device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Receive an update's tensors from rank 0 into new tensors (never into the served weights)."""
    if load_format == BUCKET_FORMAT:
        flat = torch.empty(layout[-1].end, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=group)
        return unflatten(flat, layout)
    tensors = [(spec.name, torch.empty(spec.shape, dtype=spec.dtype, device=device)) for spec in layout]
    handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for _, tensor in tensors]
    for handle in handles:
        handle.wait()
    return tensors

