"""Micro-batches of merged samples: right padding to the longest row, samples never split.

Layout: every row is one merged sample, real tokens first, padding after (``attention_mask`` 0, ``loss_mask`` 0,
``seq_ids`` -1). Under causal attention a real token only attends to earlier positions, which are all real, so
padding cannot change any real token's logits; default position ids ``0..T-1`` are right for every row. Passing
``attention_mask`` to the model is therefore optional (it is exact either way; without it, SDPA can use its
causal fast path). Packing several samples into one row with restarted position ids would need a
varlen/flash attention kernel to stay exact, which CPU SDPA does not offer.

Rows are placed first-fit-decreasing by length under a budget on padded tokens (``rows × longest row``), so
rows of similar length share a micro-batch. Shapes of a ``MicroBatch`` with ``B`` rows and ``T`` columns: every
tensor is ``[B, T]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from agentrl.training.merge import MergedSample

SequenceUnit = Literal["sample", "turn"]


@dataclass
class MicroBatch:
    """Padded tensors for one forward/backward pass (all ``[B, T]``).

    ``input_ids``/``attention_mask`` (long) go to the model; ``loss_mask`` (bool), ``old_logprobs`` (float32,
    behaviour logprobs), ``advantages`` (float32), ``versions`` (long, -1 where no policy sampled the token) and
    ``seq_ids`` (long: dense ids 0..S-1 of the sequences used by per-sequence aggregation, -1 on padding) go to
    the loss. ``sample_indices[b]`` is the index of row ``b``'s sample in the list given to the packer.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    seq_ids: torch.Tensor
    sample_indices: list[int]

    @property
    def num_sequences(self) -> int:
        return int(self.seq_ids.max().item()) + 1 if self.seq_ids.numel() else 0

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch with every tensor on ``device``."""
        names = ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "advantages", "versions", "seq_ids")
        moved = {name: getattr(self, name).to(device) for name in names}
        return MicroBatch(**moved, sample_indices=list(self.sample_indices))


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded size ``rows × longest`` stays within ``max_tokens``.

    First-fit decreasing by length; a sample longer than ``max_tokens`` gets a micro-batch of its own. The
    result is deterministic for the same lengths.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        for group in groups:
            # sorted by decreasing length: the group's first sample is its longest
            if (len(group) + 1) * lengths[group[0]] <= max_tokens:
                group.append(i)
                break
        else:
            groups.append([i])
    return groups


def collate(
    samples: Sequence[MergedSample],
    indices: Sequence[int] | None = None,
    *,
    pad_token_id: int = 0,
    sequence_unit: SequenceUnit = "sample",
    pad_to_multiple_of: int = 1,
) -> MicroBatch:
    """Right-pad ``samples`` (or those at ``indices``) into one ``MicroBatch``.

    ``sequence_unit`` says what a "sequence" is for per-sequence aggregation and GSPO: ``"sample"`` (a merged
    branch, as the original) or ``"turn"`` (each call, which reproduces per-call unmerged training exactly).
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
    return MicroBatch(input_ids, attention_mask, loss_mask, old_logprobs, advantages, versions, seq_ids, chosen)


def pack_micro_batches(
    samples: Sequence[MergedSample],
    max_tokens: int,
    *,
    pad_token_id: int = 0,
    sequence_unit: SequenceUnit = "sample",
    pad_to_multiple_of: int = 1,
) -> list[MicroBatch]:
    """Split ``samples`` into padded micro-batches of at most ``max_tokens`` padded tokens each (see module doc).

    Data-parallel ranks must run the same number of passes per step; the trainer agrees on that count.
    """
    groups = plan_micro_batches([s.num_tokens for s in samples], max_tokens)
    return [
        collate(
            samples,
            group,
            pad_token_id=pad_token_id,
            sequence_unit=sequence_unit,
            pad_to_multiple_of=pad_to_multiple_of,
        )
        for group in groups
    ]
