"""Shared token prefixes of a micro-batch as a forest, and the forward layout it gives.

The samples of a GRPO group start with the same prompt (system prompt, tool schemas, question), and branches of one
trajectory also share their first turns. ``build_forest`` finds these spans from the token ids alone: it sorts the
samples lexicographically (samples with a common prefix become neighbours) and reads the longest common prefix of
neighbours, so no pair is compared twice and nothing is re-tokenised. A span shared by several samples becomes one
node when it is at least ``min_shared`` tokens long (shorter spans are cheaper to repeat than to forward apart); the
samples below it continue in child nodes. A sample's tokens are the spans of the nodes on its root-to-node path.

Forward layout (``ForwardLayout``): the nodes of one depth form a *level*, one padded row per node;
``agentrl.training.logprobs.layout_logprobs`` packs the levels into one row per tree (a node's tokens after its
ancestors', attending to them) and forwards them in one model call, so every shared span is computed once. Token
alignment, with ``[a, b)`` a node's span:

* a root row holds tokens ``0 .. b-2`` at positions ``0 .. b-2`` and predicts tokens ``1 .. b-1``;
* any other row holds tokens ``a-1 .. b-2`` at positions ``a-1 .. b-2`` and predicts tokens ``a .. b-1``. Its first
  input repeats the parent's last token (the parent's row does not hold it): the logits there predict the node's
  first token, so each child scores its own first token, and the parent's last token is computed once per child,
  at its correct position.

Every position below ``b-1`` thus appears exactly once among a row's ancestors, at its own position, and each row
predicts exactly its node's tokens. ``out_index`` maps every ``(sample, position)`` of the micro-batch's dense
``[B, T]`` layout (``agentrl.training.batching``) to the predicted logprob of that token, so the loss sees the same
per-sample tensors as with one forward per sample; a token shared by several samples is scored once and weighted
once per sample by each sample's own loss mask and advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

MIN_SHARED_TOKENS = 32
"""Shortest span that several samples share and that gets a node of its own: a shorter span is forwarded once per
sample, which costs less than another model call."""


@dataclass(frozen=True)
class Node:
    """Tokens ``[start, end)`` shared by every sample through this node; ``parent`` is -1 for a root."""

    start: int
    end: int
    parent: int
    depth: int
    sample: int  # one sample through the node (they all hold the same tokens here)

    @property
    def width(self) -> int:
        """Tokens of the node's row: it predicts ``[max(start, 1), end)``."""
        return self.end - max(self.start, 1)


@dataclass
class Forest:
    """Nodes in creation order (a parent before its children) and each sample's root-to-node path (node ids)."""

    nodes: list[Node]
    paths: list[list[int]]

    def profile(self) -> list[tuple[int, int]]:
        """``(rows, longest row)`` per depth: the padded tokens of each level are their product."""
        out: list[tuple[int, int]] = []
        for node in self.nodes:
            if node.width <= 0:
                continue
            while len(out) <= node.depth:
                out.append((0, 0))
            rows, width = out[node.depth]
            out[node.depth] = (rows + 1, max(width, node.width))
        return out


def profile_cost(profile: Sequence[tuple[int, int]], multiple: int = 1) -> int:
    """Padded tokens forwarded for a profile (each level's width rounded up to ``multiple``)."""
    return sum(rows * -(-width // multiple) * multiple for rows, width in profile)


def merge_profiles(*profiles: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The profile of several forests forwarded together (rows add up, the longest row wins)."""
    out: list[tuple[int, int]] = []
    for profile in profiles:
        for depth, (rows, width) in enumerate(profile):
            if depth == len(out):
                out.append((0, 0))
            out[depth] = (out[depth][0] + rows, max(out[depth][1], width))
    return out


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (binary search over slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def lexicographic_order(seqs: Sequence[Sequence[int]]) -> list[int]:
    """Indices of ``seqs`` in lexicographic order of their tokens (ties by index)."""
    return sorted(range(len(seqs)), key=lambda i: (list(seqs[i]), i))


def build_forest(seqs: Sequence[Sequence[int]], min_shared: int = MIN_SHARED_TOKENS) -> Forest:
    """The prefix forest of ``seqs`` (see the module doc); ``min_shared`` must be at least 2."""
    if min_shared < 2:
        raise ValueError(f"min_shared must be at least 2, got {min_shared}")
    seqs = [list(s) for s in seqs]
    order = lexicographic_order(seqs)
    lcp = [common_prefix_length(seqs[order[k]], seqs[order[k + 1]]) for k in range(len(order) - 1)]
    forest = Forest(nodes=[], paths=[[] for _ in seqs])

    def add(start: int, end: int, parent: int, depth: int, members: Sequence[int]) -> int:
        forest.nodes.append(Node(start, end, parent, depth, members[0]))
        for i in members:
            forest.paths[i].append(len(forest.nodes) - 1)
        return len(forest.nodes) - 1

    stack = [(0, len(order), 0, -1, 0)] if order else []  # ranges [lo, hi) of `order` sharing tokens [0, start)
    while stack:
        lo, hi, start, parent, depth = stack.pop()
        if hi - lo == 1:
            if len(seqs[order[lo]]) > start:
                add(start, len(seqs[order[lo]]), parent, depth, order[lo:hi])
            continue  # else the sample ends where its parent ends
        common = min(lcp[lo:hi - 1])
        if common - start >= min_shared:
            parent = add(start, common, parent, depth, order[lo:hi])
            start, depth = common, depth + 1
        cuts = [k + 1 for k in range(lo, hi - 1) if lcp[k] == common]
        runs = list(zip([lo, *cuts], [*cuts, hi]))
        stack.extend((a, b, start, parent, depth) for a, b in reversed(runs))
    return forest


@dataclass
class Level:
    """One model call: a padded row per node of one depth (all ``[n, w]`` except ``ancestors``).

    ``input_ids``/``positions`` go to the model; ``labels`` are the tokens each position predicts, ``scored`` where a
    sample through the node has a loss token there, ``real`` the row's tokens (False on padding). ``ancestors[k]``
    (``[depth, n]``) is the row of each node's ancestor in level ``k``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    scored: torch.Tensor
    real: torch.Tensor
    ancestors: torch.Tensor

    def to(self, device: torch.device | str) -> Level:
        return Level(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})


@dataclass
class ForwardLayout:
    """How to forward a micro-batch: its forest's nodes by depth (see the module doc).

    ``out_index`` (``[B, T]``) indexes the concatenation of a 0 and every level's flattened ``[n, w]`` predicted
    logprobs: entry ``(b, i)`` is the logprob of token ``i`` of row ``b``'s sample (0: position 0 and padding).
    """

    levels: list[Level]
    out_index: torch.Tensor

    @property
    def computed_tokens(self) -> int:
        """Tokens the model forwards, padding included."""
        return sum(level.input_ids.numel() for level in self.levels)

    def to(self, device: torch.device | str) -> ForwardLayout:
        return replace(self, levels=[level.to(device) for level in self.levels], out_index=self.out_index.to(device))


@dataclass
class _LevelRows:
    nodes: list[int] = field(default_factory=list)
    width: int = 0


def forward_layout(seqs: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]], forest: Forest, width: int,
                   *, pad_token_id: int = 0, pad_to_multiple_of: int = 1) -> ForwardLayout:
    """The layout of ``forest`` (built from ``seqs``) for a dense ``[len(seqs), width]`` micro-batch.

    ``loss_masks[i]`` marks the tokens of sample ``i`` that carry loss: only those positions get the LM head.
    """
    levels: list[_LevelRows] = []
    row_of: dict[int, tuple[int, int]] = {}  # node -> (level, row)
    for node_id, node in enumerate(forest.nodes):
        if node.width <= 0:
            continue
        while len(levels) <= node.depth:
            levels.append(_LevelRows())
        rows = levels[node.depth]
        row_of[node_id] = (node.depth, len(rows.nodes))
        rows.nodes.append(node_id)
        rows.width = max(rows.width, node.width)
    scored_by_node: dict[int, list[bool]] = {}
    for sample, path in enumerate(forest.paths):
        for node_id in path:
            if node_id not in row_of:
                continue
            node = forest.nodes[node_id]
            mask = [bool(m) for m in loss_masks[sample][max(node.start, 1):node.end]]
            have = scored_by_node.setdefault(node_id, mask)
            if have is not mask:
                scored_by_node[node_id] = [x or y for x, y in zip(have, mask)]
    built, bases, base = [], [], 1
    for rows in levels:
        built.append(_level_tensors(rows, forest, seqs, scored_by_node, row_of, pad_token_id, pad_to_multiple_of))
        bases.append(base)
        base += built[-1].input_ids.numel()
    out_index = torch.zeros((len(seqs), width), dtype=torch.long)
    for sample, path in enumerate(forest.paths):
        for node_id in path:
            if node_id not in row_of:
                continue
            node, (depth, row) = forest.nodes[node_id], row_of[node_id]
            first = max(node.start, 1)
            offset = bases[depth] + row * built[depth].input_ids.shape[1]
            out_index[sample, first:node.end] = torch.arange(offset, offset + node.end - first)
    return ForwardLayout(built, out_index)


def _level_tensors(rows: _LevelRows, forest: Forest, seqs: Sequence[Sequence[int]],
                   scored_by_node: dict[int, list[bool]], row_of: dict[int, tuple[int, int]], pad_token_id: int,
                   multiple: int) -> Level:
    n, width = len(rows.nodes), -(-rows.width // multiple) * multiple
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    labels = torch.full((n, width), pad_token_id, dtype=torch.long)
    scored = torch.zeros((n, width), dtype=torch.bool)
    real = torch.zeros((n, width), dtype=torch.bool)
    positions = torch.zeros((n, width), dtype=torch.long)
    depth = forest.nodes[rows.nodes[0]].depth
    ancestors = torch.zeros((depth, n), dtype=torch.long)
    for row, node_id in enumerate(rows.nodes):
        node = forest.nodes[node_id]
        tokens, first, w = seqs[node.sample], max(node.start, 1), node.width
        input_ids[row, :w] = torch.tensor(tokens[first - 1:node.end - 1], dtype=torch.long)
        labels[row, :w] = torch.tensor(tokens[first:node.end], dtype=torch.long)
        scored[row, :w] = torch.tensor(scored_by_node.get(node_id, [False] * w), dtype=torch.bool)
        real[row, :w] = True
        positions[row] = torch.arange(first - 1, first - 1 + width)  # padding continues the count
        parent = node.parent
        while parent >= 0:
            level, ancestor_row = row_of[parent]
            ancestors[level, row] = ancestor_row
            parent = forest.nodes[parent].parent
    return Level(input_ids, positions, labels, scored, real, ancestors)
