"""Micro-batches of merged samples: the dense per-sample tensors of the loss, and how the model forwards them.

Loss layout: every row is one merged sample, real tokens first, padding after (``attention_mask`` 0, ``loss_mask``
0, ``seq_ids`` -1); every tensor of a ``MicroBatch`` with ``B`` rows and ``T`` columns is ``[B, T]``. Under causal
attention a real token only attends to earlier positions, which are all real, so padding cannot change any real
token's logits (passing ``attention_mask`` to the model is optional).

Forward layout (``MicroBatch.layout``, ``agentrl.training.prefix_tree``): samples that share a token prefix of at
least ``min_shared`` tokens (a group's prompt; the common turns of a trajectory's branches) have it forwarded once,
and ``layout_logprobs`` scatters every predicted logprob back to the ``[B, T]`` layout above, so the loss sees the
same tensors as with one forward per sample. ``min_shared=None`` forwards every sample on its own.

Planning (``plan_micro_batches``): the budget ``max_tokens`` counts the tokens the model actually forwards, padding
included and each shared span once. Samples are ordered lexicographically, so those sharing a prefix are
neighbours, and the prefix forest of the step's samples gives its groups (its trees). A group over the budget is cut
into runs of neighbours that fit (each run forwards its prefix once); the pieces are then placed first-fit
decreasing, a micro-batch costing what its pieces cost together: its trees, one packed row each, times the longest
(the padded tokens of its one model call). A sample over the budget alone gets a micro-batch of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from agentrl.training.prefix_tree import (
    MIN_SHARED_TOKENS,
    ForwardLayout,
    build_forest,
    forward_layout,
    lexicographic_order,
    merge_shapes,
    shape_cost,
)
from agentrl.training.vision_batch import StepImages, VisionBatch
from agentrl.trajectory.merge import MergedSample

if TYPE_CHECKING:
    from agentrl.training.parallel import ParallelState

SequenceUnit = Literal["sample", "turn"]
NO_SHARING = 1 << 62
"""A ``min_shared`` no prefix reaches: every sample is forwarded on its own."""


@dataclass
class MicroBatch:
    """Padded tensors for one forward/backward pass (all ``[B, T]``).

    ``input_ids``/``attention_mask`` (long) go to the model; ``loss_mask`` (bool), ``old_logprobs`` (float32,
    behaviour logprobs), ``advantages`` (float32), ``versions`` (long, -1 where no policy sampled the token) and
    ``seq_ids`` (long: dense ids 0..S-1 of the sequences used by per-sequence aggregation, -1 on padding) go to
    the loss. ``sample_indices[b]`` is the index of row ``b``'s sample in the list given to the packer.
    ``layout`` says how the model forwards the rows (shared prefixes once; see the module doc).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    seq_ids: torch.Tensor
    sample_indices: list[int]
    layout: ForwardLayout
    vision: VisionBatch | None = None  # the images of ``layout``'s rows (a vision-language policy)

    @property
    def num_sequences(self) -> int:
        return int(self.seq_ids.max().item()) + 1 if self.seq_ids.numel() else 0

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch with every tensor on ``device``."""
        names = ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "advantages", "versions", "seq_ids")
        moved = {name: getattr(self, name).to(device) for name in names}
        return MicroBatch(**moved, sample_indices=list(self.sample_indices), layout=self.layout.to(device),
                          vision=None if self.vision is None else self.vision.to(device))


def plan_micro_batches(seqs: Sequence[Sequence[int]], max_tokens: int, *, min_shared: int | None = MIN_SHARED_TOKENS,
                       pad_to_multiple_of: int = 1) -> list[list[int]]:
    """Group the indices of samples ``seqs`` (token ids) into micro-batches that forward at most ``max_tokens``
    tokens each (see the module doc). Deterministic for the same samples."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    shared = min_shared or NO_SHARING

    def shape(indices: Sequence[int]) -> tuple[int, int]:
        return build_forest([seqs[i] for i in indices], shared).shape()

    forest = build_forest(seqs, shared)
    groups: dict[int, list[int]] = {}
    for i in lexicographic_order(seqs):
        groups.setdefault(forest.paths[i][0] if forest.paths[i] else -1 - i, []).append(i)
    pieces: list[tuple[list[int], tuple[int, int]]] = []
    for group in groups.values():
        start = 0
        while start < len(group):
            def fits(end: int, members: list[int] = group, first: int = start) -> bool:
                return shape_cost(shape(members[first:end]), pad_to_multiple_of) <= max_tokens

            end = _longest_run(start, len(group), fits)
            pieces.append((group[start:end], shape(group[start:end])))
            start = end
    pieces.sort(key=lambda piece: (-shape_cost(piece[1], pad_to_multiple_of), piece[0][0]))
    bins: list[tuple[list[int], tuple[int, int]]] = []
    for indices, own in pieces:
        for index, (members, combined) in enumerate(bins):
            merged = merge_shapes(combined, own)
            if shape_cost(merged, pad_to_multiple_of) <= max_tokens:
                bins[index] = (members + indices, merged)
                break
        else:
            bins.append((list(indices), own))
    return [members for members, _ in bins]


def _longest_run(start: int, stop: int, fits) -> int:
    """The largest ``end`` in ``(start, stop]`` with ``fits(end)``, searching as if ``fits`` were monotone;
    ``start + 1`` (one sample alone) when nothing longer fits."""
    if fits(stop):
        return stop
    lo, hi = start + 1, stop  # fits(lo) is assumed (a lone sample is always placed), fits(hi) is False
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def collate(
    samples: Sequence[MergedSample],
    indices: Sequence[int] | None = None,
    *,
    pad_token_id: int = 0,
    sequence_unit: SequenceUnit = "sample",
    pad_to_multiple_of: int = 1,
    min_shared: int | None = MIN_SHARED_TOKENS,
    images: StepImages | None = None,
) -> MicroBatch:
    """Right-pad ``samples`` (or those at ``indices``) into one ``MicroBatch``, forwarding prefixes of at least
    ``min_shared`` tokens once (None: every sample on its own). With ``images`` (a vision-language policy) every
    sample is forwarded on its own and the batch carries its rows' pixel inputs (``agentrl.training.vision_batch``).

    ``sequence_unit`` says what a "sequence" is for per-sequence aggregation and GSPO: ``"sample"`` (a merged
    branch, as the original AgentRL) or ``"turn"`` (each call, which reproduces per-call unmerged training exactly).
    """
    if sequence_unit not in ("sample", "turn"):
        raise ValueError(f"sequence_unit must be 'sample' or 'turn', got {sequence_unit!r}")
    chosen = list(range(len(samples))) if indices is None else list(indices)
    if not chosen:
        raise ValueError("cannot collate an empty micro-batch")
    rows = [samples[i] for i in chosen]
    width = max(row.num_tokens for row in rows)
    width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    old_logprobs = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    versions = torch.full(shape, -1, dtype=torch.long)
    seq_ids = torch.full(shape, -1, dtype=torch.long)
    next_seq = 0
    for b, row in enumerate(rows):
        n = row.num_tokens
        input_ids[b, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(row.loss_mask, dtype=torch.bool)
        old_logprobs[b, :n] = torch.tensor(row.logprobs, dtype=torch.float32)
        advantages[b, :n] = torch.tensor(row.advantages, dtype=torch.float32)
        versions[b, :n] = torch.tensor(row.versions, dtype=torch.long)
        if sequence_unit == "sample":
            seq_ids[b, :n] = next_seq
            next_seq += 1
        else:
            for turn in row.turns:
                if turn.trained:
                    seq_ids[b, turn.output_start : turn.output_end] = next_seq
                    next_seq += 1
    seqs = [row.input_ids for row in rows]
    forest = build_forest(seqs, NO_SHARING if images is not None else min_shared or NO_SHARING)
    layout = forward_layout(seqs, [row.loss_mask for row in rows], forest, width, pad_token_id=pad_token_id,
                            pad_to_multiple_of=pad_to_multiple_of)
    vision = None
    if images is not None:  # without sharing every node is a root: one row per sample, in node order
        row_samples = [node.sample for node in forest.nodes if node.width > 0]
        vision = images.batch([rows[sample].images for sample in row_samples])
    return MicroBatch(input_ids, attention_mask, loss_mask, old_logprobs, advantages, versions, seq_ids, chosen,
                      layout, vision)


def pack_micro_batches(
    samples: Sequence[MergedSample],
    max_tokens: int,
    *,
    pad_token_id: int = 0,
    sequence_unit: SequenceUnit = "sample",
    pad_to_multiple_of: int = 1,
    min_shared: int | None = MIN_SHARED_TOKENS,
    images: StepImages | None = None,
) -> list[MicroBatch]:
    """Split ``samples`` into micro-batches that forward at most ``max_tokens`` tokens each (see the module doc);
    ``images``: the step's pictures, for a vision-language policy (no prefix is shared then).

    Data-parallel ranks must run the same number of passes per step; the trainer agrees on that count.
    """
    min_shared = None if images is not None else min_shared
    groups = plan_micro_batches([s.input_ids for s in samples], max_tokens, min_shared=min_shared,
                                pad_to_multiple_of=pad_to_multiple_of)
    return [
        collate(samples, group, pad_token_id=pad_token_id, sequence_unit=sequence_unit,
                pad_to_multiple_of=pad_to_multiple_of, min_shared=min_shared, images=images)
        for group in groups
    ]


def empty_micro_batch(pad_token_id: int = 0) -> MicroBatch:
    """Two padding tokens without a loss token: a pass that contributes nothing but keeps ranks in step."""
    return collate([MergedSample(input_ids=[pad_token_id] * 2, loss_mask=[0, 0], logprobs=[0.0, 0.0],
                                 versions=[-1, -1], advantages=[0.0, 0.0])], pad_token_id=pad_token_id)


def align_passes(micro: list[MicroBatch], parallel: ParallelState, pad_token_id: int = 0) -> int:
    """Make this rank's passes match the other data-parallel ranks' (FSDP2 makes collectives in every model call,
    and every pass is one model call): as many passes, ``empty_micro_batch`` appended. Every rank calls it; returns
    this rank's real passes."""
    real = len(micro)
    passes = int(parallel.all_reduce([float(real)], op="max", group="dp")[0])
    micro.extend(empty_micro_batch(pad_token_id) for _ in range(passes - real))
    return real
